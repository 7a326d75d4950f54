import { afterAll, beforeAll, describe, expect, test, setDefaultTimeout } from "bun:test";
import { copyFileSync, existsSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { ensureBinary } from "../helpers/binary.ts";
import { eventually } from "../helpers/poll.ts";
import {
  type Proc,
  ROOT,
  cleanEnv,
  createScratchDatabase,
  exitWithin,
  listeningUrl,
  onlyJson,
  removeScratch,
  run,
  scratchDir,
  start,
  waitFor200,
} from "../helpers/process.ts";
import { expectKeyInfo } from "../helpers/spec-types.ts";

// Bun 1.4.5 applies a preload's setDefaultTimeout only to the first test file it
// runs (test/helpers/setup.ts), so files that spawn processes or open PGlite set
// their own: a cold PGlite start on a busy 2-core machine takes several seconds.
setDefaultTimeout(60_000);

/**
 * The compiled executable, copied alone into an empty folder, must run with
 * nothing else: PGlite's wasm, pg_trgm and the migrations are inside it. This
 * builds dist/gateway once (or reuses it when it is newer than every source),
 * so CI's two `bun test` runs compile it once.
 */

const PKG_VERSION = ((await Bun.file(join(ROOT, "package.json")).json()) as { version: string }).version;
const TEST_DATABASE_URL = process.env.TEST_DATABASE_URL;

let bin: string;
beforeAll(async () => {
  bin = await ensureBinary();
}, 180_000);
afterAll(() => removeScratch());

/** A folder holding only a copy of the binary, plus decoys it must ignore. */
function emptyFolderWithBinary(): { dir: string; gw: string } {
  const dir = scratchDir("gw-e2e-");
  const gw = join(dir, "gateway");
  copyFileSync(bin, gw);
  // Built with --no-compile-autoload-dotenv/-bunfig: a stray .env or bunfig.toml
  // in the working directory must change nothing (a garbage bunfig would abort it).
  writeFileSync(join(dir, ".env"), "GATEWAY_DATA_DIR=./from-dotenv\nPORT=1\nLOG_LEVEL=silent\n");
  writeFileSync(join(dir, "bunfig.toml"), "[[[ not toml\n");
  return { dir, gw };
}

interface Ctx {
  dir: string;
  gw: string;
  env: Record<string, string>;
}
const cli = (c: Ctx, args: string[]) => run([c.gw, ...args], { cwd: c.dir, env: c.env, timeoutMs: 60_000 });

/** The smoke shared by both databases; `dbArgs` selects the embedded one. */
async function smoke(c: Ctx, dbArgs: string[], embedded: boolean) {
  const migrated = await cli(c, ["migrate", ...dbArgs, "--json"]);
  expect(migrated.stderr).toBe("");
  expect(migrated.code).toBe(0);
  expect(onlyJson<{ applied: string[] }>(migrated.stdout).applied).toContain("0001_init");
  const again = await cli(c, ["migrate", ...dbArgs, "--json"]);
  expect(again.code).toBe(0);
  expect(onlyJson<{ applied: string[] }>(again.stdout).applied).toEqual([]);

  const org = await cli(c, ["orgs", "create", "--name", "Acme", ...dbArgs, "--json"]);
  expect(org.code).toBe(0);
  const orgId = onlyJson<{ id: string }>(org.stdout).id;
  expect(orgId).toMatch(/^[0-9a-f-]{36}$/);

  const created = await cli(c, ["keys", "create", "--org", orgId, "--kind", "service", "--scopes", "inference,audit:read", ...dbArgs, "--json"]);
  expect(created.code).toBe(0);
  const key = onlyJson<{ id: string; key: string }>(created.stdout);
  expect(key.key).toMatch(/^sk-gw-[0-9A-Za-z]{43}$/);

  const server: Proc = start([c.gw, "serve", "--port", "0", ...dbArgs], {
    cwd: c.dir,
    env: { ...c.env, UPSTREAM_BASE_URL: "http://127.0.0.1:9/v1" },
  });
  try {
    const base = await listeningUrl(server);
    expect(base).toMatch(/^http:\/\/127\.0\.0\.1:\d+$/);
    await waitFor200(`${base}/readyz`, 30_000);
    expect((await fetch(`${base}/healthz`)).status).toBe(200);

    const me = await fetch(`${base}/v1/me`, { headers: { authorization: `Bearer ${key.key}` } });
    expect(me.status).toBe(200);
    expect(expectKeyInfo(await me.json()).organization.id).toBe(orgId);
    expect((await fetch(`${base}/v1/me`, { headers: { authorization: "Bearer sk-gw-nope" } })).status).toBe(401);

    // Administration while serving: with Postgres the CLI uses the database itself;
    // on the embedded one it runs inside the server (admin socket). Either way a
    // new key works at once, and an imported audit file is read by the client.
    const live = await cli(c, ["keys", "create", "--org", orgId, "--kind", "service", "--scopes", "inference", ...dbArgs, "--json"]);
    expect(live.stderr).toBe("");
    expect(live.code).toBe(0);
    const liveKey = onlyJson<{ id: string; key: string }>(live.stdout);
    expect((await fetch(`${base}/v1/me`, { headers: { authorization: `Bearer ${liveKey.key}` } })).status).toBe(200);
    const revoked = await cli(c, ["keys", "revoke", liveKey.id, ...dbArgs, "--json"]);
    expect(revoked.code).toBe(0);
    // On the embedded database the revocation runs inside the server and is immediate;
    // on Postgres it arrives by NOTIFY, so allow it a moment.
    await eventually(
      async () => (await fetch(`${base}/v1/me`, { headers: { authorization: `Bearer ${liveKey.key}` } })).status,
      (s) => s === 401,
      "the revoked key to be refused",
      5_000,
    );
    writeFileSync(
      join(c.dir, "events.jsonl"),
      `${JSON.stringify({ org_id: orgId, action: "member.invited", category: "member", actor: { type: "user", id: orgId, name: "Ada", email: "ada@example.com" }, origin: { ip_prefix: "203.0.113.0/24", user_agent_summary: "Firefox/131.0" } })}\n`,
    );
    const imported = await cli(c, ["audit", "import", "events.jsonl", ...dbArgs, "--json"]);
    expect(imported.stderr).toBe("");
    expect(onlyJson(imported.stdout)).toEqual({ imported: 1 });

    if (embedded) {
      // Anything else is refused clearly: the embedded database belongs to one process.
      const second = await cli(c, ["migrate", ...dbArgs]);
      expect(second.stdout).toBe("");
      expect(second.stderr).toMatch(/^error: the data directory .* is in use by process \d+/);
      expect(second.code).toBe(1);
      const another = await run([c.gw, "serve", "--port", "0", ...dbArgs], {
        cwd: c.dir,
        env: { ...c.env, UPSTREAM_BASE_URL: "http://127.0.0.1:9/v1" },
        timeoutMs: 60_000,
      });
      expect(another.stderr).toContain("is in use by process");
      expect(another.code).toBe(1);
    }

    server.kill("SIGTERM");
    expect(await exitWithin(server, 20_000)).toBe(0);
    expect(server.stdout()).toContain('"msg":"stopped"');
  } finally {
    server.kill("SIGKILL");
  }

  // Lock and socket released (embedded); the keys listed without their secrets.
  const listed = await cli(c, ["keys", "list", "--org", orgId, ...dbArgs, "--json"]);
  expect(listed.code).toBe(0);
  const rows = onlyJson<{ id: string; prefix: string }[]>(listed.stdout);
  expect(rows.map((r) => r.id)).toContain(key.id);
  expect(rows.length).toBe(2);
  expect(listed.stdout).not.toContain(key.key);
}

describe("compiled binary, alone in an empty folder", () => {
  test("--version and --help", async () => {
    const { dir, gw } = emptyFolderWithBinary();
    const v = await run([gw, "--version"], { cwd: dir, env: cleanEnv() });
    expect(v.code).toBe(0);
    expect(v.stdout.trim()).toMatch(new RegExp(`^gateway ${PKG_VERSION.replaceAll(".", "\\.")} \\(([0-9a-f]{7,}|unknown)\\)$`));
    const h = await run([gw, "--help"], { cwd: dir, env: cleanEnv() });
    expect(h.code).toBe(0);
    expect(h.stdout).toContain("Usage: gateway <command>");
    expect(h.stdout).toContain("keys create");
  });

  test("ignores .env and bunfig.toml in the working directory", async () => {
    const { dir, gw } = emptyFolderWithBinary();
    const r = await run([gw, "config", "print"], { cwd: dir, env: cleanEnv() });
    expect(r.stderr).toBe("");
    expect(r.code).toBe(0);
    const cfg = JSON.parse(r.stdout) as { dataDir: string; port: number; logLevel: string };
    expect(cfg).toMatchObject({ dataDir: "./data", port: 8080, logLevel: "info" });
  });

  test("embedded database: migrate, orgs/keys create, serve, /v1/me, live admin, lock, SIGTERM", async () => {
    const { dir, gw } = emptyFolderWithBinary();
    await smoke({ dir, gw, env: cleanEnv() }, ["--data-dir", join(dir, "data")], true);
    expect(existsSync(join(dir, "data", "gateway.pid"))).toBe(false);
    expect(existsSync(join(dir, "data", "admin", "admin.sock"))).toBe(false);
    expect(existsSync(join(dir, "from-dotenv"))).toBe(false);
  }, 180_000);

  test.skipIf(!TEST_DATABASE_URL)("Postgres (DATABASE_URL): migrate, create, serve, live admin, SIGTERM", async () => {
    const { dir, gw } = emptyFolderWithBinary();
    const pg = await createScratchDatabase(TEST_DATABASE_URL ?? "", "gw_e2e");
    try {
      await smoke({ dir, gw, env: cleanEnv({ DATABASE_URL: pg.url }) }, [], false);
      // Nothing was written beside the binary: the data lives in Postgres.
      expect(existsSync(join(dir, "data"))).toBe(false);
    } finally {
      await pg.drop();
    }
  }, 180_000);
});
