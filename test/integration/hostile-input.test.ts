import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { brotliCompressSync } from "node:zlib";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { rawRequest } from "../helpers/raw-http.ts";
import { TEST_PLANS, post, seedTestOrg, testAliases, upstreamSettings } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Hostile request bodies that found defects, each through real HTTP against a
 * gateway with the Responses API on: every one must get a 400 in the wire
 * shape naming the field, never a 500, and must not reach the upstream.
 * (fuzz.test.ts throws random input at every endpoint; these are the cases
 * it did not reach.)
 */

let sim: Simulator;
let gw: Gateway;
let org: SeededOrg;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 3 });
  gw = await startTestGateway({ aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: upstreamSettings(), responses: { enabled: true } });
  org = await seedTestOrg(gw.database);
});
afterEach(() => sim.reset());
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

/** Sends a body as written (a string is sent verbatim, so it may hold what JSON.stringify would never write). */
const send = (path: string, body: unknown) => post(gw, path, org.serviceKey, body);

async function expect400(res: Response, param: string | null): Promise<string> {
  const text = await res.text();
  expect({ status: res.status, text }).toMatchObject({ status: 400 });
  const err = (JSON.parse(text) as { error: { message: string; type: string; param: string | null; code: string } }).error;
  expect({ type: err.type, code: err.code, param: err.param }).toEqual({ type: "invalid_request_error", code: "invalid_request_error", param });
  return err.message;
}

/** Names every object inherits (Object.prototype's): a lookup table keyed by them must not find anything. */
const PROTOTYPE_NAMES = ["toString", "constructor", "__proto__", "hasOwnProperty", "valueOf", "isPrototypeOf"];

describe("tag values that are Object.prototype's names", () => {
  test("chat: a message role such as 'toString' is an unknown role (400 messages[i].role), not a 500", async () => {
    for (const role of PROTOTYPE_NAMES) {
      const res = await send("/v1/chat/completions", { model: "svc-fast", messages: [{ role: "user", content: "hi" }, { role, content: "x" }] });
      const message = await expect400(res, "messages[1].role");
      expect(message).toContain("system, user, assistant, tool");
    }
    expect(sim.stats.requests).toBe(0);
  });

  test("Responses: an input item type such as 'constructor' is an unsupported type (400 input[j].type), not a 500", async () => {
    for (const type of PROTOTYPE_NAMES) {
      const res = await send("/v1/responses", { model: "svc-fast", input: [{ role: "user", content: "hi" }, { type }] });
      const message = await expect400(res, "input[1].type");
      expect(message).toContain("input items are message, function_call");
    }
    expect(sim.stats.requests).toBe(0);
  });

  test("parts and roles of those names are refused by name too (these held already)", async () => {
    for (const name of PROTOTYPE_NAMES) {
      await expect400(await send("/v1/chat/completions", { model: "svc-fast", messages: [{ role: "user", content: [{ type: name }] }] }), "messages[0].content[0].type");
      await expect400(await send("/v1/responses", { model: "svc-fast", input: [{ role: "user", content: [{ type: name }] }] }), "input[0].content[0].type");
      await expect400(await send("/v1/responses", { model: "svc-fast", input: [{ role: name, content: "x" }] }), "input[0].role");
    }
    expect(sim.stats.requests).toBe(0);
  });
});

/**
 * `depth` arrays nested in one another, as JSON text: `[[…]]`. At 50,000
 * levels JSON.parse still reads it (it does not recurse), but JSON.stringify
 * runs out of stack long before: the gateway must refuse it while reading
 * the body, not fail when it serialises the request for the upstream (or,
 * on the Responses API, for the store, after the answer was generated).
 */
const nested = (depth: number) => `${"[".repeat(depth)}${"]".repeat(depth)}`;
const DEEP = nested(50_000);
const MSG = `"messages":[{"role":"user","content":"hi"}]`;

describe("free-form JSON nested past any serialiser's stack", () => {
  const chatCases: [string, string, string][] = [
    ["tool parameters", `{"model":"svc-fast",${MSG},"tools":[{"type":"function","function":{"name":"f","parameters":{"a":${DEEP}}}}]}`, "tools[0].function.parameters.a"],
    [
      "tool parameters, streamed",
      `{"model":"svc-fast",${MSG},"stream":true,"tools":[{"type":"function","function":{"name":"f","parameters":{"a":${DEEP}}}}]}`,
      "tools[0].function.parameters.a",
    ],
    [
      "response_format's JSON schema",
      `{"model":"svc-fast",${MSG},"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"a":${DEEP}}}}}`,
      "response_format.json_schema.schema.a",
    ],
    ["legacy functions' parameters", `{"model":"svc-fast",${MSG},"functions":[{"name":"f","parameters":{"a":${DEEP}}}]}`, "functions[0].parameters.a"],
  ];
  for (const [name, body, param] of chatCases) {
    test(`chat: ${name} → 400 ${param}`, async () => {
      const message = await expect400(await send("/v1/chat/completions", body), param);
      expect(message).toContain("128 levels");
      expect(sim.stats.requests).toBe(0);
    });
  }

  const fc = `{"type":"function_call","call_id":"c1","name":"f","arguments":"{}"`;
  const responsesCases: [string, string, string][] = [
    ["tool parameters", `{"model":"svc-fast","input":"hi","tools":[{"type":"function","name":"f","parameters":{"a":${DEEP}}}]}`, "tools[0].parameters.a"],
    ["text.format's JSON schema", `{"model":"svc-fast","input":"hi","text":{"format":{"type":"json_schema","name":"x","schema":{"a":${DEEP}}}}}`, "text.format.schema.a"],
    ["a function call's caller", `{"model":"svc-fast","input":[${fc},"caller":${DEEP}},{"type":"function_call_output","call_id":"c1","output":"ok"}]}`, "input[0].caller"],
    ["a function call output's caller", `{"model":"svc-fast","input":[${fc}},{"type":"function_call_output","call_id":"c1","output":"ok","caller":${DEEP}}]}`, "input[1].caller"],
    ["a reasoning item's summary", `{"model":"svc-fast","input":[{"type":"reasoning","summary":[${DEEP}]},{"role":"user","content":"hi"}]}`, "input[0].summary[0]"],
    ["a reasoning item's content", `{"model":"svc-fast","input":[{"type":"reasoning","content":[${DEEP}]},{"role":"user","content":"hi"}]}`, "input[0].content[0]"],
    [
      "an output_text part's annotations",
      `{"model":"svc-fast","input":[{"role":"assistant","content":[{"type":"output_text","text":"x","annotations":[${DEEP}]}]},{"role":"user","content":"hi"}]}`,
      "input[0].content[0].annotations[0]",
    ],
    [
      "an output_text part's logprobs, streamed",
      `{"model":"svc-fast","stream":true,"input":[{"role":"assistant","content":[{"type":"output_text","text":"x","logprobs":[${DEEP}]}]},{"role":"user","content":"hi"}]}`,
      "input[0].content[0].logprobs[0]",
    ],
  ];
  for (const [name, body, param] of responsesCases) {
    test(`Responses: ${name} → 400 ${param}`, async () => {
      const message = await expect400(await send("/v1/responses", body), param);
      expect(message).toContain("128 levels");
      expect(sim.stats.requests).toBe(0);
    });
  }

  test("the limit is 128 levels inside each such field's value: that deep reaches the upstream unchanged, one level more is refused", async () => {
    const objects = (depth: number): unknown => (depth === 0 ? "leaf" : { a: objects(depth - 1) });
    const tools = (a: unknown) => [{ type: "function", function: { name: "f", parameters: { a } } }];
    const ok = await send("/v1/chat/completions", { model: "svc-fast", messages: [{ role: "user", content: "hi" }], tools: tools(objects(128)) });
    expect(ok.status).toBe(200);
    await ok.arrayBuffer();
    expect((sim.stats.lastBody as { tools: unknown }).tools).toEqual(tools(objects(128)));
    await expect400(await send("/v1/chat/completions", { model: "svc-fast", messages: [{ role: "user", content: "hi" }], tools: tools(objects(129)) }), "tools[0].function.parameters.a");

    const format = (a: unknown) => ({ format: { type: "json_schema", name: "x", schema: { a } } });
    const stored = await send("/v1/responses", { model: "svc-fast", input: "hi", text: format(objects(128)) });
    expect(stored.status).toBe(200);
    await stored.arrayBuffer();
    await expect400(await send("/v1/responses", { model: "svc-fast", input: "hi", text: format(objects(129)) }), "text.format.schema.a");
    expect(sim.stats.requests).toBe(2);
  });
});

describe("an Authorization header that is there but is not one Bearer key", () => {
  /** Raw HTTP: fetch would merge two Authorization headers itself, and refuses some values. */
  async function me(authorization: string[]): Promise<{ status: number; code: string; message: string }> {
    const host = new URL(gw.url).host;
    const head = ["GET /v1/me HTTP/1.1", `Host: ${host}`, "Connection: close", ...authorization.map((a) => `Authorization: ${a}`)].join("\r\n");
    const a = await rawRequest({ url: gw.url, head, maxMs: 10_000 });
    const err = (JSON.parse(a.body) as { error: { code: string; message: string } }).error;
    return { status: a.status, code: err.code, message: err.message };
  }

  test("is refused as malformed (401 unauthorized), not reported as a missing key", async () => {
    const cases = [
      [`Bearer ${org.serviceKey}`, `Bearer ${org.serviceKey}`], // sent twice: the server sees "Bearer k, Bearer k"
      [`Bearer ${org.serviceKey}`, `Bearer ${org.personalKey}`],
      [`Basic ${btoa(`:${org.serviceKey}`)}`],
      [org.serviceKey],
      ["Bearer"],
      [`Bearer ${org.serviceKey} extra`],
      [`Token ${org.serviceKey}`],
    ];
    for (const authorization of cases) {
      const got = await me(authorization);
      expect({ authorization, status: got.status, code: got.code }).toEqual({ authorization, status: 401, code: "unauthorized" });
      expect(got.message).toBe("Malformed Authorization header: send exactly one, as Authorization: Bearer <key>.");
    }
  });

  test("no header at all is still a missing key", async () => {
    expect(await me([])).toEqual({ status: 401, code: "unauthorized", message: "Missing API key: send the header Authorization: Bearer <key>." });
  });
});

describe("a body that is not UTF-8 JSON because of how it was sent", () => {
  const body = JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] });
  const sendRaw = (bytes: Uint8Array, headers: Record<string, string>) =>
    fetch(`${gw.url}/v1/chat/completions`, { method: "POST", headers: { authorization: `Bearer ${org.serviceKey}`, ...headers }, body: bytes });

  test("a compressed body (Content-Encoding gzip, deflate, br) gets a 400 that says the encoding is not accepted", async () => {
    for (const [encoding, bytes] of [
      ["gzip", Bun.gzipSync(Buffer.from(body))],
      ["deflate", Bun.deflateSync(Buffer.from(body))],
      ["br", new Uint8Array(brotliCompressSync(Buffer.from(body)))],
    ] as const) {
      const res = await sendRaw(bytes, { "content-type": "application/json", "content-encoding": encoding });
      const message = await expect400(res, null);
      expect(message).toContain(`Content-Encoding ${encoding}, which is not accepted`);
    }
    expect(sim.stats.requests).toBe(0);
  });

  test("a UTF-16 body declared as such gets a 400 that says JSON bodies are UTF-8", async () => {
    const utf16 = new Uint8Array(Buffer.from(body, "utf16le"));
    const message = await expect400(await sendRaw(utf16, { "content-type": "application/json; charset=utf-16le" }), null);
    expect(message).toContain("charset=utf-16le");
    expect(message).toContain("must be UTF-8");
    expect(sim.stats.requests).toBe(0);
  });

  test("a plain body is read whatever those headers say (the bytes decide; these held already)", async () => {
    const variants: Record<string, string>[] = [
      { "content-encoding": "identity" },
      { "content-type": "application/json; charset=utf-8" },
      { "content-type": "application/json; charset=latin1" },
    ];
    for (const headers of variants) {
      const res = await sendRaw(Buffer.from(body), { "content-type": "application/json", ...headers });
      expect(res.status).toBe(200);
      await res.arrayBuffer();
    }
  });
});

describe("requests Bun's HTTP parser refuses before the gateway sees them", () => {
  const host = () => new URL(gw.url).host;
  const post = (framing: string, body: string) =>
    `POST /v1/chat/completions HTTP/1.1\r\nHost: ${host()}\r\nAuthorization: Bearer ${org.serviceKey}\r\nContent-Type: application/json\r\n${framing}\r\n${body}`;
  const get = (header: string) => `GET /v1/me HTTP/1.1\r\nHost: ${host()}\r\nAuthorization: Bearer ${org.serviceKey}\r\n${header}`;

  test("malformed framing and header values: a bare 400 and a closed connection (no JSON body: the app never runs)", async () => {
    const cases: [string, string][] = [
      ["a chunk size that is not hex", post("Transfer-Encoding: chunked\r\n", "zz\r\n{}\r\n0\r\n\r\n")],
      ["a chunk size beyond 64 bits", post("Transfer-Encoding: chunked\r\n", "ffffffffffffffffffff\r\n{}\r\n0\r\n\r\n")],
      ["Transfer-Encoding other than chunked", post("Transfer-Encoding: gzip, chunked\r\n", "2\r\n{}\r\n0\r\n\r\n")],
      ["Transfer-Encoding and Content-Length together", post("Transfer-Encoding: chunked\r\nContent-Length: 2\r\n", "2\r\n{}\r\n0\r\n\r\n")],
      ["two Content-Lengths", post("Content-Length: 2\r\nContent-Length: 3\r\n", "{}")],
      ["a signed Content-Length", post("Content-Length: +2\r\n", "{}")],
      ["a negative Content-Length", post("Content-Length: -1\r\n", "{}")],
      ["a control character in a header value", get("X-Request-Id: abc\u0001def\r\n")],
    ];
    for (const [name, request] of cases) {
      // The whole request goes out as the head (it ends with its own blank line or body).
      const a = await rawRequest({ url: gw.url, head: request.replace(/\r\n$/, ""), maxMs: 10_000 });
      expect({ name, status: a.status, closed: a.closed, body: a.body }).toEqual({ name, status: 400, closed: true, body: "" });
    }
    expect(sim.stats.requests).toBe(0);
  });

  test("a request head over Bun's 16 KiB (a 20 KB key or URL): a bare 431; the server goes on serving", async () => {
    for (const request of [get(`X-Big: ${"a".repeat(20_000)}\r\n`), `GET /v1/responses/${"a".repeat(20_000)} HTTP/1.1\r\nHost: ${host()}\r\n`]) {
      const a = await rawRequest({ url: gw.url, head: request.replace(/\r\n$/, ""), maxMs: 10_000 });
      expect({ status: a.status, closed: a.closed }).toEqual({ status: 431, closed: true });
    }
    const res = await fetch(`${gw.url}/v1/me`, { headers: { authorization: `Bearer ${org.serviceKey}` } });
    expect(res.status).toBe(200);
  });
});

describe("a Host header of three characters or fewer (a compose service named `api`)", () => {
  // Elysia finds the path by searching for '/' from the 11th character of the
  // URL, assuming a host of at least 4 ("http://a.bc"): behind "http://api" it
  // cut "/v1" off. Routing held (Bun's router matched); a 404 named the wrong path.
  test("a 404 names the path as sent", async () => {
    for (const host of ["api", "gw", "x"]) {
      for (const [method, path] of [["PUT", "/v1/models"], ["GET", "/v1/nothing/here"], ["DELETE", "/v1/chat/completions"]]) {
        const a = await rawRequest({
          url: gw.url,
          head: `${method} ${path}?q=1 HTTP/1.1\r\nHost: ${host}\r\nAuthorization: Bearer ${org.serviceKey}\r\nConnection: close`,
          maxMs: 10_000,
        });
        const err = (JSON.parse(a.body) as { error: { message: string; code: string } }).error;
        expect({ host, status: a.status, code: err.code, message: err.message }).toEqual({ host, status: 404, code: "not_found", message: `No route for ${method} ${path}.` });
      }
    }
    // The routes themselves answer whatever the host.
    const a = await rawRequest({ url: gw.url, head: `GET /v1/models HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer ${org.serviceKey}\r\nConnection: close`, maxMs: 10_000 });
    expect(a.status).toBe(200);
  });
});
