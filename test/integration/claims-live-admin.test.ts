import { afterAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { VERSION } from "../../src/lib/version.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { eventually } from "../helpers/poll.ts";
import { cleanEnv, exitWithin, listeningUrl, onlyJson, removeScratch, runGateway, scratchDir, startGatewayProcess, waitFor200 } from "../helpers/process.ts";

// Processes and PGlite start-ups on a busy 2-core machine.
setDefaultTimeout(240_000);

/**
 * README: "While `gateway serve` runs on a data directory, CLI commands on that
 * directory (`orgs`, `users`, `keys`, `audit`, `usage`) are run inside the
 * server through a Unix socket". admin-socket.test holds it for keys
 * create/list/revoke; this holds it for the other groups, each change
 * visible to the running server at once.
 */

let sim: Simulator | undefined;
afterAll(async () => {
  await sim?.stop();
  removeScratch();
});

describe("every forwardable command group while serving on the embedded database", () => {
  test("users create, orgs set (the quota at once), keys rotate, audit import (a path relative to the client), usage report", async () => {
    sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 5 });
    const dir = scratchDir();
    const dataDir = join(dir, "data");
    const cfg = join(dir, "config.json");
    await Bun.write(cfg, JSON.stringify({ quota: { flushMs: 100 }, accessLog: false }));
    const env = cleanEnv({ UPSTREAM_BASE_URL: sim.url, LOG_LEVEL: "error" });
    await runGateway(["migrate", "--data-dir", dataDir], { env });
    const server = startGatewayProcess(["serve", "--port", "0", "--data-dir", dataDir, "--config", cfg], { env: { ...env, LOG_LEVEL: "info" } });
    const gw = (args: string[], cwd?: string) => runGateway([...args, "--data-dir", dataDir], { env, ...(cwd ? { cwd } : {}) });
    try {
      const url = await listeningUrl(server);
      await waitFor200(`${url}/readyz`, 60_000);
      const chat = (key: string) =>
        fetch(`${url}/v1/chat/completions`, {
          method: "POST",
          headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
          body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }], max_tokens: 5 }),
        });

      const org = onlyJson<{ id: string }>((await gw(["orgs", "create", "--name", "live", "--quota-tokens", "1000000", "--quota-window", "day", "--json"])).stdout);
      const user = await gw(["users", "create", "--org", org.id, "--name", "Ada", "--email", "ada@live.example", "--json"]);
      expect(user.code).toBe(0);
      const userId = onlyJson<{ id: string }>(user.stdout).id;
      const made = await gw(["keys", "create", "--org", org.id, "--user", userId, "--kind", "personal", "--scopes", "inference", "--json"]);
      expect(made.code).toBe(0);
      const key = onlyJson<{ id: string; key: string }>(made.stdout);
      expect((await chat(key.key)).status).toBe(200);

      // usage report: what the server wrote, read through the server.
      const rows = await eventually(
        async () => {
          const r = await gw(["usage", "report", "--org", org.id, "--json"]);
          expect(r.code).toBe(0);
          return onlyJson<{ key_id: string; requests: number; total_tokens: number }[]>(r.stdout);
        },
        (r) => r.length === 1,
        "the request in the usage report",
        30_000,
        200,
      );
      expect(rows[0]).toMatchObject({ key_id: key.id, requests: 1 });
      expect(rows[0]?.total_tokens).toBeGreaterThan(0);

      // keys rotate: the new key works at once, the old one through its grace.
      const rotated = await gw(["keys", "rotate", key.id, "--grace", "1h", "--json"]);
      expect(rotated.code).toBe(0);
      const fresh = onlyJson<{ key: string }>(rotated.stdout);
      expect((await chat(fresh.key)).status).toBe(200);
      expect((await chat(key.key)).status).toBe(200);

      // orgs set: a quota lowered below what was used refuses the next request at once.
      const set = await gw(["orgs", "set", "--id", org.id, "--quota-tokens", "10", "--json"]);
      expect(set.code).toBe(0);
      const refused = await chat(fresh.key);
      expect(refused.status).toBe(429);
      expect(((await refused.json()) as { error: { code: string } }).error.code).toBe("budget_exceeded");

      // audit import: a path relative to the client's working directory, which is not the server's.
      const elsewhere = join(dir, "elsewhere");
      mkdirSync(elsewhere);
      const event = {
        org_id: org.id,
        action: "member.invited",
        category: "member",
        actor: { type: "user", id: userId, name: "Ada", email: "ada@live.example" },
        targets: [{ key: "target_user_id", kind: "user", id: userId, name: "Ada", email: "ada@live.example" }],
        details: { role: "member", target_user_id: userId },
        origin: { ip_prefix: "203.0.113.0/24", user_agent_summary: "Firefox/131.0" },
      };
      writeFileSync(join(elsewhere, "events.jsonl"), `${JSON.stringify(event)}\n`);
      const imported = await gw(["audit", "import", "events.jsonl", "--json"], elsewhere);
      expect(imported.stderr).toBe("");
      expect(imported.code).toBe(0);
      expect(onlyJson(imported.stdout)).toEqual({ imported: 1 });

      // decisions.md, Origin of events: events made through the admin socket, and the gateway's own, are the host's.
      const reader = onlyJson<{ key: string }>((await gw(["keys", "create", "--org", org.id, "--kind", "service", "--scopes", "audit:read", "--json"])).stdout).key;
      const page = (await (await fetch(`${url}/v1/audit-events?limit=200`, { headers: { authorization: `Bearer ${reader}` } })).json()) as {
        data: { action: string; origin: { ip_prefix: string; user_agent_summary: string } }[];
      };
      // billing.budget_exceeded too: a request brings it about, but it is the gateway's own (system actor), written once per period.
      const own = page.data.filter((e) => e.action !== "member.invited");
      expect(own.map((e) => e.action).sort()).toEqual(
        ["api_key.created", "api_key.created", "api_key.rotated", "billing.budget_exceeded", "billing.quota_changed", "member.created", "org.created"].sort(),
      );
      for (const e of own) expect(e.origin).toEqual({ ip_prefix: "127.0.0.0/8", user_agent_summary: `gateway-cli/${VERSION}` });
    } finally {
      server.kill("SIGTERM");
      expect(await exitWithin(server, 30_000)).toBe(0);
    }
  });
});
