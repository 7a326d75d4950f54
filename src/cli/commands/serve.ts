import { serveAdminSocket } from "../admin-socket.ts";
import { defineCommand } from "../command.ts";
import { config, int, waitForSignal } from "../context.ts";
import { seedDemo } from "../demo.ts";
import { ConfigError, serveProblems, upstreamAliases } from "../../config/load.ts";
import type { Config } from "../../config/schema.ts";
import { runtimeEnvWarning } from "../../lib/runtime-env.ts";
import { VERSION } from "../../lib/version.ts";
import { startGateway } from "../../server.ts";
import { startSimulator } from "../../sim/index.ts";

export const serve = defineCommand({
  group: "serve",
  summary: "run the gateway until SIGTERM, SIGINT or SIGHUP (each a graceful stop)",
  flags: {
    host: { type: "string", value: "HOST", description: "address to listen on (or HOST)" },
    port: { type: "string", value: "PORT", description: "port to listen on (or PORT; 0 picks a free one)" },
    demo: { type: "boolean", description: "in-memory database, simulated upstream, seeded keys: runs with nothing set up" },
  },
  common: ["config", "data-dir"],
  notes: [
    "The upstreams come from UPSTREAM_BASE_URL or the config file's aliases.",
    "On the embedded database, admin commands run inside the server through admin/admin.sock in the data directory.",
  ],
  examples: ["gateway serve --demo", "gateway serve --config /etc/gateway/config.json"],
  async run({ values }, { out, runCli }) {
    const overrides: Partial<Config> = {};
    if (values.host) overrides.host = values.host;
    if (values.port) overrides.port = int(values.port, "--port");
    let sim: Awaited<ReturnType<typeof startSimulator>> | undefined;
    let cfg: Config;
    let ignoredDatabase = false;
    if (values.demo) {
      // Demo: an in-memory database and an in-process simulated upstream, so it runs anywhere with nothing set up.
      sim = await startSimulator({ port: 0, ttftMs: 150, interTokenMs: 30 });
      const base = await config(values, { ...overrides, dataDir: values["data-dir"] ?? "memory://demo" });
      // Never a configured Postgres (DATABASE_URL): the demo would seed its organisation and keys there, into
      // whatever earlier runs left. The embedded database, in memory unless --data-dir: every demo starts clean.
      const { databaseUrl, ...embedded } = base;
      ignoredDatabase = databaseUrl !== undefined;
      cfg = {
        ...embedded,
        reusePort: false,
        aliases: Object.keys(base.aliases).length ? base.aliases : (upstreamAliases(sim.url) as Config["aliases"]),
        // The demo shows everything the gateway can serve, the optional Responses API included.
        responses: { ...base.responses, enabled: true },
      };
    } else {
      cfg = await config(values, overrides);
      const problems = serveProblems(cfg);
      if (problems.length > 0) throw new ConfigError(problems);
    }
    const gw = await startGateway({ config: cfg });
    // From the moment it listens, SIGTERM/SIGINT/SIGHUP are a graceful stop: handled now, before the awaits
    // below (the demo's seeding), not after them, when the signal's default action killed it (exit 143).
    // A second one ends the drain at once (open streams cut and charged, as at drainMs), then usage is
    // written and leases returned as usual; later ones are logged. Never a kill: that loses the usage
    // settled since the last write and strands the leases (SIGKILL stays the operator's hard stop).
    const signalled = waitForSignal((signal) => {
      if (gw.hurry()) gw.log.warn("stop signal again: ending the drain now; open streams are cut and charged, usage is still written", { signal });
      else gw.log.warn("already stopping: writing usage and returning quota leases (SIGKILL ends the process without them)", { signal });
    });
    gw.log.info("listening", { url: gw.url, metrics_url: gw.metricsUrl ?? null, database: gw.database.kind, demo: values.demo ?? false, version: VERSION });
    // The allocator reads its setting only at start (src/lib/runtime-env.ts): say what is missing, once.
    const allocator = runtimeEnvWarning();
    if (allocator) gw.log.warn(allocator);
    if (ignoredDatabase) gw.log.warn("demo: the configured database (DATABASE_URL / databaseUrl) is not used; the demo runs on the embedded one", { data_dir: cfg.dataDir });
    if (values.demo) out.stdout(await seedDemo(gw));
    const embeddedOnDisk = gw.database.kind === "pglite" && !cfg.dataDir.startsWith("memory://");
    const stopAdmin = embeddedOnDisk ? serveAdminSocket(cfg.dataDir, gw.database, cfg, runCli) : undefined;
    const sig = await signalled;
    gw.log.info("shutting down", { signal: sig, drain_ms: cfg.drainMs });
    stopAdmin?.();
    await gw.stop();
    await sim?.stop();
    gw.log.info("stopped");
    return 0;
  },
});
