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

/** The value of `Key=` in a unit (the last one, as systemd reads a setting given twice), with %i replaced. */
function setting(text: string, key: string, instance = "9465"): string | undefined {
  const lines = text.split("\n").filter((l) => l.startsWith(`${key}=`));
  return lines.at(-1)?.slice(key.length + 1).replaceAll("%i", instance);
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

  test("what docs/operations.md says of them: migrate first on the same directory, no restart loop on exit 2, room to drain", async () => {
    const drainMs = (await loadConfig({ env: {} })).drainMs;
    for (const name of UNITS) {
      const text = unitText(name);
      const dir = `/var/lib/${setting(text, "StateDirectory")}`;
      expect({ name, pre: setting(text, "ExecStartPre"), start: setting(text, "ExecStart"), cwd: setting(text, "WorkingDirectory") }).toEqual({
        name,
        pre: `/usr/local/bin/gateway migrate --data-dir ${dir}`,
        start: `/usr/local/bin/gateway serve --data-dir ${dir}`,
        cwd: dir,
      });
      expect({ name, mode: setting(text, "StateDirectoryMode"), umask: setting(text, "UMask") }).toEqual({ name, mode: "0700", umask: "0077" });
      // Exit 2 is a configuration or argument error: restarting cannot fix it.
      expect({ name, restart: setting(text, "Restart"), prevent: setting(text, "RestartPreventExitStatus") }).toEqual({ name, restart: "on-failure", prevent: "2" });
      expect({ name, mdwe: setting(text, "MemoryDenyWriteExecute"), signal: setting(text, "KillSignal") }).toEqual({ name, mdwe: "no", signal: "SIGTERM" });
      const stop = /^(\d+)s$/.exec(setting(text, "TimeoutStopSec") ?? "");
      expect(Number(stop?.[1]) * 1000).toBeGreaterThan(drainMs + 5_000);
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

  test("docs/operations.md of gateway.service: a dynamic user, state in /var/lib/gateway, settings from /etc/gateway/gateway.env, the allocator setting", () => {
    const text = unitText("gateway.service");
    expect({ user: setting(text, "DynamicUser"), state: setting(text, "StateDirectory"), file: setting(text, "EnvironmentFile") }).toEqual({
      user: "yes",
      state: "gateway",
      // "-": the unit starts without the file too (then `serve` says no upstream is configured, exit 2, no restart loop).
      file: "-/etc/gateway/gateway.env",
    });
    // "sets MIMALLOC_PURGE_HOLES=0" (the template's environment is held above); nothing else is set in the unit itself.
    expect(environmentOf(text, "")).toEqual({ MIMALLOC_PURGE_HOLES: "0" });
    // The template reads the same file, each instance with a state directory of its own.
    const tpl = unitText("gateway@.service");
    expect({ user: setting(tpl, "DynamicUser"), state: setting(tpl, "StateDirectory"), file: setting(tpl, "EnvironmentFile") }).toEqual({
      user: "yes",
      state: "gateway-9465",
      file: "/etc/gateway/gateway.env",
    });
    // "run the CLI as the service's user instead (systemd-run … as the unit's comment shows)": the comment's properties are the unit's.
    const comment = text
      .split("\n")
      .filter((l) => l.startsWith("#"))
      .join("\n");
    expect(comment).toContain(`systemd-run --pty -p DynamicUser=${setting(text, "DynamicUser")} -p StateDirectory=${setting(text, "StateDirectory")}`);
  });

  test("with docs/operations.md's gateway.env, the single-instance unit serves on 127.0.0.1:8080 (its curl line), every alias at that upstream, metrics on 127.0.0.1:9464", async () => {
    const ops = readFileSync(join(ROOT, "docs", "operations.md"), "utf8");
    // echo 'UPSTREAM_BASE_URL=…' | sudo tee /etc/gateway/gateway.env
    const line = /echo '([A-Z_]+=[^']*)' \| sudo tee \/etc\/gateway\/gateway\.env/.exec(ops)?.[1];
    expect(line).toBeDefined();
    const [name = "", ...value] = (line ?? "").split("=");
    const cfg = await loadConfig({ env: { ...environmentOf(unitText("gateway.service"), ""), [name]: value.join("=") } });
    expect(ops).toContain(`curl -s http://${cfg.host}:${cfg.port}/readyz`);
    expect(Object.keys(cfg.aliases).sort()).toEqual(["svc-bigthink", "svc-embed", "svc-fast", "svc-smart"]);
    for (const a of Object.values(cfg.aliases)) expect(a.targets.map((t) => t.baseUrl)).toEqual([value.join("=")]);
    expect(cfg.metrics).toEqual({ enabled: true, listen: "127.0.0.1:9464" });
  });

  test("the single-instance unit keeps metrics on loopback and does not share its port", async () => {
    const env = environmentOf(unitText("gateway.service"), "");
    const cfg = await loadConfig({ env });
    expect(cfg.reusePort).toBe(false);
    expect(cfg.metrics.listen.startsWith("127.0.0.1:")).toBe(true);
  });
});
