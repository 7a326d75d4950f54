import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { createLogger } from "../../src/lib/log.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import type { Simulator } from "../../src/sim/index.ts";
import { type SeededOrg, sharedDatabase, testConfig } from "../helpers/harness.ts";
import { type SimulatorPair, TEST_PLANS, eventually, post, seedTestOrg, sseData, startSimulatorPair, upstreamSettings, userMessages } from "./inference-fixtures.ts";

setDefaultTimeout(30_000);

/**
 * The access log through the gateway's own logger over a capturing sink
 * (issue 13 item 15): a streamed request is logged once, when it ends, with
 * its real duration, its outcome and its tokens.
 */

let sims: SimulatorPair;
let sim: Simulator;
let slow: Simulator;
let gw: Gateway;
let org: SeededOrg;
const lines: Record<string, unknown>[] = [];
// 5 tokens 200 ms apart: a stream of about a second.
const GAP_MS = 200;

beforeAll(async () => {
  sims = await startSimulatorPair({ ttftMs: 20, interTokenMs: GAP_MS, completionTokens: 5 });
  ({ sim, slow } = sims);
  const config = await testConfig({
    aliases: sims.aliases,
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 1 }),
    accessLog: true,
  });
  gw = await startGateway({ config, database: await sharedDatabase(), log: createLogger("info", (l) => lines.push(JSON.parse(l) as Record<string, unknown>)) });
  org = await seedTestOrg(gw.database);
});
afterEach(() => sims.reset());
afterAll(async () => {
  await gw.stop();
  await sims.stop();
});

const accessLines = (id: string) => lines.filter((l) => l.msg === "request" && l.request_id === id);

describe("access log", () => {
  test("a non-streamed request: one line with status, tokens and its latency", async () => {
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", messages: userMessages() });
    const id = String(res.headers.get("x-request-id"));
    await res.json();
    await eventually(() => accessLines(id).length === 1);
    const line = accessLines(id)[0] ?? {};
    expect(line.status).toBe(200);
    expect(line.streamed).toBe(false);
    expect(line.completion_tokens).toBe(5);
    expect(line.alias).toBe("svc-fast");
    expect(line.key_id).toBe(org.personalKeyId);
    // docs/operations.md, Observability: the access line names the organisation too.
    expect(line.org_id).toBe(org.orgId);
  });

  test("a streamed request is logged when it ends, with its whole duration and its tokens", async () => {
    const t0 = performance.now();
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-slow", stream: true, messages: userMessages() });
    const id = String(res.headers.get("x-request-id"));
    const reader = res.body?.getReader();
    if (!reader) throw new Error("no body");
    let text = "";
    const first = await reader.read();
    text += new TextDecoder().decode(first.value);
    // Headers and the first token are out, the stream is not over: nothing logged yet.
    expect(accessLines(id)).toEqual([]);
    for (;;) {
      const r = await reader.read();
      if (r.done) break;
      text += new TextDecoder().decode(r.value);
    }
    const took = performance.now() - t0;
    expect(sseData(text).at(-1)).toBe("[DONE]");
    await eventually(() => accessLines(id).length === 1);
    const line = accessLines(id)[0] ?? {};
    expect(line.status).toBe(200);
    expect(line.streamed).toBe(true);
    expect(line.prompt_tokens).toBeGreaterThan(0);
    expect(line.completion_tokens).toBe(5);
    expect(line.error).toBeUndefined();
    // The stream's real duration (four gaps at least), not the time to its headers.
    expect(Number(line.latency_ms)).toBeGreaterThanOrEqual(4 * GAP_MS);
    // Sanity only (the log line is written as the stream ends, which a busy machine may delay a little).
    expect(Number(line.latency_ms)).toBeLessThanOrEqual(took + 1_000);
  });

  test("a client that leaves mid-stream: status 499 with the tokens it was sent", async () => {
    // The second token is a minute away: however slowly this client reads, it was sent exactly one.
    const cfg = await fetch(`${slow.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify({ interTokenMs: 60_000 }) });
    expect(cfg.status).toBe(200);
    const ac = new AbortController();
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-slow", stream: true, messages: userMessages() }, { signal: ac.signal });
    // The server started timing before it sent these headers.
    const t0 = performance.now();
    const id = String(res.headers.get("x-request-id"));
    const reader = res.body?.getReader();
    if (!reader) throw new Error("no body");
    let text = "";
    while (!text.includes("token0")) {
      const r = await reader.read();
      if (r.done) throw new Error("stream ended early");
      text += new TextDecoder().decode(r.value);
    }
    // The client stays on the open stream a while (the behaviour under test), then leaves.
    await Bun.sleep(GAP_MS);
    expect(accessLines(id)).toEqual([]);
    ac.abort();
    const leftAfter = performance.now() - t0;
    await eventually(() => accessLines(id).length === 1, 5_000);
    const line = accessLines(id)[0] ?? {};
    expect(line.status).toBe(499);
    expect(line.streamed).toBe(true);
    // "token0 " = 7 characters ≈ 2 tokens, estimated from what was delivered.
    expect(line.completion_tokens).toBe(2);
    expect(Number(line.latency_ms)).toBeGreaterThanOrEqual(GAP_MS);
    // Until the client left, not until the headers (1 ms for rounding).
    expect(Number(line.latency_ms)).toBeGreaterThanOrEqual(leftAfter - 1);
  });

  test("a request the upstream fails is logged with its alias and the error", async () => {
    sim.setFault({ kind: "status", status: 500 });
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", messages: userMessages() });
    const id = String(res.headers.get("x-request-id"));
    expect(res.status).toBe(503);
    await res.json();
    await eventually(() => accessLines(id).length === 1);
    const line = accessLines(id)[0] ?? {};
    expect(line.status).toBe(503);
    expect(line.error).toBe("service_unavailable");
    expect(line.alias).toBe("svc-fast");
    expect(line.streamed).toBe(false);
    expect(line.completion_tokens).toBeUndefined();
  });

  test("a stream the upstream breaks off is logged with the failure", async () => {
    sim.setFault({ kind: "drop-mid-stream", afterChunks: 3 });
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", stream: true, messages: userMessages() });
    const id = String(res.headers.get("x-request-id"));
    await res.text();
    await eventually(() => accessLines(id).length === 1);
    const line = accessLines(id)[0] ?? {};
    expect(line.status).toBe(503);
    expect(line.error).toBe("service_unavailable");
    expect(line.completion_tokens).toBe(4);
  });

  test("a stream the upstream breaks off before any text is logged with no tokens, as its usage record has them", async () => {
    // The role chunk only, then the connection drops.
    sim.setFault({ kind: "drop-mid-stream", afterChunks: 1 });
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", stream: true, messages: userMessages() });
    const id = String(res.headers.get("x-request-id"));
    expect(sseData(await res.text()).at(-1)).toContain('"error"');
    await eventually(() => accessLines(id).length === 1);
    const line = accessLines(id)[0] ?? {};
    expect(line.status).toBe(503);
    // Before: the prompt estimate (8 tokens for "hi"), for a stream that delivered nothing.
    expect([line.prompt_tokens, line.completion_tokens]).toEqual([0, 0]);
  });
});
