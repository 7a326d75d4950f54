import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { createKey, createUser, revokeKey, setOrg } from "../../src/admin/service.ts";
import { type Database, openDatabase } from "../../src/db/client.ts";
import type { Gateway } from "../../src/server.ts";
import { TEST_DATABASE_URL, bearer, seedOrg, sharedDatabase, startTestGateway, type SeededOrg } from "../helpers/harness.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Authentication and authorisation on the App API (spec 4.4, 4.5, 5, 7),
 * written once and run against both endpoints, through real HTTP on a gateway
 * with the default plan limits (Standard 60, Ultra 300 requests a minute).
 *
 * Order of checks (README "Decisions"): browser-looking request → key present,
 * well-formed, known, not revoked → not expired → scope and key kind →
 * academy-only → rate limit → parameters.
 */

let gw: Gateway;
let db: Database;

beforeAll(async () => {
  gw = await startTestGateway();
  db = gw.database;
});
afterAll(async () => {
  await gw.stop();
});

const FAKE_KEY = `sk-gw-${"A".repeat(43)}`;

interface Endpoint {
  name: string;
  path: string;
  /** A key of `org` the endpoint accepts. */
  goodKey(org: SeededOrg): string;
  /** Keys of `org` refused with scope_missing (created on demand). */
  scopeMissingKeys(org: SeededOrg): Promise<{ why: string; key: string }[]>;
  /** Scopes that make a service key acceptable here. */
  scopes: string[];
  /** A service key of `org` that carries every scope except the one required here. */
  wrongScope: string[];
}

const ENDPOINTS: Endpoint[] = [
  {
    name: "GET /v1/me",
    path: "/v1/me",
    goodKey: (o) => o.personalKey,
    scopes: ["inference"],
    wrongScope: ["audit:read", "agents:run", "usage:export"],
    async scopeMissingKeys(o) {
      const k = await createKey(db, { orgId: o.orgId, kind: "service", scopes: ["audit:read"], knownModels: [], tag: "gw" });
      return [{ why: "a service key without inference", key: k.key }];
    },
  },
  {
    name: "GET /v1/audit-events",
    path: "/v1/audit-events",
    goodKey: (o) => o.serviceKey,
    scopes: ["audit:read"],
    wrongScope: ["inference", "usage:export", "members:invite"],
    async scopeMissingKeys(o) {
      const k = await createKey(db, { orgId: o.orgId, kind: "service", scopes: ["inference", "usage:export"], knownModels: [], tag: "gw" });
      return [
        { why: "a personal key (service keys only)", key: o.personalKey },
        { why: "a service key without audit:read", key: k.key },
      ];
    },
  },
];

function call(path: string, headers: Record<string, string> = {}, init: RequestInit = {}): Promise<Response> {
  return fetch(`${gw.url}${path}`, { ...init, headers });
}

/** The wire error shape, exactly. */
async function expectError(res: Response, status: number, code: string, type: string) {
  expect(res.status).toBe(status);
  expect(res.headers.get("content-type")).toContain("application/json");
  expect(res.headers.get("access-control-allow-origin")).toBeNull();
  const body = (await res.json()) as { error: { message: string; type: string; param: string | null; code: string } };
  expect(body).toEqual({ error: { message: expect.any(String), type, param: null, code } });
  return body.error.message;
}

async function expiredKey(org: SeededOrg, scopes: string[], kind: "personal" | "service" = "service") {
  return createKey(db, {
    orgId: org.orgId,
    kind,
    ...(kind === "personal" ? { userId: org.userId } : {}),
    scopes,
    knownModels: [],
    expiresAt: new Date(Date.now() - 60_000),
    tag: "gw",
  });
}

for (const ep of ENDPOINTS) {
  describe(ep.name, () => {
    let org: SeededOrg;
    beforeAll(async () => {
      org = await seedOrg(db);
    });

    test("a valid key gets 200", async () => {
      const res = await call(ep.path, bearer(ep.goodKey(org)));
      expect(res.status).toBe(200);
    });

    test("401 unauthorized: missing, malformed, unknown key; the key is never echoed", async () => {
      const cases: Record<string, string>[] = [
        {},
        { authorization: "" },
        { authorization: "Bearer" },
        { authorization: "Bearer " },
        { authorization: "Basic dXNlcjpwYXNz" },
        { authorization: "Bearer nope" },
        { authorization: `Bearer ${ep.goodKey(org)}x` },
        { authorization: `Bearer ${ep.goodKey(org).replace("sk-gw-", "sk-xx-")}` },
        { authorization: `Token ${ep.goodKey(org)}` },
        bearer(FAKE_KEY),
      ];
      for (const headers of cases) {
        const message = await expectError(await call(ep.path, headers), 401, "unauthorized", "authentication_error");
        expect(message).not.toContain(ep.goodKey(org).slice(6));
        expect(message).not.toContain(FAKE_KEY);
      }
    });

    test("401 unauthorized: a revoked key, with the advice to create a new key", async () => {
      const k = await createKey(db, { orgId: org.orgId, kind: "service", scopes: ep.scopes, knownModels: [], tag: "gw" });
      expect((await call(ep.path, bearer(k.key))).status).toBe(200);
      await revokeKey(db, k.id);
      await Bun.sleep(100);
      const message = await expectError(await call(ep.path, bearer(k.key)), 401, "unauthorized", "authentication_error");
      expect(message).toContain("create a new key");
      expect(message).not.toContain(k.key);
    });

    test("401 key_expired: an expired key, with the advice to create a new key", async () => {
      const k = await expiredKey(org, ep.scopes);
      const message = await expectError(await call(ep.path, bearer(k.key)), 401, "key_expired", "authentication_error");
      expect(message).toContain("create a new key");
      expect(message).not.toContain(k.key);
    });

    test("403 scope_missing", async () => {
      for (const { key } of await ep.scopeMissingKeys(org)) {
        await expectError(await call(ep.path, bearer(key)), 403, "scope_missing", "permission_error");
      }
      const k = await createKey(db, { orgId: org.orgId, kind: "service", scopes: ep.wrongScope, knownModels: [], tag: "gw" });
      await expectError(await call(ep.path, bearer(k.key)), 403, "scope_missing", "permission_error");
    });

    test("403 browser_request_rejected: Origin, Sec-Fetch-*, Cookie; with or without a key", async () => {
      const browserHeaders: Record<string, string>[] = [
        { origin: "https://evil.example" },
        { origin: "null" },
        { "sec-fetch-site": "cross-site" },
        { "sec-fetch-mode": "cors" },
        { "sec-fetch-dest": "empty" },
        { cookie: "session=abc" },
      ];
      for (const extra of browserHeaders) {
        for (const auth of [bearer(ep.goodKey(org)), {}, bearer(FAKE_KEY)]) {
          await expectError(await call(ep.path, { ...auth, ...extra }), 403, "browser_request_rejected", "permission_error");
        }
      }
    });

    test("an OPTIONS preflight gets 403 browser_request_rejected and no CORS headers", async () => {
      const res = await call(ep.path, { origin: "https://app.example", "access-control-request-method": "GET", "access-control-request-headers": "authorization" }, { method: "OPTIONS" });
      await expectError(res, 403, "browser_request_rejected", "permission_error");
      expect(res.headers.get("access-control-allow-headers")).toBeNull();
    });

    test("429 rate_limit_error after 60 requests a minute for a Standard organisation", async () => {
      const o = await seedOrg(db, { plan: "Standard" });
      const key = ep.goodKey(o);
      for (let i = 0; i < 60; i++) {
        const res = await call(ep.path, bearer(key));
        expect(res.status).toBe(200);
        expect(res.headers.get("x-ratelimit-remaining-requests")).toBe(String(59 - i));
      }
      const res = await call(ep.path, bearer(key));
      const retryAfter = Number(res.headers.get("retry-after"));
      expect(retryAfter).toBeGreaterThanOrEqual(1);
      expect(retryAfter).toBeLessThanOrEqual(60);
      expect(res.headers.get("x-ratelimit-limit-requests")).toBe("60");
      expect(res.headers.get("x-ratelimit-remaining-requests")).toBe("0");
      const message = await expectError(res, 429, "rate_limit_error", "rate_limit_error");
      expect(message).not.toContain("budget_exceeded");
      // The limit is per organisation: another organisation is unaffected.
      const other = await seedOrg(db, { plan: "Standard" });
      expect((await call(ep.path, bearer(ep.goodKey(other)))).status).toBe(200);
    });
  });
}

describe("academy-only accounts", () => {
  test("GET /v1/me: 403 academy_only", async () => {
    const o = await seedOrg(db, { academyOnly: true });
    await expectError(await call("/v1/me", bearer(o.personalKey)), 403, "academy_only", "permission_error");
    await expectError(await call("/v1/me", bearer(o.serviceKey)), 403, "academy_only", "permission_error");
  });

  test("GET /v1/audit-events: 403 academy_only too (the same checks on every endpoint)", async () => {
    const o = await seedOrg(db, { academyOnly: true });
    await expectError(await call("/v1/audit-events", bearer(o.serviceKey)), 403, "academy_only", "permission_error");
  });

  test("an academy-only user's personal key in a platform organisation", async () => {
    const o = await seedOrg(db);
    const u = await createUser(db, { orgId: o.orgId, name: "Learner", email: `l-${crypto.randomUUID().slice(0, 8)}@example.com`, academyOnly: true });
    const k = await createKey(db, { orgId: o.orgId, userId: u.id, kind: "personal", scopes: ["inference"], knownModels: [], tag: "gw" });
    await expectError(await call("/v1/me", bearer(k.key)), 403, "academy_only", "permission_error");
  });
});

describe("order of checks", () => {
  test("browser before key: a browser request is 403 whatever key it carries", async () => {
    const o = await seedOrg(db);
    const expired = await expiredKey(o, ["inference", "audit:read"]);
    const revoked = await createKey(db, { orgId: o.orgId, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" });
    await revokeKey(db, revoked.id);
    const scopeless = await createKey(db, { orgId: o.orgId, kind: "service", scopes: ["agents:run"], knownModels: [], tag: "gw" });
    for (const path of ["/v1/me", "/v1/audit-events"]) {
      for (const key of [expired.key, revoked.key, scopeless.key, FAKE_KEY, "garbage"]) {
        await expectError(await call(path, bearer(key, { origin: "https://x.example" })), 403, "browser_request_rejected", "permission_error");
      }
    }
    // Before routing, too: an unknown path answers the same 403, not 404.
    await expectError(await call("/v1/nowhere", { cookie: "a=b" }), 403, "browser_request_rejected", "permission_error");
  });

  test("revoked before expired: a revoked and expired key is 401 unauthorized", async () => {
    const o = await seedOrg(db);
    const k = await expiredKey(o, ["inference"]);
    await revokeKey(db, k.id);
    await Bun.sleep(50);
    await expectError(await call("/v1/me", bearer(k.key)), 401, "unauthorized", "authentication_error");
  });

  test("expiry before scope and kind: an expired key lacking the scope is 401 key_expired", async () => {
    const o = await seedOrg(db);
    const noInference = await expiredKey(o, ["audit:read"]);
    await expectError(await call("/v1/me", bearer(noInference.key)), 401, "key_expired", "authentication_error");
    const noAudit = await expiredKey(o, ["inference"]);
    await expectError(await call("/v1/audit-events", bearer(noAudit.key)), 401, "key_expired", "authentication_error");
    const personal = await expiredKey(o, ["inference"], "personal");
    await expectError(await call("/v1/audit-events", bearer(personal.key)), 401, "key_expired", "authentication_error");
  });

  test("scope before academy: an academy-only key lacking the scope is 403 scope_missing", async () => {
    const o = await seedOrg(db, { academyOnly: true });
    const k = await createKey(db, { orgId: o.orgId, kind: "service", scopes: ["audit:read"], knownModels: [], tag: "gw" });
    await expectError(await call("/v1/me", bearer(k.key)), 403, "scope_missing", "permission_error");
    await expectError(await call("/v1/audit-events", bearer(o.personalKey)), 403, "scope_missing", "permission_error");
  });

  test("academy before rate limit: refused requests never reach the limiter", async () => {
    const o = await seedOrg(db, { academyOnly: true });
    for (let i = 0; i < 65; i++) {
      const res = await call("/v1/me", bearer(o.personalKey));
      expect(res.status).toBe(403);
      await res.body?.cancel();
    }
    await expectError(await call("/v1/me", bearer(o.personalKey)), 403, "academy_only", "permission_error");
  });

  test("requests refused for scope do not use up the organisation's rate limit", async () => {
    const o = await seedOrg(db);
    for (let i = 0; i < 65; i++) {
      const res = await call("/v1/audit-events", bearer(o.personalKey));
      expect(res.status).toBe(403);
      await res.body?.cancel();
    }
    expect((await call("/v1/audit-events", bearer(o.serviceKey))).status).toBe(200);
  });

  test("rate limit before parameters, and shared by the endpoints of one organisation", async () => {
    const o = await seedOrg(db);
    for (let i = 0; i < 30; i++) expect((await call("/v1/me", bearer(o.personalKey))).status).toBe(200);
    for (let i = 0; i < 30; i++) expect((await call("/v1/audit-events", bearer(o.serviceKey))).status).toBe(200);
    await expectError(await call("/v1/audit-events?limit=0&foo=1", bearer(o.serviceKey)), 429, "rate_limit_error", "rate_limit_error");
    await expectError(await call("/v1/me", bearer(o.personalKey)), 429, "rate_limit_error", "rate_limit_error");
  });

  test("key before parameters: bad parameters with a bad key are 401", async () => {
    await expectError(await call("/v1/audit-events?limit=0&foo=1"), 401, "unauthorized", "authentication_error");
    const o = await seedOrg(db);
    const expired = await expiredKey(o, ["audit:read"]);
    await expectError(await call("/v1/audit-events?limit=0", bearer(expired.key)), 401, "key_expired", "authentication_error");
    await expectError(await call("/v1/audit-events?limit=0", bearer(o.personalKey)), 403, "scope_missing", "permission_error");
  });

  test("an Ultra organisation gets 300 a minute", async () => {
    const o = await seedOrg(db, { plan: "Ultra" });
    for (let i = 0; i < 61; i++) {
      const res = await call("/v1/me", bearer(o.personalKey));
      expect(res.status).toBe(200);
      await res.body?.cancel();
    }
    const res = await call("/v1/me", bearer(o.personalKey));
    expect(res.headers.get("x-ratelimit-limit-requests")).toBe("300");
    expect(res.headers.get("x-ratelimit-remaining-requests")).toBe("238");
  });
});

describe.skipIf(!TEST_DATABASE_URL)("two running instances on one Postgres", () => {
  let dbA: Database;
  let dbB: Database;
  let gwA: Gateway;
  let gwB: Gateway;
  beforeAll(async () => {
    dbA = await openDatabase({ databaseUrl: TEST_DATABASE_URL, dataDir: "memory://", poolMax: 4 });
    dbB = await openDatabase({ databaseUrl: TEST_DATABASE_URL, dataDir: "memory://", poolMax: 4 });
    gwA = await startTestGateway({}, dbA);
    gwB = await startTestGateway({}, dbB);
  });
  afterAll(async () => {
    await gwA.stop();
    await gwB.stop();
    await dbA.close();
    await dbB.close();
  });

  /** Milliseconds until `check` holds, polling every 10 ms for up to 2 s (Infinity if never). */
  async function timeUntil(check: () => Promise<boolean>): Promise<number> {
    const start = performance.now();
    while (performance.now() - start < 2_000) {
      if (await check()) return performance.now() - start;
      await Bun.sleep(10);
    }
    return Number.POSITIVE_INFINITY;
  }

  test("a revocation reaches the other instance within 1 s", async () => {
    const o = await seedOrg(dbA);
    for (const g of [gwA, gwB]) {
      expect((await fetch(`${g.url}/v1/me`, { headers: bearer(o.personalKey) })).status).toBe(200);
      expect((await fetch(`${g.url}/v1/audit-events`, { headers: bearer(o.serviceKey) })).status).toBe(200);
    }
    // Revoked through a third connection (the admin CLI's), so neither instance sees it locally.
    await revokeKey(await sharedDatabase(), o.serviceKeyId);
    const [msA, msB] = await Promise.all(
      [gwA, gwB].map((g) => timeUntil(async () => (await fetch(`${g.url}/v1/audit-events`, { headers: bearer(o.serviceKey) })).status === 401)),
    );
    expect(msA).toBeLessThan(1_000);
    expect(msB).toBeLessThan(1_000);
    // The other key of the organisation is untouched.
    expect((await fetch(`${gwB.url}/v1/me`, { headers: bearer(o.personalKey) })).status).toBe(200);
  });

  test("a plan change reaches the other instance within 1 s", async () => {
    const o = await seedOrg(dbA);
    expect(((await (await fetch(`${gwB.url}/v1/me`, { headers: bearer(o.personalKey) })).json()) as { organization: { plan: string } }).organization.plan).toBe("Standard");
    await setOrg(await sharedDatabase(), { id: o.orgId, plans: ["Standard", "Ultra"], plan: "Ultra" });
    const ms = await timeUntil(async () => {
      const body = (await (await fetch(`${gwB.url}/v1/me`, { headers: bearer(o.personalKey) })).json()) as { organization: { plan: string } };
      return body.organization.plan === "Ultra";
    });
    expect(ms).toBeLessThan(1_000);
  });
});
