import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { and, eq } from "drizzle-orm";
import { auditEvents, usageEvents } from "../../src/db/schema.ts";
import { upstreamAliases } from "../../src/config/load.ts";
import { createLogger } from "../../src/lib/log.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { openDatabase } from "../../src/db/client.ts";
import { TEST_DATABASE_URL, bearer, errorOf, freshDatabase, type SeededOrg, seedOrg, sharedDatabase, startTestGateway, testConfig } from "../helpers/harness.ts";
import { until } from "../helpers/poll.ts";
import { CHAT_MODEL, chatAlias, sseData, upstreamSettings } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(90_000);

/**
 * Claims of docs/decisions.md (the HTTP and runtime section, from the stream
 * bound to the Responses API) that had no test able to fail on them: each test
 * names the claim it holds.
 */

const stops: (() => unknown)[] = [];
afterAll(async () => {
  for (const s of stops.reverse()) await s();
});

describe("shutdown (decisions: Shutdown)", () => {
  test("after drainMs, a JSON request the upstream never answers is answered 503 (the gateway is shutting down) and the stop ends at most ~1 s later", async () => {
    // An upstream that takes every request and never answers; its first-byte timeout is far away.
    let seen = 0;
    const upstream = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      fetch() {
        seen++;
        return new Promise<Response>(() => {});
      },
    });
    stops.push(() => upstream.stop(true));
    const config = await testConfig({
      aliases: { "svc-fast": chatAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }]) },
      upstream: upstreamSettings({ attempts: 1 }, { firstByteMs: 120_000 }),
      drainMs: 300,
    });
    const gw: Gateway = await startGateway({ config, database: await sharedDatabase(), log: createLogger("error") });
    const org = await seedOrg(gw.database);
    const pending = fetch(`${gw.url}/v1/chat/completions`, {
      method: "POST",
      headers: bearer(org.serviceKey, { "content-type": "application/json" }),
      body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }),
    }).then(
      (r) => r.status,
      () => "closed" as const,
    );
    await until(() => seen === 1, "the request at the upstream", 10_000, 5);
    const t0 = performance.now();
    await gw.stop();
    const ms = performance.now() - t0;
    // drainMs (300) + at most 1 s for streams' last bytes, then the rest is closed; slack for a busy machine.
    expect(ms).toBeLessThan(4_000);
    // Answered, not reset with its connection (docs/decisions.md, Shutdown): before, "closed".
    expect(await pending).toBe(503);
  });
});

describe("a gateway on the simulator", () => {
  let sim: Simulator;
  let gw: Gateway;
  let org: SeededOrg;
  beforeAll(async () => {
    sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 5 });
    gw = await startTestGateway({ aliases: upstreamAliases(sim.url) });
    org = await seedOrg(gw.database);
    stops.push(() => sim.stop(), () => gw.stop());
  });
  const call = (path: string, body: unknown) =>
    fetch(`${gw.url}${path}`, { method: "POST", headers: bearer(org.serviceKey, { "content-type": "application/json" }), body: JSON.stringify(body) });

  test("embeddings: `dimensions` up to the alias's 1024 is forwarded; above it is 400 (decisions: Non-streamed answers)", async () => {
    const at = await call("/v1/embeddings", { model: "svc-embed", input: "a", dimensions: 1024 });
    expect(at.status).toBe(200);
    const body = (await at.json()) as { data: { embedding: number[] }[] };
    expect(body.data[0]?.embedding).toHaveLength(1024);
    const over = await call("/v1/embeddings", { model: "svc-embed", input: "a", dimensions: 1025 });
    expect(over.status).toBe(400);
    expect(await errorOf(over)).toMatchObject({ type: "invalid_request_error", param: "dimensions" });
  });
});

describe("request bodies (decisions: Request bodies)", () => {
  const LIMIT = 2_048;
  let sim: Simulator;
  let gw: Gateway;
  let org: SeededOrg;
  beforeAll(async () => {
    sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 3 });
    gw = await startTestGateway({ aliases: upstreamAliases(sim.url), bodyLimitBytes: LIMIT });
    org = await seedOrg(gw.database);
    stops.push(() => sim.stop(), () => gw.stop());
  });
  /** A chat body of exactly `size` bytes (JSON padded with spaces). */
  const bodyOf = (size: number) => {
    const json = JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] });
    return json + " ".repeat(size - json.length);
  };
  const send = (body: string, chunked: boolean) =>
    fetch(`${gw.url}/v1/chat/completions`, {
      method: "POST",
      headers: bearer(org.serviceKey, { "content-type": "application/json" }),
      // A stream has no declared length: Bun's fetch sends it chunked.
      body: chunked
        ? new ReadableStream<Uint8Array>({
            start(c) {
              const bytes = new TextEncoder().encode(body);
              c.enqueue(bytes.subarray(0, 1_000));
              c.enqueue(bytes.subarray(1_000));
              c.close();
            },
          })
        : body,
    });

  for (const chunked of [false, true]) {
    test(`a body of exactly bodyLimitBytes is read; one byte more is 400 too large (${chunked ? "chunked" : "Content-Length"})`, async () => {
      const at = await send(bodyOf(LIMIT), chunked);
      expect(at.status).toBe(200);
      await at.arrayBuffer();
      const over = await send(bodyOf(LIMIT + 1), chunked);
      expect(over.status).toBe(400);
      expect(over.headers.get("connection")).toBe("close");
      const e = await errorOf(over);
      expect(e).toMatchObject({ type: "invalid_request_error", code: "invalid_request_error" });
      expect(e.message).toContain(`the limit is ${LIMIT} bytes`);
    });
  }
});

describe("slow clients (decisions: Slow clients)", () => {
  test("the idle timeout is given back just before a stream's last bytes, never mid-stream: a silence longer than idleTimeoutS inside a stream does not cut it", async () => {
    // An upstream whose stream falls silent for 9 s after its first chunk (the idle timer of 1 s fires within ~4-8 s
    // in Bun's 4 s steps), well inside the upstream idle timeout.
    const GAP_MS = 9_000;
    const chunk = (content: string, finish: string | null = null) =>
      `data: ${JSON.stringify({ id: "c1", object: "chat.completion.chunk", created: 1, model: CHAT_MODEL, choices: [{ index: 0, delta: { content }, finish_reason: finish }] })}\n\n`;
    const upstream = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      idleTimeout: 30,
      fetch() {
        const enc = new TextEncoder();
        const body = new ReadableStream<Uint8Array>({
          async start(c) {
            c.enqueue(enc.encode(chunk("first ")));
            await Bun.sleep(GAP_MS);
            c.enqueue(enc.encode(chunk("second", "stop")));
            c.enqueue(enc.encode("data: [DONE]\n\n"));
            c.close();
          },
        });
        return new Response(body, { headers: { "content-type": "text/event-stream" } });
      },
    });
    stops.push(() => upstream.stop(true));
    const config = await testConfig({
      aliases: { "svc-fast": chatAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }]) },
      upstream: upstreamSettings({ attempts: 1 }, { idleMs: 30_000 }),
      idleTimeoutS: 1,
    });
    const gw: Gateway = await startGateway({ config, database: await sharedDatabase(), log: createLogger("error") });
    stops.push(() => gw.stop());
    const org = await seedOrg(gw.database);
    const res = await fetch(`${gw.url}/v1/chat/completions`, {
      method: "POST",
      headers: bearer(org.serviceKey, { "content-type": "application/json" }),
      body: JSON.stringify({ model: "svc-fast", stream: true, messages: [{ role: "user", content: "hi" }] }),
    });
    expect(res.status).toBe(200);
    const text = await res.text().catch((e: Error) => `cut: ${e.message}`);
    const data = sseData(text);
    expect(data.at(-1)).toBe("[DONE]");
    expect(text).toContain("second");
  }, 60_000);
});

describe("usage writes (decisions: Usage is written once per quota.flushMs)", () => {
  test("a few hundred requests settled between two writes go out in one write: one summed row, not one per batch of a few", async () => {
    const sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 2 });
    const gw = await startTestGateway({ aliases: upstreamAliases(sim.url), quota: { flushMs: 600_000 }, plans: { Standard: { requestsPerMinute: 1_000_000 } } });
    stops.push(() => sim.stop(), () => gw.stop());
    const org = await seedOrg(gw.database);
    const N = 600;
    for (let i = 0; i < N; i += 20) {
      const answers = await Promise.all(
        Array.from({ length: 20 }, () =>
          fetch(`${gw.url}/v1/chat/completions`, {
            method: "POST",
            headers: bearer(org.serviceKey, { "content-type": "application/json" }),
            body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }),
          }),
        ),
      );
      for (const a of answers) {
        expect(a.status).toBe(200);
        await a.arrayBuffer();
      }
    }
    await gw.quota.flush();
    const rows = await gw.database.db.select().from(usageEvents).where(eq(usageEvents.orgId, org.orgId));
    // One key, alias, target, status, not streamed: one write is one row summing them all (a batch holds
    // 10,000 records on the embedded database, 50,000 on Postgres).
    expect(rows.map((r) => r.requests)).toEqual([N]);
  });
});

describe.skipIf(!TEST_DATABASE_URL)("a pool of one (decisions: Usage writes while the database does not answer)", () => {
  test("with dbPoolMax 1 the usage writer may still leave one write unanswered, not none: usage is written", async () => {
    const sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 2 });
    const db = await openDatabase({ databaseUrl: TEST_DATABASE_URL, dataDir: "memory://", poolMax: 1 });
    const gw = await startTestGateway({ aliases: upstreamAliases(sim.url), quota: { flushMs: 600_000 } }, db);
    stops.push(() => sim.stop(), () => db.close(), () => gw.stop());
    const org = await seedOrg(gw.database);
    const res = await fetch(`${gw.url}/v1/chat/completions`, {
      method: "POST",
      headers: bearer(org.serviceKey, { "content-type": "application/json" }),
      body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }),
    });
    expect(res.status).toBe(200);
    await res.arrayBuffer();
    await gw.quota.flush();
    const rows = await gw.database.db.select().from(usageEvents).where(eq(usageEvents.orgId, org.orgId));
    expect(rows.map((r) => [r.requests, r.status])).toEqual([[1, 200]]);
    expect(gw.quota.stats().flushFailures).toBe(0);
  });
});

// The embedded database counts its transactions (database.transactions); Postgres does not here.
describe.skipIf(!!TEST_DATABASE_URL)("budget_exceeded refusals (decisions: Other database work given up on)", () => {
  test("once the period's budget_exceeded is recorded, later refusals of the organisation do no database work", async () => {
    const sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 2 });
    const db = await freshDatabase();
    const gw = await startTestGateway({ aliases: upstreamAliases(sim.url), quota: { flushMs: 600_000 }, plans: { Standard: { requestsPerMinute: 1_000_000 } } }, db);
    stops.push(() => sim.stop(), () => db.close(), () => gw.stop());
    const org = await seedOrg(db, { quotaTokens: 1_000 });
    const chat = (maxTokens: number) =>
      fetch(`${gw.url}/v1/chat/completions`, {
        method: "POST",
        headers: bearer(org.serviceKey, { "content-type": "application/json" }),
        body: JSON.stringify({ model: "svc-fast", max_tokens: maxTokens, messages: [{ role: "user", content: "hi" }] }),
      });
    // A lease makes the period's counter row; then a request that fits the quota but not what is left (530 for
    // the prompt's bound, 470 to generate: the whole 1,000) is refused and recorded. One larger than the whole
    // quota records nothing (decisions: Budget exceeded).
    const ok = await chat(5);
    expect(ok.status).toBe(200);
    await ok.arrayBuffer();
    const first = await chat(470);
    expect(first.status).toBe(429);
    expect((await errorOf(first)).code).toBe("budget_exceeded");
    const recorded = () => db.db.select().from(auditEvents).where(and(eq(auditEvents.orgId, org.orgId), eq(auditEvents.action, "billing.budget_exceeded")));
    await until(async () => (await recorded()).length === 1, "the budget_exceeded audit row", 10_000, 20);
    await Bun.sleep(100); // the write's own last statements
    const transactions = () => db.transactions?.() ?? Number.NaN;
    const before = transactions();
    for (let i = 0; i < 10; i++) {
      const r = await chat(470);
      expect(r.status).toBe(429);
      await r.arrayBuffer();
      await Bun.sleep(20);
    }
    await Bun.sleep(200);
    // Each refusal's own look at the counter (a lease transaction: docs/decisions.md, Quota), and at most the batched
    // last_used_at update of the key (every 5 s); before the memory of the marked row, each refusal also wrote and
    // rolled back an audit row and read the counter row (two transactions more each).
    expect(transactions() - before).toBeLessThanOrEqual(10 + 1);
    expect(await recorded()).toHaveLength(1);
  });
});
