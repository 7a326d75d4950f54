import { afterAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { join } from "node:path";
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
