import { describe, expect, setDefaultTimeout, test } from "bun:test";
import { sql } from "drizzle-orm";
import { openDatabase } from "../../src/db/client.ts";
import type { Gateway } from "../../src/server.ts";
import { TEST_DATABASE_URL, bearer, type SeededOrg, seedOrg } from "../helpers/harness.ts";
import { lockTable, sessionsWaiting, tally, timedCall, timedChat, useScene, waitingSampler, wholeQuotaMaxTokens } from "../helpers/pg-locks.ts";
import { until } from "../helpers/poll.ts";

setDefaultTimeout(60_000);

/**
 * Database work the gateway gives up on must not take the pool
 * (docs/decisions.md: quota leases, budget_exceeded audit writes, audit-log
 * and stored-response reads while the database does not answer). Another
 * session locks one table; every statement of the gateway's that touches it
 * waits on the server, each on its own pool connection, while the rest of the
 * database answers. Before, each kind of such work could take every
 * connection of the pool (dbPoolMax 10): /readyz, key lookups and usage
 * writes for other tables then got none. (That the server then ends the work
 * given up on, while the lock is still held: pg-statement-timeout.test.ts.)
 */

/** dbPoolMax: the default. */
const POOL = 10;
/** Leases, audit-log reads, stored-response reads that may be out at once: a quarter of the pool (maxOutAtOnce). */
const QUARTER = 2;
const DEADLINE_MS = 12_000;

describe.skipIf(!TEST_DATABASE_URL)("work that waits on a locked table holds a bounded part of the pool", () => {
  const scene = useScene("h3_bounds");

  const waiting = (like: string) => sessionsWaiting(scene.held, like);

  const sampler = (like: string) => waitingSampler(scene.held, like);

  const lock = (table: string) => lockTable(scene.scratch.url, table);
  const call = (url: string, init: RequestInit = {}) => timedCall(url, init, DEADLINE_MS);
  const chat = (url: string, key: string, maxTokens = 5) => timedChat(url, key, DEADLINE_MS, maxTokens);
  const unknownKey = () => `sk-gw-${"A".repeat(10)}${crypto.randomUUID().replaceAll("-", "").slice(0, 33)}`;

  /** The rest of the pool still works: /readyz, a key lookup (another table), a usage write. */
  async function poolStillServes(gw: Gateway, metered: SeededOrg): Promise<Record<string, unknown>> {
    const ready = await call(`${gw.url}/readyz`);
    const lookup = await call(`${gw.url}/v1/me`, { headers: bearer(unknownKey()) });
    const used = await chat(gw.url, metered.serviceKey);
    const flushed = await gw.quota.flush().then(
      () => "written",
      (e: Error) => e.message,
    );
    return { ready: ready.status, lookup: `${lookup.status} ${lookup.code}`, used: used.status, flushed };
  }
  const SERVES = { ready: 200, lookup: "401 unauthorized", used: 200, flushed: "written" };


  test("quota leases waiting on a locked usage_counters hold at most a quarter of the pool; /readyz and key lookups still get a connection", async () => {
    const db = await openDatabase({ databaseUrl: scene.scratch.url, dataDir: "", poolMax: POOL });
    const gw = await scene.gateway(db);
    let locked: { unlock(): Promise<void> } | undefined;
    try {
      const orgs = await Promise.all(Array.from({ length: 30 }, () => seedOrg(scene.held, { quotaTokens: 1_000_000, quotaWindow: "day" })));
      const free = await seedOrg(scene.held, { quotaTokens: null });
      for (const o of [...orgs, free]) expect((await call(`${gw.url}/v1/me`, { headers: bearer(o.serviceKey) })).status).toBe(200);
      locked = await lock("usage_counters");
      const s = sampler("%usage_counters%");
      const first = await Promise.all(orgs.map((o) => chat(gw.url, o.serviceKey)));
      // A second wave after the first was given up on: refused at once while the given-up leases are unanswered, or
      // after its own leases (once the server ended the first ones) were given up on; within the same bound either way.
      const second = await Promise.all(orgs.map((o) => chat(gw.url, o.serviceKey)));
      const most = await s.stop();
      // Before: all ten connections waited on lease transactions (most 10), and /readyz got 503 (no connection for its ping).
      expect({ most, first: tally(first), second: tally(second) }).toEqual({
        most: QUARTER,
        first: { "503 service_unavailable": orgs.length },
        second: { "503 service_unavailable": orgs.length },
      });
      for (const r of [...first, ...second]) expect(r.ms).toBeLessThan(8_000);
      // Given up on, they are ended by the server (statement_timeout) while the lock is still held.
      await until(async () => (await waiting("%usage_counters%")) === 0, "the given-up leases to be ended by the server", 3_000, 50);
      const ready = await call(`${gw.url}/readyz`);
      const lookup = await call(`${gw.url}/v1/me`, { headers: bearer(unknownKey()) });
      expect({ ready: ready.status, lookup: `${lookup.status} ${lookup.code}` }).toEqual({ ready: 200, lookup: "401 unauthorized" });
      await locked.unlock();
      // The lock gone, the leases settle and organisations are served again.
      await until(async () => (await chat(gw.url, (orgs[0] as SeededOrg).serviceKey)).status === 200, "leases again", 10_000, 100);
      expect(tally(await Promise.all(orgs.map((o) => chat(gw.url, o.serviceKey))))).toEqual({ "200 null": orgs.length });
    } finally {
      await locked?.unlock();
      await gw.stop();
      await db.close();
    }
  });

  test("budget_exceeded refusals while audit_events is locked: one audit write at a time per organisation and period", async () => {
    const db = await openDatabase({ databaseUrl: scene.scratch.url, dataDir: "", poolMax: POOL });
    const gw = await scene.gateway(db);
    let locked: { unlock(): Promise<void> } | undefined;
    try {
      const org = await seedOrg(scene.held, { quotaTokens: 1_000, quotaWindow: "day" });
      const other = await seedOrg(scene.held, { quotaTokens: null });
      expect((await chat(gw.url, org.serviceKey)).status).toBe(200); // its counter row exists from now on
      expect((await call(`${gw.url}/v1/me`, { headers: bearer(other.serviceKey) })).status).toBe(200);
      // Each reserving the whole quota, more than the first request left: refused for want of what is left, each
      // refusal asking for the period's audit row (one larger than the whole quota asks for none while the quota has room).
      const fits = await wholeQuotaMaxTokens(gw.url, org.serviceKey, 1_000);
      locked = await lock("audit_events");
      const s = sampler("%");
      const refused = await Promise.all(Array.from({ length: 50 }, () => chat(gw.url, org.serviceKey, fits)));
      await Bun.sleep(500);
      const most = await s.stop();
      expect(tally(refused)).toEqual({ "429 budget_exceeded": 50 });
      // Before: every connection of the pool waited (the first on audit_events, the rest on its counter row), and the flush below failed.
      expect({ most, now: await waiting("%") }).toEqual({ most: 1, now: 1 });
      expect(await poolStillServes(gw, other)).toEqual(SERVES);
      await locked.unlock();
      // No longer waiting on the lock is not yet committed: poll for the row (CI once read 0 right after the wait ended).
      const audited = async () =>
        Number(
          (
            await scene.held.rows<{ n: number }>(
              sql`select count(*)::int as n from audit_events where org_id = ${org.orgId} and action = 'billing.budget_exceeded'`,
            )
          )[0]?.n,
        );
      await until(async () => (await waiting("%")) === 0 && (await audited()) > 0, "the audit write to settle", 10_000, 50);
      await Bun.sleep(200);
      expect(await audited()).toBe(1);
    } finally {
      await locked?.unlock();
      await gw.stop();
      await db.close();
    }
  });

  test("audit-log reads waiting on a locked audit_events hold at most a quarter of the pool and get 503", async () => {
    const db = await openDatabase({ databaseUrl: scene.scratch.url, dataDir: "", poolMax: POOL });
    const gw = await scene.gateway(db);
    let locked: { unlock(): Promise<void> } | undefined;
    try {
      const org = await seedOrg(scene.held);
      const other = await seedOrg(scene.held, { quotaTokens: null });
      expect((await call(`${gw.url}/v1/audit-events`, { headers: bearer(org.serviceKey) })).status).toBe(200);
      expect((await call(`${gw.url}/v1/me`, { headers: bearer(other.serviceKey) })).status).toBe(200);
      locked = await lock("audit_events");
      const s = sampler("%audit_events%");
      const reads = await Promise.all(Array.from({ length: 30 }, () => call(`${gw.url}/v1/audit-events`, { headers: bearer(org.serviceKey) })));
      const most = await s.stop();
      // Before: no answer at all (the client gave up after 12 s) while all ten connections waited on the lock.
      expect({ most, reads: tally(reads) }).toEqual({ most: QUARTER, reads: { "503 service_unavailable": 30 } });
      for (const r of reads) expect(r.ms).toBeLessThan(8_000);
      // Given up on, they are ended by the server (statement_timeout) while the lock is still held.
      await until(async () => (await waiting("%audit_events%")) === 0, "the given-up reads to be ended by the server", 3_000, 50);
      expect(await poolStillServes(gw, other)).toEqual(SERVES);
      await locked.unlock();
      await until(
        async () => (await call(`${gw.url}/v1/audit-events`, { headers: bearer(org.serviceKey) })).status === 200,
        "audit reads again",
        10_000,
        100,
      );
    } finally {
      await locked?.unlock();
      await gw.stop();
      await db.close();
    }
  });

  test("stored-response reads waiting on a locked responses table hold at most a quarter of the pool and get 503", async () => {
    const db = await openDatabase({ databaseUrl: scene.scratch.url, dataDir: "", poolMax: POOL });
    const gw = await scene.gateway(db, { responses: { enabled: true } });
    let locked: { unlock(): Promise<void> } | undefined;
    try {
      const org = await seedOrg(scene.held);
      const other = await seedOrg(scene.held, { quotaTokens: null });
      const get = () => call(`${gw.url}/v1/responses/resp_nothere`, { headers: bearer(org.serviceKey) });
      expect(await get()).toMatchObject({ status: 404 });
      expect((await call(`${gw.url}/v1/me`, { headers: bearer(other.serviceKey) })).status).toBe(200);
      locked = await lock("responses");
      const s = sampler("%responses%");
      const reads = await Promise.all(Array.from({ length: 30 }, get));
      const most = await s.stop();
      // Before: no answer at all (the client gave up after 12 s) while all ten connections waited on the lock.
      expect({ most, reads: tally(reads) }).toEqual({ most: QUARTER, reads: { "503 service_unavailable": 30 } });
      for (const r of reads) expect(r.ms).toBeLessThan(8_000);
      // Given up on, they are ended by the server (statement_timeout) while the lock is still held.
      await until(async () => (await waiting("%responses%")) === 0, "the given-up reads to be ended by the server", 3_000, 50);
      expect(await poolStillServes(gw, other)).toEqual(SERVES);
      await locked.unlock();
      await until(async () => (await get()).status === 404, "stored-response reads again", 10_000, 100);
    } finally {
      await locked?.unlock();
      await gw.stop();
      await db.close();
    }
  });
});
