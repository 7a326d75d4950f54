import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { join } from "node:path";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { cleanEnv, listeningUrl, onlyJson, type Proc, removeScratch, runGateway, scratchDir, startGatewayProcess, waitFor200 } from "../helpers/process.ts";

// A child gateway on the embedded database, and bodies of several MB through a socket on a busy machine.
setDefaultTimeout(60_000);

/**
 * Validation and translation are linear in the body's size (docs/decisions.md):
 * a body near the limit (16 MiB) whose arrays are as long as that allows is
 * answered at once, not after the request thread spent minutes on it while
 * every other client waited. Each case is one request the old code kept busy
 * for seconds to hours (the commit that fixed it says how long).
 *
 * The gateway runs as a child process: a request that occupies its thread
 * must not freeze the test runner too, so the bound fails the test on time
 * (the fetch is aborted) rather than after the work is done.
 */

/** Generous: upload, JSON.parse and validation of ~14 MB take well under a second here. */
const BOUND_MS = 5_000;

let sim: Simulator;
let server: Proc;
let url: string;
let key: string;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 3 });
  const dir = scratchDir();
  const dataDir = join(dir, "data");
  const cfg = join(dir, "config.json");
  await Bun.write(cfg, JSON.stringify({ accessLog: false, responses: { enabled: true } }));
  const env = cleanEnv({ UPSTREAM_BASE_URL: sim.url, LOG_LEVEL: "error" });
  await runGateway(["migrate", "--data-dir", dataDir], { env });
  server = startGatewayProcess(["serve", "--port", "0", "--data-dir", dataDir, "--config", cfg], { env: { ...env, LOG_LEVEL: "info" } });
  url = await listeningUrl(server);
  await waitFor200(`${url}/readyz`, 60_000);
  const gw = (args: string[]) => runGateway([...args, "--data-dir", dataDir, "--json"], { env });
  const org = onlyJson<{ id: string }>((await gw(["orgs", "create", "--name", "linear"])).stdout);
  key = onlyJson<{ key: string }>((await gw(["keys", "create", "--org", org.id, "--kind", "service", "--scopes", "inference"])).stdout).key;
}, 180_000);

afterAll(async () => {
  // A gateway still busy with a request (the old code) does not stop on SIGTERM in time.
  server?.kill("SIGKILL");
  await server?.exited;
  await sim?.stop();
  removeScratch();
});

interface Answer {
  status: number;
  body: { error?: { message: string; param: string | null; code: string }; [k: string]: unknown };
}

/** POST within BOUND_MS (the fetch is aborted after it: the test fails with a TimeoutError). */
async function post(path: string, body: string): Promise<Answer> {
  expect(body.length).toBeLessThan(16 * 1024 * 1024);
  const res = await fetch(`${url}${path}`, {
    method: "POST",
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
    body,
    signal: AbortSignal.timeout(BOUND_MS),
  });
  return { status: res.status, body: (await res.json()) as Answer["body"] };
}

/** The ids of n calls: `c0` … */
const ids = (n: number) => Array.from({ length: n }, (_, i) => `c${i}`);

describe("chat: tool messages answering an assistant message with many tool_calls", () => {
  // ~12.5 MB. Each tool message was looked up among all the calls: 10^10 comparisons, 75 s here.
  const N = 100_000;
  const calling = { role: "assistant", content: null, tool_calls: ids(N).map((id) => ({ id, type: "function", function: { name: "f", arguments: "" } })) };
  const answers = ids(N).map((id) => ({ role: "tool", content: "", tool_call_id: id }));

  test(`${N.toLocaleString("en")} calls, each answered: 200`, async () => {
    const a = await post("/v1/chat/completions", JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "go" }, calling, ...answers] }));
    expect(a.status).toBe(200);
    expect(a.body.object).toBe("chat.completion");
  });

  test(`${N.toLocaleString("en")} calls, the last tool message answering none of them: 400 on its tool_call_id`, async () => {
    const last = { role: "tool", content: "", tool_call_id: "nope" };
    const a = await post("/v1/chat/completions", JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "go" }, calling, ...answers, last] }));
    expect(a.status).toBe(400);
    expect(a.body.error?.param).toBe(`messages[${N + 2}].tool_call_id`);
    expect(a.body.error?.message).toBe("Invalid parameter: 'tool_call_id' of 'nope' not found in 'tool_calls' of previous message.");
  });
});

describe("Responses: function_call items of one turn, and their outputs", () => {
  const call = (id: string) => ({ type: "function_call", call_id: id, name: "f", arguments: "" });
  const output = (id: string) => ({ type: "function_call_output", call_id: id, output: "" });

  test("200,000 calls then an output answering none of them: 400 on that item", async () => {
    // ~14 MB. Each call was added by copying the calls before it into a new array: 2·10^10 copies, 60 s here.
    const N = 200_000;
    const input = [{ role: "user", content: "go" }, ...ids(N).map(call), output("nope")];
    const a = await post("/v1/responses", JSON.stringify({ model: "svc-fast", input, store: false }));
    expect(a.status).toBe(400);
    expect(a.body.error?.param).toBe(`input[${N + 1}]`);
    expect(a.body.error?.message).toBe("No tool call found for function call output with call_id nope.");
  });

  test("100,000 calls, each answered: 200", async () => {
    const N = 100_000;
    const input = [{ role: "user", content: "go" }, ...ids(N).map(call), ...ids(N).map(output)];
    const a = await post("/v1/responses", JSON.stringify({ model: "svc-fast", input, store: false }));
    expect(a.status).toBe(200);
    expect(a.body.object).toBe("response");
  });
});

describe("Responses: tool_choice allowed_tools over many tools", () => {
  test("100,000 function tools and 100,000 allowed names, none of them a tool: 400 on tool_choice.tools", async () => {
    // ~7 MB. Each tool's name was looked up in the list of allowed names: 10^10 comparisons.
    const N = 100_000;
    const tools = Array.from({ length: N }, (_, i) => ({ type: "function", name: `t${i}` }));
    const allowed = Array.from({ length: N }, (_, i) => ({ type: "function", name: `a${i}` }));
    const a = await post("/v1/responses", JSON.stringify({ model: "svc-fast", input: "go", tools, tool_choice: { type: "allowed_tools", mode: "auto", tools: allowed }, store: false }));
    expect(a.status).toBe(400);
    expect(a.body.error?.param).toBe("tool_choice.tools");
    expect(a.body.error?.message).toBe("None of the allowed tools ('a0', 'a1', 'a2', 'a3', 'a4', …) is one of this request's function tools: name function tools from 'tools'.");
  });
});

describe("image URLs: a host name of many dots", () => {
  test("15,000,000 dots before 'localhost': 400 on the URL (an internal host), at once", async () => {
    // The trailing dots of a name were stripped by /\.+$/, which tries every run of dots to the end: n²/2 steps (160,000 dots took 29 s here).
    const host = `x${".".repeat(15_000_000)}localhost`;
    const image = { type: "image_url", image_url: { url: `http://${host}/cat.png` } };
    const a = await post("/v1/chat/completions", JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: [image] }] }));
    expect(a.status).toBe(400);
    expect(a.body.error?.param).toBe("messages[0].content[0].image_url.url");
    expect(a.body.error?.message).toBe(`The image URL names the host '${host}'; image URLs must name public hosts.`);
  });
});

describe("bodies with millions of errors: the first is reported without listing the others", () => {
  // ~16 MB of `{}`: every element is an error, and each was described (message, path) before the first was chosen: 12 s here.
  const N = 5_500_000;
  const empties = `[${Array(N).fill("{}").join(",")}]`;

  test(`chat: ${N.toLocaleString("en")} messages without a role: 400 on messages[0].role`, async () => {
    const a = await post("/v1/chat/completions", `{"model":"svc-fast","messages":${empties}}`);
    expect(a.status).toBe(400);
    expect(a.body.error?.param).toBe("messages[0].role");
    expect(a.body.error?.message).toBe("Missing required parameter: 'messages[0].role'.");
  });

  test(`Responses: ${N.toLocaleString("en")} tools without a type: 400 on tools[0].type`, async () => {
    const a = await post("/v1/responses", `{"model":"svc-fast","input":"go","tools":${empties}}`);
    expect(a.status).toBe(400);
    expect(a.body.error?.param).toBe("tools[0].type");
    expect(a.body.error?.message).toBe("Missing required parameter: 'tools[0].type'.");
  });
});
