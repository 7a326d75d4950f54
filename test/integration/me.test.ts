import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { createKey, revokeKey } from "../../src/admin/service.ts";
import type { Gateway } from "../../src/server.ts";
import { bearer, errorOf, seedOrg, sharedDatabase, startTestGateway, type SeededOrg } from "../helpers/harness.ts";
import { expectKeyInfo } from "../helpers/spec-types.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

let gw: Gateway;
let org: SeededOrg;

beforeAll(async () => {
  gw = await startTestGateway();
  org = await seedOrg(gw.database);
});
afterAll(async () => {
  await gw.stop();
});

describe("GET /v1/me", () => {
  test("returns exactly the spec 2.5 fields for a personal key", async () => {
    const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(org.personalKey) });
    expect(res.status).toBe(200);
    expect(res.headers.get("x-request-id")).toMatch(/^req_/);
    const body = expectKeyInfo(await res.json());
    expect(body).toEqual({
      key: { id: org.personalKeyId, kind: "personal", scopes: ["inference"], expires_at: expect.any(String) },
      organization: { id: org.orgId, plan: "Standard" },
    });
  });

  test("a key made without an expiry reports one: the default lifetime of 365 days", async () => {
    const made = Date.now();
    const k = await createKey(await sharedDatabase(), { orgId: org.orgId, kind: "service", scopes: ["inference", "audit:read"], knownModels: [], tag: "gw" });
    const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(k.key) });
    expect(res.status).toBe(200);
    const body = expectKeyInfo(await res.json());
    expect(body.key.expires_at).toBe(k.expires_at);
    expect(Math.abs(Date.parse(body.key.expires_at) - (made + 365 * 86_400_000))).toBeLessThan(60_000);
  });

  test("expires_at is ISO 8601 UTC with milliseconds", async () => {
    const k = await createKey(await sharedDatabase(), {
      orgId: org.orgId,
      kind: "service",
      scopes: ["inference"],
      knownModels: [],
      expiresAt: new Date("2099-01-31T09:00:00Z"),
      tag: "gw",
    });
    const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(k.key) });
    const body = expectKeyInfo(await res.json());
    expect(body.key.expires_at).toBe("2099-01-31T09:00:00.000Z");
  });

  test("missing, malformed and unknown keys get 401 unauthorized", async () => {
    for (const headers of [{}, { authorization: "Bearer nope" }, bearer(`sk-gw-${"A".repeat(43)}`), { authorization: "Basic abc" }]) {
      const res = await fetch(`${gw.url}/v1/me`, { headers });
      expect(res.status).toBe(401);
      expect((await errorOf(res)).code).toBe("unauthorized");
    }
  });

  test("a revoked key gets 401 unauthorized at once", async () => {
    const db = await sharedDatabase();
    const k = await createKey(db, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" });
    const ok = await fetch(`${gw.url}/v1/me`, { headers: bearer(k.key) });
    expect(ok.status).toBe(200);
    expectKeyInfo(await ok.json());
    await revokeKey(db, k.id);
    // NOTIFY is delivered asynchronously: poll, within the 1 s budget.
    const deadline = performance.now() + 1_000;
    let res = await fetch(`${gw.url}/v1/me`, { headers: bearer(k.key) });
    while (res.status === 200 && performance.now() < deadline) {
      await Bun.sleep(10);
      res = await fetch(`${gw.url}/v1/me`, { headers: bearer(k.key) });
    }
    expect(res.status).toBe(401);
    const err = await errorOf(res);
    expect(err.code).toBe("unauthorized");
    expect(err.message).not.toContain(k.key);
  });

  test("a key revoked from a host whose clock runs ahead is refused at once too", async () => {
    const db = await sharedDatabase();
    const own = await seedOrg(db); // its own rate limit: the polling below must not run into the organisation's 60 a minute
    const k = await createKey(db, { orgId: own.orgId, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" });
    expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(k.key) })).status).toBe(200);
    // `gateway keys revoke` stamps revoked_at with its own clock; here it runs 10 minutes ahead of the gateway's.
    await revokeKey(db, k.id, new Date(Date.now() + 600_000));
    const deadline = performance.now() + 1_000;
    let res = await fetch(`${gw.url}/v1/me`, { headers: bearer(k.key) });
    while (res.status === 200 && performance.now() < deadline) {
      await Bun.sleep(50);
      res = await fetch(`${gw.url}/v1/me`, { headers: bearer(k.key) });
    }
    expect(res.status).toBe(401);
    expect((await errorOf(res)).code).toBe("unauthorized");
  });

  test("an expired key gets 401 key_expired", async () => {
    const k = await createKey(await sharedDatabase(), {
      orgId: org.orgId,
      kind: "service",
      scopes: ["inference"],
      knownModels: [],
      expiresAt: new Date(Date.now() - 1000),
      tag: "gw",
    });
    const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(k.key) });
    expect(res.status).toBe(401);
    const err = await errorOf(res);
    expect(err.code).toBe("key_expired");
    expect(err.message).toContain("create a new key");
  });

  test("a key without the inference scope gets 403 scope_missing", async () => {
    const k = await createKey(await sharedDatabase(), { orgId: org.orgId, kind: "service", scopes: ["audit:read"], knownModels: [], tag: "gw" });
    const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(k.key) });
    expect(res.status).toBe(403);
    expect((await errorOf(res)).code).toBe("scope_missing");
  });

  test("an academy-only organisation gets 403 academy_only", async () => {
    const academy = await seedOrg(await sharedDatabase(), { academyOnly: true });
    const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(academy.personalKey) });
    expect(res.status).toBe(403);
    expect((await errorOf(res)).code).toBe("academy_only");
  });

  test("browser-looking requests get 403 browser_request_rejected, before the key is checked", async () => {
    const browserHeaders: Record<string, string>[] = [{ origin: "https://evil.example" }, { "sec-fetch-mode": "cors", "sec-fetch-site": "cross-site" }, { cookie: "session=1" }];
    for (const extra of browserHeaders) {
      for (const headers of [bearer(org.personalKey, extra), extra]) {
        const res = await fetch(`${gw.url}/v1/me`, { headers });
        expect(res.status).toBe(403);
        expect(res.headers.get("access-control-allow-origin")).toBeNull();
        expect((await errorOf(res)).code).toBe("browser_request_rejected");
      }
    }
  });

  test("an OPTIONS preflight gets the same 403", async () => {
    const res = await fetch(`${gw.url}/v1/me`, { method: "OPTIONS", headers: { origin: "https://app.example", "access-control-request-method": "GET" } });
    expect(res.status).toBe(403);
    expect((await errorOf(res)).code).toBe("browser_request_rejected");
  });

  test("an x-request-id sent by the caller is echoed", async () => {
    const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(org.personalKey, { "x-request-id": "trace-123" }) });
    expect(res.headers.get("x-request-id")).toBe("trace-123");
  });
});
