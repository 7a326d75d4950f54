import { describe, expect, setDefaultTimeout, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { sql } from "drizzle-orm";
import { ANSWER_TIMEOUT_MS, openDatabase } from "../../src/db/client.ts";
import type { Gateway } from "../../src/server.ts";
import { TEST_DATABASE_URL, bearer, type SeededOrg, seedOrg } from "../helpers/harness.ts";
import { type Outcome, lockTable, sessionsWaiting, tally, timedCall, timedChat, useScene, waitingSampler, wholeQuotaMaxTokens } from "../helpers/pg-locks.ts";
import { until } from "../helpers/poll.ts";

setDefaultTimeout(60_000);

/**
 * Database work the gateway gave up on must not go on holding its pool
 * connection on the server (docs/decisions.md: database work given up on is
 * ended by the server). Another session locks the table a kind of work needs
 * and keeps the lock; the gateway gives up on that work after
 * ANSWER_TIMEOUT_MS. Before, the given-up statements went on waiting on the
 * lock, each on its pool connection, for as long as the lock was held: with
 * a pool of two (dbPoolMax 2: one key lookup, one lease, one audit or
 * stored-response read may be out, and security audit writes had no bound),
 * given-up work held every connection and /readyz and the usage flush
 * starved. Now Postgres ends each such statement (statement_timeout, set per
 * transaction) shortly after the gateway gave up, and the pool serves other
 * work while the lock is still held.
 */

const POOL = 2;
const DEADLINE_MS = 12_000;
/** How soon after the gateway gave up its statement must have been ended by the server. */
const FREED_WITHIN_MS = 3_000;

describe.skipIf(!TEST_DATABASE_URL)("database work given up on is ended by the server while the lock is still held", () => {
  const scene = useScene("h5_timeouts");

  /** Sessions of this database waiting on a lock: only the gateway's (the locker holds, the test's own connections wait on nothing). */
  const waiting = () => sessionsWaiting(scene.held, "%");
  const call = (url: string, init: RequestInit = {}) => timedCall(url, init, DEADLINE_MS);
  const me = (url: string, key: string, headers: Record<string, string> = {}) => call(`${url}/v1/me`, { headers: bearer(key, headers) });
  const chat = (url: string, key: string, maxTokens = 5) => timedChat(url, key, DEADLINE_MS, maxTokens);
  /** A well-formed key that is in no row. */
  function randomKey(): string {
    const alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    return `sk-gw-${[...randomBytes(43)].map((b) => alphabet[b % 62]).join("")}`;
  }


  /**
   * The pool serves other work: /readyz, a request with a cached key of an
   * organisation without quota, a key lookup (unless the keys table is the one
   * locked) and the request's usage written (unless the counters table is:
   * every organisation's usage is counted there).
   */
  async function poolServes(gw: Gateway, free: SeededOrg, locked: string[]): Promise<Record<string, unknown>> {
    const out: Record<string, unknown> = {};
    out.ready = (await call(`${gw.url}/readyz`)).status;
    out.used = (await chat(gw.url, free.serviceKey)).status;
    if (!locked.includes("api_keys")) {
      const lookup = await me(gw.url, randomKey());
      out.lookup = `${lookup.status} ${lookup.code}`;
    }
    if (!locked.includes("usage_counters")) {
      out.flushed = await gw.quota.flush().then(
        () => "written",
        (e: Error) => e.message,
      );
      const [row] = await scene.held.rows<{ n: number }>(sql`select coalesce(sum(requests), 0)::int as n from usage_events where org_id = ${free.orgId}`);
      out.requests = row?.n;
    }
    return out;
  }
  function serves(locked: string[]): Record<string, unknown> {
    return {
      ready: 200,
      used: 200,
      ...(locked.includes("api_keys") ? {} : { lookup: "401 unauthorized" }),
      ...(locked.includes("usage_counters") ? {} : { flushed: "written", requests: 1 }),
    };
  }

  interface Case {
    name: string;
    /** Tables another session locks (and keeps locked until the end). */
    tables: string[];
    /** Gateway config beyond the defaults above. */
    config?: Record<string, unknown>;
    /** Before the lock: what the trigger needs (cached keys, counter rows). */
    prepare(gw: Gateway, free: SeededOrg): Promise<() => Promise<Outcome[]>>;
    /** What the trigger's requests get. */
    outcomes: Record<string, number>;
    /**
     * Work that must not be lost and so goes on waiting (a stored response's row: its id is the client's):
     * the sessions it may keep waiting on the lock (never the pool), and a check that it lands after it.
     */
    keeps?: { sessions: number; landed(): Promise<boolean> };
  }

  const cases: Case[] = [
    {
      name: "key lookups",
      tables: ["api_keys"],
      async prepare(gw, free) {
        // The key used so far gets its last_used_at (flushed every 5 s) before api_keys is locked, not while it is.
        await until(
          async () => (await scene.held.rows<{ at: Date | null }>(sql`select last_used_at as at from api_keys where id = ${free.serviceKeyId}`))[0]?.at != null,
          "last_used_at written",
          10_000,
          100,
        );
        // Keys not in the cache: one lookup out at once (half the pool), the others wait their turn and are given up on with it.
        return async () => Promise.all([1, 2, 3].map(() => me(gw.url, randomKey())));
      },
      outcomes: { "503 service_unavailable": 3 },
    },
    {
      name: "quota leases",
      tables: ["usage_counters"],
      async prepare(gw) {
        const metered = await Promise.all([1, 2, 3].map(() => seedOrg(scene.held, { quotaTokens: 1_000_000, quotaWindow: "day" })));
        for (const o of metered) expect((await me(gw.url, o.serviceKey)).status).toBe(200);
        return async () => Promise.all(metered.map((o) => chat(gw.url, o.serviceKey)));
      },
      outcomes: { "503 service_unavailable": 3 },
    },
    {
      name: "the budget_exceeded audit write",
      tables: ["audit_events"],
      async prepare(gw) {
        const org = await seedOrg(scene.held, { quotaTokens: 1_000, quotaWindow: "day" });
        expect((await chat(gw.url, org.serviceKey)).status).toBe(200); // its counter row exists from now on
        // One whose reservation is the whole quota, more than the first request left: refused for want of what is
        // left, and the refusal writes the period's audit row in the background (one larger than the whole quota
        // takes none while the quota has room: decisions.md, budget_exceeded).
        const fits = await wholeQuotaMaxTokens(gw.url, org.serviceKey, 1_000);
        return async () => [await chat(gw.url, org.serviceKey, fits)];
      },
      outcomes: { "429 budget_exceeded": 1 },
    },
    {
      name: "security audit writes (a valid key sent from a browser)",
      tables: ["audit_events"],
      async prepare(gw) {
        const org = await seedOrg(scene.held);
        for (const k of [org.serviceKey, org.personalKey]) expect((await me(gw.url, k)).status).toBe(200);
        // Two keys, two writes: before, they held both connections for as long as the lock was held.
        return async () => Promise.all([org.serviceKey, org.personalKey].map((k) => me(gw.url, k, { origin: "https://example.com" })));
      },
      outcomes: { "403 browser_request_rejected": 2 },
    },
    {
      name: "audit-log reads",
      tables: ["audit_events"],
      async prepare(gw) {
        const org = await seedOrg(scene.held);
        const read = () => call(`${gw.url}/v1/audit-events`, { headers: bearer(org.serviceKey) });
        expect((await read()).status).toBe(200);
        return async () => Promise.all([read(), read()]);
      },
      outcomes: { "503 service_unavailable": 2 },
    },
    {
      name: "stored-response reads",
      tables: ["responses"],
      config: { responses: { enabled: true } },
      async prepare(gw) {
        const org = await seedOrg(scene.held);
        const get = () => call(`${gw.url}/v1/responses/resp_nothere`, { headers: bearer(org.serviceKey) });
        expect((await get()).status).toBe(404);
        return async () => Promise.all([get(), get()]);
      },
      outcomes: { "503 service_unavailable": 2 },
    },
    (() => {
      let orgId = "";
      return {
        name: "a stored-response write (kept: written once the table is free, holding one connection meanwhile)",
        tables: ["responses"],
        config: { responses: { enabled: true } },
        async prepare(gw: Gateway) {
          const org = await seedOrg(scene.held);
          orgId = org.orgId;
          expect((await me(gw.url, org.serviceKey)).status).toBe(200);
          // Answered after the store's own wait (5 s); the insert goes on without the request.
          return async () => [
            await call(`${gw.url}/v1/responses`, {
              method: "POST",
              headers: { ...bearer(org.serviceKey), "content-type": "application/json" },
              body: JSON.stringify({ model: "svc-fast", input: "hello" }),
            }),
          ];
        },
        outcomes: { "200 null": 1 },
        keeps: {
          sessions: 1,
          async landed() {
            const [r] = await scene.held.rows<{ n: number }>(sql`select count(*)::int as n from responses where org_id = ${orgId}`);
            return r?.n === 1;
          },
        },
      };
    })(),
  ];

  for (const c of cases) {
    test(`${c.name}: no longer waiting on the lock shortly after the gateway gave up; the pool serves other work`, async () => {
      const db = await openDatabase({ databaseUrl: scene.scratch.url, dataDir: "", poolMax: POOL });
      const gw = await scene.gateway(db, c.config);
      const locks: { unlock(): Promise<void> }[] = [];
      try {
        const free = await seedOrg(scene.held, { quotaTokens: null });
        expect((await me(gw.url, free.serviceKey)).status).toBe(200); // cached from now on
        const trigger = await c.prepare(gw, free);
        for (const t of c.tables) locks.push(await lockTable(scene.scratch.url, t));

        const sampler = waitingSampler(scene.held, "%");
        const startedAt = Date.now();
        const outcomes = tally(await trigger());
        // Work the request did not wait for (audit writes) is given up on, or was never waited for, from here on.
        const gaveUpAt = Math.max(Date.now(), startedAt + ANSWER_TIMEOUT_MS);
        let left = -1;
        while (Date.now() < gaveUpAt + FREED_WITHIN_MS) {
          left = await waiting();
          if (left === 0 && Date.now() > gaveUpAt) break;
          await Bun.sleep(50);
        }
        const most = await sampler.stop();
        // And nothing starts waiting again (a retry of the ended work would, for as long again).
        await Bun.sleep(500);
        const later = await waiting();
        // Before: the given-up statements went on waiting on the lock (left 1, or 2: the whole pool) as long as it was held.
        const kept = c.keeps?.sessions ?? 0;
        // Kept work waits on the lock the whole time, but never on more sessions than it may keep.
        expect({ outcomes, waitedOnTheLock: most > 0, atMostKept: kept === 0 || most <= kept, left, later }).toEqual({
          outcomes: c.outcomes,
          waitedOnTheLock: true,
          atMostKept: true,
          left: kept,
          later: kept,
        });
        // The lock is still held; the connections (all but what kept work holds) are free for other work.
        expect(await poolServes(gw, free, c.tables)).toEqual(serves(c.tables));
        if (c.keeps) {
          for (const l of locks.splice(0)) await l.unlock();
          await until(() => (c.keeps as NonNullable<Case["keeps"]>).landed(), "the kept work lands once the lock is gone", 10_000, 100);
        }
      } finally {
        for (const l of locks) await l.unlock();
        await gw.stop();
        await db.close();
      }
    });
  }

  test("work that waited for its turn is ended by the server when the request gives up on it, not 5 s after it began", async () => {
    // A pool of 2: one key lookup at a time (half the pool). The second waits for the first's place, which comes
    // free only when the server ends the first (about 5 s in), leaving the second a few hundred ms of its 5 s.
    const db = await openDatabase({ databaseUrl: scene.scratch.url, dataDir: "", poolMax: POOL });
    const gw = await scene.gateway(db);
    const lock = await lockTable(scene.scratch.url, "api_keys");
    try {
      const first = me(gw.url, randomKey());
      await Bun.sleep(300);
      const second = me(gw.url, randomKey());
      expect(tally(await Promise.all([first, second]))).toEqual({ "503 service_unavailable": 2 });
      // Before: the second's statement began when the first's place came free and had the server's whole 5 s
      // from then: it went on waiting on the lock ~4.7 s after the request had given up on it.
      await until(async () => (await waiting()) === 0, "no lookup left waiting on the lock shortly after the requests gave up", 1_500, 50);
    } finally {
      await lock.unlock();
      await gw.stop();
      await db.close();
    }
  });
});
