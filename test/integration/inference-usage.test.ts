import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { eq } from "drizzle-orm";
import OpenAI from "openai";
import { usageReport } from "../../src/admin/usage.ts";
import { usageEvents } from "../../src/db/schema.ts";
import { createLogger } from "../../src/lib/log.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import { type SeededOrg, sharedDatabase, startTestGateway, testConfig } from "../helpers/harness.ts";
import { until } from "../helpers/poll.ts";
import { specData } from "../helpers/sse-spec.ts";
import { CHAT_MODEL, EMBED_MODEL, TEST_PLANS, arr, chatAlias, embedAlias, post, rec, seedTestOrg, spacedJson, sseData, upstreamSettings, userMessages } from "./inference-fixtures.ts";

/** The three shapes of an upstream's error event that decisions.md names: vLLM's two and FastAPI's `detail`. */
const UPSTREAM_ERROR_SHAPES = [
  ["error", { error: { message: "the engine is overloaded (vLLM)", type: "ServiceUnavailable", code: 503 } }],
  ["object error", { object: "error", message: "the engine is overloaded (old vLLM)", type: "ServiceUnavailable", code: 503 }],
  ["detail", { detail: "the engine is overloaded (FastAPI)" }],
] as const;

setDefaultTimeout(30_000);

/**
 * Usage figures from a hostile upstream (issue 13 item 5): a token count that
 * is not an integer in 0..10^9 is replaced by the gateway's own estimate, in
 * what the client sees and in what is recorded, and the upstream that sent it
 * is named in a warning.
 */

/** What the hostile upstream puts in `usage`, set per test. */
let usage: Record<string, unknown> = {};
/** A whole chat answer of the test's own (the events of a stream, or a JSON completion), instead of the usual one. */
let scripted:
  | {
      events: unknown[];
      done: boolean;
      /** Every UTF-16 unit outside ASCII written as `\uXXXX`, as Python's json.dumps writes it by default. */
      ascii?: boolean;
      /** Events sent after [DONE]. */
      after?: unknown[];
      /** The body is never ended (no final chunk, connection kept). */
      open?: boolean;
      /** Writes each event's SSE text (its JSON given), instead of `data: <json>\n\n`. */
      frame?: (json: string) => string;
      /** Sent before the first event (a byte order mark). */
      prefix?: string;
      /** The events' JSON written with this white space around each colon, and `pad` inside braces and brackets (spacedJson). */
      spaced?: { colon: string; pad?: string };
    }
  | { completion: Record<string, unknown>; ascii?: boolean }
  /** A stream that never ends: `event` again and again, as fast as it is read; `cancelled` once the gateway closed the call. */
  | { endless: unknown; cancelled: boolean }
  | undefined;
const upstream = Bun.serve({
  hostname: "127.0.0.1",
  port: 0,
  async fetch(req) {
    const body = (await req.json()) as { stream?: boolean; input?: unknown };
    if (scripted && "endless" in scripted) {
      const run = scripted;
      const bytes = new TextEncoder().encode(`data: ${JSON.stringify(run.endless)}\n\n`);
      const stream = new ReadableStream<Uint8Array>({
        async pull(c) {
          await Bun.sleep(1);
          c.enqueue(bytes);
        },
        cancel() {
          run.cancelled = true;
        },
      });
      return new Response(stream, { headers: { "content-type": "text/event-stream" } });
    }
    if (scripted && "completion" in scripted) {
      const answer = { id: "c1", created: 1, model: CHAT_MODEL, object: "chat.completion", ...scripted.completion };
      return scripted.ascii ? new Response(asciiJson(answer), { headers: { "content-type": "application/json" } }) : Response.json(answer);
    }
    if (scripted && "events" in scripted) {
      // Without [DONE] the stream just ends: cut off, as a dying upstream's would be.
      const spaced = scripted.spaced;
      const serialise = spaced ? (v: unknown) => spacedJson(v, spaced.colon, " ", spaced.pad) : scripted.ascii ? asciiJson : JSON.stringify;
      const frame = scripted.frame ?? ((json: string) => `data: ${json}\n\n`);
      const events = (list: unknown[]) => list.map((e) => frame(serialise(e))).join("");
      const text = (scripted.prefix ?? "") + events(scripted.events) + (scripted.done ? frame("[DONE]") : "") + events(scripted.after ?? []);
      if (!scripted.open) return new Response(text, { headers: { "content-type": "text/event-stream" } });
      const bytes = new TextEncoder().encode(text);
      return new Response(new ReadableStream({ start: (c) => c.enqueue(bytes) }), { headers: { "content-type": "text/event-stream" } });
    }
    if (new URL(req.url).pathname.endsWith("/embeddings")) {
      // One vector per input (a string or a token list is one input), as spec 2.4 asks of the answer.
      const inputs = typeof body.input === "string" || typeof arr(body.input)[0] === "number" ? 1 : arr(body.input).length;
      const data = Array.from({ length: inputs }, (_, index) => ({ object: "embedding", index, embedding: [0.5, 0.5] }));
      return Response.json({ object: "list", model: EMBED_MODEL, data, usage });
    }
    const head = { id: "c1", created: 1, model: CHAT_MODEL };
    if (!body.stream) {
      return Response.json({ ...head, object: "chat.completion", choices: [{ index: 0, message: { role: "assistant", content: "abcdefgh" }, finish_reason: "stop" }], usage });
    }
    const chunk = { ...head, object: "chat.completion.chunk", choices: [{ index: 0, delta: { content: "abcdefgh" }, finish_reason: null }] };
    const last = { ...head, object: "chat.completion.chunk", choices: [], usage };
    return new Response(`data: ${JSON.stringify(chunk)}\n\ndata: ${JSON.stringify(last)}\n\ndata: [DONE]\n\n`, { headers: { "content-type": "text/event-stream" } });
  },
});
const base = `http://127.0.0.1:${upstream.port}/v1`;

/** JSON as Python's json.dumps writes it by default (`", "` and `": "` separators), as servers built on it stream. */
/** A stream of two choices (n = 2): choice 0 sends 20 deltas of 40 characters, choice 1 two, then stops; choice 0 stops last. */
function twoChoiceEvents(): unknown[] {
  const events: unknown[] = [chunkOf([deltaOf({ role: "assistant", content: "" })]), chunkOf([deltaOf({ role: "assistant", content: "" }, 1)])];
  for (let i = 0; i < 20; i++) {
    events.push(chunkOf([deltaOf({ content: "a".repeat(40) })]));
    if (i < 2) events.push(chunkOf([deltaOf({ content: "b".repeat(40) }, 1)]));
    if (i === 2) events.push(chunkOf([{ index: 1, delta: {}, finish_reason: "stop" }]));
  }
  events.push(chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]));
  return events;
}

function pythonJson(v: unknown): string {
  if (Array.isArray(v)) return `[${v.map(pythonJson).join(", ")}]`;
  if (v !== null && typeof v === "object") return `{${Object.entries(v).map(([k, x]) => `${JSON.stringify(k)}: ${pythonJson(x)}`).join(", ")}}`;
  return JSON.stringify(v);
}

/** JSON as Python's json.dumps writes it by default: pythonJson with every UTF-16 unit outside ASCII as `\uXXXX`. */
function asciiJson(v: unknown): string {
  return pythonJson(v).replace(/[\u0080-\uffff]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`);
}

const lines: Record<string, unknown>[] = [];
let gw: Gateway;
let org: SeededOrg;

beforeAll(async () => {
  const config = await testConfig({
    aliases: {
      "svc-fast": chatAlias([{ baseUrl: base }]),
      "svc-embed": embedAlias([{ baseUrl: base }]),
      // An upstream that goes silent is cut after 400 ms here (10 s on svc-fast).
      "svc-idle": chatAlias([{ baseUrl: base }], { timeouts: { connectMs: 2_000, firstByteMs: 10_000, idleMs: 400 } }),
    },
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 1 }),
    responses: { enabled: true },
  });
  gw = await startGateway({ config, database: await sharedDatabase(), log: createLogger("warn", (l) => lines.push(JSON.parse(l) as Record<string, unknown>)) });
  org = await seedTestOrg(gw.database);
});
afterAll(async () => {
  await gw.stop();
  upstream.stop(true);
});

const warnings = () => lines.filter((l) => l.level === "warn" && String(l.msg).includes("usage"));

async function rows(orgId: string) {
  await gw.quota.flush();
  return gw.database.db.select().from(usageEvents).where(eq(usageEvents.orgId, orgId));
}

/** The prompt estimate of `userMessages()` ("hi"): 3 + 4 per message + 1 = what the gateway reserves. */
async function estimateOf(stream: boolean): Promise<number> {
  usage = {};
  const o = await seedTestOrg(gw.database);
  const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream });
  await res.text();
  const [row] = await rows(o.orgId);
  return row?.promptTokens ?? -1;
}

/** A streamed Responses request's final Response (its `response.completed` event). */
async function completedResponse(o: SeededOrg): Promise<Record<string, unknown>> {
  const r = await post(gw, "/v1/responses", o.personalKey, { model: "svc-fast", input: "hi", stream: true });
  expect(r.status).toBe(200);
  const completed = (await r.text()).split("\n\n").find((e) => e.startsWith("event: response.completed"));
  return rec(rec(JSON.parse(completed?.split("data: ")[1] ?? "null")).response);
}

/** A streamed Responses request completes with `text` and the usage given, and its record is charged that usage. */
async function expectAnswered(o: SeededOrg, text: string, input: number, output: number): Promise<void> {
  const final = await completedResponse(o);
  expect(JSON.stringify(final.output)).toContain(`"text":${JSON.stringify(text)}`);
  expect(rec(final.usage)).toMatchObject({ input_tokens: input, output_tokens: output });
  const [row] = await rows(o.orgId);
  expect([row?.status, row?.promptTokens, row?.completionTokens]).toEqual([200, input, output]);
}

const ABSURD: Record<string, unknown>[] = [
  { prompt_tokens: 1e20, completion_tokens: 1e20, total_tokens: 2e20 },
  { prompt_tokens: -5, completion_tokens: 1_000_000_001, total_tokens: 3 },
  { prompt_tokens: 2.5, completion_tokens: "7", total_tokens: null },
];

describe("usage figures an upstream makes up are clamped", () => {
  test("non-streamed: the client and the usage record get the estimate, and the target is named in a warning", async () => {
    const promptEstimate = await estimateOf(false);
    expect(promptEstimate).toBeGreaterThan(0);
    for (const u of ABSURD) {
      usage = u;
      lines.length = 0;
      const o = await seedTestOrg(gw.database);
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
      expect(res.status).toBe(200);
      // "abcdefgh": 8 characters ≈ 2 tokens.
      expect(rec(await res.json()).usage).toEqual({ prompt_tokens: promptEstimate, completion_tokens: 2, total_tokens: promptEstimate + 2 });
      const [row] = await rows(o.orgId);
      expect(row?.promptTokens).toBe(promptEstimate);
      expect(row?.completionTokens).toBe(2);
      expect(warnings().length).toBe(1);
      expect(warnings()[0]?.target).toBe(`${base}|${CHAT_MODEL}`);
    }
  });

  test("streamed: the usage chunk the client sees carries the clamped figures, and so does the record", async () => {
    const promptEstimate = await estimateOf(true);
    for (const u of ABSURD) {
      usage = u;
      lines.length = 0;
      const o = await seedTestOrg(gw.database);
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } });
      const data = sseData(await res.text());
      expect(data.at(-1)).toBe("[DONE]");
      const last = rec(JSON.parse(String(data.at(-2))));
      expect(last.model).toBe("svc-fast");
      expect(last.choices).toEqual([]);
      expect(last.usage).toEqual({ prompt_tokens: promptEstimate, completion_tokens: 2, total_tokens: promptEstimate + 2 });
      const [row] = await rows(o.orgId);
      expect(row?.promptTokens).toBe(promptEstimate);
      expect(row?.completionTokens).toBe(2);
      expect(warnings().length).toBe(1);
      expect(warnings()[0]?.target).toBe(`${base}|${CHAT_MODEL}`);
    }
  });

  test("streamed without include_usage: the usage chunk is dropped, the record still clamped and the target named", async () => {
    const promptEstimate = await estimateOf(true);
    usage = { prompt_tokens: 1e20, completion_tokens: 3, total_tokens: 1e20 };
    lines.length = 0;
    const o = await seedTestOrg(gw.database);
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true });
    const data = sseData(await res.text());
    expect(data.some((d) => d.includes('"usage"'))).toBe(false);
    const [row] = await rows(o.orgId);
    expect(row?.promptTokens).toBe(promptEstimate);
    expect(row?.completionTokens).toBe(3);
    expect(warnings().length).toBe(1);
    expect(warnings()[0]?.prompt_tokens).toBe("100000000000000000000");
  });

  test("embeddings: an absurd prompt count becomes the estimate", async () => {
    usage = { prompt_tokens: 1e20, total_tokens: 1e20 };
    lines.length = 0;
    const o = await seedTestOrg(gw.database);
    const res = await post(gw, "/v1/embeddings", o.personalKey, { model: "svc-embed", input: "abcdefgh" });
    expect(res.status).toBe(200);
    expect(rec(await res.json()).usage).toEqual({ prompt_tokens: 2, total_tokens: 2 });
    const [row] = await rows(o.orgId);
    expect(row?.promptTokens).toBe(2);
    expect(warnings()[0]?.target).toBe(`${base}|${EMBED_MODEL}`);
  });

  test("embeddings: a prompt count above one token per byte of input (plus 16 special tokens an input) is capped there", async () => {
    // Plausible in itself (under 10^9), but no tokenizer makes a million tokens of 8 bytes.
    usage = { prompt_tokens: 1_000_000, total_tokens: 1_000_000 };
    for (const [input, bound] of [
      ["abcdefgh", 8 + 16],
      [["abcdefgh", "é"], 8 + 16 + 2 + 16],
      [[[1, 2, 3]], 3 + 16],
    ] as const) {
      lines.length = 0;
      const o = await seedTestOrg(gw.database);
      const res = await post(gw, "/v1/embeddings", o.personalKey, { model: "svc-embed", input });
      expect(res.status).toBe(200);
      expect(rec(await res.json()).usage).toEqual({ prompt_tokens: bound, total_tokens: bound });
      const [row] = await rows(o.orgId);
      expect(row?.promptTokens).toBe(bound);
      expect(warnings()[0]?.prompt_tokens).toBe("1000000");
    }
    // Within the bound: the upstream's count stands.
    usage = { prompt_tokens: 20, total_tokens: 20 };
    const ok = await post(gw, "/v1/embeddings", org.personalKey, { model: "svc-embed", input: "abcdefgh" });
    expect(rec(await ok.json()).usage).toEqual({ prompt_tokens: 20, total_tokens: 20 });
  });

  test("a completion count beyond the bound the upstream was told (n × max_tokens) is capped there: one request cannot overshoot the quota", async () => {
    // 1,000,000 completion tokens claimed for an answer bounded at 50 a choice, under a quota of 10,000.
    usage = { prompt_tokens: 9, completion_tokens: 1_000_000, total_tokens: 1_000_009 };
    for (const [stream, n] of [[false, 1], [true, 1], [false, 2], [true, 2]] as const) {
      lines.length = 0;
      const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), max_tokens: 50, n, stream, ...(stream ? { stream_options: { include_usage: true } } : {}) });
      expect(res.status).toBe(200);
      const seen = stream ? rec(JSON.parse(String(sseData(await res.text()).at(-2)))).usage : rec(await res.json()).usage;
      expect(seen).toEqual({ prompt_tokens: 9, completion_tokens: 50 * n, total_tokens: 9 + 50 * n });
      const [row] = await rows(o.orgId);
      expect(row?.promptTokens).toBe(9);
      expect(row?.completionTokens).toBe(50 * n);
      expect(warnings().length).toBe(1);
      expect(warnings()[0]?.completion_tokens).toBe("1000000");
    }
    // Without a bound (no quota, no max_tokens) the figure stands.
    const o = await seedTestOrg(gw.database);
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
    expect(rec(await res.json()).usage).toEqual(usage);
  });

  test("a prompt count beyond the alias's context window is capped at the window, streamed or not", async () => {
    // svc-fast's window is 128,000 tokens; the upstream claims 10^9 for "hi".
    usage = { prompt_tokens: 1_000_000_000, completion_tokens: 2, total_tokens: 1_000_000_002 };
    for (const stream of [false, true]) {
      lines.length = 0;
      const o = await seedTestOrg(gw.database);
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream, ...(stream ? { stream_options: { include_usage: true } } : {}) });
      expect(res.status).toBe(200);
      const seen = stream ? rec(JSON.parse(String(sseData(await res.text()).at(-2)))).usage : rec(await res.json()).usage;
      expect(seen).toEqual({ prompt_tokens: 128_000, completion_tokens: 2, total_tokens: 128_002 });
      const [row] = await rows(o.orgId);
      expect(row?.promptTokens).toBe(128_000);
      expect(warnings()[0]?.prompt_tokens).toBe("1000000000");
    }
  });

  test("a count of zero for work that was done (a prompt sent, text delivered) is replaced by the estimate and warned about, streamed or not", async () => {
    const promptEstimate = await estimateOf(false);
    lines.length = 0;
    usage = { prompt_tokens: 0, completion_tokens: 0, total_tokens: 0 };
    const o = await seedTestOrg(gw.database);
    // "abcdefgh": 8 characters delivered ≈ 2 tokens.
    const expected = { prompt_tokens: promptEstimate, completion_tokens: 2, total_tokens: promptEstimate + 2 };
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
    expect(rec(await res.json()).usage).toEqual(expected);
    const s = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } });
    expect(rec(JSON.parse(String(sseData(await s.text()).at(-2)))).usage).toEqual(expected);
    const recorded = await rows(o.orgId);
    expect(recorded.reduce((n, r) => n + r.promptTokens + r.completionTokens, 0)).toBe(2 * (promptEstimate + 2));
    expect(warnings().map((w) => [w.prompt_tokens, w.completion_tokens])).toEqual([
      ["0", "0"],
      ["0", "0"],
    ]);
  });

  test("plausible figures pass unchanged, without a warning (10^9 is still plausible)", async () => {
    lines.length = 0;
    for (const u of [
      { prompt_tokens: 1, completion_tokens: 1, total_tokens: 2 },
      { prompt_tokens: 12, completion_tokens: 1_000_000_000, total_tokens: 1_000_000_012 },
    ]) {
      usage = u;
      const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", messages: userMessages() });
      expect(rec(await res.json()).usage).toEqual(u);
      const s = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } });
      const data = sseData(await s.text());
      expect(rec(JSON.parse(String(data.at(-2)))).usage).toEqual(u);
    }
    expect(warnings()).toEqual([]);
  });

  test("a total_tokens other than the sum of the parts (or none) is the sum in what the client sees, streamed or not, as the record counts it", async () => {
    const details = { prompt_tokens_details: { cached_tokens: 4 } };
    for (const total of [99_999, 0, undefined]) {
      usage = { prompt_tokens: 12, completion_tokens: 3, ...(total !== undefined ? { total_tokens: total } : {}), ...details };
      const o = await seedTestOrg(gw.database);
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
      expect(rec(await res.json()).usage).toEqual({ prompt_tokens: 12, completion_tokens: 3, total_tokens: 15, ...details });
      const s = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } });
      const data = sseData(await s.text());
      // Before: the streamed chunk was relayed as sent (total_tokens 99999, or none) while 15 were charged.
      expect(rec(JSON.parse(String(data.at(-2)))).usage).toEqual({ prompt_tokens: 12, completion_tokens: 3, total_tokens: 15, ...details });
      const charged = (await rows(o.orgId)).map((r) => [r.requests, r.promptTokens, r.completionTokens]);
      expect(charged).toEqual([
        [1, 12, 3],
        [1, 12, 3],
      ]);
    }
  });

  test("non-streamed: the upstream's prompt_tokens_details and completion_tokens_details are passed on (chat, the openai SDK, the Responses API), their known integer counts only, each within the count it is part of; what is charged is unchanged", async () => {
    const promptDetails = { cached_tokens: 8, audio_tokens: 0, cache_write_tokens: 2, image_tokens: 0, text_tokens: 12 };
    const completionDetails = { reasoning_tokens: 20, audio_tokens: 0, accepted_prediction_tokens: 1, rejected_prediction_tokens: 0, text_tokens: 10 };
    usage = { prompt_tokens: 12, completion_tokens: 30, total_tokens: 42, prompt_tokens_details: promptDetails, completion_tokens_details: completionDetails };
    const o = await seedTestOrg(gw.database);
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
    expect(res.status).toBe(200);
    // Before: { prompt_tokens: 12, completion_tokens: 30, total_tokens: 42 } alone, where the stream passed the details on.
    expect(rec(await res.json()).usage).toEqual(usage);
    const s = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } });
    expect(rec(JSON.parse(String(sseData(await s.text()).at(-2)))).usage).toEqual(usage);
    // As a typed client reads them.
    const client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: o.personalKey, maxRetries: 0 });
    const typed = await client.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] });
    expect([typed.usage?.prompt_tokens_details?.cached_tokens, typed.usage?.completion_tokens_details?.reasoning_tokens]).toEqual([8, 20]);
    // The Responses API answered whole takes them from the chat answer.
    const r = await post(gw, "/v1/responses", o.personalKey, { model: "svc-fast", input: "hi" });
    expect(r.status).toBe(200);
    expect(rec(await r.json()).usage).toEqual({
      input_tokens: 12,
      input_tokens_details: { cached_tokens: 8, cache_write_tokens: 2 },
      output_tokens: 30,
      output_tokens_details: { reasoning_tokens: 20 },
      total_tokens: 42,
    });
    // Four requests (rows sum those of one key, alias, target and status): each charged 12 and 30.
    const charged = (await rows(o.orgId)).reduce((n, row) => ({ requests: n.requests + row.requests, prompt: n.prompt + row.promptTokens, completion: n.completion + row.completionTokens }), { requests: 0, prompt: 0, completion: 0 });
    expect(charged).toEqual({ requests: 4, prompt: 4 * 12, completion: 4 * 30 });

    // Hostile details: a count that is no integer from 0 to the count it is part of, a field no client knows, or details
    // that are not an object, are dropped; details left empty are left out.
    for (const [sent, kept] of [
      [
        {
          prompt_tokens_details: { cached_tokens: 13, audio_tokens: -1, image_tokens: "3", text_tokens: 2.5, secret: 5 },
          completion_tokens_details: { reasoning_tokens: 31, audio_tokens: 1e20, accepted_prediction_tokens: 30, rejected_prediction_tokens: null, text_tokens: { n: 1 } },
        },
        { completion_tokens_details: { accepted_prediction_tokens: 30 } },
      ],
      [{ prompt_tokens_details: null, completion_tokens_details: [5] }, {}],
      [{ prompt_tokens_details: "8", completion_tokens_details: 20 }, {}],
    ] as const) {
      usage = { prompt_tokens: 12, completion_tokens: 30, total_tokens: 42, ...sent };
      lines.length = 0;
      const json = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
      expect(rec(await json.json()).usage).toEqual({ prompt_tokens: 12, completion_tokens: 30, total_tokens: 42, ...kept });
    }
    // Streamed, the usage chunk is checked the same way (the Vercel AI SDK refuses a chunk whose cached_tokens is a string).
    usage = {
      prompt_tokens: 12,
      completion_tokens: 30,
      total_tokens: 42,
      prompt_tokens_details: { cached_tokens: "8", audio_tokens: 0 },
      completion_tokens_details: { reasoning_tokens: 31, secret: 1 },
    };
    const hostile = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } });
    // Before: relayed as sent.
    expect(rec(JSON.parse(String(sseData(await hostile.text()).at(-2)))).usage).toEqual({ prompt_tokens: 12, completion_tokens: 30, total_tokens: 42, prompt_tokens_details: { audio_tokens: 0 } });
    // Within the counts charged when the upstream's count was replaced: the estimate of "hi" is less than 12 cached tokens.
    const promptEstimate = await estimateOf(false);
    expect(promptEstimate).toBeLessThan(12);
    usage = { prompt_tokens: 1e20, completion_tokens: 30, total_tokens: 1e20, prompt_tokens_details: { cached_tokens: 12, audio_tokens: 0 }, completion_tokens_details: { reasoning_tokens: 20 } };
    const replaced = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
    expect(rec(await replaced.json()).usage).toEqual({
      prompt_tokens: promptEstimate,
      completion_tokens: 30,
      total_tokens: promptEstimate + 30,
      prompt_tokens_details: { audio_tokens: 0 },
      completion_tokens_details: { reasoning_tokens: 20 },
    });
  });
});

/** One streamed chat request of `o`'s, read to the end: its usage row, recorded with status 200. */
async function streamedRow(o: SeededOrg) {
  const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true });
  expect(res.status).toBe(200);
  await res.text();
  const [row] = await rows(o.orgId);
  expect(row?.status).toBe(200);
  return row;
}

/** A streamed chunk of the upstream's, with the given choices (and usage, when given). */
const chunkOf = (choices: unknown[], extra: Record<string, unknown> = {}) => ({ id: "c1", object: "chat.completion.chunk", created: 1, model: CHAT_MODEL, choices, ...extra });
const deltaOf = (delta: Record<string, unknown>, index = 0) => ({ index, delta, finish_reason: null });

describe("usage the upstream leaves out, or reports before the end", () => {
  afterEach(() => {
    scripted = undefined;
  });

  test("streamed: usage reported mid-stream, then more text: what came after the report is charged too, cut off or not", async () => {
    for (const done of [false, true]) {
      const o = await seedTestOrg(gw.database);
      // As servers reporting usage on every chunk (or only the first) do: 1 token so far, then 400 characters more with no report.
      scripted = {
        events: [
          chunkOf([deltaOf({ role: "assistant", content: "abcd" })], { usage: { prompt_tokens: 9, completion_tokens: 1, total_tokens: 10 } }),
          ...Array.from({ length: 10 }, () => chunkOf([deltaOf({ content: "x".repeat(40) })])),
        ],
        done,
      };
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true });
      expect(res.status).toBe(200);
      await res.text();
      const [row] = await rows(o.orgId);
      expect(row?.status).toBe(done ? 200 : 503);
      expect(row?.promptTokens).toBe(9);
      // The reported token, plus 400 characters ≈ 100 tokens delivered after the report.
      expect(row?.completionTokens).toBe(101);
    }
  });

  test("usage reported in parts (the prompt on the first chunk, the completion on the last): the prompt count is kept when the last report leaves it out, streamed or not", async () => {
    const promptEstimate = await estimateOf(true);
    // 12 prompt tokens reported (the estimate of "hi" is less), then 20 characters, then the completion alone.
    expect(promptEstimate).not.toBe(12);
    const events = [
      chunkOf([deltaOf({ role: "assistant", content: "a".repeat(20) })], { usage: { prompt_tokens: 12 } }),
      chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]),
      chunkOf([], { usage: { completion_tokens: 7 } }),
    ];
    for (const stream of [true, false]) {
      scripted = { events, done: true };
      const o = await seedTestOrg(gw.database);
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream, ...(stream ? { stream_options: { include_usage: true } } : {}) });
      expect(res.status).toBe(200);
      const text = await res.text();
      const told = stream ? rec(JSON.parse(sseData(text).at(-2) ?? "null")).usage : rec(JSON.parse(text)).usage;
      // Before: the prompt the upstream counted was forgotten for the estimate, since the last report left it out.
      expect(told).toEqual({ prompt_tokens: 12, completion_tokens: 7, total_tokens: 19 });
      const [row] = await rows(o.orgId);
      expect([row?.promptTokens, row?.completionTokens]).toEqual([12, 7]);
    }
  });

  test("streamed without usage: every delta's text counts (reasoning, refusal, each choice and each tool call of an event)", async () => {
    const promptEstimate = await estimateOf(true);
    const o = await seedTestOrg(gw.database);
    scripted = {
      events: [
        // The reasoning under both its names (vLLM's older and newer), the same text: counted once.
        chunkOf([deltaOf({ role: "assistant", reasoning_content: "r".repeat(40), reasoning: "r".repeat(40) })]),
        chunkOf([deltaOf({ refusal: "f".repeat(40) })]),
        // Two choices (n = 2) in one event.
        chunkOf([deltaOf({ content: "a".repeat(40) }), deltaOf({ content: "b".repeat(40) }, 1)]),
        // Two parallel tool calls' arguments in one event.
        chunkOf([deltaOf({ tool_calls: [{ index: 0, function: { arguments: "c".repeat(40) } }, { index: 1, function: { arguments: "d".repeat(40) } }] })]),
      ],
      done: true,
    };
    const row = await streamedRow(o);
    expect(row?.promptTokens).toBe(promptEstimate);
    // 6 × 40 characters delivered ≈ 60 tokens.
    expect(row?.completionTokens).toBe(60);
  });

  test("without usage, one character an event (digits: a token each in Qwen's tokenizer): each event of text is charged at least a token, as the bound's cut counts them", async () => {
    const promptEstimate = await estimateOf(true);
    // 200 events of one digit, then the finish: at least 200 tokens generated, 200 bytes (~50 at 4 bytes a token).
    const events = [
      chunkOf([deltaOf({ role: "assistant", content: "" })]),
      ...Array.from({ length: 200 }, () => chunkOf([deltaOf({ content: "7" })])),
      chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]),
    ];
    // Streamed, complete and cut off (no [DONE]); and a non-streamed request the upstream answers with the same SSE.
    for (const [stream, done] of [[true, true], [true, false], [false, true]] as const) {
      scripted = { events, done };
      const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream, max_tokens: 200 });
      expect(res.status).toBe(200);
      await res.text();
      const [row] = await rows(o.orgId);
      // Before: 50 (200 bytes at 4 a token), where one event more (past max_tokens: 200) was charged 200.
      expect({ stream, done, prompt: row?.promptTokens, completion: row?.completionTokens }).toEqual({ stream, done, prompt: promptEstimate, completion: 200 });
    }
  });

  test("streamed without usage, the client asking for it: a usage chunk with what was counted comes before [DONE] (chat), and the Response carries it (Responses API)", async () => {
    const promptEstimate = await estimateOf(true);
    const events = [
      chunkOf([deltaOf({ role: "assistant", content: "a".repeat(40) })]),
      chunkOf([deltaOf({ content: "b".repeat(40) })]),
      chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]),
    ];
    // An upstream that ignores stream_options.include_usage: no usage chunk at all.
    scripted = { events, done: true };
    const o = await seedTestOrg(gw.database);
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } });
    expect(res.status).toBe(200);
    const data = sseData(await res.text());
    expect(data.at(-1)).toBe("[DONE]");
    // 80 characters delivered ≈ 20 tokens: what the record says, the client sees.
    const last = rec(JSON.parse(data.at(-2) ?? "null"));
    expect(last).toEqual({ id: "c1", object: "chat.completion.chunk", created: expect.any(Number), model: "svc-fast", choices: [], usage: { prompt_tokens: promptEstimate, completion_tokens: 20, total_tokens: promptEstimate + 20 } });
    const [row] = await rows(o.orgId);
    expect([row?.promptTokens, row?.completionTokens]).toEqual([promptEstimate, 20]);
    // Not asked for: no usage chunk, as before.
    const plain = sseData(await (await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true })).text());
    expect(plain.filter((d) => d.includes('"usage"'))).toEqual([]);
    // Cut off (no [DONE]): the error event ends it; no usage chunk is made up.
    scripted = { events, done: false };
    const cut = sseData(await (await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } })).text());
    expect(cut.filter((d) => d.includes('"usage"'))).toEqual([]);
    expect(cut.at(-1)).toContain('"error"');

    // The Responses API asks chat for usage: its final event and stored Response carry the same figures.
    scripted = { events, done: true };
    const final = await completedResponse(o);
    expect(rec(final.usage)).toMatchObject({ output_tokens: 20, total_tokens: rec(final.usage).input_tokens as number + 20 });
  });

  test("streamed, usage reported mid-stream, then more text, the client asking for usage: a usage chunk with what is charged comes before [DONE] (chat), and the Response carries it (Responses API)", async () => {
    const events = [
      chunkOf([deltaOf({ role: "assistant", content: "abcd" })], { usage: { prompt_tokens: 9, completion_tokens: 1, total_tokens: 10 } }),
      ...Array.from({ length: 10 }, () => chunkOf([deltaOf({ content: "x".repeat(40) })])),
      chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]),
    ];
    scripted = { events, done: true };
    const o = await seedTestOrg(gw.database);
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } });
    expect(res.status).toBe(200);
    const data = sseData(await res.text());
    expect(data.at(-1)).toBe("[DONE]");
    // The upstream's report, then the figures charged: its token plus 400 characters ≈ 100 tokens after it.
    // Before: the client's last word on usage was the upstream's 1 completion token, and the record said 101.
    const reports = data.filter((d) => d.includes('"usage"')).map((d) => rec(JSON.parse(d)).usage);
    expect(reports.at(-1)).toEqual({ prompt_tokens: 9, completion_tokens: 101, total_tokens: 110 });
    expect(rec(JSON.parse(data.at(-2) ?? "null")).choices).toEqual([]);
    const [row] = await rows(o.orgId);
    expect([row?.promptTokens, row?.completionTokens]).toEqual([9, 101]);
    // A report that covers all the text (the usual final one): nothing added, relayed as sent.
    scripted = { events: [...events, chunkOf([], { usage: { prompt_tokens: 9, completion_tokens: 120, total_tokens: 129 } })], done: true };
    const whole = sseData(await (await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } })).text());
    expect(whole.filter((d) => d.includes('"usage"')).map((d) => rec(JSON.parse(d)).usage)).toEqual([
      { prompt_tokens: 9, completion_tokens: 1, total_tokens: 10 },
      { prompt_tokens: 9, completion_tokens: 120, total_tokens: 129 },
    ]);

    // The Responses API asks chat for usage: its final event and stored Response carry the figures charged.
    scripted = { events, done: true };
    const r = await seedTestOrg(gw.database);
    const final = await completedResponse(r);
    expect(rec(final.usage)).toMatchObject({ input_tokens: 9, output_tokens: 101, total_tokens: 110 });
    const [responseRow] = await rows(r.orgId);
    expect([responseRow?.promptTokens, responseRow?.completionTokens]).toEqual([9, 101]);
  });

  test("streamed, usage with its breakdowns reported mid-stream, then more text, the client asking for usage: the usage chunk the gateway adds keeps the breakdowns (chat), and the Response's cached and reasoning tokens are the upstream's (Responses API)", async () => {
    const details = { prompt_tokens_details: { cached_tokens: 8 }, completion_tokens_details: { reasoning_tokens: 1 } };
    const events = [
      chunkOf([deltaOf({ role: "assistant", content: "abcd" })], { usage: { prompt_tokens: 9, completion_tokens: 1, total_tokens: 10, ...details } }),
      ...Array.from({ length: 10 }, () => chunkOf([deltaOf({ content: "x".repeat(40) })])),
      chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]),
    ];
    scripted = { events, done: true };
    const o = await seedTestOrg(gw.database);
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } });
    expect(res.status).toBe(200);
    const reports = sseData(await res.text())
      .filter((d) => d.includes('"usage"'))
      .map((d) => rec(JSON.parse(d)).usage);
    // As a JSON answer (and an SSE answer to a non-streamed request) carries them for the same upstream.
    expect(reports.at(-1)).toEqual({ prompt_tokens: 9, completion_tokens: 101, total_tokens: 110, ...details });
    const r = await seedTestOrg(gw.database);
    const final = await completedResponse(r);
    expect(rec(final.usage)).toMatchObject({ input_tokens: 9, input_tokens_details: { cached_tokens: 8 }, output_tokens: 101, output_tokens_details: { reasoning_tokens: 1 } });
  });

  test("events framed with other fields (`event:`, `id:`, `retry:`, a comment line) or split over several `data:` lines are read all the same: text and usage charged, model named by its alias, plain `data:` events to the client", async () => {
    /** Splits a JSON text at its commas into `data:` lines (SSE joins them with a line feed, which JSON reads as white space). */
    const split = (json: string) => `data: ${json.replaceAll('","', '",\ndata: "')}\n\n`;
    const framings: [string, (json: string) => string][] = [
      ["event: line first", (j) => `event: message\ndata: ${j}\n\n`],
      ["id: line first", (j) => `id: 7\ndata: ${j}\n\n`],
      ["id: line after the data", (j) => `data: ${j}\nid: 7\n\n`],
      ["retry: line and a comment line", (j) => `retry: 3000\n: note\ndata: ${j}\n\n`],
      ["several data: lines", split],
      ["CRLF line ends with an event: line", (j) => `event: message\r\ndata: ${j}\r\n\r\n`],
      ["CR line ends", (j) => `event: message\rdata: ${j}\r\r`],
    ];
    for (const [name, frame] of framings) {
      const o = await seedTestOrg(gw.database);
      scripted = {
        events: [
          chunkOf([deltaOf({ role: "assistant", content: "a".repeat(400) })]),
          chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]),
          chunkOf([], { usage: { prompt_tokens: 9, completion_tokens: 123, total_tokens: 132 } }),
        ],
        done: true,
        frame,
      };
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } });
      expect(res.status).toBe(200);
      const text = await res.text();
      // Before: the events passed through unread, `event:` line and all (and their usage was not seen).
      let data: string[] = [];
      expect(() => {
        // A CRLF upstream's line ends are kept (as before); the events are what is checked.
        data = sseData(text.replaceAll("\r\n", "\n"));
      }, name).not.toThrow();
      expect(data.at(-1), name).toBe("[DONE]");
      const chunks = data.slice(0, -1).map((d) => rec(JSON.parse(d)));
      expect(chunks.map((c) => c.model), name).toEqual(["svc-fast", "svc-fast", "svc-fast"]);
      expect(chunks.at(-1)?.usage, name).toEqual({ prompt_tokens: 9, completion_tokens: 123, total_tokens: 132 });
      const [row] = await rows(o.orgId);
      expect([row?.status, row?.promptTokens, row?.completionTokens], name).toEqual([200, 9, 123]);
    }
    // The Responses API reads the same events: its answer has the text and the usage.
    const o = await seedTestOrg(gw.database);
    scripted = {
      events: [chunkOf([deltaOf({ role: "assistant", content: "hello" })]), chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]), chunkOf([], { usage: { prompt_tokens: 9, completion_tokens: 55, total_tokens: 64 } })],
      done: true,
      frame: (j) => `event: message\nid: 1\ndata: ${j}\n\n`,
    };
    await expectAnswered(o, "hello", 9, 55);
  });

  test("an upstream that ignores max_tokens is ended at its bound however it frames its events", async () => {
    const o = await seedTestOrg(gw.database);
    scripted = {
      events: Array.from({ length: 50 }, (_, i) => chunkOf([deltaOf(i === 0 ? { role: "assistant", content: "x" } : { content: "x" })])),
      done: true,
      frame: (j) => `event: message\ndata: ${j}\n\n`,
    };
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, max_tokens: 5 });
    expect(res.status).toBe(200);
    const data = sseData(await res.text());
    const texts = data.filter((d) => d.includes('"content":"x"'));
    // Before: all 50 relayed, event: lines and all.
    expect(texts.length).toBe(5);
    const [row] = await rows(o.orgId);
    expect(row?.completionTokens).toBeLessThanOrEqual(5);
  });

  test("[DONE] ends the answer: what an upstream sends after it is neither relayed nor charged, and an upstream that then keeps the body open does not fail the stream", async () => {
    for (const open of [false, true]) {
      const o = await seedTestOrg(gw.database);
      scripted = {
        events: [chunkOf([deltaOf({ role: "assistant", content: "abcd" })]), chunkOf([], { usage: { prompt_tokens: 9, completion_tokens: 10, total_tokens: 19 } })],
        done: true,
        after: Array.from({ length: 10 }, () => chunkOf([deltaOf({ content: "x".repeat(400) })])),
        open,
      };
      const t0 = performance.now();
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true });
      expect(res.status).toBe(200);
      const data = sseData(await res.text());
      // Before: the kept-open body was waited on for idleMs (10 s here), then an error event followed [DONE].
      expect(performance.now() - t0).toBeLessThan(5_000);
      expect(data.at(-1)).toBe("[DONE]");
      expect(data.some((d) => d.includes("xxxx"))).toBe(false);
      const [row] = await rows(o.orgId);
      expect(row?.status).toBe(200);
      expect(row?.promptTokens).toBe(9);
      // Before: 10 + 4,000 characters after [DONE] ≈ 1,010.
      expect(row?.completionTokens).toBe(10);
    }
  });

  test("without the upstream's count, a prompt in a dense script (CJK) is charged its UTF-8 bytes ÷ 4, as delivered text is: streamed, cut off or whole", async () => {
    // 400 characters, 1,200 bytes: ~1 token a character on common BPE vocabularies, 300 at 4 bytes a token.
    const prompt = "你好".repeat(200);
    const expected = 3 + 4 + 1_200 / 4;
    const cases: [string, NonNullable<typeof scripted>, boolean][] = [
      ["whole", { completion: { choices: [{ index: 0, message: { role: "assistant", content: "abcd" }, finish_reason: "stop" }] } }, false],
      ["streamed", { events: [chunkOf([deltaOf({ role: "assistant", content: "abcd" })]), chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }])], done: true }, true],
      ["cut off", { events: [chunkOf([deltaOf({ role: "assistant", content: "abcd" })])], done: false }, true],
    ];
    for (const [name, script, stream] of cases) {
      scripted = script;
      const o = await seedTestOrg(gw.database);
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(prompt), stream });
      expect(res.status, name).toBe(200);
      await res.text();
      const [row] = await rows(o.orgId);
      // Before: 3 + 4 + 400 / 4 = 107, a third of the bytes' count and a quarter of a tokenizer's.
      expect([name, row?.promptTokens, row?.completionTokens]).toEqual([name, expected, 1]);
    }
    // ASCII text is one byte a character: its estimate is as before ("hi": 3 + 4 + 1).
    expect(await estimateOf(false)).toBe(8);
  });

  test("without the upstream's count, an answer in a dense script (CJK) is charged its UTF-8 bytes ÷ 4 whole as streamed, and embedding input likewise", async () => {
    // 400 characters, 1,200 bytes: 300 tokens at 4 bytes a token.
    const text = "你好".repeat(200);
    const charged: [string, number | undefined][] = [];
    const cases: [string, NonNullable<typeof scripted>, boolean][] = [
      ["streamed", { events: [chunkOf([deltaOf({ role: "assistant", content: text })]), chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }])], done: true }, true],
      ["whole", { completion: { choices: [{ index: 0, message: { role: "assistant", content: text }, finish_reason: "stop" }] } }, false],
      ["whole, reasoning and a tool call", { completion: { choices: [{ index: 0, message: { role: "assistant", content: null, reasoning_content: text, tool_calls: [{ id: "c", type: "function", function: { name: "f", arguments: text } }] }, finish_reason: "tool_calls" }] } }, false],
      // The same answer streamed: the reasoning, then the call opened with its name, then its arguments.
      [
        "streamed, reasoning and a tool call",
        {
          events: [
            chunkOf([deltaOf({ role: "assistant", reasoning_content: text })]),
            chunkOf([deltaOf({ tool_calls: [{ index: 0, id: "c", type: "function", function: { name: "f", arguments: "" } }] })]),
            chunkOf([deltaOf({ tool_calls: [{ index: 0, function: { arguments: text } }] })]),
            chunkOf([{ index: 0, delta: {}, finish_reason: "tool_calls" }]),
          ],
          done: true,
        },
        true,
      ],
      // Sent as SSE to a non-streamed request: a report of 1 token on the first chunk, the text after it.
      ["whole, from SSE", { events: [chunkOf([deltaOf({ role: "assistant", content: "" })], { usage: { prompt_tokens: 9, completion_tokens: 1 } }), chunkOf([deltaOf({ content: text })])], done: true }, false],
    ];
    for (const [name, script, stream] of cases) {
      scripted = script;
      const o = await seedTestOrg(gw.database);
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream });
      expect(res.status, name).toBe(200);
      await res.text();
      const [row] = await rows(o.orgId);
      charged.push([name, row?.completionTokens]);
    }
    // Before: 300 streamed, 100 whole (UTF-16 units ÷ 4), 101 from SSE; the reasoning and the call's arguments
    // were 100 and 100 + 12 whole; then 300 and 300 + 16 whole (the call's JSON around its arguments, ~60
    // bytes, counted as generated text), 600 streamed. Now a call's arguments, as a stream counts them.
    expect(charged).toEqual([
      ["streamed", 300],
      ["whole", 300],
      ["whole, reasoning and a tool call", 600],
      ["streamed, reasoning and a tool call", 600],
      ["whole, from SSE", 1 + 300],
    ]);
    // Embeddings whose upstream reports no count: 1,200 bytes ≈ 300 tokens (before: 100).
    scripted = undefined;
    usage = {};
    const o = await seedTestOrg(gw.database);
    const res = await post(gw, "/v1/embeddings", o.personalKey, { model: "svc-embed", input: text });
    expect(rec(await res.json()).usage).toEqual({ prompt_tokens: 300, total_tokens: 300 });
  });

  test("without the upstream's count, text its server escapes (`\\uXXXX` for CJK, `\\n`, `\\\"`) is charged its UTF-8 bytes ÷ 4 as unescaped text is: streamed (the usage chunk the gateway adds, the record, the Response) and whole (JSON, SSE)", async () => {
    // 50 × (6 CJK characters, a line feed, a quoted CJK character): 50 × 24 = 1,200 bytes of UTF-8, 300 tokens;
    // as Python's json.dumps writes it, 50 × 48 bytes (each CJK character `\uXXXX`, 6 bytes; `\n` and `\"` 2).
    const text = '你好，世界。\n"引"'.repeat(50);
    expect(Buffer.byteLength(text)).toBe(1_200);
    const streamed = [chunkOf([deltaOf({ role: "assistant", content: text.slice(0, 100) })]), chunkOf([deltaOf({ content: text.slice(100) })]), chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }])];
    const charged: [string, unknown, number | undefined][] = [];
    for (const ascii of [false, true]) {
      const how = ascii ? "escaped" : "UTF-8";
      // Streamed without a usage chunk, the client asking for usage: the gateway adds it with what it charges.
      scripted = { events: streamed, done: true, ascii };
      let o = await seedTestOrg(gw.database);
      let res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: true } });
      const data = sseData(await res.text());
      expect(data.at(-1)).toBe("[DONE]");
      charged.push([`streamed, ${how}`, rec(rec(JSON.parse(data.at(-2) ?? "null")).usage).completion_tokens, (await rows(o.orgId))[0]?.completionTokens]);
      // The same stream through the Responses API: its final usage and the record.
      o = await seedTestOrg(gw.database);
      const final = await completedResponse(o);
      charged.push([`Responses API, ${how}`, rec(final.usage).output_tokens, (await rows(o.orgId))[0]?.completionTokens]);
      // A JSON answer without usage, and an SSE answer to a non-streamed request without usage.
      for (const [name, script] of [
        ["whole", { completion: { choices: [{ index: 0, message: { role: "assistant", content: text }, finish_reason: "stop" }] }, ascii }],
        ["whole, from SSE", { events: streamed, done: true, ascii }],
      ] as [string, NonNullable<typeof scripted>][]) {
        scripted = script;
        o = await seedTestOrg(gw.database);
        res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
        const body = rec(await res.json());
        expect(rec(rec(arr(body.choices)[0]).message).content).toBe(text);
        charged.push([`${name}, ${how}`, rec(body.usage).completion_tokens, (await rows(o.orgId))[0]?.completionTokens]);
      }
    }
    // Before: the escaped stream was charged (and told) 600, twice the whole answer's 300 for the same text.
    expect(charged).toEqual([
      ["streamed, UTF-8", 300, 300],
      ["Responses API, UTF-8", 300, 300],
      ["whole, UTF-8", 300, 300],
      ["whole, from SSE, UTF-8", 300, 300],
      ["streamed, escaped", 300, 300],
      ["Responses API, escaped", 300, 300],
      ["whole, escaped", 300, 300],
      ["whole, from SSE, escaped", 300, 300],
    ]);
  });

  test("non-streamed without usage: reasoning and refusal text count as completion, for the client and the record", async () => {
    const promptEstimate = await estimateOf(false);
    const cases: [Record<string, unknown>, number][] = [
      // 8 characters of answer and 400 of reasoning ≈ 102 tokens.
      [{ role: "assistant", content: "abcdefgh", reasoning_content: "r".repeat(400) }, 102],
      // Under both names, the same text: counted once.
      [{ role: "assistant", content: "abcdefgh", reasoning_content: "r".repeat(400), reasoning: "r".repeat(400) }, 102],
      [{ role: "assistant", content: null, refusal: "f".repeat(40) }, 10],
    ];
    for (const [message, completion] of cases) {
      const o = await seedTestOrg(gw.database);
      scripted = { completion: { choices: [{ index: 0, message, finish_reason: "stop" }] } };
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
      expect(res.status).toBe(200);
      expect(rec(await res.json()).usage).toEqual({ prompt_tokens: promptEstimate, completion_tokens: completion, total_tokens: promptEstimate + completion });
      const [row] = await rows(o.orgId);
      expect(row?.completionTokens).toBe(completion);
    }
  });
});

describe("a stream that fails before it delivered any text, without a usage report, is charged nothing, as a failed JSON request is", () => {
  afterEach(() => {
    scripted = undefined;
  });

  /** The record of one request of a fresh organisation: [status, prompt tokens, completion tokens]. */
  async function charged(send: (o: SeededOrg) => Promise<void>): Promise<[number | undefined, number | undefined, number | undefined]> {
    const o = await seedTestOrg(gw.database);
    await send(o);
    const [row] = await rows(o.orgId);
    return [row?.status, row?.promptTokens, row?.completionTokens];
  }
  const chat = (o: SeededOrg, model = "svc-fast", stream = true, init: RequestInit = {}) =>
    post(gw, "/v1/chat/completions", o.personalKey, { model, messages: userMessages(), stream, ...(stream ? { stream_options: { include_usage: true } } : {}) }, init);
  const role = chunkOf([deltaOf({ role: "assistant", content: "" })]);
  const upstreamError = { error: { message: "the engine died", type: "InternalServerError", code: 500 } };

  test("cut off, an upstream error event, idle, or cut at shutdown: the chat stream's record is 503 with no tokens; the client got its error event and no usage", async () => {
    const promptEstimate = await estimateOf(true);
    const failures: [string, NonNullable<typeof scripted>, string][] = [
      ["cut off", { events: [role], done: false }, "svc-fast"],
      ["an error event", { events: [role, upstreamError], done: false }, "svc-fast"],
      ["idle", { events: [role], done: false, open: true }, "svc-idle"],
    ];
    const got: [string, ...unknown[]][] = [];
    for (const [name, script, model] of failures) {
      scripted = script;
      let told: string[] = [];
      const row = await charged(async (o) => {
        told = sseData(await (await chat(o, model)).text());
      });
      expect(told.at(-1), name).toContain('"error"');
      expect(told.filter((d) => d.includes('"usage"')), name).toEqual([]);
      got.push([name, ...row]);
    }
    // Cut by the gateway's own shutdown (drainMs over): an instance of its own on the same database.
    scripted = { events: [role], done: false, open: true };
    const stopping = await startTestGateway({ aliases: { "svc-fast": chatAlias([{ baseUrl: base }]) }, plans: TEST_PLANS, upstream: upstreamSettings({ attempts: 1 }), drainMs: 200 });
    const o = await seedTestOrg(gw.database);
    const res = await post(stopping, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true });
    const reader = res.body?.getReader();
    if (!reader) throw new Error("no body");
    // The role chunk reached the client: the stream is open, then the gateway stops.
    expect(new TextDecoder().decode((await reader.read()).value)).toContain('"role":"assistant"');
    const stopped = stopping.stop();
    let rest = "";
    for (let r = await reader.read(); !r.done; r = await reader.read()) rest += new TextDecoder().decode(r.value);
    await stopped;
    expect(rest).toContain("shutting down");
    const [row] = await rows(o.orgId);
    got.push(["shutdown", row?.status, row?.promptTokens, row?.completionTokens]);
    // The same failure on a non-streamed request (an SSE answer with the upstream's error event): nothing, as before.
    scripted = { events: [role, upstreamError], done: false };
    got.push(["non-streamed, an error event", ...(await charged(async (o) => void (await (await chat(o, "svc-fast", false)).text())))]);
    // Before: each stream was charged the prompt estimate, though the client got nothing and the failure was not its own.
    expect(got).toEqual([
      ["cut off", 503, 0, 0],
      ["an error event", 503, 0, 0],
      ["idle", 503, 0, 0],
      ["shutdown", 503, 0, 0],
      ["non-streamed, an error event", 503, 0, 0],
    ]);
    expect(promptEstimate).toBeGreaterThan(0);
  });

  test("Responses API: a stream that fails before any text is recorded as 503 with no tokens, and its failed Response says no usage", async () => {
    for (const script of [
      { events: [role], done: false },
      { events: [role, upstreamError], done: false },
    ]) {
      scripted = script;
      let failed: Record<string, unknown> = {};
      const row = await charged(async (o) => {
        const r = await post(gw, "/v1/responses", o.personalKey, { model: "svc-fast", input: "hi", stream: true });
        const last = (await r.text()).split("\n\n").find((e) => e.startsWith("event: response.failed"));
        failed = rec(rec(JSON.parse(last?.split("data: ")[1] ?? "null")).response);
      });
      expect(failed.status).toBe("failed");
      expect(failed.usage).toBeUndefined();
      // Before: [503, the prompt estimate, 0], while the Response said no usage.
      expect(row).toEqual([503, 0, 0]);
    }
  });

  test("an error event of each shape decisions.md names ends the stream with the upstream's message; the shape never reaches the client; charged nothing", async () => {
    for (const [name, error] of UPSTREAM_ERROR_SHAPES) {
      for (const events of [[error], [role, error]]) {
        scripted = { events, done: false };
        let told: string[] = [];
        const row = await charged(async (o) => {
          told = sseData(await (await chat(o)).text());
        });
        // Before, FastAPI's {detail}: the event was relayed as it came, then "ended the stream early".
        expect({ name, events: told.length }).toEqual({ name, events: events.length });
        const last = rec(rec(JSON.parse(told.at(-1) ?? "null")).error);
        expect({ name, code: last.code }).toEqual({ name, code: "service_unavailable" });
        expect(String(last.message)).toContain("failed while generating: the engine is overloaded");
        expect(told.join("\n")).not.toContain("detail");
        expect([name, ...row]).toEqual([name, 503, 0, 0]);
      }
    }
  });

  test("what is still charged: a usage report that came before the failure, text delivered before it, and a client that left (499)", async () => {
    const promptEstimate = await estimateOf(true);
    // A report (9 prompt tokens, none generated yet), then the upstream fails: the report is charged.
    scripted = { events: [chunkOf([deltaOf({ role: "assistant", content: "" })], { usage: { prompt_tokens: 9, completion_tokens: 0, total_tokens: 9 } })], done: false };
    expect(await charged(async (o) => void (await (await chat(o)).text()))).toEqual([503, 9, 0]);
    // Text delivered, then the upstream fails: the prompt estimate and the text (4 bytes, 1 token).
    scripted = { events: [chunkOf([deltaOf({ role: "assistant", content: "abcd" })])], done: false };
    expect(await charged(async (o) => void (await (await chat(o)).text()))).toEqual([503, promptEstimate, 1]);
    // The client leaves after the role chunk, before any text: charged the prompt estimate, as before.
    scripted = { events: [role], done: false, open: true };
    const row = await charged(async (o) => {
      const ac = new AbortController();
      const res = await chat(o, "svc-fast", true, { signal: ac.signal });
      const reader = res.body?.getReader();
      if (!reader) throw new Error("no body");
      await reader.read();
      ac.abort();
      await reader.read().catch(() => undefined);
      await until(async () => (await rows(o.orgId)).length > 0, "the record of the client that left", 10_000, 20);
    });
    expect(row).toEqual([499, promptEstimate, 0]);
  });
});

describe("an upstream that writes JSON white space before or after its colons (`\"usage\" : {…}`, tabs, `{ \"id\" : …}`): its stream is metered as the compact one is", () => {
  afterEach(() => {
    scripted = undefined;
  });

  /** The spacings: each valid JSON, none what Python's json.dumps (`": "`) or JSON.stringify writes. */
  // `": "` is what servers built on Python's json write (its default separators, `", "` between items too).
  const SPACINGS = [{ colon: ": " }, { colon: " : " }, { colon: "\t:\t" }, { colon: " :" }, { colon: "\t: " }, { colon: " : ", pad: " " }];
  const how = (s: { colon: string; pad?: string }) => JSON.stringify(s);
  const chat = (o: SeededOrg, body: Record<string, unknown> = {}) =>
    post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, ...body });

  test("the usage chunk's counts are charged and told to the client (chat, the Responses API); the usage-only chunk is dropped when the client did not ask for it", async () => {
    for (const spaced of SPACINGS) {
      const events = [
        chunkOf([deltaOf({ role: "assistant", content: "a".repeat(400) })]),
        chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]),
        chunkOf([], { usage: { prompt_tokens: 9, completion_tokens: 123, total_tokens: 132 } }),
      ];
      scripted = { events, done: true, spaced };
      const o = await seedTestOrg(gw.database);
      const data = sseData(await (await chat(o, { stream_options: { include_usage: true } })).text());
      expect(data.at(-1), how(spaced)).toBe("[DONE]");
      // Before: the report was not seen; the client got it as sent and then the gateway's estimate (100 + the prompt's).
      expect(data.filter((d) => d.includes('"usage"')).map((d) => rec(JSON.parse(d)).usage), how(spaced)).toEqual([{ prompt_tokens: 9, completion_tokens: 123, total_tokens: 132 }]);
      const [row] = await rows(o.orgId);
      expect([how(spaced), row?.status, row?.promptTokens, row?.completionTokens]).toEqual([how(spaced), 200, 9, 123]);
      // Not asked for: the usage-only chunk is dropped, its counts still charged.
      const p = await seedTestOrg(gw.database);
      const plain = sseData(await (await chat(p)).text());
      expect(plain.filter((d) => d.includes('"usage"')), how(spaced)).toEqual([]);
      const [plainRow] = await rows(p.orgId);
      expect([how(spaced), plainRow?.promptTokens, plainRow?.completionTokens]).toEqual([how(spaced), 9, 123]);
      // The Responses API reads the same stream: its answer and its record carry the upstream's counts.
      scripted = { events: [chunkOf([deltaOf({ role: "assistant", content: "hello" })]), chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]), chunkOf([], { usage: { prompt_tokens: 9, completion_tokens: 55, total_tokens: 64 } })], done: true, spaced };
      await expectAnswered(await seedTestOrg(gw.database), "hello", 9, 55);
    }
  });

  test("without a usage report, every delta's text counts (content, reasoning, refusal, tool-call arguments, each choice)", async () => {
    const promptEstimate = await estimateOf(true);
    for (const spaced of SPACINGS) {
      const o = await seedTestOrg(gw.database);
      scripted = {
        events: [
          chunkOf([deltaOf({ role: "assistant", reasoning_content: "r".repeat(40) })]),
          chunkOf([deltaOf({ content: "a".repeat(40) }), deltaOf({ content: "b".repeat(40) }, 1)]),
          chunkOf([deltaOf({ tool_calls: [{ index: 0, function: { arguments: "c".repeat(40) } }] })]),
          chunkOf([deltaOf({ refusal: "f".repeat(40) })]),
        ],
        done: true,
        spaced,
      };
      const row = await streamedRow(o);
      // 5 × 40 characters delivered ≈ 50 tokens (before: 0, none of the text was seen).
      expect([how(spaced), row?.promptTokens, row?.completionTokens]).toEqual([how(spaced), promptEstimate, 50]);
    }
  });

  test("an upstream that ignores max_tokens is ended at its bound, per choice with n = 2, and charged at most the bound", async () => {
    for (const spaced of SPACINGS) {
      scripted = {
        events: [chunkOf([deltaOf({ role: "assistant", content: "" })]), ...Array.from({ length: 50 }, () => chunkOf([deltaOf({ content: "x".repeat(40) })])), chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }])],
        done: true,
        spaced,
      };
      const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
      const data = sseData(await (await chat(o, { max_tokens: 5 })).text());
      expect(data.at(-1), how(spaced)).toBe("[DONE]");
      // Before: all 50 relayed, and 2,000 characters were not seen: 0 completion tokens charged.
      expect([how(spaced), data.filter((d) => d.includes("xxxx")).length]).toEqual([how(spaced), 5]);
      const [row] = await rows(o.orgId);
      expect([how(spaced), row?.status, row?.completionTokens]).toEqual([how(spaced), 200, 5]);

      // n = 2, one event per choice: choice 1 (two events, then stop) within its bound, choice 0 cut after its fifth.
      const events = twoChoiceEvents();
      scripted = { events, done: true, spaced };
      const n2 = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
      const chunks = sseData(await (await chat(n2, { max_tokens: 5, n: 2 })).text())
        .slice(0, -1)
        .map((d) => rec(JSON.parse(d)));
      const finishes = chunks.flatMap((c) => arr(c.choices).map((k) => [rec(k).index, rec(k).finish_reason]).filter(([, f]) => f != null));
      expect([how(spaced), finishes]).toEqual([how(spaced), [[1, "stop"], [0, "length"]]]);
      const [n2Row] = await rows(n2.orgId);
      // 7 chunks of 40 characters delivered ≈ 70 tokens; at most the bound, 2 × 5.
      expect([how(spaced), n2Row?.completionTokens]).toEqual([how(spaced), 10]);
    }
  });

  test("an upstream error event of each shape ends the stream with its message, the shape never reaching the client; charged nothing", async () => {
    for (const spaced of SPACINGS) {
      for (const [name, error] of UPSTREAM_ERROR_SHAPES) {
        scripted = { events: [error], done: false, spaced };
        const o = await seedTestOrg(gw.database);
        const told = sseData(await (await chat(o, { stream_options: { include_usage: true } })).text());
        const last = rec(JSON.parse(told.at(-1) ?? "null"));
        // Before, `{"object" : "error", …}` and `{ "error" : …}`: relayed as a chunk, then "ended the stream early".
        expect([how(spaced), name, told.length, rec(last.error).code]).toEqual([how(spaced), name, 1, "service_unavailable"]);
        expect(String(rec(last.error).message)).toContain("failed while generating: the engine is overloaded");
        const [row] = await rows(o.orgId);
        expect([how(spaced), name, row?.status, row?.promptTokens, row?.completionTokens]).toEqual([how(spaced), name, 503, 0, 0]);
      }
    }
  });
});

describe("an upstream's SSE is read as the SSE standard reads it (test/helpers/sse-spec.ts), streamed, whole and through the Responses API", () => {
  afterEach(() => {
    scripted = undefined;
  });
  /** 400 + 40 characters of text ≈ 110 tokens, with no usage reported: what is charged is what was read. */
  const answer = () => [chunkOf([deltaOf({ role: "assistant", content: "a".repeat(400) })]), chunkOf([deltaOf({ content: "b".repeat(40) })]), chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }])];
  const TEXT = "a".repeat(400) + "b".repeat(40);

  /** The answer streamed (chat), answered whole (chat) and streamed through the Responses API, each as a client and its usage row see it. */
  async function everyWay(frame: () => Partial<Extract<typeof scripted, { events: unknown[] }>>) {
    const seen: { way: string; status: number | undefined; text: string; tokens: number | undefined; unreadable?: string[] }[] = [];
    {
      scripted = { events: answer(), done: true, ...frame() };
      const o = await seedTestOrg(gw.database);
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true });
      const data = specData(await res.text());
      const chunks = data.filter((d) => d.startsWith("{")).map((d) => rec(JSON.parse(d)));
      const text = chunks.flatMap((c) => ((c.choices as Record<string, unknown>[] | undefined) ?? []).map((ch) => String(rec(ch.delta).content ?? ""))).join("");
      const [row] = await rows(o.orgId);
      // Data no chat client can read (each event's data is parsed as JSON, but [DONE]).
      const unreadable = data.filter((d) => d !== "[DONE]" && !d.startsWith("{"));
      seen.push({ way: `streamed, ending ${JSON.stringify(data.at(-1)?.slice(0, 40))}`, status: row?.status, text, tokens: row?.completionTokens, unreadable });
    }
    {
      scripted = { events: answer(), done: true, ...frame() };
      const o = await seedTestOrg(gw.database);
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
      const body = rec(await res.json());
      const text = String(rec(rec((body.choices as unknown[] | undefined)?.[0] ?? {}).message ?? {}).content ?? "");
      const [row] = await rows(o.orgId);
      seen.push({ way: "whole", status: row?.status, text, tokens: row?.completionTokens });
    }
    {
      scripted = { events: answer(), done: true, ...frame() };
      const o = await seedTestOrg(gw.database);
      const r = await post(gw, "/v1/responses", o.personalKey, { model: "svc-fast", input: "hi", stream: true });
      const last = (await r.text()).split("\n\n").find((b) => /^event: response\.(completed|incomplete|failed)\n/.test(b)) ?? "";
      const response = rec(rec(JSON.parse(last.split("\ndata: ")[1] ?? "{}")).response ?? {});
      const text = ((response.output as Record<string, unknown>[] | undefined) ?? []).flatMap((i) => ((i.content as Record<string, unknown>[] | undefined) ?? []).map((c) => String(c.text ?? ""))).join("");
      const [row] = await rows(o.orgId);
      seen.push({ way: `Responses, ${String(response.status)}`, status: row?.status, text, tokens: row?.completionTokens });
    }
    return seen;
  }

  test("a byte order mark before the first event is not part of its first line: the first event is relayed and charged", async () => {
    // Before: the first event's first line read as the field `\uFEFFdata`: the event was dropped (chat streamed and whole), its 100 tokens neither sent nor charged.
    const seen = await everyWay(() => ({ prefix: "\uFEFF" }));
    expect(seen).toEqual([
      { way: 'streamed, ending "[DONE]"', status: 200, text: TEXT, tokens: 110, unreadable: [] },
      { way: "whole", status: 200, text: TEXT, tokens: 110 },
      { way: "Responses, completed", status: 200, text: TEXT, tokens: 110 },
    ]);
  });

  test("line ends that change between events (CRLF, then LF; LF, then CRLF; a blank line ended another way than its event's last line) still end each event", async () => {
    const framings: [string, () => (json: string) => string][] = [
      ["CRLF, then LF", () => {
        let i = 0;
        return (j) => (i++ === 0 ? `data: ${j}\r\n\r\n` : `data: ${j}\n\n`);
      }],
      ["LF, then CRLF", () => {
        let i = 0;
        return (j) => (i++ === 0 ? `data: ${j}\n\n` : `data: ${j}\r\n\r\n`);
      }],
      ["LF then CRLF, CRLF then LF", () => (j) => `data: ${j}\n\r\n`],
    ];
    for (const [name, frame] of framings) {
      // Before: "CRLF, then LF" and "LF, then CRLF" were held unsplit until the body ended, then failed ("ended the stream
      // early", 503, nothing relayed); "\n\r\n" ran every event into one, which no reader could parse.
      const seen = await everyWay(() => ({ frame: frame() }));
      expect(seen, name).toEqual([
        { way: 'streamed, ending "[DONE]"', status: 200, text: TEXT, tokens: 110, unreadable: [] },
        { way: "whole", status: 200, text: TEXT, tokens: 110 },
        { way: "Responses, completed", status: 200, text: TEXT, tokens: 110 },
      ]);
    }
  });

  test("an event with empty data (`data:`, or `data` with no colon) carries no chunk: passed over, not relayed", async () => {
    for (const empty of ["data:", "data: ", "data"]) {
      // Before: relayed as `data: ` (which the SDKs fail on: they parse each event's data as JSON), and the Responses
      // stream failed on it ("The model sent an unreadable stream").
      const seen = await everyWay(() => ({ frame: (j) => `data: ${j}\n\n${empty}\n\n` }));
      expect(seen, empty).toEqual([
        { way: 'streamed, ending "[DONE]"', status: 200, text: TEXT, tokens: 110, unreadable: [] },
        { way: "whole", status: 200, text: TEXT, tokens: 110 },
        { way: "Responses, completed", status: 200, text: TEXT, tokens: 110 },
      ]);
    }
  });
});

describe("an upstream that ignores stream: true and answers with one JSON completion", () => {
  afterEach(() => {
    scripted = undefined;
  });
  const toolCall = { id: "call_1", type: "function", function: { name: "lookup", arguments: '{"q":"x"}' } };

  test("chat: the client gets the answer as a stream (text, tool calls, finish_reason, usage when asked, [DONE]); the reported usage is charged", async () => {
    for (const wantsUsage of [true, false]) {
      const o = await seedTestOrg(gw.database);
      scripted = {
        completion: {
          choices: [{ index: 0, message: { role: "assistant", content: "x".repeat(4_000), tool_calls: [toolCall] }, finish_reason: "tool_calls" }],
          usage: { prompt_tokens: 9, completion_tokens: 1_000, total_tokens: 1_009 },
        },
      };
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, ...(wantsUsage ? { stream_options: { include_usage: true } } : {}) });
      expect(res.status).toBe(200);
      const data = sseData(await res.text());
      // Before: one error event ("ended the stream early"), and the record charged 0 completion tokens for 1,000 generated.
      expect(data.at(-1)).toBe("[DONE]");
      const chunks = data.slice(0, -1).map((d) => rec(JSON.parse(d)));
      for (const c of chunks) expect([c.object, c.model, c.id]).toEqual(["chat.completion.chunk", "svc-fast", "c1"]);
      const deltas = chunks.flatMap((c) => (c.choices as Record<string, unknown>[]).map((ch) => rec(ch.delta)));
      expect(deltas.map((d) => d.content ?? "").join("")).toBe("x".repeat(4_000));
      expect(deltas.flatMap((d) => (d.tool_calls as unknown[] | undefined) ?? [])).toEqual([{ index: 0, ...toolCall }]);
      expect(chunks.flatMap((c) => (c.choices as Record<string, unknown>[]).map((ch) => ch.finish_reason)).filter((f) => f !== null)).toEqual(["tool_calls"]);
      const usageChunks = chunks.filter((c) => c.usage !== undefined);
      expect(usageChunks.map((c) => c.usage)).toEqual(wantsUsage ? [{ prompt_tokens: 9, completion_tokens: 1_000, total_tokens: 1_009 }] : []);
      const [row] = await rows(o.orgId);
      expect([row?.status, row?.promptTokens, row?.completionTokens]).toEqual([200, 9, 1_000]);
    }
  });

  test("Responses API: the stream completes with the answer and its usage", async () => {
    const o = await seedTestOrg(gw.database);
    scripted = { completion: { choices: [{ index: 0, message: { role: "assistant", content: "hello there" }, finish_reason: "stop" }], usage: { prompt_tokens: 9, completion_tokens: 77, total_tokens: 86 } } };
    await expectAnswered(o, "hello there", 9, 77);
  });

  test("a JSON error body with a 200 to a streamed request ends the stream with the upstream's message", async () => {
    const o = await seedTestOrg(gw.database);
    scripted = { completion: { object: "error", message: "the engine is overloaded", type: "ServiceUnavailable", code: 503, choices: undefined } };
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true });
    const data = sseData(await res.text());
    expect(data).toHaveLength(1);
    expect(rec(rec(JSON.parse(data[0] ?? "null")).error).message).toContain("the engine is overloaded");
    const [row] = await rows(o.orgId);
    expect(row?.status).toBe(503);
  });

  test("a completion's answer past the bound the upstream was sent is charged at most the bound", async () => {
    const o = await seedTestOrg(gw.database);
    scripted = { completion: { choices: [{ index: 0, message: { role: "assistant", content: "x".repeat(4_000) }, finish_reason: "stop" }], usage: { prompt_tokens: 9, completion_tokens: 1_000, total_tokens: 1_009 } } };
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: true, max_tokens: 10 });
    expect(res.status).toBe(200);
    await res.text();
    const [row] = await rows(o.orgId);
    expect(row?.completionTokens).toBeLessThanOrEqual(10);
  });
});

describe("an upstream that streams a non-streamed request", () => {
  afterEach(() => {
    scripted = undefined;
  });

  test("the chunks are put together into the completion they stand for (text, reasoning, tool calls, finish_reason, n = 2) and its usage is charged", async () => {
    const o = await seedTestOrg(gw.database);
    scripted = {
      events: [
        chunkOf([deltaOf({ role: "assistant", content: "Hel", reasoning_content: "think" }), deltaOf({ role: "assistant", content: "Other" }, 1)]),
        chunkOf([deltaOf({ content: "lo" })]),
        chunkOf([deltaOf({ tool_calls: [{ index: 0, id: "call_1", type: "function", function: { name: "lookup", arguments: '{"q":' } }] })]),
        chunkOf([deltaOf({ tool_calls: [{ index: 0, function: { arguments: '"x"}' } }] })]),
        chunkOf([{ index: 0, delta: {}, finish_reason: "tool_calls" }, { index: 1, delta: {}, finish_reason: "stop" }]),
        chunkOf([], { usage: { prompt_tokens: 9, completion_tokens: 321, total_tokens: 330 } }),
      ],
      done: true,
    };
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), n: 2 });
    // Before: 503 "sent an unreadable answer", and the record charged no completion for the 321 tokens generated.
    expect(res.status).toBe(200);
    const body = rec(await res.json());
    expect([body.object, body.model, body.id]).toEqual(["chat.completion", "svc-fast", "c1"]);
    const choices = body.choices as Record<string, unknown>[];
    expect(choices.map((c) => [c.index, rec(c.message).content, c.finish_reason])).toEqual([
      [0, "Hello", "tool_calls"],
      [1, "Other", "stop"],
    ]);
    expect(rec(choices[0]?.message).reasoning_content).toBe("think");
    expect(rec(choices[0]?.message).tool_calls).toEqual([{ id: "call_1", type: "function", function: { name: "lookup", arguments: '{"q":"x"}' } }]);
    expect(body.usage).toEqual({ prompt_tokens: 9, completion_tokens: 321, total_tokens: 330 });
    const [row] = await rows(o.orgId);
    expect([row?.status, row?.promptTokens, row?.completionTokens]).toEqual([200, 9, 321]);
  });

  test("usage reported mid-stream, then more text: what came after the report is charged too, and the answer says so, [DONE] or not", async () => {
    for (const done of [false, true]) {
      const o = await seedTestOrg(gw.database);
      // As a server reporting usage on every chunk (or only the first) does: 1 token so far, then 400 characters more with no report.
      scripted = {
        events: [
          chunkOf([deltaOf({ role: "assistant", content: "abcd" })], { usage: { prompt_tokens: 9, completion_tokens: 1, total_tokens: 10 } }),
          ...Array.from({ length: 10 }, () => chunkOf([deltaOf({ content: "x".repeat(40) })])),
        ],
        done,
      };
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
      expect(res.status).toBe(200);
      const body = rec(await res.json());
      const [choice] = body.choices as Record<string, unknown>[];
      expect(String(rec(choice?.message).content).length).toBe(404);
      // The reported token, plus 400 characters ≈ 100 tokens delivered after the report: as a stream is charged.
      // Before: charged (and told) 1 completion token for the 404 characters the client received.
      expect(body.usage).toEqual({ prompt_tokens: 9, completion_tokens: 101, total_tokens: 110 });
      const [row] = await rows(o.orgId);
      expect([row?.status, row?.promptTokens, row?.completionTokens]).toEqual([200, 9, 101]);
    }
  });

  test("[DONE] ends the answer, as it ends a stream: text, usage and errors sent after it are neither in the answer nor charged", async () => {
    for (const after of [
      [chunkOf([deltaOf({ content: "x".repeat(400) })]), chunkOf([], { usage: { prompt_tokens: 9, completion_tokens: 500, total_tokens: 509 } })],
      Array.from({ length: 10 }, () => chunkOf([deltaOf({ content: "x".repeat(400) })])),
      [{ error: { message: "the engine is overloaded", type: "ServiceUnavailable", code: 503 } }],
    ]) {
      const o = await seedTestOrg(gw.database);
      scripted = {
        events: [chunkOf([deltaOf({ role: "assistant", content: "abcd" })]), chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]), chunkOf([], { usage: { prompt_tokens: 9, completion_tokens: 10, total_tokens: 19 } })],
        done: true,
        after,
      };
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
      // Before: 200 with the text after [DONE] appended (and charged ~100 tokens a 400 characters past the report), or a 503 for the error after it.
      expect(res.status).toBe(200);
      const body = rec(await res.json());
      const [choice] = body.choices as Record<string, unknown>[];
      expect(rec(choice?.message).content).toBe("abcd");
      expect(body.usage).toEqual({ prompt_tokens: 9, completion_tokens: 10, total_tokens: 19 });
      const [row] = await rows(o.orgId);
      expect([row?.status, row?.promptTokens, row?.completionTokens]).toEqual([200, 9, 10]);
    }
  });

  test("text after the report past the bound: charged the bound, and a warning names only figures the upstream sent", async () => {
    // max_tokens 10; a report on the first chunk, then 400 characters (~100 tokens) with no report.
    const after = Array.from({ length: 10 }, () => chunkOf([deltaOf({ content: "x".repeat(40) })]));
    const cases: [string, Record<string, unknown>, string | undefined][] = [
      // The upstream's count (1) is plausible: the text after it takes the charge past the bound, which caps it; nothing to warn about.
      ["a plausible report", { prompt_tokens: 9, completion_tokens: 1, total_tokens: 10 }, undefined],
      // The upstream's count (50) is above the bound itself: the warning names 50, what it sent.
      ["a report above the bound", { prompt_tokens: 9, completion_tokens: 50, total_tokens: 59 }, "50"],
    ];
    for (const [name, report, named] of cases) {
      scripted = { events: [chunkOf([deltaOf({ role: "assistant", content: "abcd" })], { usage: report }), ...after], done: true };
      lines.length = 0;
      const o = await seedTestOrg(gw.database);
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), max_tokens: 10 });
      expect(res.status, name).toBe(200);
      expect(rec(await res.json()).usage, name).toEqual({ prompt_tokens: 9, completion_tokens: 10, total_tokens: 19 });
      const [row] = await rows(o.orgId);
      expect([name, row?.promptTokens, row?.completionTokens]).toEqual([name, 9, 10]);
      // Before: "upstream sent implausible usage" with completion_tokens "101" and "150": the report plus the
      // gateway's own estimate of the text after it, figures the upstream never sent.
      const implausible = lines.filter((l) => String(l.msg).startsWith("upstream sent implausible usage"));
      expect([name, implausible.map((l) => l.completion_tokens)]).toEqual([name, named === undefined ? [] : [named]]);
    }
  });

  test("an error event in the stream is the upstream's error, with its message, in each shape decisions.md names; charged nothing", async () => {
    const role = chunkOf([deltaOf({ role: "assistant", content: "" })]);
    for (const [name, error] of UPSTREAM_ERROR_SHAPES) {
      for (const events of [[error], [role, error]]) {
        const o = await seedTestOrg(gw.database);
        scripted = { events, done: false };
        const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() });
        const err = rec(rec(await res.json()).error);
        // Before, FastAPI's {detail}: 503 "… sent an unreadable answer", its message lost.
        expect({ name, status: res.status, code: err.code }).toEqual({ name, status: 503, code: "service_unavailable" });
        expect(String(err.message)).toContain("failed while generating: the engine is overloaded");
        expect(String(err.message)).not.toContain("detail");
        const [row] = await rows(o.orgId);
        expect([name, row?.status, row?.promptTokens, row?.completionTokens]).toEqual([name, 503, 0, 0]);
      }
    }
  });
});

describe("an upstream that ignores max_tokens", () => {
  afterEach(() => {
    scripted = undefined;
  });

  /** The choices of the client's chunks: each text delta's choice index, and each finish_reason given. */
  function choicesOf(data: string[]): { texts: number[]; finishes: [number, unknown][] } {
    const texts: number[] = [];
    const finishes: [number, unknown][] = [];
    for (const d of data.slice(0, -1)) {
      for (const c of (rec(JSON.parse(d)).choices ?? []) as Record<string, unknown>[]) {
        if (typeof rec(c.delta).content === "string" && rec(c.delta).content !== "") texts.push(Number(c.index));
        if (c.finish_reason != null) finishes.push([Number(c.index), c.finish_reason]);
      }
    }
    return { texts, finishes };
  }
  const ignoredWarnings = () => lines.filter((l) => l.level === "warn" && String(l.msg).includes("max_tokens"));

  test("streamed: past max_tokens chunks of text the answer ends there (finish_reason length, usage, [DONE]) and is charged the bound, not what the upstream went on to send", async () => {
    const promptEstimate = await estimateOf(true);
    // 50 chunks of 40 characters where 5 tokens were allowed, then the upstream's own ending and a made-up count.
    scripted = {
      events: [
        chunkOf([deltaOf({ role: "assistant", content: "" })]),
        ...Array.from({ length: 50 }, () => chunkOf([deltaOf({ content: "x".repeat(40) })])),
        chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]),
        chunkOf([], { usage: { prompt_tokens: 9, completion_tokens: 1_000, total_tokens: 1_009 } }),
      ],
      done: true,
    };
    for (const wantsUsage of [true, false]) {
      lines.length = 0;
      const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
      const res = await post(gw, "/v1/chat/completions", o.personalKey, {
        model: "svc-fast",
        messages: userMessages(),
        max_tokens: 5,
        stream: true,
        ...(wantsUsage ? { stream_options: { include_usage: true } } : {}),
      });
      expect(res.status).toBe(200);
      const data = sseData(await res.text());
      // Before: all 50 chunks were relayed, and 2,000 characters ≈ 500 tokens charged against a reservation of 5.
      expect(choicesOf(data)).toEqual({ texts: [0, 0, 0, 0, 0], finishes: [[0, "length"]] });
      expect(data.at(-1)).toBe("[DONE]");
      const end = (wantsUsage ? data.at(-3) : data.at(-2)) ?? "null";
      expect(rec(JSON.parse(end))).toEqual({ id: "c1", object: "chat.completion.chunk", created: expect.any(Number), model: "svc-fast", choices: [{ index: 0, delta: {}, logprobs: null, finish_reason: "length" }] });
      if (wantsUsage) {
        expect(rec(JSON.parse(data.at(-2) ?? "null"))).toEqual({ id: "c1", object: "chat.completion.chunk", created: expect.any(Number), model: "svc-fast", choices: [], usage: { prompt_tokens: promptEstimate, completion_tokens: 5, total_tokens: promptEstimate + 5 } });
      } else expect(data.filter((d) => d.includes('"usage"'))).toEqual([]);
      const [row] = await rows(o.orgId);
      expect([row?.status, row?.promptTokens, row?.completionTokens]).toEqual([200, promptEstimate, 5]);
      expect(ignoredWarnings().length).toBe(1);
      // The warning names the target that ignored its bound.
      expect(ignoredWarnings()[0]).toMatchObject({ alias: "svc-fast", target: expect.stringContaining(base), max_tokens: 5 });
    }
  });

  test("streamed: ended at its bound after a usage report with breakdowns, the client asking for usage: the closing usage chunk keeps them", async () => {
    // Seen failing before: the usage chunk written when the bound ends a stream had the three counts only, where
    // the chunk the relay adds before [DONE] (and a JSON answer) keeps the last report's checked breakdowns.
    const details = { prompt_tokens_details: { cached_tokens: 8 }, completion_tokens_details: { reasoning_tokens: 1 } };
    scripted = {
      events: [
        chunkOf([deltaOf({ role: "assistant", content: "abcd" })], { usage: { prompt_tokens: 9, completion_tokens: 1, total_tokens: 10, ...details } }),
        ...Array.from({ length: 10 }, () => chunkOf([deltaOf({ content: "x".repeat(40) })])),
      ],
      done: true,
    };
    const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), max_tokens: 5, stream: true, stream_options: { include_usage: true } });
    const data = sseData(await res.text());
    expect(choicesOf(data).finishes).toEqual([[0, "length"]]);
    expect(rec(JSON.parse(data.at(-2) ?? "null")).usage).toEqual({ prompt_tokens: 9, completion_tokens: 5, total_tokens: 14, ...details });
  });

  test("streamed: exactly max_tokens chunks of text (the upstream keeping its bound) pass unchanged", async () => {
    scripted = {
      events: [
        chunkOf([deltaOf({ role: "assistant", content: "" })]),
        ...Array.from({ length: 4 }, () => chunkOf([deltaOf({ content: "x".repeat(40) })])),
        chunkOf([{ index: 0, delta: { content: "y".repeat(40) }, finish_reason: "length" }]),
        chunkOf([], { usage: { prompt_tokens: 9, completion_tokens: 5, total_tokens: 14 } }),
      ],
      done: true,
    };
    lines.length = 0;
    const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), max_tokens: 5, stream: true, stream_options: { include_usage: true } });
    const data = sseData(await res.text());
    expect(choicesOf(data)).toEqual({ texts: [0, 0, 0, 0, 0], finishes: [[0, "length"]] });
    expect(rec(JSON.parse(data.at(-2) ?? "null")).usage).toEqual({ prompt_tokens: 9, completion_tokens: 5, total_tokens: 14 });
    const [row] = await rows(o.orgId);
    expect([row?.status, row?.completionTokens]).toEqual([200, 5]);
    expect(ignoredWarnings()).toEqual([]);
  });

  test("streamed: an upstream that never stops is ended at the bound and its call closed; the client's stream ends properly", async () => {
    const run = { endless: chunkOf([deltaOf({ content: "xxxx" })]), cancelled: false };
    scripted = run;
    const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), max_tokens: 20, stream: true, stream_options: { include_usage: true } });
    expect(res.status).toBe(200);
    // Before: relayed without end (here: until the deadline).
    const text = await Promise.race([res.text(), Bun.sleep(8_000).then(() => "(still streaming)")]);
    expect(text).not.toBe("(still streaming)");
    const data = sseData(text);
    expect(data.at(-1)).toBe("[DONE]");
    expect(choicesOf(data)).toEqual({ texts: Array(20).fill(0), finishes: [[0, "length"]] });
    expect(rec(JSON.parse(data.at(-2) ?? "null")).usage).toMatchObject({ completion_tokens: 20 });
    await until(() => run.cancelled, "the upstream call closed");
    const [row] = await rows(o.orgId);
    expect([row?.status, row?.completionTokens]).toEqual([200, 20]);
  });

  test("streamed with n = 2: the bound holds per choice; the choice that ran past it ends with length, one that had finished keeps its stop", async () => {
    const events = twoChoiceEvents();
    scripted = { events, done: true };
    const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), max_tokens: 5, n: 2, stream: true });
    const data = sseData(await res.text());
    expect(data.at(-1)).toBe("[DONE]");
    // Choice 1 (two chunks, then stop) was within its bound; choice 0 was cut after its fifth.
    expect(choicesOf(data)).toEqual({ texts: [0, 1, 0, 1, 0, 0, 0], finishes: [[1, "stop"], [0, "length"]] });
    const [row] = await rows(o.orgId);
    // 7 chunks of 40 characters delivered ≈ 70 tokens; at most the bound, 2 × 5.
    expect([row?.status, row?.completionTokens]).toEqual([200, 10]);
  });

  test("streamed with n = 2, both choices in each event (whose choice cannot be told): the answer ends past n × max_tokens events, charged at most n × the bound", async () => {
    const events: unknown[] = [chunkOf([deltaOf({ role: "assistant", content: "" }), deltaOf({ role: "assistant", content: "" }, 1)])];
    for (let i = 0; i < 30; i++) events.push(chunkOf([deltaOf({ content: "a".repeat(40) }), deltaOf({ content: "b".repeat(40) }, 1)]));
    events.push(chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }, { index: 1, delta: {}, finish_reason: "stop" }]));
    scripted = { events, done: true };
    const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), max_tokens: 5, n: 2, stream: true });
    const data = sseData(await res.text());
    expect(data.at(-1)).toBe("[DONE]");
    // Ten events (n × max_tokens) relayed, each carrying both choices; the eleventh and the rest were not. Before
    // the total was counted, such events were relayed for as long as the upstream sent them.
    const { texts, finishes } = choicesOf(data);
    expect(texts).toHaveLength(20);
    expect(finishes).toEqual([
      [0, "length"],
      [1, "length"],
    ]);
    const [row] = await rows(o.orgId);
    expect([row?.status, row?.completionTokens]).toEqual([200, 10]);
  });

  test("without a quota, the bound the client sent is held all the same: max_completion_tokens alone, or the larger of the two", async () => {
    // No quota: the gateway adds no max_tokens, so the bound is only what the client sent (Upstream token counts:
    // n × the larger of max_tokens and max_completion_tokens).
    const endless = () => ({ events: [chunkOf([deltaOf({ role: "assistant", content: "" })]), ...Array.from({ length: 50 }, () => chunkOf([deltaOf({ content: "x".repeat(40) })]))], done: true });
    for (const [bounds, bound] of [
      [{ max_completion_tokens: 5 }, 5],
      [{ max_tokens: 5, max_completion_tokens: 7 }, 7],
      [{ max_tokens: 7, max_completion_tokens: 5 }, 7],
    ] as const) {
      scripted = endless();
      const o = await seedTestOrg(gw.database);
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), ...bounds, stream: true, stream_options: { include_usage: true } });
      const data = sseData(await res.text());
      expect({ bounds, texts: choicesOf(data).texts.length, finishes: choicesOf(data).finishes }).toEqual({ bounds, texts: bound, finishes: [[0, "length"]] });
      expect(rec(JSON.parse(data.at(-2) ?? "null")).usage).toMatchObject({ completion_tokens: bound });
      const [row] = await rows(o.orgId);
      expect([row?.status, row?.completionTokens]).toEqual([200, bound]);
      // Not streamed: a count far past the bound is capped there.
      scripted = { completion: { choices: [{ index: 0, message: { role: "assistant", content: "x".repeat(4_000) }, finish_reason: "stop" }], usage: { prompt_tokens: 9, completion_tokens: 1_000, total_tokens: 1_009 } } };
      const json = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), ...bounds });
      expect(rec(await json.json()).usage).toEqual({ prompt_tokens: 9, completion_tokens: bound, total_tokens: 9 + bound });
    }
  });

  test("Responses API: a stream cut at max_output_tokens ends with response.incomplete (max_output_tokens), charged the bound", async () => {
    const run = { endless: chunkOf([deltaOf({ content: "xxxx" })]), cancelled: false };
    scripted = run;
    const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
    const res = await post(gw, "/v1/responses", o.personalKey, { model: "svc-fast", input: "hi", max_output_tokens: 16, stream: true });
    expect(res.status).toBe(200);
    const text = await Promise.race([res.text(), Bun.sleep(8_000).then(() => "(still streaming)")]);
    expect(text).not.toBe("(still streaming)");
    const events = text.split("\n\n").filter((e) => e.length > 0);
    const last = events.at(-1) ?? "";
    expect(last.startsWith("event: response.incomplete")).toBe(true);
    const response = rec(rec(JSON.parse(last.split("data: ")[1] ?? "null")).response);
    expect(response.status).toBe("incomplete");
    expect(response.incomplete_details).toEqual({ reason: "max_output_tokens" });
    expect(response.output_text).toBe("xxxx".repeat(16));
    expect(rec(response.usage).output_tokens).toBe(16);
    await until(() => run.cancelled, "the upstream call closed");
    const [row] = await rows(o.orgId);
    expect([row?.status, row?.completionTokens]).toEqual([200, 16]);
  });

  test("streamed: a few chunks of much text past the bound (not certainly past it in tokens) are relayed, and charged at most the bound", async () => {
    const promptEstimate = await estimateOf(true);
    for (const claimed of [{ prompt_tokens: 9, completion_tokens: 300, total_tokens: 309 }, undefined]) {
      // 3 chunks of 400 characters (≈ 300 tokens) where 5 tokens were allowed: 3 chunks may be 3 tokens, so nothing is cut.
      scripted = {
        events: [
          chunkOf([deltaOf({ role: "assistant", content: "" })]),
          ...Array.from({ length: 3 }, () => chunkOf([deltaOf({ content: "x".repeat(400) })])),
          chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]),
          ...(claimed ? [chunkOf([], { usage: claimed })] : []),
        ],
        done: true,
      };
      const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), max_tokens: 5, stream: true, stream_options: { include_usage: true } });
      expect(res.status).toBe(200);
      const data = sseData(await res.text());
      expect(data.filter((d) => d.includes("x".repeat(400)))).toHaveLength(3);
      const prompt = claimed ? 9 : promptEstimate;
      // Before: 300 tokens (the claim, or the estimate of 1,200 characters) against a reservation of 5.
      expect(rec(JSON.parse(data.at(-2) ?? "null")).usage).toEqual({ prompt_tokens: prompt, completion_tokens: 5, total_tokens: prompt + 5 });
      const [row] = await rows(o.orgId);
      expect([row?.status, row?.promptTokens, row?.completionTokens]).toEqual([200, prompt, 5]);
    }
  });

  test("streamed without include_usage and without the upstream's count: a few chunks of much text past the bound are charged at most the bound", async () => {
    // 3 chunks of 400 characters (≈ 300 tokens by the delivered text) where 5 tokens were allowed; no usage from the
    // upstream and none asked for by the client, so only the settlement's own cap holds the charge to the bound.
    scripted = {
      events: [
        chunkOf([deltaOf({ role: "assistant", content: "" })]),
        ...Array.from({ length: 3 }, () => chunkOf([deltaOf({ content: "x".repeat(400) })])),
        chunkOf([{ index: 0, delta: {}, finish_reason: "stop" }]),
      ],
      done: true,
    };
    const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
    const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), max_tokens: 5, stream: true });
    expect(res.status).toBe(200);
    const data = sseData(await res.text());
    expect(data.filter((d) => d.includes("x".repeat(400)))).toHaveLength(3);
    const [row] = await rows(o.orgId);
    expect([row?.status, row?.completionTokens]).toEqual([200, 5]);
  });

  test("non-streamed: an answer far past max_tokens is charged at most the bound, whatever the upstream claims or omits", async () => {
    const promptEstimate = await estimateOf(false);
    for (const claimed of [{ prompt_tokens: 9, completion_tokens: 1_000, total_tokens: 1_009 }, undefined]) {
      // 4,000 characters (≈ 1,000 tokens) where 5 tokens were allowed.
      scripted = { completion: { choices: [{ index: 0, message: { role: "assistant", content: "x".repeat(4_000) }, finish_reason: "stop" }], ...(claimed ? { usage: claimed } : {}) } };
      const o = await seedTestOrg(gw.database, { quotaTokens: 10_000 });
      const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), max_tokens: 5 });
      expect(res.status).toBe(200);
      const prompt = claimed ? 9 : promptEstimate;
      // Before: the estimate of the delivered text, 1,000 tokens against a reservation of 5.
      expect(rec(await res.json()).usage).toEqual({ prompt_tokens: prompt, completion_tokens: 5, total_tokens: prompt + 5 });
      const [row] = await rows(o.orgId);
      expect([row?.promptTokens, row?.completionTokens]).toEqual([prompt, 5]);
    }
  });
});

describe("the JSON answer's shape", () => {
  afterEach(() => {
    scripted = undefined;
  });

  test("choices[].logprobs and message.refusal are sent as null when the upstream's answer leaves them out; a refusal it sends passes through", async () => {
    // The simulator sends logprobs: null as vLLM does; other servers (and older vLLM for refusal) leave the keys out.
    scripted = { completion: { choices: [{ index: 0, message: { role: "assistant", content: "hi" }, finish_reason: "stop" }] } };
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", messages: userMessages() });
    const [choice] = rec(await res.json()).choices as Record<string, unknown>[];
    expect(choice).toEqual({ index: 0, message: { role: "assistant", content: "hi", refusal: null }, logprobs: null, finish_reason: "stop" });
    scripted = { completion: { choices: [{ index: 0, message: { role: "assistant", content: null, refusal: "I can't help with that." }, finish_reason: "stop" }] } };
    const refused = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", messages: userMessages() });
    const [r] = rec(await refused.json()).choices as Record<string, unknown>[];
    expect(rec(r?.message).refusal).toBe("I can't help with that.");
  });
});

describe("usage rows", () => {
  test("requests of one key, alias, target and status in one write are one row that sums them; streamed ones another", async () => {
    usage = { prompt_tokens: 7, completion_tokens: 3, total_tokens: 10 };
    const o = await seedTestOrg(gw.database);
    await gw.quota.flush();
    const n = 25;
    const answers = await Promise.all(
      Array.from({ length: n }, async (_, i) => {
        const res = await post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream: i % 5 === 0 });
        expect(res.status).toBe(200);
        return res.text();
      }),
    );
    expect(answers).toHaveLength(n);
    const got = await rows(o.orgId);
    // One write: one unstreamed row and one streamed row (each ≤ one per write, should the flush timer fire in between).
    expect(got.length).toBeLessThanOrEqual(4);
    expect(got.length).toBeGreaterThanOrEqual(2);
    const sum = (f: (r: (typeof got)[number]) => number) => got.reduce((a, r) => a + f(r), 0);
    expect(sum((r) => r.requests)).toBe(n);
    expect(sum((r) => (r.streamed ? r.requests : 0))).toBe(5);
    expect(sum((r) => r.promptTokens)).toBe(7 * n);
    expect(sum((r) => r.completionTokens)).toBe(3 * n);
    for (const r of got) expect(r.latencyMs).toBeGreaterThanOrEqual(0);
    // The usage report counts requests, not rows.
    const report = await usageReport(gw.database, o.orgId);
    expect(report.map((r) => [r.alias, r.requests, r.prompt_tokens, r.completion_tokens])).toEqual([["svc-fast", n, 7 * n, 3 * n]]);
  });
});

