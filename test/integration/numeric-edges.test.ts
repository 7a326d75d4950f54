import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { errorOf, type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { TEST_PLANS, chatAlias, embedAlias, seedTestOrg, testAliases, upstreamSettings } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Numbers as strict clients and hand-written JSON spell them, sent as raw
 * bytes: 1.0 and 1e2 where an integer is required, -0, 2^53 + 1 as written,
 * 1e308. The upstream is reached through a proxy that keeps the bytes it was
 * sent, so what vLLM would read is asserted as text: an integer field goes
 * out as digits (JSON.stringify writes 1e21 and more as `1e+21`, a float to
 * Python), and a number JSON.parse rounded never goes out at all.
 */

let sim: Simulator;
let proxy: ReturnType<typeof Bun.serve>;
let gw: Gateway;
let org: SeededOrg;
let sent: string[] = [];

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 5 });
  proxy = Bun.serve({
    port: 0,
    async fetch(req) {
      const text = await req.text();
      sent.push(text);
      const res = await fetch(sim.url + new URL(req.url).pathname, { method: req.method, body: text, headers: { "content-type": "application/json" } });
      return new Response(await res.arrayBuffer(), { status: res.status, headers: { "content-type": res.headers.get("content-type") ?? "application/json" } });
    },
  });
  const url = `http://127.0.0.1:${proxy.port}`;
  const aliases = {
    ...testAliases(url),
    // Neither bound the gateway checks against: only the number's own range stands between the client and vLLM.
    "svc-open": chatAlias([{ baseUrl: url }], { contextWindow: undefined }),
    "svc-embed-open": { ...embedAlias([{ baseUrl: url }]), dimensions: undefined },
  };
  gw = await startTestGateway({ aliases, plans: TEST_PLANS, upstream: upstreamSettings({ attempts: 1 }), responses: { enabled: true, webSearch: "ignore" } });
  org = await seedTestOrg(gw.database);
});
afterAll(async () => {
  await gw.stop();
  proxy.stop(true);
  await sim.stop();
});

async function send(path: string, body: string): Promise<Response> {
  sent = [];
  return fetch(`${gw.url}${path}`, { method: "POST", headers: { "content-type": "application/json", authorization: `Bearer ${org.personalKey}` }, body });
}

async function expectRefused(path: string, body: string, param: string): Promise<void> {
  const res = await send(path, body);
  const err = res.status === 400 ? await errorOf(res) : { status: res.status, body: await res.text() };
  expect({ body, err }).toEqual({ body, err: { message: expect.any(String), type: "invalid_request_error", param, code: "invalid_request_error" } });
  expect(sent).toEqual([]);
}

/** The field as the upstream got it, in its JSON spelling. */
async function forwarded(path: string, body: string, field: RegExp): Promise<string | undefined> {
  const res = await send(path, body);
  expect({ body, status: res.status }).toEqual({ body, status: 200 });
  await res.arrayBuffer();
  expect(sent.length).toBe(1);
  return field.exec(sent[0] ?? "")?.[1];
}

const CHAT = "/v1/chat/completions";
const chatBody = (model: string, extra: string) => `{"model":"${model}","messages":[{"role":"user","content":"hi"}],${extra}}`;
/** Past 2^53 − 1 (what JSON.parse holds exactly) or written as JSON.stringify never writes an integer. */
const TOO_BIG = ["9007199254740992", "9007199254740993", "1e21", "1e308", "1E308"];

describe("chat: integer fields", () => {
  test("1.0, 1e2, 1E2, 2.0e0 and -0 are the integers they denote, forwarded as digits", async () => {
    const cases: [string, string, string][] = [
      ["max_tokens", "1.0", "1"],
      ["max_tokens", "1e2", "100"],
      ["max_completion_tokens", "1E2", "100"],
      ["n", "2.0e0", "2"],
      ["seed", "-0", "0"],
      ["seed", "1e15", "1000000000000000"],
      ["top_k", "4e1", "40"],
    ];
    for (const [field, written, digits] of cases) {
      const got = await forwarded(CHAT, chatBody("svc-fast", `"${field}":${written}`), new RegExp(`"${field}":([^,}]+)`));
      expect({ field, written, got }).toEqual({ field, written, got: digits });
    }
    const lp = await forwarded(CHAT, chatBody("svc-fast", `"logprobs":true,"top_logprobs":1.0`), /"top_logprobs":([^,}]+)/);
    expect(lp).toBe("1");
  });

  test("a fraction, a string, a boolean or a value below the least is 400 with param = the field (these held already)", async () => {
    for (const field of ["max_tokens", "max_completion_tokens", "n", "seed", "top_k"]) {
      for (const v of ["0.5", "1e-7", '"5"', "true"]) await expectRefused(CHAT, chatBody("svc-fast", `"${field}":${v}`), field);
    }
    for (const field of ["max_tokens", "max_completion_tokens", "n"]) for (const v of ["0", "-0", "-5"]) await expectRefused(CHAT, chatBody("svc-fast", `"${field}":${v}`), field);
    for (const v of ["21", "1e2", "-1"]) await expectRefused(CHAT, chatBody("svc-fast", `"logprobs":true,"top_logprobs":${v}`), "top_logprobs");
    for (const v of ["129", "1e308"]) await expectRefused(CHAT, chatBody("svc-fast", `"n":${v}`), "n");
  });

  test("max_tokens and max_completion_tokens past 2^53 − 1 are 400 on an alias without a context window too (were forwarded as 1e+308, 9007199254740992)", async () => {
    for (const field of ["max_tokens", "max_completion_tokens"]) {
      for (const v of TOO_BIG) await expectRefused(CHAT, chatBody("svc-open", `"${field}":${v}`), field);
    }
    // The largest whole number JSON holds exactly still reaches the upstream as written: judging it is vLLM's.
    expect(await forwarded(CHAT, chatBody("svc-open", `"max_tokens":9007199254740991`), /"max_tokens":([^,}]+)/)).toBe("9007199254740991");
  });

  test("top_k (vLLM's integer) past 2^53 − 1, or below -1 (vLLM's 'no limit'), is 400 (was forwarded as 1e+308, -5)", async () => {
    for (const v of [...TOO_BIG, "-2", "-1e308"]) await expectRefused(CHAT, chatBody("svc-fast", `"top_k":${v}`), "top_k");
    for (const [v, digits] of [["-1", "-1"], ["0", "0"], ["9007199254740991", "9007199254740991"]]) {
      expect(await forwarded(CHAT, chatBody("svc-fast", `"top_k":${v}`), /"top_k":([^,}]+)/)).toBe(digits);
    }
  });
});

describe("chat: OpenAI's bounds on top_p, presence_penalty and frequency_penalty", () => {
  test("top_p 0 to 1, as on the Responses API (was forwarded as sent: 1e+308, -5, 9007199254740992)", async () => {
    for (const v of ["1.0000001", "2.0e0", "1e2", "-0.1", "-5", "1e308", "9007199254740993"]) await expectRefused(CHAT, chatBody("svc-fast", `"top_p":${v}`), "top_p");
    for (const [v, out] of [["0", "0"], ["-0", "0"], ["1.0", "1"], ["0.5", "0.5"], ["1e-7", "1e-7"]]) {
      expect(await forwarded(CHAT, chatBody("svc-fast", `"top_p":${v}`), /"top_p":([^,}]+)/)).toBe(out);
    }
  });

  test("presence_penalty and frequency_penalty -2 to 2 (were forwarded as sent)", async () => {
    for (const field of ["presence_penalty", "frequency_penalty"]) {
      for (const v of ["2.0001", "-2.0001", "1e2", "-1e308", "9007199254740993", '"1"', "true"]) await expectRefused(CHAT, chatBody("svc-fast", `"${field}":${v}`), field);
      for (const [v, out] of [["-2", "-2"], ["2.0", "2"], ["-0", "0"], ["0.5", "0.5"]]) {
        expect(await forwarded(CHAT, chatBody("svc-fast", `"${field}":${v}`), new RegExp(`"${field}":([^,}]+)`))).toBe(out);
      }
    }
  });

  test("temperature 0 to 2 and logit_bias values -100 to 100 in every spelling (these held already)", async () => {
    for (const v of ["2.0000001", "1e2", "-0.0001", "1e308", '"1"', "true"]) await expectRefused(CHAT, chatBody("svc-fast", `"temperature":${v}`), "temperature");
    expect(await forwarded(CHAT, chatBody("svc-fast", `"temperature":2.0e0`), /"temperature":([^,}]+)/)).toBe("2");
    for (const v of ["1e308", "100.5", "-1e3", '"5"', "true"]) await expectRefused(CHAT, chatBody("svc-fast", `"logit_bias":{"50256":${v}}`), "logit_bias[50256]");
    for (const k of ["1.0", "-0", "1e2", "99999999999", ""]) await expectRefused(CHAT, chatBody("svc-fast", `"logit_bias":{"${k}":1}`), "logit_bias");
    expect(await forwarded(CHAT, chatBody("svc-fast", `"logit_bias":{"50256":1e2}`), /"logit_bias":(\{[^}]*\})/)).toBe('{"50256":100}');
  });
});

describe("embeddings", () => {
  const EMB = "/v1/embeddings";
  const embBody = (model: string, extra: string) => `{"model":"${model}",${extra}}`;

  test("token ids past 2^53 − 1 are 400 with the element's path (were forwarded as 1e+308, 9007199254740992)", async () => {
    for (const v of TOO_BIG) {
      await expectRefused(EMB, embBody("svc-embed", `"input":[1,${v}]`), "input[1]");
      await expectRefused(EMB, embBody("svc-embed", `"input":[[1],[2,${v}]]`), "input[1][1]");
    }
    expect(await forwarded(EMB, embBody("svc-embed", `"input":[1.0,1e2,-0,9007199254740991]`), /"input":(\[[^\]]*\])/)).toBe("[1,100,0,9007199254740991]");
    expect(await forwarded(EMB, embBody("svc-embed", `"input":[[2.0e0]]`), /"input":(\[\[[^\]]*\]\])/)).toBe("[[2]]");
  });

  test("negative or fractional token ids, and strings or booleans among them, are 400 (these held already)", async () => {
    for (const v of ["-1", "-0.5", "0.5", "1e-7", "-1e308"]) {
      await expectRefused(EMB, embBody("svc-embed", `"input":[1,${v}]`), "input[1]");
      await expectRefused(EMB, embBody("svc-embed", `"input":[[1,${v}]]`), "input[0][1]");
    }
    for (const v of ['"5"', "true", "null"]) {
      await expectRefused(EMB, embBody("svc-embed", `"input":[1,${v}]`), "input");
      await expectRefused(EMB, embBody("svc-embed", `"input":[[1,${v}]]`), "input[0][1]");
    }
  });

  test("dimensions: 1e2 is 100; a fraction, 0, a string or past 2^53 − 1 is 400, with or without the alias's own bound", async () => {
    expect(await forwarded(EMB, embBody("svc-embed", `"input":"hi","dimensions":1e2`), /"dimensions":([^,}]+)/)).toBe("100");
    for (const v of ["0", "-0", "0.5", '"5"', "true"]) await expectRefused(EMB, embBody("svc-embed", `"input":"hi","dimensions":${v}`), "dimensions");
    for (const v of TOO_BIG) await expectRefused(EMB, embBody("svc-embed-open", `"input":"hi","dimensions":${v}`), "dimensions");
  });
});

describe("Responses API", () => {
  const RESP = "/v1/responses";
  const respBody = (model: string, extra: string) => `{"model":"${model}","input":"hi","store":false,${extra}}`;

  test("max_output_tokens and max_tool_calls past 2^53 − 1 are 400 (max_tool_calls was echoed as 1e+308, max_output_tokens forwarded so without a context window)", async () => {
    for (const v of TOO_BIG) {
      await expectRefused(RESP, respBody("svc-open", `"max_output_tokens":${v}`), "max_output_tokens");
      await expectRefused(RESP, respBody("svc-fast", `"max_tool_calls":${v}`), "max_tool_calls");
    }
    const res = await send(RESP, respBody("svc-fast", `"max_tool_calls":1e2,"max_output_tokens":1.6e1`));
    expect(res.status).toBe(200);
    const text = await res.text();
    expect(/"max_tool_calls":([^,}]+)/.exec(text)?.[1]).toBe("100");
    expect(/"max_tokens":([^,}]+)/.exec(sent[0] ?? "")?.[1]).toBe("16");
  });

  test("top_p, temperature, top_logprobs in odd spellings (these held already)", async () => {
    for (const [field, v] of [["top_p", "1e308"], ["top_p", "2.0e0"], ["temperature", "1e2"], ["top_logprobs", "1e2"], ["top_logprobs", "0.5"], ["max_output_tokens", "1.0"], ["max_output_tokens", "0.5"]] as const) {
      await expectRefused(RESP, respBody("svc-fast", `"${field}":${v}`), field);
    }
  });
});

describe("query-string limits: GET /v1/audit-events (1 to 200) and GET /v1/responses/{id}/input_items (1 to 100)", () => {
  const get = (path: string, key: string) => fetch(`${gw.url}${path}`, { headers: { authorization: `Bearer ${key}` } });
  let itemsPath = "";
  beforeAll(async () => {
    const input = Array.from({ length: 5 }, (_, i) => ({ role: "user", content: `item ${i}` }));
    const res = await send("/v1/responses", JSON.stringify({ model: "svc-fast", input }));
    itemsPath = `/v1/responses/${String(((await res.json()) as { id: string }).id)}/input_items`;
  });
  const audit = (qs: string) => get(`/v1/audit-events?${qs}`, org.serviceKey);
  const items = (qs: string) => get(`${itemsPath}?${qs}`, org.personalKey);

  async function expectBad(res: Response, code: string, qs: string): Promise<void> {
    const err = res.status === 400 ? await errorOf(res) : { status: res.status };
    expect({ qs, err }).toEqual({ qs, err: { message: expect.any(String), type: "invalid_request_error", param: "limit", code } });
  }

  test("a whole number in decimal digits is that number however many zeros lead it (0050 was refused, 050 taken as 50)", async () => {
    for (const qs of ["limit=3", "limit=03", "limit=0003", "limit=000000000000000000003"]) {
      const res = await items(qs);
      expect({ qs, status: res.status }).toEqual({ qs, status: 200 });
      expect({ qs, n: ((await res.json()) as { data: unknown[] }).data.length }).toEqual({ qs, n: 3 });
      const a = await audit(qs);
      expect({ qs, status: a.status }).toEqual({ qs, status: 200 });
      await a.arrayBuffer();
    }
    for (const qs of ["limit=0200", "limit=00101"]) expect((await audit(qs)).status).toBe(200);
    for (const qs of ["limit=0201", "limit=0000"]) await expectBad(await audit(qs), "invalid_body", qs);
    for (const qs of ["limit=0101", "limit=0000"]) await expectBad(await items(qs), "invalid_request_error", qs);
  });

  test("input_items: a limit given twice is 400, as on the audit log (limit=2&limit=3 was answered with one of them)", async () => {
    for (const qs of ["limit=2&limit=3", "limit=2&limit=2"]) await expectBad(await items(qs), "invalid_request_error", qs);
  });

  test("0, -1, -0, 1.5, 1.0, 1e2, +5, 0x10, a space, empty, huge, past the maximum: 400 param limit on both (these held already, and 101 is within the audit log's 1 to 200)", async () => {
    const both = ["limit=0", "limit=-1", "limit=-0", "limit=1.5", "limit=1.0", "limit=1e2", "limit=%2B5", "limit=0x10", "limit=%205", "limit=5%20", "limit=", "limit=99999999999999999999999", "limit=%EF%BC%95"];
    for (const qs of [...both, "limit=201", "limit=5&limit=5"]) await expectBad(await audit(qs), "invalid_body", qs);
    for (const qs of [...both, "limit=101"]) await expectBad(await items(qs), "invalid_request_error", qs);
    const ok = await audit("limit=101");
    expect(ok.status).toBe(200);
    await ok.arrayBuffer();
  });
});
