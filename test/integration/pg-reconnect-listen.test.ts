import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import postgres from "postgres";
import { createKey, revokeKey } from "../../src/admin/service.ts";
import { ANSWER_TIMEOUT_MS, type Database, LISTEN_CHECK_MS, migrate, openDatabase } from "../../src/db/client.ts";
import { TEST_DATABASE_URL, bearer, seedOrg, startTestGateway } from "../helpers/harness.ts";
import { until } from "../helpers/poll.ts";
import { createScratchDatabase, type ScratchPostgres } from "../helpers/process.ts";

setDefaultTimeout(120_000);

/**
 * The LISTEN session ended by the server (pg_terminate_backend: a failover, a
 * pooler recycling backends), again and again, and at the moment it
 * re-subscribes: between the new session's connect and its LISTEN statements.
 * postgres.js opens a new session and LISTENs again on every channel; the
 * gateway then re-verifies every cached key (a revocation may have been
 * missed meanwhile). The promise (docs/decisions.md, "Postgres connection
 * lost"; "A LISTEN connection that dies without a word"): a key revoked while
 * the session was away is refused once it is back, and one revoked after is
 * refused within the probe's bound (LISTEN_CHECK_MS + ANSWER_TIMEOUT_MS, with
 * slack), never at the cache TTL (10 minutes here, so only the NOTIFY or the
 * re-verification can evict an entry).
 *
 * Postgres only: the embedded database (PGlite) delivers NOTIFY in-process,
 * with no session the server could end.
 */

const KEY_CACHE = { ttlMs: 600_000, max: 1_000, negativeTtlMs: 5_000, negativeMax: 1_000, unknownPerPrefixPerMin: 1_000, unknownPerMin: 10_000 };
/** How soon a revocation must reach the instance: the dead-channel probe's bound plus 5 s for a busy machine. */
const BOUND_MS = LISTEN_CHECK_MS + ANSWER_TIMEOUT_MS + 5_000;

describe.skipIf(!TEST_DATABASE_URL)("Postgres only (PGlite has no LISTEN session to end): the LISTEN session killed, also while re-subscribing", () => {
  let scratch: ScratchPostgres;
  let name: string;
  /** The test's own connection: revocations are made through it. */
  let held: Database;
  let admin: postgres.Sql;

  beforeAll(async () => {
    scratch = await createScratchDatabase(TEST_DATABASE_URL as string, "gw_listen_kill");
    name = new URL(scratch.url).pathname.slice(1);
    held = await openDatabase({ databaseUrl: scratch.url, dataDir: "", poolMax: 1 });
    await migrate(held);
    admin = postgres(TEST_DATABASE_URL as string, { max: 1, onnotice: () => {} });
  });
  afterAll(async () => {
    await admin?.end({ timeout: 5 });
    await held?.close();
    await scratch?.drop();
  });

  const sessions = () => admin<{ pid: number; query: string }[]>`select pid, query from pg_stat_activity where datname = ${name}`;

  // 0 ms: killed as soon as the new session shows (often before its LISTEN); later: around the LISTEN statements.
  for (const delayMs of [0, 3, 10, 30]) {
    test(`killed 6 times, each new session again ${delayMs} ms after it shows: revocations during and after are honoured`, async () => {
      const db = await openDatabase({ databaseUrl: scratch.url, dataDir: "", poolMax: 4 });
      const gw = await startTestGateway({ keyCache: KEY_CACHE, plans: { Standard: { requestsPerMinute: 1_000_000 } } }, db);
      try {
        const org = await seedOrg(held);
        const later = await createKey(held, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" });
        const me = async (key: string) => (await fetch(`${gw.url}/v1/me`, { headers: bearer(key), signal: AbortSignal.timeout(20_000) })).status;
        for (const key of [org.serviceKey, org.personalKey, later.key]) expect(await me(key)).toBe(200);

        // Every session of the database but the LISTEN one (the test's own, the gateway's pool) is left alone;
        // no request is made during the kills, so the pool opens none.
        const before = await sessions();
        const listening = before.filter((s) => s.query.toLowerCase().startsWith("listen"));
        expect(listening).toHaveLength(1);
        const spared = new Set(before.filter((s) => !s.query.toLowerCase().startsWith("listen")).map((s) => s.pid));
        const ended = new Set<number>();
        for (let round = 0; round < 6; round++) {
          for (const s of await sessions()) {
            if (spared.has(s.pid) || ended.has(s.pid)) continue;
            ended.add(s.pid);
            await admin`select pg_terminate_backend(${s.pid})`;
          }
          // Made while the listening session is away: its NOTIFY may never reach the instance.
          if (round === 2) await revokeKey(held, org.serviceKeyId);
          // The next session, ended at the next round `delayMs` after it shows (while it connects or LISTENs).
          await until(async () => (await sessions()).some((s) => !spared.has(s.pid) && !ended.has(s.pid)), "a new LISTEN session", 10_000, 1);
          if (delayMs > 0) await Bun.sleep(delayMs);
        }
        expect(ended.size).toBeGreaterThanOrEqual(6);

        // Back: the key revoked while the session was away is refused (re-verification)...
        const t0 = Date.now();
        await until(async () => (await me(org.serviceKey)) === 401, "the key revoked during the kills refused", BOUND_MS + 5_000, 50);
        expect(Date.now() - t0).toBeLessThan(BOUND_MS);
        expect(await me(org.personalKey)).toBe(200);
        // ...and the channel delivers: a key revoked now is refused within the bound, not at the TTL.
        await until(async () => (await sessions()).some((s) => s.query.toLowerCase().startsWith("listen")), "LISTEN again", 10_000, 20);
        await revokeKey(held, later.id);
        const t1 = Date.now();
        await until(async () => (await me(later.key)) === 401, "the key revoked after the kills refused", BOUND_MS + 5_000, 20);
        expect(Date.now() - t1).toBeLessThan(BOUND_MS);
        expect(await me(org.personalKey)).toBe(200);
      } finally {
        await gw.stop();
        await db.close();
      }
    });
  }
});
