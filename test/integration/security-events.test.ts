import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { and, eq } from "drizzle-orm";
import { createKey } from "../../src/admin/service.ts";
import { lookupKey } from "../../src/auth/key-row.ts";
import { hashKey } from "../../src/auth/keys.ts";
import { createSecurityAuditor } from "../../src/auth/security.ts";
import type { Database } from "../../src/db/client.ts";
import { auditEvents } from "../../src/db/schema.ts";
import { createLogger } from "../../src/lib/log.ts";
import type { Gateway } from "../../src/server.ts";
import { TEST_DATABASE_URL, bearer, seedOrg, startTestGateway } from "../helpers/harness.ts";

setDefaultTimeout(30_000);

/**
 * Security events' origin and rate (issue 18): the prefix of an IPv6 client
 * is its /48, an IPv4 client reaching a dual-stack listener (an IPv4-mapped
 * address) is its /24; one event per key and action a minute.
 */

let gw: Gateway;
let db: Database;
beforeAll(async () => {
  // Dual-stack: IPv4 clients arrive as ::ffff:a.b.c.d.
  gw = await startTestGateway({ host: "::" });
  db = gw.database;
}, 120_000);
afterAll(async () => {
  await gw.stop();
});

async function eventsOf(keyId: string, action: string) {
  return db.db
    .select({ prefix: auditEvents.originIpPrefix, ua: auditEvents.originUserAgentSummary })
    .from(auditEvents)
    .where(and(eq(auditEvents.actorKeyId, keyId), eq(auditEvents.action, action)));
}

/** The key's security events once at least `n` are written (written off the request path). */
async function awaitEvents(keyId: string, action: string, n: number) {
  const deadline = performance.now() + 10_000;
  let rows = await eventsOf(keyId, action);
  while (rows.length < n && performance.now() < deadline) {
    await Bun.sleep(10);
    rows = await eventsOf(keyId, action);
  }
  return rows;
}

async function expiredKey() {
  const org = await seedOrg(db);
  return createKey(db, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: [], expiresAt: new Date(Date.now() - 1_000), tag: "gw" });
}

describe("origin of security events", () => {
  test("an IPv6 client is recorded as its /48", async () => {
    const k = await expiredKey();
    const res = await fetch(`http://[::1]:${gw.port}/v1/me`, { headers: bearer(k.key, { "user-agent": "curl/8.5.0" }) });
    expect(res.status).toBe(401);
    const rows = await awaitEvents(k.id, "security.expired_key_used", 1);
    expect(rows).toEqual([{ prefix: "::/48", ua: "curl/8.5" }]);
  });

  test("an IPv4 client on a dual-stack listener (IPv4-mapped) is recorded as its /24", async () => {
    const k = await expiredKey();
    const res = await fetch(`http://127.0.0.1:${gw.port}/v1/me`, { headers: bearer(k.key) });
    expect(res.status).toBe(401);
    const rows = await awaitEvents(k.id, "security.expired_key_used", 1);
    expect(rows.map((r) => r.prefix)).toEqual(["127.0.0.0/24"]);
  });
});

describe("at most one event per key and action a minute", () => {
  test("with the auditor's clock driven by the test", async () => {
    const k = await expiredKey();
    const principal = await lookupKey(db, hashKey(k.key));
    if (!principal) throw new Error("key not found");
    let t = Date.parse("2030-01-01T00:00:00Z");
    const auditor = createSecurityAuditor(db, createLogger("silent"), () => t);
    const meta = { ip: "2001:db8:42:1::7", userAgent: null };
    const count = async (action: string) => {
      await auditor.drain();
      return (await eventsOf(k.id, action)).length;
    };
    auditor.keyRejected(principal, "security.expired_key_used", meta);
    t += 59_999;
    auditor.keyRejected(principal, "security.expired_key_used", meta);
    expect(await count("security.expired_key_used")).toBe(1);
    // Another action of the same key is its own stream.
    auditor.keyRejected(principal, "security.browser_request_rejected", meta);
    expect(await count("security.browser_request_rejected")).toBe(1);
    t += 1; // a minute after the first
    auditor.keyRejected(principal, "security.expired_key_used", meta);
    auditor.keyRejected(principal, "security.expired_key_used", meta);
    expect(await count("security.expired_key_used")).toBe(2);
    expect(new Set((await eventsOf(k.id, "security.expired_key_used")).map((r) => r.prefix))).toEqual(new Set(["2001:db8:42::/48"]));
  });
});

describe("security audit events beyond the bound (docs/decisions.md, Security audit writes are bounded)", () => {
  test("events that find the writes busy and the queue full are dropped, counted and logged once; the rest are written together", async () => {
    const k = await expiredKey();
    const principal = await lookupKey(db, hashKey(k.key));
    if (!principal) throw new Error("key not found");
    const lines: string[] = [];
    const auditor = createSecurityAuditor(db, createLogger("warn", (l) => lines.push(l)), Date.now, { maxQueued: 5 });
    const meta = { ip: "192.0.2.7", userAgent: null };
    // 20 distinct keys in one turn of the event loop: no write can finish before the last arrives.
    const ids = Array.from({ length: 20 }, () => crypto.randomUUID());
    for (const keyId of ids) auditor.keyRejected({ ...principal, keyId }, "security.revoked_key_used", meta);
    const s = auditor.stats();
    // The embedded database takes one write at a time, a pool of 10 two (a quarter).
    const writing = TEST_DATABASE_URL ? 2 : 1;
    expect(s).toEqual({ writing, queued: 5, dropped: 20 - writing - 5 });
    const dropLines = lines.filter((l) => l.includes("security audit events dropped"));
    expect(dropLines.length).toBe(1);
    await auditor.drain();
    const rows = await db.db
      .select({ keyId: auditEvents.actorKeyId })
      .from(auditEvents)
      .where(and(eq(auditEvents.orgId, principal.orgId), eq(auditEvents.action, "security.revoked_key_used")));
    expect(new Set(rows.map((r) => r.keyId))).toEqual(new Set(ids.slice(0, writing + 5)));
    expect(auditor.stats()).toEqual({ writing: 0, queued: 0, dropped: 20 - writing - 5 });
  });
});
