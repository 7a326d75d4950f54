import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { createKey, revokeKey } from "../../src/admin/service.ts";
import { openDatabase, migrate, type Database } from "../../src/db/client.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { TEST_DATABASE_URL, bearer, errorOf, type SeededOrg, seedOrg, startTestGateway } from "../helpers/harness.ts";
import { startFreezeProxy } from "../helpers/freeze-proxy.ts";
import { until } from "../helpers/poll.ts";
import { createScratchDatabase } from "../helpers/process.ts";
import { chatOn, seedTestOrg, TEST_PLANS, testAliases } from "./inference-fixtures.ts";
import { scrapeOf, sample } from "../helpers/scrape.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(90_000);

/**
 * Claims of README.md, docs/operations.md and docs/decisions.md that the
 * earlier rounds (claims-*.test.ts) left without a test able to fail on them.
 * Each test names the claim it holds; each was shown failing against a
 * mutation of src/ that breaks its claim (see the commit messages).
 */

let gw: Gateway;
let sim: Simulator;
let org: SeededOrg;

// The simulator sends a JSON answer's headers with the whole answer: after TTFT and every token (~1 s).
const TTFT_MS = 600;
const GAP_MS = 200;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: TTFT_MS, interTokenMs: GAP_MS, completionTokens: 3 });
  gw = await startTestGateway({ aliases: testAliases(sim.url), plans: TEST_PLANS, quota: { flushMs: 600_000 } });
  org = await seedTestOrg(gw.database);
});
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

const chat = chatOn;

describe("gateway_upstream_first_byte_seconds{alias} (docs/operations.md: upstream time to headers)", () => {
  test("a JSON answer whose headers take ~0.8 s adds about that to the histogram, no more than the whole request took", async () => {
    const series = "gateway_upstream_first_byte_seconds_sum";
    const before = await scrapeOf(gw);
    const t0 = performance.now();
    const json = await chat(gw, org.serviceKey);
    expect(json.status).toBe(200);
    await json.arrayBuffer();
    const jsonTook = (performance.now() - t0) / 1000;
    const afterJson = await scrapeOf(gw);
    const jsonAdded = sample(afterJson, series, { alias: "svc-fast" }) - sample(before, series, { alias: "svc-fast" });
    // The upstream sent its headers only after TTFT and every token.
    expect(jsonAdded).toBeGreaterThanOrEqual((TTFT_MS + GAP_MS) / 1000 - 0.05);
    expect(jsonAdded).toBeLessThanOrEqual(jsonTook + 0.05);

  });
});

describe("refusals before the limiter do not count (docs/decisions.md, Rate limits: requests refused before the limiter (bad key, missing scope) do not)", () => {
  test("70 requests each with a revoked key, an expired key, a key lacking the scope, and of an academy-only account: the organisation's window is untouched (59 left after one admitted request)", async () => {
    const knownModels = ["svc-fast", "svc-smart", "svc-bigthink", "svc-embed"];
    const std = await seedTestOrg(gw.database, { plan: "Standard" });
    const auditOnly = await createKey(gw.database, { orgId: std.orgId, kind: "service", scopes: ["audit:read"], knownModels, tag: "gw" });
    const expired = await createKey(gw.database, { orgId: std.orgId, kind: "service", scopes: ["inference"], knownModels, tag: "gw", expiresAt: new Date(Date.now() - 86_400_000) });
    const revoked = await createKey(gw.database, { orgId: std.orgId, kind: "service", scopes: ["inference"], knownModels, tag: "gw" });
    await revokeKey(gw.database, revoked.id);
    const academy = await seedTestOrg(gw.database, { plan: "Standard", academyOnly: true });
    const refusals: [string, string, string][] = [
      [auditOnly.key, "/v1/models", "scope_missing"],
      [std.personalKey, "/v1/audit-events", "scope_missing"],
      [expired.key, "/v1/models", "key_expired"],
      [revoked.key, "/v1/models", "unauthorized"],
      [academy.serviceKey, "/v1/models", "academy_only"],
    ];
    for (const [key, path, code] of refusals) {
      for (let i = 0; i < 70; i++) {
        const res = await fetch(`${gw.url}${path}`, { headers: bearer(key) });
        const err = await errorOf(res);
        if (err.code !== code) expect({ path, i, code: err.code }).toEqual({ path, i, code });
      }
    }
    // Each organisation's next admitted request is the first of its window: 60 allowed, 59 left.
    const own = await fetch(`${gw.url}/v1/models`, { headers: bearer(std.serviceKey) });
    expect(own.status).toBe(200);
    await own.arrayBuffer();
    expect([own.headers.get("x-ratelimit-limit-requests"), own.headers.get("x-ratelimit-remaining-requests")]).toEqual(["60", "59"]);
    // The audit log is open to academy-only accounts (spec 4.5): their one admitted request here.
    const acad = await fetch(`${gw.url}/v1/audit-events`, { headers: bearer(academy.serviceKey) });
    expect(acad.status).toBe(200);
    await acad.arrayBuffer();
    expect([acad.headers.get("x-ratelimit-limit-requests"), acad.headers.get("x-ratelimit-remaining-requests")]).toEqual(["60", "59"]);
  });
});

describe.skipIf(!TEST_DATABASE_URL)("gateway_database_unanswered{work} (docs/operations.md: by kind: lease, budget_audit, audit_read, response_read)", () => {
  test("an audit-log read and a stored-response read given up on (the database does not answer) each show under their own kind until they settle", async () => {
    const scratch = await createScratchDatabase(TEST_DATABASE_URL as string, "c7_unanswered");
    let held: Database | undefined;
    let db: Database | undefined;
    let own: Gateway | undefined;
    const proxy = await startFreezeProxy(scratch.url, 0);
    try {
      held = await openDatabase({ databaseUrl: scratch.url, dataDir: "", poolMax: 2 });
      await migrate(held);
      db = await openDatabase({ databaseUrl: proxy.url, dataDir: "", poolMax: 10 });
      own = await startTestGateway({ responses: { enabled: true } }, db);
      const g = own;
      const seeded = await seedOrg(held);
      const unanswered = async (work: string) => sample(await scrapeOf(g), "gateway_database_unanswered", { work });
      // The key is cached before the database stops answering: the reads below are the only database work.
      const me = await fetch(`${g.url}/v1/me`, { headers: bearer(seeded.serviceKey) });
      expect(me.status).toBe(200);
      await me.arrayBuffer();
      // Both reads once, side by side, before: each then has a pool connection open (a new one, through the frozen proxy, would fail to connect instead).
      const warm = await Promise.all(
        ["/v1/audit-events", "/v1/responses/resp_nothere"].map(async (path) => {
          const res = await fetch(`${g.url}${path}`, { headers: bearer(seeded.serviceKey) });
          await res.arrayBuffer();
          return res.status;
        }),
      );
      expect(warm).toEqual([200, 404]);
      expect({ audit: await unanswered("audit_read"), response: await unanswered("response_read") }).toEqual({ audit: 0, response: 0 });
      proxy.freeze();
      const reads = await Promise.all(
        ["/v1/audit-events", "/v1/responses/resp_nothere"].map(async (path) => {
          const res = await fetch(`${g.url}${path}`, { headers: bearer(seeded.serviceKey), signal: AbortSignal.timeout(20_000) });
          return `${res.status} ${(await errorOf(res)).code}`;
        }),
      );
      expect(reads).toEqual(["503 service_unavailable", "503 service_unavailable"]);
      // Given up on (the 503s) and not settled: each under its own kind, and nothing under the others.
      expect({ audit: await unanswered("audit_read"), response: await unanswered("response_read"), lease: await unanswered("lease"), budget: await unanswered("budget_audit") }).toEqual({
        audit: 1,
        response: 1,
        lease: 0,
        budget: 0,
      });
      proxy.thaw();
      await until(async () => (await unanswered("audit_read")) + (await unanswered("response_read")) === 0, "the given-up reads to settle", 10_000, 100);
    } finally {
      proxy.thaw();
      await own?.stop();
      await db?.close();
      proxy.stop();
      await held?.close();
      await scratch.drop();
    }
  });
});
