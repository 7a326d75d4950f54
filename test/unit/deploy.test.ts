import { describe, expect, test } from "bun:test";
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { loadConfig } from "../../src/config/load.ts";
import { ROOT } from "../helpers/process.ts";

/**
 * The systemd units in deploy/: they must be valid units (systemd-analyze,
 * where the machine has it), and the environment they give the binary must
 * configure it as their comments say.
 */
const UNITS = ["gateway.service", "gateway@.service"];

function unitText(name: string): string {
  return readFileSync(join(ROOT, "deploy", name), "utf8");
}

/** `Environment=K=V` lines of a unit, with the instance specifier %i replaced. */
function environmentOf(text: string, instance: string): Record<string, string> {
  const env: Record<string, string> = {};
  for (const line of text.split("\n")) {
    const m = /^Environment=([A-Z_][A-Z0-9_]*)=(.*)$/.exec(line.trim());
    if (m?.[1] !== undefined && m[2] !== undefined) env[m[1]] = m[2].replaceAll("%i", instance);
  }
  return env;
}

const analyze = Bun.which("systemd-analyze");

describe("deploy/ systemd units", () => {
  test.skipIf(!analyze)("systemd-analyze verify accepts both units", async () => {
    const dir = mkdtempSync(join(tmpdir(), "gw-units-"));
    for (const name of UNITS) {
      // verify checks that ExecStart's binary exists: point it at one that does.
      writeFileSync(join(dir, name), unitText(name).replaceAll("/usr/local/bin/gateway", "/bin/true"));
    }
    for (const unit of ["gateway.service", "gateway@9465.service"]) {
      const p = Bun.spawnSync([analyze ?? "systemd-analyze", "verify", "--man=no", unit], { cwd: dir, stderr: "pipe", stdout: "pipe" });
      const out = `${p.stdout.toString()}${p.stderr.toString()}`;
      expect({ unit, code: p.exitCode, out }).toEqual({ unit, code: 0, out: "" });
    }
  });

  test("the template runs each instance on the shared port with its own metrics listener", async () => {
    const env = environmentOf(unitText("gateway@.service"), "9465");
    expect(env).toEqual({ GATEWAY_REUSE_PORT: "1", METRICS_LISTEN: "127.0.0.1:9465", MIMALLOC_PURGE_HOLES: "0" });
    const cfg = await loadConfig({
      env: { ...env, DATABASE_URL: "postgres://gateway@127.0.0.1:5432/gateway", PORT: "8080", GATEWAY_RATE_LIMIT_INSTANCES: "4" },
    });
    expect(cfg.reusePort).toBe(true);
    expect(cfg.metrics.listen).toBe("127.0.0.1:9465");
    expect(cfg.port).toBe(8080);
    expect(cfg.rateLimit.instances).toBe(4);
    // Without a shared Postgres the template's settings are refused (exit 2 in serve).
    await expect(loadConfig({ env })).rejects.toThrow("/reusePort");
  });

  test("the single-instance unit keeps metrics on loopback and does not share its port", async () => {
    const env = environmentOf(unitText("gateway.service"), "");
    const cfg = await loadConfig({ env });
    expect(cfg.reusePort).toBe(false);
    expect(cfg.metrics.listen.startsWith("127.0.0.1:")).toBe(true);
  });
});
