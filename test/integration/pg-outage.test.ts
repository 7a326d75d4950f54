import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { sql } from "drizzle-orm";
import postgres from "postgres";
import { createKey, revokeKey } from "../../src/admin/service.ts";
import { type Database, migrate, openDatabase } from "../../src/db/client.ts";
import type { Gateway } from "../../src/server.ts";
import { TEST_DATABASE_URL, bearer, errorOf, seedOrg, startTestGateway } from "../helpers/harness.ts";
import { createScratchDatabase, type ScratchPostgres } from "../helpers/process.ts";
import { eventually, until } from "../helpers/poll.ts";

setDefaultTimeout(60_000);

/**
 * The key store unreachable (issue 18), on Postgres only: the gateway's
 * connections are terminated and new ones refused (`ALTER DATABASE …
 * ALLOW_CONNECTIONS false`, from another database), which needs no server
 * restart. The test keeps one connection of its own open to make changes the
 * gateway cannot hear about.
 *
 * Claims (README "Decisions"): a cached key keeps working up to 10 × the cache
 * TTL; a key not in the cache gets 503, never admission; the LISTEN
 * connection re-subscribes and re-verifies cached keys.
 */

const KEY_CACHE = { max: 1_000, negativeTtlMs: 5_000, negativeMax: 1_000, unknownPerPrefixPerMin: 1_000, unknownPerMin: 10_000 };

describe.skipIf(!TEST_DATABASE_URL)("key store unreachable: connections cut and refused", () => {
  let scratch: ScratchPostgres;
  let name: string;
  /** The test's own connection, kept open through the outage. */
  let held: Database;
  let heldPid: number;
  let admin: postgres.Sql;

  beforeAll(async () => {
    scratch = await createScratchDatabase(TEST_DATABASE_URL as string, "gw_outage");
    name = new URL(scratch.url).pathname.slice(1);
    held = await openDatabase({ databaseUrl: scratch.url, dataDir: "", poolMax: 1 });
    await migrate(held);
    const [row] = await held.rows<{ pid: number }>(sql`select pg_backend_pid() as pid`);
    heldPid = Number(row?.pid);
    admin = postgres(TEST_DATABASE_URL as string, { max: 1, onnotice: () => {} });
  });
  afterAll(async () => {
    await admin?.unsafe(`alter database "${name}" allow_connections true`).catch(() => {});
    await admin?.end({ timeout: 5 });
    await held?.close();
    await scratch?.drop();
  });

  /** Terminate every connection to the scratch database but the test's own, and refuse new ones. */
  async function cut() {
    await admin.unsafe(`alter database "${name}" allow_connections false`);
    await admin`select pg_terminate_backend(pid) from pg_stat_activity where datname = ${name} and pid <> ${heldPid}`;
  }
  async function restore() {
    await admin.unsafe(`alter database "${name}" allow_connections true`);
  }

  async function startOn(ttlMs: number): Promise<{ gw: Gateway; db: Database }> {
    const db = await openDatabase({ databaseUrl: scratch.url, dataDir: "", poolMax: 4 });
    const gw = await startTestGateway({ keyCache: { ttlMs, ...KEY_CACHE }, plans: { Standard: { requestsPerMinute: 1_000_000 } } }, db);
    return { gw, db };
  }

  const randomKey = () => `sk-gw-${[...randomBytes(43)].map((b) => "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"[b % 62]).join("")}`;

  /** GET /v1/me with a deadline: no request may hang while the database is away. */
  async function me(gw: Gateway, key: string): Promise<{ status: number; code: string | null }> {
    const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(key), signal: AbortSignal.timeout(15_000) });
    if (res.status !== 200) return { status: res.status, code: (await errorOf(res)).code };
    await res.arrayBuffer();
    return { status: res.status, code: null };
  }

  test("a cached key works up to 10 × the TTL, then 503; a key not in the cache gets 503, never admission", async () => {
    // 10 × TTL = 10 s: room enough for the steps that must happen before it on a busy machine.
    const TTL = 1_000;
    const { gw, db } = await startOn(TTL);
    try {
      const org = await seedOrg(held);
      const uncached = await createKey(held, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" });
      const tWarm = Date.now();
      expect(await me(gw, org.personalKey)).toEqual({ status: 200, code: null }); // looked up now: cached at or after tWarm
      await cut();
      const tCut = Date.now();
      // Past the TTL: the entry is stale, the refresh fails, the stale entry serves.
      await Bun.sleep(TTL + 100);
      expect(await me(gw, org.personalKey)).toEqual({ status: 200, code: null });
      for (const key of [uncached.key, randomKey()]) expect(await me(gw, key)).toEqual({ status: 503, code: "service_unavailable" });
      // Until 10 × TTL after it was fetched, then 503.
      let firstRefusal: number | undefined;
      while (firstRefusal === undefined && Date.now() - tCut < 10 * TTL + 10_000) {
        const r = await me(gw, org.personalKey);
        if (r.status !== 200) {
          expect(r).toEqual({ status: 503, code: "service_unavailable" });
          firstRefusal = Date.now();
        } else await Bun.sleep(50);
      }
      expect(firstRefusal).toBeDefined();
      expect((firstRefusal ?? 0) - tWarm).toBeGreaterThanOrEqual(10 * TTL);
      // …and not much later: it was fetched before the cut, so by 10 × TTL after the cut, with 5 s of slack for a busy machine.
      expect((firstRefusal ?? 0) - tCut).toBeLessThan(15 * TTL);
      await restore();
      // Back: the key is looked up again and works; the uncached one is admitted now that it can be verified.
      await until(async () => (await me(gw, org.personalKey)).status === 200, "the key to work again after the outage", 20_000, 50);
      expect(await me(gw, org.personalKey)).toEqual({ status: 200, code: null });
      expect(await me(gw, uncached.key)).toEqual({ status: 200, code: null });
    } finally {
      await restore();
      await gw.stop();
      await db.close();
    }
  });

  test("LISTEN re-subscribes and re-verifies cached keys: a revocation made while it was away takes effect", async () => {
    const { gw, db } = await startOn(600_000); // entries never age out during the test: only re-verification can evict them
    try {
      const org = await seedOrg(held);
      const later = await createKey(held, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" });
      for (const key of [org.personalKey, org.serviceKey, later.key]) expect((await me(gw, key)).status).toBe(200);
      await cut();
      // Through the test's own connection: the NOTIFY goes out, but the gateway's LISTEN connection is gone.
      await revokeKey(held, org.serviceKeyId);
      expect(await me(gw, org.serviceKey)).toEqual({ status: 200, code: null }); // cached, and nothing says otherwise yet
      await restore();
      const r = await eventually(() => me(gw, org.serviceKey), (v) => v.status !== 200, "the revoked key refused after re-verification", 30_000, 50);
      expect(r).toEqual({ status: 401, code: "unauthorized" });
      expect(await me(gw, org.personalKey)).toEqual({ status: 200, code: null });
      // And the re-subscribed channel delivers: a revocation after the outage arrives at once (within
      // 5 s here, for a busy machine; entries never age out, so only the NOTIFY can do it).
      await revokeKey(held, later.id);
      const t = Date.now();
      await until(async () => (await me(gw, later.key)).status !== 200, "the revocation after the outage", 10_000, 10);
      expect(Date.now() - t).toBeLessThan(5_000);
      expect(await me(gw, later.key)).toEqual({ status: 401, code: "unauthorized" });
    } finally {
      await restore();
      await gw.stop();
      await db.close();
    }
  });
});
