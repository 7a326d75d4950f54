import { describe, expect, setDefaultTimeout, test } from "bun:test";
import { sql } from "drizzle-orm";
import { createKey } from "../../src/admin/service.ts";
import { openDatabase } from "../../src/db/client.ts";
import { TEST_DATABASE_URL, bearer, seedOrg } from "../helpers/harness.ts";
import { gaugeOf, lockTable, sessionsWaiting, timedCall, useScene } from "../helpers/pg-locks.ts";
import { until } from "../helpers/poll.ts";

setDefaultTimeout(90_000);

/**
 * Security audit writes during a flood (docs/decisions.md, Security audit
 * writes are bounded): credential stuffing with many expired or revoked keys
 * writes one `security.*` event per key a minute, off the request path. With
 * `audit_events` locked (or the database slow), each write waited on its
 * own pool connection for up to 5 s (statement_timeout) and the rest queued
 * in the driver behind them: the flood took the whole pool from key lookups
 * and usage writes. Now at most a quarter of the pool is writing them (2 of
 * 10); the events that arrive meanwhile wait in a bounded queue and go out
 * together in the next write.
 */

const FLOOD = 40;

describe.skipIf(!TEST_DATABASE_URL)("security audit writes while audit_events is locked", () => {
  const scene = useScene("s1_security");

  test(`${FLOOD} expired keys at once: at most 2 writes wait on the lock, key lookups and the usage writer keep the pool, every event is written once the lock goes`, async () => {
    const org = await seedOrg(scene.held, { quotaTokens: 1_000_000 });
    const expired: { id: string; key: string }[] = [];
    for (let i = 0; i < FLOOD; i++) {
      expired.push(await createKey(scene.held, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: [], expiresAt: new Date(Date.now() - 1_000), tag: "gw" }));
    }
    const fresh = await createKey(scene.held, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" });
    const db = await openDatabase({ databaseUrl: scene.scratch.url, dataDir: "", poolMax: 10 });
    // Usage is written when the test flushes.
    const gw = await scene.gateway(db);
    const lock = await lockTable(scene.scratch.url, "audit_events");
    try {
      // A usage record to write later (its lease is taken now, before the flood).
      const used = await timedCall(
        `${gw.url}/v1/chat/completions`,
        { method: "POST", headers: { ...bearer(org.serviceKey), "content-type": "application/json" }, body: JSON.stringify({ model: "svc-fast", max_tokens: 5, messages: [{ role: "user", content: "hi" }] }) },
        10_000,
      );
      expect(used.status).toBe(200);

      const refused = await Promise.all(expired.map((k) => timedCall(`${gw.url}/v1/me`, { headers: bearer(k.key) }, 10_000)));
      const statuses = [...new Set(refused.map((r) => r.status))];
      let most = 0;
      const t0 = Date.now();
      while (Date.now() - t0 < 1_000) {
        most = Math.max(most, await sessionsWaiting(scene.held, "%audit_events%"));
        await Bun.sleep(50);
      }
      // The rest of the pool serves: a key not yet cached is looked up, the usage writer writes.
      const lookup = await timedCall(`${gw.url}/v1/me`, { headers: bearer(fresh.key) }, 10_000);
      const flushed = await gw.quota.flush().then(
        () => "written",
        (e: Error) => e.message,
      );
      // Before: ten sessions (the whole pool) waiting on the lock, the flood's own later lookups and the
      // fresh key's 503 after 5 s, the flush failed.
      expect({ statuses, waitingOnLock: most, lookup: lookup.status, lookupFast: lookup.ms < 3_000, flushed }).toEqual({
        statuses: [401],
        waitingOnLock: 2,
        lookup: 200,
        lookupFast: true,
        flushed: "written",
      });
      await lock.unlock();
      const written = async () => {
        const [r] = await scene.held.rows<{ n: number }>(sql`select count(*)::int as n from audit_events where org_id = ${org.orgId} and action = 'security.expired_key_used'`);
        return r?.n ?? 0;
      };
      await until(async () => (await written()) === FLOOD, `all ${FLOOD} security events written`, 15_000, 100);
      expect(await gaugeOf(gw.metricsUrl as string, "gateway_security_events_dropped_total", 5_000)).toBe(0);
    } finally {
      await lock.unlock();
      await gw.stop();
      await db.close();
    }
  });
});
