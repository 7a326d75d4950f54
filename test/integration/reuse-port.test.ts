import { afterAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { revokeKey } from "../../src/admin/service.ts";
import { ConfigError, loadConfig } from "../../src/config/load.ts";
import type { Gateway } from "../../src/server.ts";
import { bearer, rejectionOf, seedOrg, sharedDatabase, startTestGateway } from "../helpers/harness.ts";
import { eventually } from "../helpers/poll.ts";
import { cleanEnv, removeScratch, runGateway, scratchDir } from "../helpers/process.ts";

setDefaultTimeout(90_000);

/**
 * Several instances on one host share a port only when the operator asks for
 * it (`reusePort`); otherwise a second instance on a taken port is an
 * operator's mistake and must fail loudly ("port taken", exit 1), not quietly
 * take half of the traffic.
 */
const open: Gateway[] = [];
afterAll(async () => {
  for (const g of open.reverse()) await g.stop();
  removeScratch();
});

async function started(overrides: Record<string, unknown>): Promise<Gateway> {
  const g = await startTestGateway(overrides);
  open.push(g);
  return g;
}

describe("sharing the listening port", () => {
  test("reusePort needs a shared Postgres; GATEWAY_REUSE_PORT turns it on", async () => {
    const err = await rejectionOf(loadConfig({ env: { GATEWAY_REUSE_PORT: "1" } }));
    expect(err).toBeInstanceOf(ConfigError);
    expect(String((err as ConfigError).problems)).toContain("/reusePort: several instances on one port need a shared Postgres");
    const ok = await loadConfig({ env: { GATEWAY_REUSE_PORT: "true", DATABASE_URL: "postgres://postgres@127.0.0.1:5432/x" } });
    expect(ok.reusePort).toBe(true);
    expect((await loadConfig({ env: {} })).reusePort).toBe(false);
  });

  test("gateway serve with GATEWAY_REUSE_PORT=1 and no DATABASE_URL: exit 2 (the units' RestartPreventExitStatus), the option named, nothing created", async () => {
    // docs/operations.md: "`serve` refuses `reusePort` without `databaseUrl` (exit 2)"; a restart loop would follow any other code.
    const dataDir = join(scratchDir(), "data");
    for (const value of ["1", "on"]) {
      const r = await runGateway(["serve", "--port", "0", "--data-dir", dataDir], {
        env: cleanEnv({ GATEWAY_REUSE_PORT: value, UPSTREAM_BASE_URL: "http://127.0.0.1:9/v1", MIMALLOC_PURGE_HOLES: "0" }),
      });
      expect({ value, code: r.code, stdout: r.stdout }).toEqual({ value, code: 2, stdout: "" });
      expect(r.stderr).toBe("error: invalid configuration:\n  - /reusePort: several instances on one port need a shared Postgres (databaseUrl)\n");
      expect(existsSync(dataDir)).toBe(false);
    }
  });

  test("without reusePort a second instance on a taken port fails to start", async () => {
    const first = await started({});
    const err = await rejectionOf(startTestGateway({ port: first.port }));
    expect(String(err)).toMatch(/EADDRINUSE|in use|address already/i);
  });

  test("with reusePort two instances on one port both serve", async () => {
    const a = await started({ reusePort: true });
    const b = await started({ reusePort: true, port: a.port });
    expect(b.port).toBe(a.port);
    const db = await sharedDatabase();
    const org = await seedOrg(db, { plan: "Ultra" });
    // Ultra (300 a minute per instance), so the rate limit never binds here.
    // The kernel spreads new connections over both listeners: count who answered
    // through each instance's own access counter (its metrics).
    const before = await Promise.all([a, b].map((g) => served(g, "200")));
    for (let i = 0; i < 100; i++) {
      // A new connection per request, so the kernel chooses a listener each time.
      const res = await fetch(`${a.url}/v1/me`, { headers: { ...bearer(org.personalKey), connection: "close" } });
      expect(res.status).toBe(200);
    }
    // The counter is bumped after the answer went out: wait for the last one.
    const total = async () => (await Promise.all([a, b].map((g) => served(g, "200")))).reduce((x, y) => x + y, 0);
    const base = (before[0] ?? 0) + (before[1] ?? 0);
    expect(await eventually(total, (n) => n - base >= 100, "all 100 answers counted", 5_000)).toBe(base + 100);
    const after = await Promise.all([a, b].map((g) => served(g, "200")));
    const servedA = (after[0] ?? 0) - (before[0] ?? 0);
    const servedB = (after[1] ?? 0) - (before[1] ?? 0);
    expect(servedA + servedB).toBe(100);
    expect(servedA).toBeGreaterThan(0);
    expect(servedB).toBeGreaterThan(0);

    // A revocation reaches both instances (NOTIFY): soon every connection, to
    // whichever instance the kernel picks, is refused.
    await revokeKey(db, org.personalKeyId);
    const me = async () => (await fetch(`${a.url}/v1/me`, { headers: { ...bearer(org.personalKey), connection: "close" } })).status;
    await eventually(async () => (await Promise.all(Array.from({ length: 20 }, me))).every((s) => s === 401), (ok) => ok, "the revoked key refused by both instances", 10_000);
    const revokedBefore = await Promise.all([a, b].map((g) => served(g, "401")));
    for (let i = 0; i < 40; i++) expect(await me()).toBe(401);
    await eventually(
      async () => (await Promise.all([a, b].map((g) => served(g, "401")))).reduce((x, y) => x + y, 0),
      (n) => n - (revokedBefore[0] ?? 0) - (revokedBefore[1] ?? 0) >= 40,
      "all 40 refusals counted",
      5_000,
    );
    const revokedAfter = await Promise.all([a, b].map((g) => served(g, "401")));
    // Both instances answered some of those 40 with 401.
    expect((revokedAfter[0] ?? 0) - (revokedBefore[0] ?? 0)).toBeGreaterThan(0);
    expect((revokedAfter[1] ?? 0) - (revokedBefore[1] ?? 0)).toBeGreaterThan(0);
  });
});

/** Answers with this status this instance gave on /v1/me, from its own metrics registry. */
async function served(g: Gateway, status: string): Promise<number> {
  const text = await g.metrics.registry.metrics();
  const line = text.split("\n").find((l) => l.startsWith("gateway_http_requests_total{") && l.includes('route="/v1/me"') && l.includes(`status="${status}"`));
  return line ? Number(line.slice(line.lastIndexOf(" ") + 1)) : 0;
}
