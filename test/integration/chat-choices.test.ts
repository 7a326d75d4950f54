import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { sql } from "drizzle-orm";
import OpenAI from "openai";
import type { Gateway } from "../../src/server.ts";
import { type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { TEST_PLANS, arr, chatAlias, rec, seedTestOrg, upstreamSettings } from "./inference-fixtures.ts";

setDefaultTimeout(30_000);

/**
 * Chat answers with fewer choices than the `n` asked, or choice indices that
 * skip, from a scripted upstream, read by the openai SDK (which indexes a
 * streamed answer's choices by `index` and refuses one at or past `n`), and
 * what each is charged.
 */

const HEAD = { id: "chatcmpl-n", object: "chat.completion.chunk", created: 1, model: "m" };
const chunk = (index: number, delta: Record<string, unknown>, finish: string | null = null) =>
  `data: ${JSON.stringify({ ...HEAD, choices: [{ index, delta, logprobs: null, finish_reason: finish }] })}\n\n`;
const usage = (completion: number) =>
  `data: ${JSON.stringify({ ...HEAD, choices: [], usage: { prompt_tokens: 5, completion_tokens: completion, total_tokens: 5 + completion } })}\n\n`;
const DONE = "data: [DONE]\n\n";
/** A chunk whose choice index is written as `index` (raw JSON text: `1.5`, `"1"`, `1e0`), the rest as JSON writes it. */
const rawChunk = (index: string, delta: Record<string, unknown>, finish: string | null = null) =>
  chunk(0, delta, finish).replace('"index":0', `"index":${index}`);
/** Indices a choice may be written with that are not a plain non-negative integer (or not one below 10,000). */
const ODD_INDICES = ["1.5", "1e0", "1.0", "-1", '"1"', "12345", "1 ", " 1.5"];

const jsonAnswer = (choices: { index: number; content: string }[], completion?: number) => ({
  id: "chatcmpl-j",
  object: "chat.completion",
  created: 1,
  model: "m",
  choices: choices.map((c) => ({ index: c.index, message: { role: "assistant", content: c.content }, logprobs: null, finish_reason: "stop" })),
  ...(completion !== undefined ? { usage: { prompt_tokens: 5, completion_tokens: completion, total_tokens: 5 + completion } } : {}),
});

/** Streamed scripts, by the user's text. */
const STREAMS: Record<string, string[]> = {
  // n = 2 asked, one choice answered.
  fewer: [chunk(0, { role: "assistant", content: "" }), chunk(0, { content: "only one" }), chunk(0, {}, "stop"), usage(2), DONE],
  // n = 2 asked, choices 0 and 2 answered.
  skips: [
    chunk(0, { role: "assistant", content: "" }),
    chunk(2, { role: "assistant", content: "" }),
    chunk(0, { content: "zero" }),
    chunk(2, { content: "two" }),
    chunk(0, {}, "stop"),
    chunk(2, {}, "stop"),
    usage(2),
    DONE,
  ],
  // n = 2 asked, choices 3 and 5 answered, both in each chunk.
  "skips-together": [
    `data: ${JSON.stringify({ ...HEAD, choices: [3, 5].map((index) => ({ index, delta: { role: "assistant", content: `c${index}` }, logprobs: null, finish_reason: null })) })}\n\n`,
    `data: ${JSON.stringify({ ...HEAD, choices: [5, 3].map((index) => ({ index, delta: {}, logprobs: null, finish_reason: "stop" })) })}\n\n`,
    usage(2),
    DONE,
  ],
  // n = 2 asked, three choices answered, beginning in the order 0, 2, 1 (2 takes the free index 1).
  more: [
    chunk(0, { role: "assistant", content: "zero" }),
    chunk(2, { role: "assistant", content: "two" }),
    chunk(1, { role: "assistant", content: "one" }),
    chunk(0, {}, "stop"),
    chunk(2, {}, "stop"),
    chunk(1, {}, "stop"),
    usage(3),
    DONE,
  ],
  // n = 2 asked, choice 0 and a choice whose index is no plain integer (`odd:1.5`, …).
  ...Object.fromEntries(
    ODD_INDICES.map((x) => [
      `odd:${x}`,
      [
        chunk(0, { role: "assistant", content: "" }),
        rawChunk(x, { role: "assistant", content: "" }),
        chunk(0, { content: "zero" }),
        rawChunk(x, { content: "other" }),
        chunk(0, {}, "stop"),
        rawChunk(x, {}, "stop"),
        usage(2),
        DONE,
      ],
    ]),
  ),
  // n = 2 asked, choice 1.5 begins before choice 1: read as one choice by its bytes, they were merged.
  "odd-then-one": [
    rawChunk("1.5", { role: "assistant", content: "half" }),
    chunk(1, { role: "assistant", content: "one" }),
    rawChunk("1.5", {}, "stop"),
    chunk(1, {}, "stop"),
    usage(2),
    DONE,
  ],
  // n = 2 asked with max_tokens 3, one choice answered, going past its bound (no usage report).
  "fewer-past-bound": [
    chunk(0, { role: "assistant", content: "" }),
    ...Array.from({ length: 6 }, (_, i) => chunk(0, { content: `w${i} ` })),
    chunk(0, {}, "stop"),
    DONE,
  ],
};
/** JSON answers, by the user's text. */
const JSONS: Record<string, unknown> = {
  // n = 2 asked, both choices answered with index 0 (a server that does not number its choices).
  "same-index": jsonAnswer(
    [
      { index: 0, content: "zero" },
      { index: 0, content: "other" },
    ],
    2,
  ),
  fewer: jsonAnswer([{ index: 0, content: "only one" }], 2),
  skips: jsonAnswer(
    [
      { index: 0, content: "zero" },
      { index: 2, content: "two" },
    ],
    2,
  ),
};

let upstream: ReturnType<typeof Bun.serve>;
let gw: Gateway;
let org: SeededOrg;
let client: OpenAI;

beforeAll(async () => {
  upstream = Bun.serve({
    port: 0,
    hostname: "127.0.0.1",
    async fetch(req) {
      const body = rec(await req.json());
      const text = String(rec(arr(body.messages).at(-1)).content);
      // "sse:" and "json:" answer so whatever was asked.
      if (text.startsWith("json:")) return Response.json(JSONS[text.slice(5)] ?? {});
      const script = STREAMS[text.replace(/^sse:/, "")];
      if (body.stream === true || text.startsWith("sse:")) return new Response((script ?? []).join(""), { headers: { "content-type": "text/event-stream" } });
      return Response.json(JSONS[text] ?? {});
    },
  });
  gw = await startTestGateway({
    aliases: { "svc-n": chatAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }]) },
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 1 }),
  });
  org = await seedTestOrg(gw.database);
  client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: org.personalKey, maxRetries: 0 });
});
afterAll(async () => {
  await gw.stop();
  upstream.stop(true);
});

async function lastUsage(): Promise<{ prompt: number; completion: number; status: number }> {
  await gw.quota.flush();
  const rows = await gw.database.rows<{ prompt_tokens: number; completion_tokens: number; status: number }>(
    sql`select prompt_tokens, completion_tokens, status from usage_events where key_id = ${org.personalKeyId} order by id desc limit 1`,
  );
  const r = rows[0];
  return { prompt: Number(r?.prompt_tokens), completion: Number(r?.completion_tokens), status: Number(r?.status) };
}

const ask = (text: string) => ({ model: "svc-n", n: 2, max_tokens: 10, messages: [{ role: "user" as const, content: text }] });

describe("n = 2, one choice answered", () => {
  test("JSON: the one choice, charged what the upstream reports", async () => {
    const r = await client.chat.completions.create(ask("fewer"));
    expect(r.choices.map((c) => [c.index, c.message.content])).toEqual([[0, "only one"]]);
    expect(await lastUsage()).toEqual({ prompt: 5, completion: 2, status: 200 });
  });

  test("streamed: the SDK's finalChatCompletion() has the one choice; charged what the upstream reports", async () => {
    const final = await client.chat.completions.stream(ask("fewer")).finalChatCompletion();
    expect(final.choices.map((c) => [c.index, c.message.content, c.finish_reason])).toEqual([[0, "only one", "stop"]]);
    expect(await lastUsage()).toEqual({ prompt: 5, completion: 2, status: 200 });
  });
});

describe("n = 2, choices 0 and 2 answered", () => {
  test("JSON: indices the SDK can take, each choice once, charged what the upstream reports", async () => {
    const r = await client.chat.completions.create(ask("skips"));
    expect(r.choices.map((c) => [c.index, c.message.content])).toEqual([
      [0, "zero"],
      [1, "two"],
    ]);
    expect(await lastUsage()).toEqual({ prompt: 5, completion: 2, status: 200 });
  });

  test("streamed: the SDK's finalChatCompletion() reads both choices; charged what the upstream reports", async () => {
    const final = await client.chat.completions.stream(ask("skips")).finalChatCompletion();
    expect(final.choices.map((c) => [c.index, c.message.content, c.finish_reason])).toEqual([
      [0, "zero", "stop"],
      [1, "two", "stop"],
    ]);
    expect(await lastUsage()).toEqual({ prompt: 5, completion: 2, status: 200 });
  });

  test("streamed, both choices in each chunk (3 and 5): renumbered 0 and 1, in the order they began", async () => {
    const final = await client.chat.completions.stream(ask("skips-together")).finalChatCompletion();
    expect(final.choices.map((c) => [c.index, c.message.content, c.finish_reason])).toEqual([
      [0, "c3", "stop"],
      [1, "c5", "stop"],
    ]);
    expect(await lastUsage()).toEqual({ prompt: 5, completion: 2, status: 200 });
  });
});

describe("n = 2, both choices answered in JSON with index 0", () => {
  test("JSON: each choice its own index, 0 and 1", async () => {
    const r = await client.chat.completions.create(ask("same-index"));
    expect(r.choices.map((c) => [c.index, c.message.content])).toEqual([
      [0, "zero"],
      [1, "other"],
    ]);
  });

  test("a streamed request answered in JSON: the SDK's finalChatCompletion() reads both choices, not one with their texts merged", async () => {
    const final = await client.chat.completions.stream(ask("json:same-index")).finalChatCompletion();
    expect(final.choices.map((c) => [c.index, c.message.content, c.finish_reason])).toEqual([
      [0, "zero", "stop"],
      [1, "other", "stop"],
    ]);
    expect(await lastUsage()).toEqual({ prompt: 5, completion: 2, status: 200 });
  });
});

describe("n = 2, three choices answered (0, 2, then 1)", () => {
  test("streamed: no two of the upstream's choices share an index (2 takes 1; the extra one is not merged into it)", async () => {
    const res = await fetch(`${gw.url}/v1/chat/completions`, {
      method: "POST",
      headers: { authorization: `Bearer ${org.personalKey}`, "content-type": "application/json" },
      body: JSON.stringify({ ...ask("more"), stream: true }),
    });
    expect(res.status).toBe(200);
    const texts = new Map<number, string[]>();
    for (const line of (await res.text()).split("\n")) {
      if (!line.startsWith("data: {")) continue;
      for (const c of arr(rec(JSON.parse(line.slice(6))).choices)) {
        const content = rec(rec(c).delta).content;
        if (typeof content === "string" && content !== "") texts.set(Number(rec(c).index), [...(texts.get(Number(rec(c).index)) ?? []), content]);
      }
    }
    // Choices 0 and 2 go out as 0 and 1 (the SDK reads them); the third is no part of either.
    expect(texts.get(0)).toEqual(["zero"]);
    expect(texts.get(1)).toEqual(["two"]);
    expect([...texts.values()].sort()).toEqual([["one"], ["two"], ["zero"]]);
    expect(await lastUsage()).toEqual({ prompt: 5, completion: 3, status: 200 });
  });
});

/** A streamed request's data chunks as received (raw text, and parsed). */
async function streamedChunks(text: string): Promise<{ raw: string; parsed: Record<string, unknown> }[]> {
  const res = await fetch(`${gw.url}/v1/chat/completions`, {
    method: "POST",
    headers: { authorization: `Bearer ${org.personalKey}`, "content-type": "application/json" },
    body: JSON.stringify({ ...ask(text), stream: true }),
  });
  expect(res.status).toBe(200);
  return (await res.text())
    .split("\n")
    .filter((l) => l.startsWith("data: {"))
    .map((l) => ({ raw: l.slice(6), parsed: rec(JSON.parse(l.slice(6))) }));
}

describe("n = 2, a choice index that is no plain non-negative integer", () => {
  for (const x of ODD_INDICES) {
    test(`streamed, index ${JSON.stringify(x)}: the SDK reads choices 0 and 1; every index the client gets is written as a plain integer below n`, async () => {
      const final = await client.chat.completions.stream(ask(`odd:${x}`)).finalChatCompletion();
      expect(final.choices.map((c) => [c.index, c.message.content, c.finish_reason])).toEqual([
        [0, "zero", "stop"],
        [1, "other", "stop"],
      ]);
      expect(await lastUsage()).toEqual({ prompt: 5, completion: 2, status: 200 });
      for (const { raw, parsed } of await streamedChunks(`odd:${x}`)) {
        for (const c of arr(parsed.choices)) expect([0, 1]).toContain(rec(c).index as number);
        // As a strict client reads it (an integer field: serde's u32, Go's int): digits only, no 1e0 nor 1.0.
        expect(raw).not.toMatch(/"index":(?![01][ \t\r\n]*[,}])/);
      }
      // This request's usage written now, not summed into the next test's.
      await gw.quota.flush();
    });
  }

  test("streamed, choice 1.5 then choice 1: two choices, not one with their texts merged", async () => {
    const final = await client.chat.completions.stream(ask("odd-then-one")).finalChatCompletion();
    expect(final.choices.map((c) => [c.index, c.message.content, c.finish_reason])).toEqual([
      [0, "half", "stop"],
      [1, "one", "stop"],
    ]);
    expect(await lastUsage()).toEqual({ prompt: 5, completion: 2, status: 200 });
  });
});

describe("n = 2, one choice answered past its max_tokens", () => {
  test("streamed: the gateway ends it at the bound; the SDK reads the one choice, cut for length; charged the tokens seen", async () => {
    const final = await client.chat.completions.stream({ ...ask("fewer-past-bound"), max_tokens: 3 }).finalChatCompletion();
    expect(final.choices.map((c) => [c.index, c.message.content, c.finish_reason])).toEqual([[0, "w0 w1 w2 ", "length"]]);
    // The events of text seen, the one past the bound too (each at least one token generated), within n × the bound: 4.
    expect(await lastUsage()).toMatchObject({ completion: 4, status: 200 });
  });
});

describe("answered in the other form than asked, choices 0 and 2 of n = 2", () => {
  test("a JSON request answered as a stream: indices 0 and 1", async () => {
    const r = await client.chat.completions.create(ask("sse:skips"));
    expect(r.choices.map((c) => [c.index, c.message.content])).toEqual([
      [0, "zero"],
      [1, "two"],
    ]);
    expect(await lastUsage()).toEqual({ prompt: 5, completion: 2, status: 200 });
  });

  test("a streamed request answered in JSON: the SDK's finalChatCompletion() reads both choices", async () => {
    const final = await client.chat.completions.stream(ask("json:skips")).finalChatCompletion();
    expect(final.choices.map((c) => [c.index, c.message.content, c.finish_reason])).toEqual([
      [0, "zero", "stop"],
      [1, "two", "stop"],
    ]);
    expect(await lastUsage()).toEqual({ prompt: 5, completion: 2, status: 200 });
  });
});
