import { randomBytes } from "node:crypto";
import { eq } from "drizzle-orm";
import { createGuard } from "./auth/guard.ts";
import { createSecurityAuditor } from "./auth/security.ts";
import { type KeyVerifier, createKeyVerifier } from "./auth/verify.ts";
import { auditRoutes, meRoutes } from "./audit/routes.ts";
import type { Config } from "./config/schema.ts";
import { type Database, migrate, migrationsCurrent, openDatabase } from "./db/client.ts";
import { settings } from "./db/schema.ts";
import { createApp } from "./http/app.ts";
import { openApiDocument } from "./http/openapi.ts";
import { VERSION } from "./lib/version.ts";
import { createLogger, type Logger } from "./lib/log.ts";
import { createMetrics, type Metrics } from "./metrics/registry.ts";
import { type QuotaManager, createQuota } from "./limits/quota.ts";
import { createLimiter } from "./limits/store.ts";
import { createInference } from "./inference/routes.ts";
import type { HostLookup } from "./inference/image-url.ts";

export interface Gateway {
  url: string;
  port: number;
  config: Config;
  database: Database;
  log: Logger;
  /** Usage accounting (tests flush it to read the database). */
  quota: QuotaManager;
  metrics: Metrics;
  /** Where /metrics is served when `metrics.listen` is set. */
  metricsUrl: string | undefined;
  /** Graceful stop: refuse new connections, let in-flight requests finish up to drainMs, flush, close. */
  stop(): Promise<void>;
}

export interface StartOptions {
  config: Config;
  /** An already-open database (tests share one); otherwise opened from config and closed on stop. */
  database?: Database;
  log?: Logger;
  /** How image URL hosts are resolved (tests stand in for DNS); the system resolver by default. */
  lookup?: HostLookup;
}

/** The cursor HMAC secret: configured, or generated once and kept in the database (shared by instances). */
async function cursorSecret(database: Database, configured: string | undefined): Promise<string> {
  if (configured) return configured;
  const fresh = randomBytes(32).toString("base64url");
  await database.db.insert(settings).values({ key: "cursor_secret", value: fresh }).onConflictDoNothing();
  const [row] = await database.db.select().from(settings).where(eq(settings.key, "cursor_secret"));
  if (!row) throw new Error("cursor secret missing after insert");
  return row.value;
}

export async function startGateway(opts: StartOptions): Promise<Gateway> {
  const { config } = opts;
  const log = opts.log ?? createLogger(config.logLevel);
  const ownsDb = !opts.database;
  const database =
    opts.database ?? (await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir, poolMax: config.dbPoolMax }));
  try {
    const applied = await migrate(database);
    if (applied.length > 0) log.info("migrations applied", { applied });
    const secret = await cursorSecret(database, config.cursorSecret);

    const verifier = createKeyVerifier(database, config.keyCache);
    await verifier.start();
    const security = createSecurityAuditor(database, log);
    const limiter = createLimiter({ instances: config.rateLimit.instances, maxKeys: config.rateLimit.maxOrgs, windowMs: config.rateLimit.windowMs });
    const sweep = setInterval(() => limiter.sweep(Date.now()), 30_000);
    sweep.unref?.();
    const fallbackLimit = config.plans[config.defaultPlan]?.requestsPerMinute ?? 60;
    const guard = createGuard({
      verifier,
      limiter,
      keyTag: config.keyTag,
      security,
      planLimit: (plan) => config.plans[plan]?.requestsPerMinute ?? fallbackLimit,
    });
    const metrics = createMetrics();
    const quota = createQuota(database, log, {
      ...config.quota,
      // The embedded database runs in its own thread (src/db/pglite-worker.ts),
      // so a batch's insert no longer pauses request handling; it still runs
      // on the same cores, so batches stay moderate there.
      eventsPerBatch: database.kind === "pglite" ? 1_000 : 5_000,
      onSettle: (alias, prompt, completion) => {
        metrics.tokens.inc({ alias, direction: "prompt" }, prompt);
        metrics.tokens.inc({ alias, direction: "completion" }, completion);
      },
    });
    quota.start();
    const inference = createInference({ config, metering: quota, log, metrics, ...(opts.lookup ? { lookup: opts.lookup } : {}) });

    observeInternals(metrics, verifier, quota);
    const app = createApp({
      metrics,
      openapi: openApiDocument(VERSION),
      metricsRoute: config.metrics.enabled && !config.metrics.listen,
      guard,
      verifier,
      security,
      log,
      accessLog: config.accessLog,
      ready: async () => {
        const up = await database.ping();
        metrics.dbUp.set(up ? 1 : 0);
        return up && (await migrationsCurrent(database));
      },
      modules: [meRoutes, auditRoutes({ database, cursorSecret: secret, log }), inference.routes],
    });

    app.listen({
      hostname: config.host,
      port: config.port,
      // Elysia turns SO_REUSEPORT on by default, which lets a second instance
      // on a taken port start and quietly take part of the traffic.
      reusePort: config.reusePort,
      // Our own reader enforces bodyLimitBytes and answers 400 (spec 7), so
      // Bun's limit (which would answer 413 itself) sits above it.
      maxRequestBodySize: config.bodyLimitBytes * 2 + 1024 * 1024,
      // Idle connections and slow request bodies are cut after this; inference
      // requests lift it once their body is read (src/inference/routes.ts).
      idleTimeout: config.idleTimeoutS,
    });
    const server = app.server;
    if (!server) throw new Error("server did not start");
    // Metrics on their own address when configured, so they need not be public.
    let metricsServer: ReturnType<typeof Bun.serve> | undefined;
    if (config.metrics.enabled && config.metrics.listen) {
      const at = config.metrics.listen.lastIndexOf(":");
      metricsServer = Bun.serve({
        hostname: config.metrics.listen.slice(0, at).replace(/^\[|\]$/g, ""),
        port: Number(config.metrics.listen.slice(at + 1)),
        fetch: async (req) =>
          new URL(req.url).pathname === "/metrics"
            ? new Response(await metrics.registry.metrics(), { headers: { "content-type": metrics.registry.contentType } })
            : new Response("not found", { status: 404 }),
      });
    }
    const url = `http://${config.host.includes(":") ? `[${config.host}]` : config.host}:${server.port}`;

    let stopping: Promise<void> | undefined;
    return {
      url,
      port: server.port ?? config.port,
      config,
      database,
      log,
      quota,
      metrics,
      metricsUrl: metricsServer ? `http://${metricsServer.hostname}:${metricsServer.port}/metrics` : undefined,
      stop() {
        stopping ??= (async () => {
          const t0 = performance.now();
          const step = async (name: string, fn: () => Promise<unknown> | unknown) => {
            const t = performance.now();
            await fn();
            log.debug("shutdown step", { step: name, ms: Math.round(performance.now() - t) });
          };
          await step("drain", async () => {
            const drained = server.stop(false);
            let timer: ReturnType<typeof setTimeout> | undefined;
            const timedOut = new Promise<"timeout">((r) => {
              timer = setTimeout(() => r("timeout"), config.drainMs);
            });
            const over = (await Promise.race([drained.then(() => "done" as const), timedOut])) === "timeout";
            clearTimeout(timer);
            if (!over) return;
            // Streams end the way a mid-stream upstream failure does (error event, clean close, usage
            // settled), with a short, bounded moment for those last bytes; only then is what remains reset.
            const STREAM_FLUSH_MS = 1_000;
            const streams = inference.endStreams("The gateway is shutting down; the stream was ended. Retry the request.");
            log.warn("drain time over; ending open streams", { drain_ms: config.drainMs, streams });
            let flushTimer: ReturnType<typeof setTimeout> | undefined;
            const flushed = await Promise.race([
              drained.then(() => true),
              new Promise<boolean>((r) => {
                flushTimer = setTimeout(() => r(false), STREAM_FLUSH_MS);
              }),
            ]);
            clearTimeout(flushTimer);
            if (!flushed) {
              log.warn("closing remaining connections");
              await server.stop(true);
            }
          });
          clearInterval(sweep);
          await step("metrics", () => metricsServer?.stop(true));
          await step("inference", () => inference.stop());
          await step("usage", () => quota.stop());
          await step("security", () => security.drain());
          await step("keys", () => verifier.stop());
          if (ownsDb) await step("database", () => database.close());
          log.debug("shutdown complete", { ms: Math.round(performance.now() - t0) });
        })();
        return stopping;
      },
    };
  } catch (e) {
    if (ownsDb) await database.close().catch(() => {});
    throw e;
  }
}


/** Gauges and counters read from components' own counters at scrape time (nothing on the hot path). */
function observeInternals(metrics: Metrics, verifier: KeyVerifier, quota: QuotaManager) {
  let seenHits = 0;
  let seenMisses = 0;
  let seenThrottled = 0;
  const sync = () => {
    const v = verifier.stats();
    metrics.keyCache.inc({ result: "hit" }, v.hits - seenHits);
    metrics.keyCache.inc({ result: "miss" }, v.misses - seenMisses);
    metrics.keyCache.inc({ result: "throttled" }, v.throttled - seenThrottled);
    seenHits = v.hits;
    seenMisses = v.misses;
    seenThrottled = v.throttled;
    const q = quota.stats();
    metrics.usageBuffered.set(q.bufferedEvents);
    metrics.usagePendingTokens.set(q.pendingTokens);
    metrics.usageFlushFailures.set(q.flushFailures);
  };
  metrics.onScrape(sync);
}
