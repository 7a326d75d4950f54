import { afterAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import postgres from "postgres";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { createKey } from "../../src/admin/service.ts";
import { loadConfig } from "../../src/config/load.ts";
import { mintKey } from "../../src/auth/keys.ts";
import { openDatabase } from "../../src/db/client.ts";
import { createLogger } from "../../src/lib/log.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import { captureCli, withoutEnv } from "../helpers/cli.ts";
import { TEST_DATABASE_URL, bearer, errorOf, freshDatabase, seedOrg, startTestGateway, testConfig } from "../helpers/harness.ts";
import { createScratchDatabase, onlyJson, removeScratch, scratchDir } from "../helpers/process.ts";
import { startSimulator } from "../../src/sim/index.ts";
import { testAliases, upstreamSettings } from "./inference-fixtures.ts";
import { until } from "../helpers/poll.ts";

// PGlite start-ups and CLI runs on a busy 2-core machine take more than the default 5 s.
setDefaultTimeout(60_000);

/**
 * README's configuration table, held through HTTP: options an operator sets
 * in the file and relies on reaching what the CLI makes and what the
 * gateway serves (keyTag, defaultPlan, added plans, cursorSecret).
 */

// runCli reads process.env: keep a developer's own settings out of these tests.
const SCRUB = ["DATABASE_URL", "GATEWAY_CONFIG", "GATEWAY_DATA_DIR", "GATEWAY_CURSOR_SECRET", "LOG_LEVEL"];
withoutEnv(SCRUB);
afterAll(removeScratch);

const KNOWN_MODELS = ["svc-fast", "svc-smart", "svc-bigthink", "svc-embed"];

describe("keyTag, defaultPlan and plans from the config file", () => {
  test("the CLI makes sk-<keyTag>- keys and defaultPlan organisations; the gateway on that file accepts only its own tag and enforces the added plan beside the built-in ones", async () => {
    const work = scratchDir("gw-claims-");
    const dataDir = join(work, "data");
    const file = join(work, "gateway.json");
    // On the suite's Postgres when it runs on one (the file's databaseUrl), else an embedded database in dataDir.
    const databaseUrl = TEST_DATABASE_URL;
    writeFileSync(file, JSON.stringify({ keyTag: "acme", defaultPlan: "Tiny", plans: { Tiny: { requestsPerMinute: 2 } }, ...(databaseUrl ? { databaseUrl } : {}) }));
    const cli = (...args: string[]) => captureCli([...args, "--config", file, "--data-dir", dataDir]);

    const org = await cli("orgs", "create", "--name", "Acme", "--json");
    expect(org.code).toBe(0);
    const created = onlyJson<{ id: string; plan: string }>(org.stdout);
    expect(created.plan).toBe("Tiny");
    const std = onlyJson<{ id: string }>((await cli("orgs", "create", "--name", "Std", "--plan", "Standard", "--json")).stdout);
    const key = await cli("keys", "create", "--org", created.id, "--kind", "service", "--scopes", "inference", "--json");
    expect(key.code).toBe(0);
    const acmeKey = onlyJson<{ key: string }>(key.stdout).key;
    expect(acmeKey).toMatch(/^sk-acme-[0-9A-Za-z]{43}$/);
    const stdKey = onlyJson<{ key: string }>((await cli("keys", "create", "--org", std.id, "--kind", "service", "--scopes", "inference", "--json")).stdout).key;

    const database = await openDatabase({ databaseUrl, dataDir });
    const config = { ...(await loadConfig({ env: {}, file, overrides: { host: "127.0.0.1", port: 0 } })), metrics: { enabled: false, listen: "127.0.0.1:0" }, logLevel: "error" as const, accessLog: false };
    const g: Gateway = await startGateway({ config, database, log: createLogger("error") });
    try {
      // A key of the default tag, valid in every other respect, is no key of this gateway.
      const gwKey = await createKey(database, { orgId: created.id, kind: "service", scopes: ["inference"], knownModels: KNOWN_MODELS, tag: "gw" });
      const refused = await fetch(`${g.url}/v1/me`, { headers: bearer(gwKey.key) });
      expect(refused.status).toBe(401);
      expect((await errorOf(refused)).code).toBe("unauthorized");

      // The added plan: 2 a minute, the third refused.
      for (let i = 0; i < 2; i++) {
        const ok = await fetch(`${g.url}/v1/me`, { headers: bearer(acmeKey) });
        expect(ok.status).toBe(200);
        expect(ok.headers.get("x-ratelimit-limit-requests")).toBe("2");
      }
      const limited = await fetch(`${g.url}/v1/me`, { headers: bearer(acmeKey) });
      expect(limited.status).toBe(429);
      expect((await errorOf(limited)).code).toBe("rate_limit_error");
      // The built-in plans are still there, with their limits.
      const standard = await fetch(`${g.url}/v1/me`, { headers: bearer(stdKey) });
      expect(standard.status).toBe(200);
      expect(standard.headers.get("x-ratelimit-limit-requests")).toBe("60");
    } finally {
      await g.stop();
      await database.close();
    }
  }, 180_000);
});

describe("cursorSecret", () => {
  async function firstPage(g: Gateway, key: string): Promise<string> {
    const res = await fetch(`${g.url}/v1/audit-events?limit=1`, { headers: bearer(key) });
    expect(res.status).toBe(200);
    const page = (await res.json()) as { next_cursor: string };
    expect(page.next_cursor).not.toBe("");
    return page.next_cursor;
  }
  const next = (g: Gateway, key: string, cursor: string) => fetch(`${g.url}/v1/audit-events?limit=1&cursor=${encodeURIComponent(cursor)}`, { headers: bearer(key) });

  test("unset: generated once and kept in the database, so every instance (and the next start) reads the others' cursors", async () => {
    const database = await freshDatabase();
    const a = await startTestGateway({}, database);
    const org = await seedOrg(database);
    let cursor: string;
    try {
      cursor = await firstPage(a, org.serviceKey);
    } finally {
      await a.stop();
    }
    // A later start on the same database (another instance, or a restart) keeps the secret.
    const b = await startTestGateway({}, database);
    try {
      const res = await next(b, org.serviceKey, cursor);
      expect(res.status).toBe(200);
      expect(((await res.json()) as { data: unknown[] }).data).toHaveLength(1);
    } finally {
      await b.stop();
      await database.close();
    }
  });

  test("set: a cursor signed with another secret is refused, 400 invalid_body on cursor", async () => {
    const database = await freshDatabase();
    const a = await startTestGateway({ cursorSecret: "a".repeat(32) }, database);
    const b = await startTestGateway({ cursorSecret: "b".repeat(32) }, database);
    const c = await startTestGateway({ cursorSecret: "a".repeat(32) }, database);
    try {
      const org = await seedOrg(database);
      const cursor = await firstPage(a, org.serviceKey);
      const refused = await next(b, org.serviceKey, cursor);
      expect(refused.status).toBe(400);
      const err = await errorOf(refused);
      expect(err).toMatchObject({ code: "invalid_body", param: "cursor", type: "invalid_request_error" });
      expect((await next(c, org.serviceKey, cursor)).status).toBe(200);
    } finally {
      await a.stop();
      await b.stop();
      await c.stop();
      await database.close();
    }
  });
});

describe.skipIf(!TEST_DATABASE_URL)("dbPoolMax", () => {
  test("is the pool's size: under more concurrent key lookups than they may take (half the pool), the gateway holds exactly dbPoolMax / 2 connections for them (above the default's 5)", async () => {
    const scratch = await createScratchDatabase(TEST_DATABASE_URL as string, "h2_pool");
    // Two connections: one holds the lock, the other counts.
    const admin = postgres(scratch.url, { max: 2, onnotice: () => {} });
    const app = `gw_pool_${crypto.randomUUID().slice(0, 8)}`;
    const url = new URL(scratch.url);
    url.searchParams.set("application_name", app);
    // The gateway opens its own database from the configuration, as `serve` does.
    // Key lookups may hold half the pool (src/auth/verify.ts, maxKeyLookups): 12 of 24.
    const g = await startGateway({ config: await testConfig({ databaseUrl: url.toString(), dbPoolMax: 24 }), log: createLogger("error") });
    let locker: postgres.ReservedSql | undefined;
    const waiting = async () => {
      const [r] = await admin`select count(*)::int as n from pg_stat_activity where application_name = ${app} and wait_event_type = 'Lock'`;
      return Number(r?.n);
    };
    try {
      // Every key lookup waits on this lock, each on a connection of its own while the pool has one free.
      locker = await admin.reserve();
      await locker`begin`;
      await locker`lock table api_keys in access exclusive mode`;
      const lookups = Array.from({ length: 14 }, () => fetch(`${g.url}/v1/me`, { headers: bearer(mintKey("gw").key) }).then((r) => r.status));
      // Were the option ignored, the pool would be the default 10 and the count would stop at 5.
      await until(async () => (await waiting()) >= 12, "12 lookups waiting, each on its own connection", 20_000, 50);
      expect(await waiting()).toBe(12);
      await locker`rollback`;
      locker.release();
      locker = undefined;
      // Unknown keys: 401 once looked up (503 for one whose lookup gave up waiting).
      for (const status of await Promise.all(lookups)) expect([401, 503]).toContain(status);
    } finally {
      if (locker) {
        await locker`rollback`.catch(() => {});
        locker.release();
      }
      await g.stop();
      await admin.end();
      await scratch.drop();
    }
  });
});

describe("idleTimeoutS (1–255 s, README)", () => {
  test("0, 256, -1, 1.5 and a string are refused by `config check` (exit 2, the option named), as by serve's loader", async () => {
    const work = scratchDir("gw-idle-");
    for (const v of [0, 256, -1, 1.5, "60"]) {
      const file = join(work, `idle-${String(v)}.json`);
      writeFileSync(file, JSON.stringify({ idleTimeoutS: v }));
      const r = await captureCli(["config", "check", "--config", file]);
      // 0 would be Bun's "no idle timeout at all"; above 255 Bun.serve throws at start.
      expect({ v, code: r.code, stdout: r.stdout, named: r.stderr.includes("  - /idleTimeoutS:") }).toEqual({ v, code: 2, stdout: "", named: true });
      const loaded = await loadConfig({ env: {}, file }).then(
        () => "accepted",
        (e: Error) => e.message,
      );
      expect(loaded).toContain("/idleTimeoutS:");
    }
  });

  test("the extremes 1 and 255 start a gateway that answers a chat completion (Bun.serve takes at most 255)", async () => {
    const sim = await startSimulator({ port: 0, ttftMs: 1, interTokenMs: 0, completionTokens: 3 });
    try {
      for (const idleTimeoutS of [1, 255]) {
        const g = await startTestGateway({ idleTimeoutS, upstream: upstreamSettings(), aliases: testAliases(sim.url) });
        try {
          const org = await seedOrg(g.database);
          const res = await fetch(`${g.url}/v1/chat/completions`, {
            method: "POST",
            headers: { ...bearer(org.serviceKey), "content-type": "application/json" },
            body: JSON.stringify({ model: "svc-fast", max_tokens: 5, messages: [{ role: "user", content: "hi" }] }),
          });
          expect({ idleTimeoutS, status: res.status }).toEqual({ idleTimeoutS, status: 200 });
          await res.arrayBuffer();
        } finally {
          await g.stop();
        }
      }
    } finally {
      await sim.stop();
    }
  });
});
