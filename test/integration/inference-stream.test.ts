import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { parseChatBody } from "../../src/inference/model.ts";
import { estimatePromptTokens } from "../../src/inference/tokens.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import type { SeededOrg } from "../helpers/harness.ts";
import { type LateUsageRun, type LateUsageUpstream, lateUsageUpstream } from "../helpers/late-usage-upstream.ts";
import { readUntilThenLeave, startTestGateway } from "../helpers/harness.ts";
import {
  CHAT_MODEL,
  TEST_PLANS,
  arr,
  chatAlias,
  eventually,
  post,
  rec,
  seedTestOrg,
  spacedJson,
  sseData,
  testAliases,
  upstreamSettings,
  usageEventsOf,
  userMessages,
} from "./inference-fixtures.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/** Streamed chat completions: wire format, usage handling, failures, aborts, idle timeouts. */

let sim: Simulator;
let slow: Simulator;
let gw: Gateway;
let org: SeededOrg;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 5 });
  // 5 tokens 150 ms apart: long enough to act mid-stream, and for the idle limit below to bite.
  slow = await startSimulator({ port: 0, ttftMs: 20, interTokenMs: 150, completionTokens: 5 });
  gw = await startTestGateway({
    aliases: {
      ...testAliases(sim.url),
      "svc-slow": chatAlias([{ baseUrl: slow.url }]),
      // An idle limit shorter than the slow simulator's token gap.
      "svc-idle": chatAlias([{ baseUrl: slow.url }], { timeouts: { connectMs: 1_000, firstByteMs: 5_000, idleMs: 80 } }),
    },
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 2 }),
  });
  org = await seedTestOrg(gw.database);
});
/** Changes the slow simulator's pacing for one test (afterEach restores it). */
async function slowConfig(patch: { ttftMs?: number; interTokenMs?: number; completionTokens?: number }): Promise<void> {
  const res = await fetch(`${slow.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify(patch) });
  expect(res.status).toBe(200);
}
afterEach(() => {
  sim.reset();
  slow.reset();
});
afterAll(async () => {
  await gw.stop();
  await sim.stop();
  await slow.stop();
});

const stream = (body: Record<string, unknown>, init?: RequestInit, key = org.personalKey) =>
  post(gw, "/v1/chat/completions", key, { stream: true, messages: userMessages(), ...body }, init);

const usageRows = (orgId: string) => usageEventsOf(gw, orgId);

/** The one usage row of an organisation, once the request has been settled (after the client left, that is asynchronous). */
async function settledRow(orgId: string) {
  const deadline = performance.now() + 10_000;
  for (;;) {
    const rows = await usageRows(orgId);
    if (rows.length > 0 || performance.now() > deadline) {
      expect(rows.length).toBe(1);
      return rows[0];
    }
    await Bun.sleep(20);
  }
}

describe("streamed chat: wire format", () => {
  test("SSE headers, one data event per chunk, model = alias in every chunk, [DONE] last", async () => {
    const res = await stream({ model: "svc-fast" });
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toBe("text/event-stream; charset=utf-8");
    expect(res.headers.get("cache-control")).toBe("no-cache");
    expect(res.headers.get("x-accel-buffering")).toBe("no");
    expect(res.headers.get("x-request-id")).toMatch(/^req_/);
    const text = await res.text();
    expect(text).not.toContain(CHAT_MODEL);
    const data = sseData(text);
    expect(data.at(-1)).toBe("[DONE]");
    const chunks = data.slice(0, -1).map((d) => rec(JSON.parse(d)));
    // role chunk, 5 content chunks, finish chunk; no usage chunk (not asked for)
    expect(chunks.length).toBe(7);
    for (const c of chunks) {
      expect(c.object).toBe("chat.completion.chunk");
      expect(c.model).toBe("svc-fast");
      expect(c.usage).toBeUndefined();
    }
    expect(rec(rec(arr(chunks[0]?.choices)[0]).delta).role).toBe("assistant");
    const textOut = chunks.map((c) => String(rec(rec(arr(c.choices)[0] ?? {}).delta ?? {}).content ?? "")).join("");
    expect(textOut).toBe("token0 token1 token2 token3 token4 ");
    expect(rec(arr(chunks[6]?.choices)[0]).finish_reason).toBe("stop");
    // The gateway always asks the upstream for usage, to meter the stream.
    expect(rec(sim.stats.lastBody).stream_options).toEqual({ include_usage: true });
    expect(rec(sim.stats.lastBody).model).toBe(CHAT_MODEL);
  });

  test("include_usage asked for: the usage chunk (choices: []) reaches the client", async () => {
    const res = await stream({ model: "svc-fast", stream_options: { include_usage: true } });
    const data = sseData(await res.text());
    expect(data.at(-1)).toBe("[DONE]");
    const last = rec(JSON.parse(String(data.at(-2))));
    expect(last.choices).toEqual([]);
    expect(last.model).toBe("svc-fast");
    const usage = rec(last.usage);
    expect(usage.completion_tokens).toBe(5);
    expect(usage.total_tokens).toBe(Number(usage.prompt_tokens) + 5);
  });

  test("include_usage false: stripped for the client, still metered", async () => {
    const o = await seedTestOrg(gw.database);
    const res = await stream({ model: "svc-fast", stream_options: { include_usage: false } }, undefined, o.personalKey);
    const data = sseData(await res.text());
    expect(data.some((d) => d.includes('"usage"'))).toBe(false);
    expect(rec(sim.stats.lastBody).stream_options).toEqual({ include_usage: true });
    const rows = await usageRows(o.orgId);
    expect(rows.length).toBe(1);
    expect(rows[0]?.completionTokens).toBe(5);
    expect(rows[0]?.streamed).toBe(true);
    expect(rows[0]?.status).toBe(200);
  });

  test("streamed tool calls: deltas pass through and reassemble", async () => {
    const tools = [{ type: "function", function: { name: "get_weather", parameters: { type: "object", properties: { location: { type: "string" } } } } }];
    const data = sseData(await (await stream({ model: "svc-fast", tools, messages: userMessages("weather in Paris?") })).text());
    let args = "";
    let name = "";
    let finish = "";
    for (const d of data.slice(0, -1)) {
      const choice = rec(arr(rec(JSON.parse(d)).choices)[0]);
      for (const tc of (rec(choice.delta).tool_calls as unknown[] | undefined) ?? []) {
        const fn = rec(rec(tc).function);
        if (typeof fn.name === "string") name = fn.name;
        if (typeof fn.arguments === "string") args += fn.arguments;
      }
      if (typeof choice.finish_reason === "string") finish = choice.finish_reason;
    }
    expect(name).toBe("get_weather");
    expect(JSON.parse(args)).toEqual({ location: "Paris" });
    expect(finish).toBe("tool_calls");
  });

  test("reasoning deltas, refusal deltas and requested logprobs pass through", async () => {
    await fetch(`${sim.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify({ reasoning: "Let me think it over." }) });
    const chunksOf = async (body: Record<string, unknown>) =>
      sseData(await (await stream({ model: "svc-fast", ...body })).text())
        .slice(0, -1)
        .map((d) => rec(arr(rec(JSON.parse(d)).choices)[0]));
    const field = (choices: Record<string, unknown>[], k: string) => choices.map((c) => String(rec(c.delta)[k] ?? "")).join("");

    const answer = await chunksOf({ logprobs: true, top_logprobs: 1 });
    expect(field(answer, "reasoning_content")).toBe("Let me think it over.");
    expect(field(answer, "content")).toBe("token0 token1 token2 token3 token4 ");
    const withText = answer.filter((c) => String(rec(c.delta).content ?? "") !== "");
    expect(withText.length).toBe(5);
    for (const c of withText) {
      const [lp] = arr(rec(c.logprobs).content).map(rec);
      expect(lp?.token).toBe(rec(c.delta).content);
      expect(arr(lp?.top_logprobs).length).toBe(1);
    }

    const refused = await chunksOf({ messages: userMessages("Please refuse this.") });
    expect(field(refused, "refusal")).toBe("I can't help with that.");
    expect(field(refused, "content")).toBe("");
    expect(refused.at(-1)?.finish_reason).toBe("stop");
  });

  test("chunks arrive as they are generated, not buffered", async () => {
    // The second token comes a minute after the first: a gateway that buffered
    // the stream would deliver nothing before then. No wall-clock bound: the
    // first chunk must arrive while the upstream is still generating.
    await slowConfig({ completionTokens: 2, interTokenMs: 60_000 });
    const ac = new AbortController();
    const res = await stream({ model: "svc-slow" }, { signal: ac.signal });
    const reader = res.body?.getReader();
    if (!reader) throw new Error("no body");
    const first = await reader.read();
    const text = new TextDecoder().decode(first.value);
    expect(text).toContain('"role":"assistant"');
    expect(text).toContain("token0");
    expect(text).not.toContain("[DONE]");
    expect(slow.stats.inFlight).toBe(1);
    ac.abort();
    await eventually(() => slow.stats.aborts === 1, 10_000);
  });
});

describe("streamed chat: failures", () => {
  test("upstream dies mid-stream: an error event in the wire shape ends the stream cleanly; usage estimated", async () => {
    const o = await seedTestOrg(gw.database);
    sim.setFault({ kind: "drop-mid-stream", afterChunks: 3 });
    const res = await stream({ model: "svc-fast" }, undefined, o.personalKey);
    expect(res.status).toBe(200);
    // Reading to the end does not throw: the connection closes cleanly.
    const data = sseData(await res.text());
    expect(data.length).toBe(4);
    expect(data).not.toContain("[DONE]");
    const err = rec(rec(JSON.parse(String(data.at(-1)))).error);
    expect(Object.keys(err).sort()).toEqual(["code", "message", "param", "type"]);
    expect(err.code).toBe("service_unavailable");
    expect(err.param).toBeNull();
    expect(String(err.message)).toContain("svc-fast");
    // Never retried after bytes reached the client.
    expect(sim.stats.requests).toBe(1);
    const rows = await usageRows(o.orgId);
    expect(rows.length).toBe(1);
    // Two content chunks ("token0 ", "token1 ") were delivered: 14 chars ≈ 4 tokens.
    expect(rows[0]?.completionTokens).toBe(4);
    expect(rows[0]?.promptTokens).toBeGreaterThan(0);
    expect(rows[0]?.status).toBe(503);
  });

  test("a stream that dies before its first byte fails over like any request", async () => {
    sim.setFault({ kind: "drop-mid-stream", afterChunks: 0 });
    const res = await stream({ model: "svc-fast" });
    // attempts = 2 on one target: both dropped before any byte, so a clean 503.
    expect(res.status).toBe(503);
    expect(sim.stats.requests).toBe(2);
  });

  test("an upstream error event is translated, not leaked", async () => {
    // A server that streams an error event the way vLLM does ({"error": {"object": "error", ...}}).
    const fake = Bun.serve({
      port: 0,
      hostname: "127.0.0.1",
      fetch: () =>
        new Response(
          `data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"${CHAT_MODEL}","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n` +
            `data: {"error": {"object": "error", "message": "engine crashed", "type": "InternalServerError", "param": null, "code": 500}}\n\n`,
          { headers: { "content-type": "text/event-stream" } },
        ),
    });
    const gw2 = await startTestGateway({ aliases: { "svc-fast": chatAlias([{ baseUrl: `http://127.0.0.1:${fake.port}/v1` }]) }, plans: TEST_PLANS });
    try {
      const res = await post(gw2, "/v1/chat/completions", org.personalKey, { model: "svc-fast", stream: true, messages: userMessages() });
      const data = sseData(await res.text());
      expect(data.length).toBe(2);
      const err = rec(rec(JSON.parse(String(data[1]))).error);
      expect(err.code).toBe("service_unavailable");
      expect(String(err.message)).toContain("engine crashed");
      expect(data[1]).not.toContain('"object"');
    } finally {
      await gw2.stop();
      fake.stop(true);
    }
  });

  test("idle timeout within a stream: error event, upstream aborted", async () => {
    // Tokens a minute apart against an 80 ms idle limit: only the idle timeout can end this stream.
    await slowConfig({ interTokenMs: 60_000 });
    const res = await stream({ model: "svc-idle" });
    const data = sseData(await res.text());
    const err = rec(rec(JSON.parse(String(data.at(-1)))).error);
    expect(String(err.message)).toContain("stopped sending");
    await eventually(() => slow.stats.aborts === 1, 10_000);
    expect(slow.stats.inFlight).toBe(0);
  });
});

describe("streamed chat: client disconnects abort the upstream", () => {
  test("mid-stream: the simulator sees the abort at once", async () => {
    // Without the upstream's usage chunk, the prompt is charged at the gateway's estimate.
    const promptEstimate = estimatePromptTokens(parseChatBody({ model: "svc-slow", messages: userMessages(), stream: true }));
    expect(promptEstimate).toBeGreaterThan(0);
    const o = await seedTestOrg(gw.database);
    // The next token comes a minute after the first: only an abort that reaches the upstream at once ends it in time.
    await slowConfig({ interTokenMs: 60_000 });
    const ac = new AbortController();
    const res = await stream({ model: "svc-slow" }, { signal: ac.signal }, o.personalKey);
    const reader = res.body?.getReader();
    if (!reader) throw new Error("no body");
    let text = "";
    while (!text.includes("token0")) {
      const r = await reader.read();
      if (r.done) throw new Error("stream ended early");
      text += new TextDecoder().decode(r.value);
    }
    expect(slow.stats.inFlight).toBe(1);
    ac.abort();
    // Well before the next token (a minute away) would have been generated.
    await eventually(() => slow.stats.aborts === 1, 10_000);
    expect(slow.stats.inFlight).toBe(0);
    const rows = await usageRows(o.orgId);
    expect(rows.length).toBe(1);
    expect(rows[0]?.status).toBe(499);
    expect(rows[0]?.streamed).toBe(true);
    // Charged for what the client was sent ("token0 " = 7 characters ≈ 2 tokens) and the prompt estimate.
    expect(rows[0]?.completionTokens).toBe(2);
    expect(rows[0]?.promptTokens).toBe(promptEstimate);
  });

  test("before the first byte (the model still thinking): recorded as 499, nothing delivered", async () => {
    const o = await seedTestOrg(gw.database);
    await fetch(`${slow.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify({ ttftMs: 5_000 }) });
    const ac = new AbortController();
    const pending = stream({ model: "svc-slow" }, { signal: ac.signal }, o.personalKey).catch((e: unknown) => e);
    await eventually(() => slow.stats.inFlight === 1);
    ac.abort();
    expect(await pending).toBeInstanceOf(Error);
    await eventually(() => slow.stats.aborts === 1);
    expect(slow.stats.inFlight).toBe(0);
    expect(await settledRow(o.orgId)).toMatchObject({ status: 499, streamed: true, completionTokens: 0 });
  });

  test("non-streamed: a client that leaves aborts the upstream too, and is recorded as 499 with nothing delivered", async () => {
    const o = await seedTestOrg(gw.database);
    await fetch(`${slow.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify({ ttftMs: 5_000 }) });
    const ac = new AbortController();
    const pending = post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-slow", messages: userMessages() }, { signal: ac.signal }).catch((e: unknown) => e);
    await eventually(() => slow.stats.inFlight === 1);
    ac.abort();
    expect(await pending).toBeInstanceOf(Error);
    await eventually(() => slow.stats.aborts === 1);
    expect(await settledRow(o.orgId)).toMatchObject({ status: 499, streamed: false, completionTokens: 0 });
  });
});

describe("streamed chat: a client that leaves once the answer is complete", () => {
  /** The answer and its finish chunk at once, the usage when the test says (or never). */
  let fake: LateUsageUpstream;
  /** The same, its JSON written with white space around each colon (`"finish_reason" : "stop"`). */
  let spaced: LateUsageUpstream;
  let run: LateUsageRun;
  let gw2: Gateway;

  beforeAll(async () => {
    fake = lateUsageUpstream(CHAT_MODEL);
    spaced = lateUsageUpstream(CHAT_MODEL, (v) => spacedJson(v, " :\t", " "));
    gw2 = await startTestGateway({
      aliases: { "svc-script": chatAlias([{ baseUrl: fake.baseUrl }]), "svc-spaced": chatAlias([{ baseUrl: spaced.baseUrl }]) },
      plans: TEST_PLANS,
    });
  });
  afterAll(async () => {
    await gw2.stop();
    fake.stop();
    spaced.stop();
  });

  async function usageRow(orgId: string) {
    return (await usageEventsOf(gw2, orgId))[0];
  }

  /** The organisation's usage row once the request has been settled (after the client left, asynchronously); undefined after 10 s. */
  async function settledUsageRow(orgId: string) {
    const deadline = performance.now() + 10_000;
    let row = await usageRow(orgId);
    while (!row && performance.now() < deadline) {
      await Bun.sleep(20);
      row = await usageRow(orgId);
    }
    return row;
  }

  /** Streams the scripted answer and disconnects as soon as its finish chunk has arrived; resolves when it has. */
  async function leaveAfterFinish(key: string, model = "svc-script", finish = '"finish_reason":"stop"'): Promise<number> {
    const ac = new AbortController();
    const res = await post(gw2, "/v1/chat/completions", key, { model, stream: true, max_tokens: 200, messages: userMessages() }, { signal: ac.signal });
    await readUntilThenLeave(res, finish, ac);
    return performance.now();
  }

  test("the usage chunk that comes after the client left is read and charged, not the estimate (499)", async () => {
    const o = await seedTestOrg(gw2.database);
    run = fake.next();
    await leaveAfterFinish(o.personalKey);
    // Time for the gateway to see the client go (a gateway that aborts the upstream then has done so).
    for (let i = 0; i < 15 && !run.cancelled; i++) await Bun.sleep(20);
    // False when the gateway closed the call: nothing more could be sent (the row then shows the estimate).
    fake.sendUsage(run);
    const row = await settledUsageRow(o.orgId);
    expect(row).toMatchObject({ status: 499, streamed: true, promptTokens: 1234, completionTokens: 77 });
  });

  test("an upstream writing white space around its colons (`\"finish_reason\" :\t\"stop\"`): the answer is seen complete all the same, and the usage that comes after the client left is charged (499)", async () => {
    const o = await seedTestOrg(gw2.database);
    run = spaced.next();
    await leaveAfterFinish(o.personalKey, "svc-spaced", '"finish_reason" :\t"stop"');
    for (let i = 0; i < 15 && !run.cancelled; i++) await Bun.sleep(20);
    // Before: the finish was not seen, the upstream call was closed as the client left, and the estimate charged (5).
    expect(spaced.sendUsage(run)).toBe(true);
    const row = await settledUsageRow(o.orgId);
    expect(row).toMatchObject({ status: 499, streamed: true, promptTokens: 1234, completionTokens: 77 });
  });

  test("an upstream that sends no usage after the finish is cut within about a second of the client leaving, and the estimate charged", async () => {
    const promptEstimate = estimatePromptTokens(parseChatBody({ model: "svc-script", messages: userMessages(), stream: true, max_tokens: 200 }));
    const o = await seedTestOrg(gw2.database);
    run = fake.next();
    const left = await leaveAfterFinish(o.personalKey);
    const row = await settledUsageRow(o.orgId);
    const settledAfter = performance.now() - left;
    expect(row).toMatchObject({ status: 499, streamed: true, promptTokens: promptEstimate, completionTokens: 5 });
    expect(settledAfter).toBeLessThan(2_500);
    await eventually(() => run.cancelled, 2_000);
  });
});
