import { afterAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { join } from "node:path";
import { startSimulator } from "../../src/sim/index.ts";
import { cleanEnv, exitWithin, freePort, onlyJson, removeScratch, runGateway, scratchDir, startGatewayProcess, waitFor200 } from "../helpers/process.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Process faults on the embedded database: SIGKILL under load, then restart on
 * the same data directory. Nothing is corrupt (the database recovers, every
 * committed row is there), and what was lost is bounded by the flush interval.
 */

afterAll(() => removeScratch());

describe("SIGKILL under load (embedded database)", () => {
  test("restart recovers; committed usage survives; loss bounded by the flush interval", async () => {
    const sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 10 });
    const dir = scratchDir();
    const dataDir = join(dir, "data");
    const env = cleanEnv({ UPSTREAM_BASE_URL: sim.url, LOG_LEVEL: "error" });
    try {
      const org = onlyJson<{ id: string }>((await runGateway(["orgs", "create", "--name", "crash", "--data-dir", dataDir, "--json"], { env })).stdout);
      const key = onlyJson<{ key: string; id: string }>(
        (await runGateway(["keys", "create", "--org", org.id, "--kind", "service", "--scopes", "inference", "--data-dir", dataDir, "--json"], { env })).stdout,
      );
      const cfg = join(dir, "config.json");
      await Bun.write(cfg, JSON.stringify({ quota: { flushMs: 200 }, accessLog: false, plans: { Standard: { requestsPerMinute: 1_000_000 } } }));
      const port = freePort();
      const proc = startGatewayProcess(["serve", "--port", String(port), "--data-dir", dataDir, "--config", cfg], { env });
      await waitFor200(`http://127.0.0.1:${port}/readyz`, 60_000);
      let received = 0;
      let stop = false;
      const client = async () => {
        while (!stop) {
          try {
            const res = await fetch(`http://127.0.0.1:${port}/v1/chat/completions`, {
              method: "POST",
              headers: { authorization: `Bearer ${key.key}`, "content-type": "application/json" },
              body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }),
            });
            if (res.status === 200) received += ((await res.json()) as { usage: { total_tokens: number } }).usage.total_tokens;
          } catch {
            return;
          }
        }
      };
      const load = Promise.all(Array.from({ length: 8 }, () => client()));
      await Bun.sleep(1_500);
      const receivedAtKill = received;
      proc.kill("SIGKILL");
      stop = true;
      await load;
      expect(await exitWithin(proc, 10_000)).not.toBeNull();
      expect(receivedAtKill).toBeGreaterThan(0);

      // Restart on the same directory: the stale pid file is not a live process, and Postgres recovers its WAL.
      const report = await runGateway(["usage", "report", "--org", org.id, "--data-dir", dataDir, "--json"], { env, timeoutMs: 60_000 });
      expect(report.stderr).toBe("");
      expect(report.code).toBe(0);
      const rows = onlyJson<{ total_tokens: number }[]>(report.stdout);
      const recorded = rows.reduce((a, r) => a + r.total_tokens, 0);
      const lost = received - recorded;
      console.log(`sigkill: delivered=${received} recorded=${recorded} lost=${lost} tokens`);
      expect(recorded).toBeGreaterThan(0);
      expect(recorded).toBeLessThanOrEqual(received);
      // At most ~one flush interval of traffic (200 ms of the ~1.5 s run), with slack for a busy machine.
      expect(lost).toBeLessThanOrEqual(received * 0.5);

      // And it serves again.
      const again = startGatewayProcess(["serve", "--port", String(port), "--data-dir", dataDir], { env });
      await waitFor200(`http://127.0.0.1:${port}/readyz`, 60_000);
      const me = await fetch(`http://127.0.0.1:${port}/v1/me`, { headers: { authorization: `Bearer ${key.key}` } });
      expect(me.status).toBe(200);
      again.kill("SIGTERM");
      expect(await exitWithin(again, 20_000)).toBe(0);
    } finally {
      await sim.stop();
    }
  }, 180_000);
});
