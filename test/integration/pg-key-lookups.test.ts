import { describe, expect, setDefaultTimeout, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { sql } from "drizzle-orm";
import { createKeyVerifier } from "../../src/auth/verify.ts";
import { ANSWER_TIMEOUT_MS, openDatabase } from "../../src/db/client.ts";
import { TEST_DATABASE_URL, bearer, seedOrg } from "../helpers/harness.ts";
import { gaugeOf, lockTable, sessionsWaiting, tally, timedCall, useScene, waitingSampler } from "../helpers/pg-locks.ts";
import { until } from "../helpers/poll.ts";

setDefaultTimeout(60_000);

/**
 * Key lookups the gateway gave up on must not take the pool (docs/decisions.md:
 * key lookups while the database does not answer). The keys table is locked
 * by another session, so every lookup of a key not in the cache waits on the
 * server while the rest of the database answers: a flood of distinct unknown
 * keys then held every connection of the pool (dbPoolMax 10), and the usage
 * writer could not get one. (That the server then ends the lookups given up
 * on, while the lock is still held: pg-statement-timeout.test.ts.)
 */

/** dbPoolMax: the default. */
const POOL = 10;
/** Key lookups that may hold a connection at once: half the pool (maxKeyLookups). */
const BOUND = 5;
const FLOOD = 200;
const DEADLINE_MS = 20_000;

function randomKey(): string {
  const alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
  return `sk-gw-${[...randomBytes(43)].map((b) => alphabet[b % 62]).join("")}`;
}

describe.skipIf(!TEST_DATABASE_URL)("key lookups that wait on a locked keys table", () => {
  const scene = useScene("h1_lookups");

  /** A key lookup's statement (ILIKE). */
  const LOOKUP_LIKE = '%from "api_keys"%"api_keys"."hash" = %';
  /** The gateway's sessions whose current statement is a key lookup waiting on the lock. */
  const lookupsWaiting = () => sessionsWaiting(scene.held, LOOKUP_LIKE);
  const me = (url: string, key: string) => timedCall(`${url}/v1/me`, { headers: bearer(key) }, DEADLINE_MS);
  /** Another session locks the keys table: every statement that reads or writes it waits on the server; nothing else does. */
  const lockKeys = () => lockTable(scene.scratch.url, "api_keys");
  const gauge = (metricsUrl: string, name: string) => gaugeOf(metricsUrl, name, DEADLINE_MS);

  test("a flood of unknown keys holds at most half the pool; a cached key still gets 200 and its usage is written", async () => {
    const db = await openDatabase({ databaseUrl: scene.scratch.url, dataDir: "", poolMax: POOL });
    // Usage is written when the test flushes.
    const gw = await scene.gateway(db);
    let lock: { unlock(): Promise<void> } | undefined;
    try {
      const org = await seedOrg(scene.held);
      expect((await me(gw.url, org.serviceKey)).status).toBe(200); // cached from now on
      lock = await lockKeys();

      const sampler = waitingSampler(scene.held, LOOKUP_LIKE);
      const flood = await Promise.all(Array.from({ length: FLOOD }, () => me(gw.url, randomKey())));
      const most = await sampler.stop();
      // (a) The lookups waited on the server, each on its connection: at most the bound, and at it.
      // Before: all ten connections (the whole pool) waited on key lookups.
      expect({ most, codes: tally(flood) }).toEqual({ most: BOUND, codes: { "503 service_unavailable": FLOOD } });
      for (const r of flood) expect(r.ms).toBeLessThan(12_000);
      // Given up on, they are ended by the server (statement_timeout) while the lock is still held: their places are free again.
      // (A new key is refused at once only while lookups given up on are unanswered: key-verify.test.ts.)
      await until(async () => (await lookupsWaiting()) === 0, "the given-up lookups to be ended by the server", 3_000, 50);
      await until(async () => (await gauge(gw.metricsUrl as string, "gateway_key_lookups_unanswered")) === 0, "the given-up lookups to settle", 3_000, 50);

      // (b) A cached key is served, and its usage is written: a connection is left to the usage writer.
      // Before: the flush waited for a connection and failed after 5 s ("no answer from the database").
      expect((await me(gw.url, org.serviceKey)).status).toBe(200);
      const res = await fetch(`${gw.url}/v1/chat/completions`, {
        method: "POST",
        headers: { ...bearer(org.serviceKey), "content-type": "application/json" },
        body: JSON.stringify({ model: "svc-fast", max_tokens: 20, messages: [{ role: "user", content: "hello" }] }),
        signal: AbortSignal.timeout(DEADLINE_MS),
      });
      expect(res.status).toBe(200);
      const { usage } = (await res.json()) as { usage: { total_tokens: number } };
      const flushed = await gw.quota.flush().then(
        () => "written",
        (e: Error) => e.message,
      );
      const [row] = await scene.held.rows<{ requests: number; tokens: number }>(
        sql`select coalesce(sum(requests), 0)::int as requests, coalesce(sum(prompt_tokens + completion_tokens), 0)::int as tokens from usage_events where org_id = ${org.orgId}`,
      );
      expect({ flushed, row }).toEqual({ flushed: "written", row: { requests: 1, tokens: usage.total_tokens } });

      // The lock goes: unknown keys are looked up again.
      await lock.unlock();
      expect(await me(gw.url, randomKey())).toMatchObject({ status: 401, code: "unauthorized" });
      expect(await lookupsWaiting()).toBe(0);
    } finally {
      await lock?.unlock();
      await gw.stop();
      await db.close();
    }
  });

  test("a last_used_at update left unanswered is not followed by another while it is out", async () => {
    const db = await openDatabase({ databaseUrl: scene.scratch.url, dataDir: "", poolMax: POOL });
    // Flushed only when the test says so.
    const verifier = createKeyVerifier(db, { ttlMs: 60_000, max: 100, negativeTtlMs: 5_000, negativeMax: 100, lastUsedFlushMs: 600_000 });
    let lock: { unlock(): Promise<void> } | undefined;
    const updatesWaiting = async () => {
      const [r] = await scene.held.rows<{ n: number }>(
        sql`select count(*)::int as n from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock' and query like 'update api_keys%last_used_at%'`,
      );
      return r?.n ?? -1;
    };
    try {
      const org = await seedOrg(scene.held);
      lock = await lockKeys();
      verifier.markUsed(org.serviceKeyId);
      const t = Date.now();
      await verifier.flushLastUsed(); // given up on after ANSWER_TIMEOUT_MS; still waiting on the server
      expect(Date.now() - t).toBeGreaterThanOrEqual(ANSWER_TIMEOUT_MS - 100);
      verifier.markUsed(org.personalKeyId);
      await verifier.flushLastUsed();
      // The second flush is skipped while the first is unanswered, or sent once the server has ended the first
      // (statement_timeout, a moment after the give-up): never two at once. Before: the second update was sent on a
      // second connection and waited there too (2).
      expect(await updatesWaiting()).toBeLessThanOrEqual(1);
      // Whichever waits is ended by the server while the lock is still held.
      await until(async () => (await updatesWaiting()) === 0, "the held update to be ended by the server", ANSWER_TIMEOUT_MS + 3_000, 20);
      await lock.unlock();
      // The next flush writes what the skipped or ended ones kept.
      await until(
        async () => {
          await verifier.flushLastUsed();
          const [r] = await scene.held.rows<{ n: number }>(sql`select count(*)::int as n from api_keys where org_id = ${org.orgId} and last_used_at is not null`);
          return r?.n === 2;
        },
        "both keys' last_used_at written",
        10_000,
        50,
      );
    } finally {
      await lock?.unlock();
      await verifier.stop();
      await db.close();
    }
  });
});
