import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { createOpenAI } from "@ai-sdk/openai";
import { generateText } from "ai";
import type { Gateway } from "../../src/server.ts";
import { errorOf, type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { CHAT_MODEL, TEST_PLANS, chatAlias, post, seedTestOrg, sseData, upstreamSettings, userMessages, usageEventsOf } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * A chat upstream's whole (JSON) answer that no client can read as a chat
 * completion, through the gateway over real HTTP: chat JSON and streamed
 * (a server that answers a stream whole), the Responses API JSON.
 */

/** The scripted upstream's next JSON answer. */
let answer: Record<string, unknown>;
let upstream: ReturnType<typeof Bun.serve>;
let gw: Gateway;
let org: SeededOrg;

const USAGE = { prompt_tokens: 3, completion_tokens: 1, total_tokens: 4 };
const completion = (choices: unknown[], extra: Record<string, unknown> = {}) => ({ id: "c1", object: "chat.completion", created: 1, model: CHAT_MODEL, choices, usage: USAGE, ...extra });

beforeAll(async () => {
  upstream = Bun.serve({ port: 0, hostname: "127.0.0.1", fetch: () => Response.json(answer) });
  gw = await startTestGateway({
    aliases: { "svc-fast": chatAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }]) },
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 1, breakerFailures: 1_000_000 }),
    responses: { enabled: true },
  });
  org = await seedTestOrg(gw.database);
});

afterAll(async () => {
  await gw.stop();
  upstream.stop(true);
});

const usageRows = (orgId: string) => usageEventsOf(gw, orgId);

describe("a JSON answer with no choice (choices: [], or none an object) is no answer: 503, nothing charged", () => {
  for (const [name, choices] of [
    ["choices: []", []],
    ["choices: [null, 5]", [null, 5]],
  ] as const) {
    test(`${name}: chat JSON and the Responses API JSON answer 503 unreadable`, async () => {
      answer = completion([...choices]);
      const o = await seedTestOrg(gw.database);
      const chat = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
      expect(chat.status).toBe(503);
      expect(await errorOf(chat)).toMatchObject({ type: "service_unavailable", message: "The model 'svc-fast' sent an unreadable answer; retry with backoff." });
      const resp = await post(gw, "/v1/responses", o.personalKey, { model: "svc-fast", input: "hi", store: false });
      expect(resp.status).toBe(503);
      expect(await errorOf(resp)).toMatchObject({ type: "service_unavailable", message: "The model 'svc-fast' sent an unreadable answer; retry with backoff." });
      // One row for both (rows are summed by key, alias, target and status within a write).
      const rows = await usageRows(o.orgId);
      expect(rows.map((r) => [r.status, r.promptTokens, r.completionTokens, r.requests])).toEqual([[503, 0, 0, 2]]);
    });

    test(`${name}: a stream answered whole ends with an error event, not an empty answer`, async () => {
      answer = completion([...choices]);
      const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", messages: userMessages(), stream: true });
      expect(res.status).toBe(200);
      const data = sseData(await res.text());
      expect(data.length).toBe(1);
      expect(JSON.parse(data[0] as string)).toMatchObject({ error: { type: "service_unavailable" } });
    });
  }
});

describe("the answer's integers are integers a strict client reads (u32/i64 fields: created, index)", () => {
  /** `created` and each choice's `index` as the client gets them, JSON and streamed, read from the text (1e+308 is no integer there). */
  async function numbersOf(stream: boolean): Promise<string[]> {
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", messages: userMessages(), stream });
    expect(res.status).toBe(200);
    const text = await res.text();
    return [...text.matchAll(/"(created|index)":([^,}\]]*)/g)].map((m) => `${m[1]}:${m[2]}`);
  }

  for (const [name, created, index] of [
    ["1e308", 1e308, 1e308],
    ["negative", -5, -1],
    ["fractional", 1.5, 0.5],
    ["a string", "1700000000", "0"],
    ["2^53", 2 ** 53, 2 ** 53],
  ] as const) {
    test(`created and index ${name}: the time of the answer and the choice's position, JSON and streamed`, async () => {
      answer = completion([{ index, message: { role: "assistant", content: "hi" }, finish_reason: "stop" }], { created });
      const before = Math.floor(Date.now() / 1000);
      for (const stream of [false, true]) {
        const numbers = await numbersOf(stream);
        expect(numbers.length).toBeGreaterThan(1);
        for (const n of numbers) {
          const [field, value] = n.split(":") as [string, string];
          expect(value).toMatch(/^\d+$/);
          if (field === "index") expect(value).toBe("0");
          else expect(Number(value)).toBeGreaterThanOrEqual(before);
        }
      }
    });
  }

  test("plausible ones are kept as sent", async () => {
    answer = completion([{ index: 0, message: { role: "assistant", content: "hi" }, finish_reason: "stop" }], { created: 1_700_000_000 });
    for (const stream of [false, true]) for (const n of await numbersOf(stream)) expect(["created:1700000000", "index:0"]).toContain(n);
  });
});

describe("a JSON answer's tool calls are sent in the shape the SDKs read (id, type function, function.name and .arguments as strings)", () => {
  const ask = () => post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", messages: userMessages() });
  const withCalls = (tool_calls: unknown[]) => completion([{ index: 0, message: { role: "assistant", content: null, tool_calls }, finish_reason: "tool_calls" }]);

  test("entries that are not objects are left out; a missing or non-string id, type, name or arguments is filled in", async () => {
    answer = withCalls([
      5,
      null,
      { id: 3, type: "x", function: { name: 7, arguments: null } },
      { type: "function", function: { name: "get_weather", arguments: '{"city":"Oslo"}' } },
      { id: "call_1", type: "function" },
      { id: "call_2", type: "function", function: { name: "f", arguments: 12 } },
    ]);
    const res = await ask();
    expect(res.status).toBe(200);
    const calls = ((await res.json()) as { choices: { message: { tool_calls: unknown } }[] }).choices[0]?.message.tool_calls as { id: string; type: string; function: { name: string; arguments: string } }[];
    expect(calls.length).toBe(4);
    for (const c of calls) {
      expect(c.id).toMatch(/^call_/);
      expect(c.type).toBe("function");
      expect(typeof c.function.name).toBe("string");
      expect(typeof c.function.arguments).toBe("string");
    }
    expect(calls.map((c) => [c.function.name, c.function.arguments])).toEqual([
      ["", ""],
      ["get_weather", '{"city":"Oslo"}'],
      ["", ""],
      ["f", ""],
    ]);
    expect(calls[3]?.id).toBe("call_2");
  });

  test("the Vercel AI SDK reads the answer (its schema: type 'function', name and arguments strings)", async () => {
    answer = withCalls([{ id: 3, type: "x", function: { name: "get_weather", arguments: null } }, { id: "call_9", type: "function", function: { name: "get_weather", arguments: '{"city":"Oslo"}' } }]);
    const provider = createOpenAI({ apiKey: org.personalKey, baseURL: `${gw.url}/v1` });
    const r = await generateText({ model: provider.chat("svc-fast"), prompt: "x", maxRetries: 0 });
    expect(r.toolCalls.map((c) => c.toolName)).toEqual(["get_weather", "get_weather"]);
  });
});

describe("a JSON answer's logprobs are sent in the shape the SDKs read, or null", () => {
  const good = { token: "hi", logprob: -0.5, bytes: [104, 105], top_logprobs: [{ token: "hi", logprob: -0.5, bytes: [104, 105] }] };
  const withLogprobs = (logprobs: unknown) => completion([{ index: 0, message: { role: "assistant", content: "hi" }, logprobs, finish_reason: "stop" }]);
  const logprobsOf = async () => {
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", messages: userMessages(), logprobs: true, top_logprobs: 1 });
    expect(res.status).toBe(200);
    return ((await res.json()) as { choices: { logprobs: unknown }[] }).choices[0]?.logprobs;
  };

  test("not an object: null; entries that are not a token with a finite logprob are left out, at either depth", async () => {
    answer = withLogprobs("zzz");
    expect(await logprobsOf()).toBeNull();
    answer = withLogprobs({ content: [{ token: 5 }, null, { ...good, top_logprobs: [...good.top_logprobs, { token: 3 }, { token: "x", logprob: "1" }] }, { token: "y", logprob: -1, bytes: "zz", top_logprobs: "zz" }], refusal: 7 });
    expect(await logprobsOf()).toEqual({ content: [good, { token: "y", logprob: -1, bytes: null, top_logprobs: [] }], refusal: null });
    answer = withLogprobs({ content: [good], refusal: null });
    expect(await logprobsOf()).toEqual({ content: [good], refusal: null });
  });

  test("the Vercel AI SDK reads an answer whose upstream logprobs were garbage", async () => {
    answer = withLogprobs({ content: [{ token: 5 }] });
    const provider = createOpenAI({ apiKey: org.personalKey, baseURL: `${gw.url}/v1` });
    const r = await generateText({ model: provider.chat("svc-fast"), prompt: "x", maxRetries: 0 });
    expect(r.text).toBe("hi");
  });
});
