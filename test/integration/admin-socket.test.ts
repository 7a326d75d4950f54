import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { chmodSync, lstatSync, mkdirSync, symlinkSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { forward, serveAdminSocket, socketPath } from "../../src/cli/admin-socket.ts";
import type { Config } from "../../src/config/schema.ts";
import type { Database } from "../../src/db/client.ts";
import { sharedDatabase, testConfig } from "../helpers/harness.ts";
import { cleanEnv, exitWithin, listeningUrl, onlyJson, removeScratch, runGateway, scratchDir, startGatewayProcess, waitFor200 } from "../helpers/process.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Live administration on the embedded database: while `serve` holds the data
 * directory, CLI commands run inside the server through its admin socket, and
 * a revocation takes effect at once (the server's cache is invalidated
 * in-process).
 */

afterAll(() => removeScratch());

describe("CLI against a running server on the embedded database", () => {
  test("create, list and revoke keys while serving; revocation is immediate", async () => {
    const dir = scratchDir();
    const dataDir = join(dir, "data");
    const cfg = join(dir, "config.json");
    // A plan only this config knows: forwarded commands must use the server's configuration.
    await Bun.write(cfg, JSON.stringify({ plans: { Gold: { requestsPerMinute: 1000 } }, accessLog: false }));
    const env = cleanEnv({ UPSTREAM_BASE_URL: "http://127.0.0.1:9/v1", LOG_LEVEL: "error" });
    await runGateway(["migrate", "--data-dir", dataDir], { env });
    const server = startGatewayProcess(["serve", "--port", "0", "--data-dir", dataDir, "--config", cfg], {
      // Info level: the "listening" line carries the bound port.
      env: { ...env, LOG_LEVEL: "info" },
    });
    try {
      const port = Number(new URL(await listeningUrl(server)).port);
      await waitFor200(`http://127.0.0.1:${port}/readyz`, 60_000);
      const org = await runGateway(["orgs", "create", "--name", "live", "--plan", "Gold", "--data-dir", dataDir, "--json"], { env });
      expect(org.code).toBe(0);
      const orgId = onlyJson<{ id: string; plan: string }>(org.stdout);
      expect(orgId.plan).toBe("Gold");
      const created = onlyJson<{ id: string; key: string }>(
        (await runGateway(["keys", "create", "--org", orgId.id, "--kind", "service", "--scopes", "inference", "--data-dir", dataDir, "--json"], { env })).stdout,
      );
      const me = () => fetch(`http://127.0.0.1:${port}/v1/me`, { headers: { authorization: `Bearer ${created.key}` } });
      expect((await me()).status).toBe(200);
      const listed = onlyJson<{ id: string }[]>((await runGateway(["keys", "list", "--org", orgId.id, "--data-dir", dataDir, "--json"], { env })).stdout);
      expect(listed.map((k) => k.id)).toEqual([created.id]);
      const revoked = await runGateway(["keys", "revoke", created.id, "--data-dir", dataDir, "--json"], { env });
      expect(revoked.code).toBe(0);
      const res = await me();
      expect(res.status).toBe(401);
      // A warning the command prints is printed once, not once by the client and again by the server.
      const past = await runGateway(["keys", "create", "--org", orgId.id, "--kind", "service", "--scopes", "inference", "--expires-at", "2020-01-01", "--data-dir", dataDir, "--json"], { env });
      expect(past.code).toBe(0);
      onlyJson(past.stdout);
      expect(past.stderr).toBe("warning: --expires-at is in the past; the key is created already expired\n");
      // Bad arguments still exit 2 with a message, through the socket.
      const bad = await runGateway(["keys", "revoke", "not-a-uuid", "--data-dir", dataDir], { env });
      expect(bad.code).toBe(2);
      expect(bad.stderr).toContain("UUID");
    } finally {
      server.kill("SIGTERM");
      expect(await exitWithin(server, 20_000)).toBe(0);
    }
  }, 120_000);
});

describe("a data directory held by a process that does not answer on the socket", () => {
  test("a stale socket file: one error line naming the socket, exit 1, no stack", async () => {
    const dataDir = join(scratchDir(), "data");
    const env = cleanEnv({ LOG_LEVEL: "error" });
    expect((await runGateway(["migrate", "--data-dir", dataDir], { env })).code).toBe(0);
    // A gateway killed with SIGKILL leaves its socket; its successor holds the directory while it starts.
    const holder = Bun.spawn(["sleep", "60"]);
    try {
      writeFileSync(join(dataDir, "gateway.pid"), String(holder.pid));
      mkdirSync(dirname(socketPath(dataDir)), { recursive: true, mode: 0o700 });
      writeFileSync(socketPath(dataDir), "stale");
      const r = await runGateway(["keys", "list", "--org", "00000000-0000-4000-8000-000000000000", "--data-dir", dataDir, "--json"], { env });
      expect(r.code).toBe(1);
      expect(r.stdout).toBe("");
      expect(r.stderr).toStartWith("error: ");
      expect(r.stderr).toContain(socketPath(dataDir));
      expect(r.stderr.trimEnd().split("\n")).toHaveLength(1);
    } finally {
      holder.kill();
    }
  });
});

describe("the admin socket's permissions", () => {
  // The socket only hands the database to the runner; any open one will do (PGlite may start slowly here).
  let database: Database;
  let config: Config;
  beforeAll(async () => {
    database = await sharedDatabase();
    config = await testConfig();
  }, 120_000);

  /**
   * Serve the socket with Bun.serve instrumented to look at the file the
   * moment the bind returns (before any chmod could run), under a permissive
   * umask, and return the modes seen then.
   */
  async function serveAndWatch(dataDir: string) {
    const realServe = Bun.serve;
    let seen: { socket: number; dir: number; uid: number } | undefined;
    const watching: typeof Bun.serve = (options) => {
      const server = realServe(options);
      if ("unix" in options && typeof options.unix === "string") {
        const dir = lstatSync(dirname(options.unix));
        seen = { socket: lstatSync(options.unix).mode & 0o777, dir: dir.mode & 0o777, uid: dir.uid };
      }
      return server;
    };
    const umask = process.umask(0o000);
    Bun.serve = watching;
    try {
      const stop = serveAdminSocket(dataDir, database, config, async (argv, out) => {
        out.stdout(`ran ${argv.join(" ")}`);
        return 0;
      });
      return { stop, seen };
    } finally {
      Bun.serve = realServe;
      process.umask(umask);
    }
  }

  test("no other user can connect at any moment: socket 0600 from creation, in a 0700 directory of our own", async () => {
    const dataDir = join(scratchDir(), "data");
    mkdirSync(dataDir, { mode: 0o755 });
    chmodSync(dataDir, 0o755); // a data directory others may enter
    const { stop, seen } = await serveAndWatch(dataDir);
    try {
      expect(seen).toBeDefined();
      expect(seen?.socket.toString(8)).toBe("600");
      expect(seen?.dir.toString(8)).toBe("700");
      expect(seen?.uid).toBe(process.getuid?.() ?? 0);
      expect(dirname(socketPath(dataDir))).not.toBe(dataDir);
      // And it still carries commands.
      expect(await forward(socketPath(dataDir), ["orgs", "list"])).toEqual({ code: 0, stdout: "ran orgs list", stderr: "" });
    } finally {
      stop();
    }
  });

  test("a directory left with wider permissions is tightened; a stale socket is replaced", async () => {
    const dataDir = join(scratchDir(), "data");
    mkdirSync(join(dataDir, "admin"), { recursive: true });
    chmodSync(join(dataDir, "admin"), 0o777);
    writeFileSync(socketPath(dataDir), "stale");
    const { stop, seen } = await serveAndWatch(dataDir);
    try {
      expect(seen?.dir.toString(8)).toBe("700");
      expect(seen?.socket.toString(8)).toBe("600");
      expect(lstatSync(socketPath(dataDir)).isSocket()).toBe(true);
    } finally {
      stop();
    }
  });

  test("a symbolic link in place of the directory is refused", async () => {
    const dataDir = join(scratchDir(), "data");
    mkdirSync(dataDir);
    const elsewhere = join(scratchDir(), "elsewhere");
    mkdirSync(elsewhere, { mode: 0o777 });
    symlinkSync(elsewhere, join(dataDir, "admin"));
    expect(() => serveAdminSocket(dataDir, database, config, async () => 0)).toThrow("admin");
  });
});
