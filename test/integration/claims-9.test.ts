import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { type AddressInfo, type Server, type Socket, connect, createServer } from "node:net";
import { eq, sql } from "drizzle-orm";
import { openDatabase } from "../../src/db/client.ts";
import { usageEvents } from "../../src/db/schema.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { TEST_DATABASE_URL, startTestGateway } from "../helpers/harness.ts";
import { until } from "../helpers/poll.ts";
import { TEST_PLANS, chatAlias, post, seedTestOrg, testAliases, upstreamSettings, userMessages, chargesOf } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(90_000);

/**
 * Claims of README.md, docs/operations.md, docs/decisions.md and the OpenAPI
 * document that the earlier rounds (claims-*.test.ts) left without a test
 * able to fail on them (round 9). Each test names the claim it holds; each
 * was shown failing against a mutation of src/ that breaks its claim (see
 * the commit messages).
 */

let sim: Simulator;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 5, interTokenMs: 1, completionTokens: 3 });
});
afterAll(async () => {
  await sim.stop();
});

const usageOf = chargesOf;

describe("a client that leaves before its request reached an upstream that works on it is charged nothing (docs/decisions.md: one that leaves … in the backoff between attempts, or after the upstream refused it (an error status), is charged nothing)", () => {
  /** What the upstream does with each request: "refuse" answers 500 and holds its body until the gateway leaves; "busy" answers 503 at once. */
  let mode: "refuse" | "busy" = "busy";
  let received = 0;
  let gone = 0;
  const upstream = Bun.serve({
    hostname: "127.0.0.1",
    port: 0,
    idleTimeout: 0,
    async fetch(req) {
      await req.text();
      received++;
      if (mode === "busy") return Response.json({ error: { message: "busy", type: "server_error" } }, { status: 503 });
      // The error status goes out at once; its body never comes until the gateway gives up the connection.
      const body = new ReadableStream({
        start(controller) {
          controller.enqueue(new TextEncoder().encode('{"error": {"message": "'));
          req.signal.addEventListener("abort", () => {
            gone++;
            try {
              controller.close();
            } catch {}
          });
        },
      });
      return new Response(body, { status: 500, headers: { "content-type": "application/json" } });
    },
  });
  const base = `http://127.0.0.1:${upstream.port}/v1`;
  let gw: Gateway;

  beforeAll(async () => {
    gw = await startTestGateway({
      aliases: { "svc-fast": chatAlias([{ baseUrl: base }]) },
      plans: TEST_PLANS,
      // Two attempts, the second after a backoff of 2.5-7.5 s (50% to 150% of backoffMs): the client leaves during it.
      upstream: upstreamSettings({ attempts: 2, backoffMs: 5_000, breakerFailures: 1_000 }, { firstByteMs: 30_000 }),
    });
  });
  afterAll(async () => {
    await gw?.stop();
    await upstream.stop(true);
  });

  for (const stream of [false, true]) {
    test(`${stream ? "streamed" : "JSON"}: refused at once (503), the client leaves in the backoff before the next attempt: 499, nothing charged, no second attempt`, async () => {
      mode = "busy";
      const o = await seedTestOrg(gw.database, { quotaTokens: 1_000_000, quotaWindow: "day" });
      const before = received;
      const ac = new AbortController();
      const res = post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream }, { signal: ac.signal }).catch(() => undefined);
      await until(() => received > before, "the first attempt upstream", 10_000, 5);
      await Bun.sleep(300);
      ac.abort();
      await res;
      await until(async () => (await usageOf(gw, o.orgId)).length > 0, "the usage record", 10_000, 20);
      expect(await usageOf(gw, o.orgId)).toEqual([{ status: 499, prompt: 0, completion: 0 }]);
      expect(received).toBe(before + 1);
    });

    test(`${stream ? "streamed" : "JSON"}: the upstream refused it (500) and the client leaves while its error body is read: 499, nothing charged`, async () => {
      mode = "refuse";
      const o = await seedTestOrg(gw.database, { quotaTokens: 1_000_000, quotaWindow: "day" });
      const before = received;
      const left = gone;
      const ac = new AbortController();
      const res = post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), stream }, { signal: ac.signal }).catch(() => undefined);
      await until(() => received > before, "the request upstream", 10_000, 5);
      await Bun.sleep(300);
      ac.abort();
      await res;
      await until(() => gone > left, "the upstream connection given up", 10_000, 5);
      await until(async () => (await usageOf(gw, o.orgId)).length > 0, "the usage record", 10_000, 20);
      expect(await usageOf(gw, o.orgId)).toEqual([{ status: 499, prompt: 0, completion: 0 }]);
      expect(received).toBe(before + 1);
    });
  }
});

describe("responses.retentionDays (README configuration table: keep responses that many days; docs/decisions.md, Retention: from creation)", () => {
  test("a gateway configured with 7 (and 1) days stores each response to expire that many days after its creation", async () => {
    for (const days of [7, 1]) {
      const gw = await startTestGateway({ aliases: testAliases(sim.url), plans: TEST_PLANS, responses: { enabled: true, retentionDays: days } });
      try {
        const o = await seedTestOrg(gw.database);
        const res = await post(gw, "/v1/responses", o.personalKey, { model: "svc-fast", input: "hi" });
        expect(res.status).toBe(200);
        const id = String(((await res.json()) as { id: string }).id);
        const [row] = await gw.database.rows<{ seconds: number }>(
          sql`select extract(epoch from expires_at - created_at) as seconds from responses where id = ${id}`,
        );
        // `days` days to the hour (created_at is the database's clock, expires_at the gateway's).
        expect({ days, hours: Math.round(Number(row?.seconds) / 3_600) }).toEqual({ days, hours: days * 24 });
        // Retrievable meanwhile.
        expect((await fetch(`${gw.url}/v1/responses/${id}`, { headers: { authorization: `Bearer ${o.personalKey}` } })).status).toBe(200);
      } finally {
        await gw.stop();
      }
    }
  });
});


describe("a request between attempts at the drain limit (docs/decisions.md, Shutdown: requests still waiting for an upstream's answer then end the same moment the same way … answered 503 service_unavailable, recorded as a 503 with nothing charged; no further attempt starts)", () => {
  test("an upstream that answered 503, the next attempt 1-3 s away when drainMs (300) ends: the client gets 503 service_unavailable, not a reset; no second attempt; usage 503, nothing charged", async () => {
    let received = 0;
    const upstream = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      async fetch(req) {
        await req.text();
        received++;
        return Response.json({ error: { message: "busy", type: "server_error" } }, { status: 503 });
      },
    });
    const gw = await startTestGateway({
      aliases: { "svc-fast": chatAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }]) },
      plans: TEST_PLANS,
      // The second attempt waits 1-3 s (50% to 150% of min(backoffMs, 2 s)): well past the drain's 300 ms.
      upstream: upstreamSettings({ attempts: 3, backoffMs: 2_000, breakerFailures: 1_000 }),
      drainMs: 300,
    });
    try {
      const o = await seedTestOrg(gw.database, { quotaTokens: 1_000_000, quotaWindow: "day" });
      type Got = { status: number; body: { error?: { code?: string; message?: string } } | null };
      const answer: Promise<Got> = post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages() }).then(
        async (r) => ({ status: r.status, body: (await r.json().catch(() => null)) as Got["body"] }),
        (e: unknown) => ({ status: 0, body: { error: { code: String((e as { code?: string }).code ?? e) } } }),
      );
      await until(() => received === 1, "the first attempt upstream", 10_000, 5);
      const t0 = performance.now();
      await gw.stop();
      const stopMs = performance.now() - t0;
      const got = await answer;
      expect({ status: got.status, code: got.body?.error?.code }).toEqual({ status: 503, code: "service_unavailable" });
      expect(got.body?.error?.message).toContain("shutting down");
      expect(received).toBe(1);
      expect(stopMs).toBeLessThan(4_000);
      const rows = await gw.database.db
        .select({ status: usageEvents.status, prompt: usageEvents.promptTokens, completion: usageEvents.completionTokens })
        .from(usageEvents)
        .where(eq(usageEvents.orgId, o.orgId));
      expect(rows).toEqual([{ status: 503, prompt: 0, completion: 0 }]);
    } finally {
      await gw.stop();
      await upstream.stop(true);
    }
  });
});

describe.skipIf(!TEST_DATABASE_URL)("the Postgres reconnect backoff (docs/decisions.md, Sessions ended under load reconnect at once: reconnectBackoff doubles from 50 ms to 1 s; a database that refuses sees about one attempt a second per pooled connection)", () => {
  test("after 6 s of refused connections a query is answered within ~1 s of the database accepting again, and the refusals saw a bounded number of attempts", async () => {
    const target = new URL(String(TEST_DATABASE_URL));
    const sockets = new Set<Socket>();
    let attempts = 0;
    const forward = (client: Socket) => {
      attempts++;
      sockets.add(client);
      const up = connect(Number(target.port || 5432), target.hostname);
      sockets.add(up);
      client.pipe(up).on("error", () => {});
      up.pipe(client).on("error", () => {});
      const end = () => {
        client.destroy();
        up.destroy();
      };
      client.on("close", end).on("error", end);
      up.on("close", end).on("error", end);
    };
    let proxy: Server = createServer(forward);
    await new Promise<void>((r) => proxy.listen(0, "127.0.0.1", () => r()));
    const port = (proxy.address() as AddressInfo).port;
    const url = new URL(String(TEST_DATABASE_URL));
    url.hostname = "127.0.0.1";
    url.port = String(port);
    const database = await openDatabase({ databaseUrl: url.toString(), dataDir: "memory://", poolMax: 1 });
    try {
      expect(await database.rows(sql`select 1 as one`)).toEqual([{ one: 1 }]);
      // The database goes away: the session is cut and new connections are refused (ECONNREFUSED).
      const closed = new Promise<void>((r) => proxy.close(() => r()));
      for (const s of sockets) s.destroy();
      sockets.clear();
      await closed;
      const refusedFrom = performance.now();
      let failures = 0;
      while (performance.now() - refusedFrom < 6_000) {
        await database.rows(sql`select 1`).catch(() => failures++);
        await Bun.sleep(20);
      }
      expect(failures).toBeGreaterThanOrEqual(3);
      // Counted by the driver's attempts: with no backoff hundreds; ours about one a second after the first doublings.
      expect(failures).toBeLessThanOrEqual(25);
      // The database accepts again: the next query waits at most the capped backoff (1 s), not the driver's 3^n / 100 s.
      attempts = 0;
      proxy = createServer(forward);
      await new Promise<void>((r) => proxy.listen(port, "127.0.0.1", () => r()));
      const back = performance.now();
      let answered = false;
      while (!answered && performance.now() - back < 30_000) {
        answered = await database.rows(sql`select 1 as one`).then(
          (r) => r.length === 1,
          () => false,
        );
      }
      const waited = performance.now() - back;
      expect(answered).toBe(true);
      expect(waited).toBeLessThan(2_000);
      expect(attempts).toBeGreaterThanOrEqual(1);
    } finally {
      await database.close().catch(() => {});
      proxy.close();
      for (const s of sockets) s.destroy();
    }
  });
});
