import { randomBytes } from "node:crypto";
import { and, eq } from "drizzle-orm";
import { createGuard } from "./auth/guard.ts";
import { createSecurityAuditor, type SecurityAuditor } from "./auth/security.ts";
import { type KeyVerifier, createKeyVerifier } from "./auth/verify.ts";
import { auditRoutes } from "./audit/routes.ts";
import { meRoutes } from "./auth/routes.ts";
import { listenAddress } from "./config/load.ts";
import type { Config } from "./config/schema.ts";
import { type Database, migrate, openDatabase, unknownMigrations } from "./db/client.ts";
import { createReadiness } from "./db/ready.ts";
import { settings } from "./db/schema.ts";
import { type Bound, createBound, maxOutAtOnce } from "./db/bounded.ts";
import { createApp } from "./http/app.ts";
import { errorBody } from "./http/errors.ts";
import { openApiDocument } from "./http/openapi.ts";
import { VERSION } from "./lib/version.ts";
import { createLogger, type Logger } from "./lib/log.ts";
import { createMetrics, type Metrics } from "./metrics/registry.ts";
import { type QuotaManager, createQuota } from "./limits/quota.ts";
import { createLimiter, type Limiter } from "./limits/store.ts";
import { createInference } from "./inference/routes.ts";
import type { HostLookup } from "./inference/image-url.ts";
import { firstSeen } from "./lib/once.ts";
import { resolvesWithin } from "./lib/within.ts";

export interface Gateway {
  url: string;
  port: number;
  config: Config;
  database: Database;
  log: Logger;
  /** Usage accounting (tests flush it to read the database). */
  quota: QuotaManager;
  metrics: Metrics;
  /** Where /metrics is served (its own listener, or the main one with `metrics.listen: "main"`); unset when disabled. */
  metricsUrl: string | undefined;
  /** The routes the app serves (method, path): the one route list, which the OpenAPI document is tested against. */
  routes: { method: string; path: string }[];
  /** Graceful stop: refuse new connections, let in-flight requests finish up to drainMs, flush, close. */
  stop(): Promise<void>;
  /**
   * End the stop's drain now, as its drainMs would (open streams get their error event and are charged),
   * then write usage and return leases as usual: a second stop signal. True when a drain was still to end.
   */
  hurry(): boolean;
}

export interface StartOptions {
  config: Config;
  /** An already-open database (tests share one); otherwise opened from config and closed on stop. */
  database?: Database;
  log?: Logger;
  /** How image URL hosts are resolved (tests stand in for DNS); the system resolver by default. */
  lookup?: HostLookup;
  /** The quota's clock, epoch ms (tests move it to the end of a quota period); Date.now by default. */
  now?: () => number;
}

/** The cursor HMAC secret: configured, or generated once and kept in the database (shared by instances). */
/** A stored cursor secret is used when it has this many characters (the config's `cursorSecret` has at least 32). */
const SECRET_CHARS = { min: 32, max: 1024 };

async function cursorSecret(database: Database, configured: string | undefined, log: Logger): Promise<string> {
  if (configured) return configured;
  const fresh = randomBytes(32).toString("base64url");
  await database.db.insert(settings).values({ key: "cursor_secret", value: fresh }).onConflictDoNothing();
  const [row] = await database.db.select().from(settings).where(eq(settings.key, "cursor_secret"));
  if (!row) throw new Error("cursor secret missing after insert");
  if (row.value.length >= SECRET_CHARS.min && row.value.length <= SECRET_CHARS.max) return row.value;
  // Empty (every audit page with a next one failed), short (guessable) or huge (hashed on every page):
  // replaced only if no other instance replaced it meanwhile, so all instances agree on the one they read.
  await database.db.update(settings).set({ value: fresh }).where(and(eq(settings.key, "cursor_secret"), eq(settings.value, row.value)));
  const [current] = await database.db.select().from(settings).where(eq(settings.key, "cursor_secret"));
  log.warn("the settings row cursor_secret breaks the gateway's rules: replaced (audit cursors issued before no longer page)", {
    problem: `${row.value.length} characters, not ${SECRET_CHARS.min} to ${SECRET_CHARS.max}`,
  });
  if (!current || current.value.length < SECRET_CHARS.min) throw new Error("cursor secret missing after replacing it");
  return current.value;
}

export async function startGateway(opts: StartOptions): Promise<Gateway> {
  const { config } = opts;
  const log = opts.log ?? createLogger(config.logLevel);
  const ownsDb = !opts.database;
  const metrics = createMetrics();
  const metricsOnMain = config.metrics.enabled && config.metrics.listen === "main";
  let metricsServer: ReturnType<typeof Bun.serve> | undefined;
  /** What has started, for a start that fails later (a taken port): stopped, last first, before the database closes. */
  const started: (() => unknown)[] = [];
  const database =
    opts.database ?? (await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir, poolMax: config.dbPoolMax }));
  try {
    // Metrics name upstream targets and internal figures, so by default they
    // have a listener of their own on loopback; "main" puts them on the public
    // port. Bound first, so that a taken address fails before anything starts.
    if (config.metrics.enabled && !metricsOnMain) metricsServer = serveMetrics(config.metrics.listen, metrics);
    const applied = await migrate(database);
    if (applied.length > 0) log.info("migrations applied", { applied });
    // Served all the same: in a rolling deploy the first new instance migrates while the old ones still run and restart.
    const ahead = await unknownMigrations(database);
    if (ahead) log.warn(ahead.message, { unknown: ahead.unknown, database_newest: ahead.databaseNewest, gateway_newest: ahead.gatewayNewest });
    const secret = await cursorSecret(database, config.cursorSecret, log);

    const verifier = createKeyVerifier(database, { ...config.keyCache, log });
    await verifier.start();
    started.push(() => verifier.stop());
    const security = createSecurityAuditor(database, log);
    started.push(() => security.drain());
    const limiter = createLimiter({ instances: config.rateLimit.instances, maxKeys: config.rateLimit.maxOrgs, windowMs: config.rateLimit.windowMs });
    // Organisations idle for a window hold no state that matters: drop them at least once a window.
    const sweep = setInterval(() => limiter.sweep(Date.now()), Math.min(30_000, config.rateLimit.windowMs));
    sweep.unref?.();
    started.push(() => clearInterval(sweep));
    const fallbackLimit = config.plans[config.defaultPlan]?.requestsPerMinute ?? 60;
    // A plan the configuration does not name (hand-edited, or a newer instance's config) is limited as the
    // default plan, what a new organisation gets; logged once per organisation (docs/decisions.md, Rows read from the database).
    const firstUnknownPlan = firstSeen();
    const planLimit = (plan: string, orgId: string): number => {
      if (Object.hasOwn(config.plans, plan)) return config.plans[plan]?.requestsPerMinute ?? fallbackLimit;
      if (firstUnknownPlan(`${orgId}|${plan}`)) {
        log.warn("an organization row breaks the gateway's rules", {
          org_id: orgId,
          problem: `plan ${JSON.stringify(plan.slice(0, 40))} is not in the configuration's plans: limited as the default plan ${config.defaultPlan} (${fallbackLimit} requests a minute)`,
        });
      }
      return fallbackLimit;
    };
    const guard = createGuard({
      verifier,
      limiter,
      keyTag: config.keyTag,
      security,
      planLimit,
    });
    // Each kind of database work given up on holds at most a quarter of the pool (docs/decisions.md:
    // database work given up on); key lookups and usage writes have bounds of their own.
    const outAtOnce = maxOutAtOnce(database.poolMax);
    const bounds: Record<string, Bound> = {
      lease: createBound("quota lease", outAtOnce, log),
      budget_audit: createBound("budget_exceeded audit write", outAtOnce, log),
      audit_read: createBound("audit-log read", outAtOnce, log),
      response_read: createBound("stored-response read", outAtOnce, log),
    };
    const quota = createQuota(database, log, {
      ...config.quota,
      leaseBound: bounds.lease,
      budgetAuditBound: bounds.budget_audit,
      ...(opts.now ? { now: opts.now } : {}),
      // The embedded database runs in its own thread (src/db/pglite-worker.ts),
      // so a batch's insert no longer pauses request handling; it still runs
      // on the same cores, so batches stay moderate there. Records are summed
      // into a row per key, alias, target and status (usage-log.ts aggregate),
      // so a batch of busy keys is a few rows.
      eventsPerBatch: database.kind === "pglite" ? 10_000 : 50_000,
      onSettle: (alias, prompt, completion) => {
        metrics.tokens.inc({ alias, direction: "prompt" }, prompt);
        metrics.tokens.inc({ alias, direction: "completion" }, completion);
      },
    });
    quota.start();
    started.push(() => quota.stop());
    const inference = createInference({ config, metering: quota, log, metrics, ...(opts.lookup ? { lookup: opts.lookup } : {}) });
    started.push(() => inference.stop());

    // Off by default: the spec's v1 surface is chat, embeddings and models (docs/decisions.md: Responses API).
    // Imported only when the operator turned the Responses API on (off by default): a process holds no code it does not run.
    const responsesApi = config.responses.enabled ? (await import("./responses/routes.ts")).createResponses({ config, database, log, chat: inference, readBound: bounds.response_read }) : undefined;
    responsesApi?.start();
    started.push(() => responsesApi?.stop());

    observeInternals(metrics, verifier, quota, limiter, database, bounds, security);
    const app = createApp({
      metrics,
      openapi: JSON.stringify(openApiDocument(VERSION, { responses: responsesApi !== undefined })),
      metricsRoute: metricsOnMain,
      guard,
      verifier,
      security,
      log,
      accessLog: config.accessLog,
      // One check out at a time, shared by concurrent polls, each answered within READY_TIMEOUT_MS (src/db/ready.ts).
      ready: createReadiness(database, (up) => metrics.dbUp.set(up ? 1 : 0)).ready,
      modules: [meRoutes, auditRoutes({ database, cursorSecret: secret, log, bound: bounds.audit_read }), inference.routes, ...(responsesApi ? [responsesApi.routes] : [])],
    });

    app.listen({
      hostname: config.host,
      port: config.port,
      // Elysia turns SO_REUSEPORT on by default, which lets a second instance
      // on a taken port start and quietly take part of the traffic.
      reusePort: config.reusePort,
      // Bun's own limit would answer a bare 413 before any of our code runs;
      // spec 7 wants 400 in the error shape at every size. So Bun's limit is
      // off and our reader enforces bodyLimitBytes (src/http/body.ts): it
      // refuses a declared length over the limit without reading a byte, cuts
      // a chunked body at the limit, and the answer closes the connection, so
      // the rest is never read. No route reads a body any other way. (A
      // Content-Length of 18 digits or more is malformed to Bun's parser and
      // gets its bare 400.)
      maxRequestBodySize: Number.POSITIVE_INFINITY,
      // Idle connections and slow request bodies are cut after this; inference
      // requests lift it once their body is read (src/inference/routes.ts).
      idleTimeout: config.idleTimeoutS,
    });
    const server = app.server;
    if (!server) throw new Error("server did not start");
    const url = httpUrl(config.host, server.port ?? config.port);

    let stopping: Promise<void> | undefined;
    /** Set by hurry(): the drain ends at once (docs/decisions.md: Shutdown, a second signal). */
    let hurried = false;
    let endDrain = () => {};
    const drainEnded = new Promise<"hurried">((r) => {
      endDrain = () => r("hurried");
    });
    /** The drain step is over (finished, timed out or cut): nothing is left for hurry() to end. */
    let drainOver = false;
    return {
      url,
      port: server.port ?? config.port,
      config,
      database,
      log,
      quota,
      metrics,
      routes: app.routes.map((r) => ({ method: r.method, path: r.path })),
      metricsUrl: metricsServer ? `${httpUrl(metricsServer.hostname ?? "", metricsServer.port ?? 0)}/metrics` : metricsOnMain ? `${url}/metrics` : undefined,
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
            const how = await Promise.race([drained.then(() => "done" as const), timedOut, drainEnded]);
            clearTimeout(timer);
            if (how === "done") return;
            // Streams end the way a mid-stream upstream failure does (error event, clean close, usage
            // settled), with a short, bounded moment for those last bytes; only then is what remains reset.
            const STREAM_FLUSH_MS = 1_000;
            const streams = inference.endStreams("The gateway is shutting down; the stream was ended. Retry the request.");
            // Requests still waiting for an upstream's answer are answered 503 the same moment (not reset with
            // their connection below), and settled before the final usage write (inference.stop waits for them).
            const requests = inference.endCalls("The gateway is shutting down; the request was ended. Retry the request.");
            if (how === "timeout") log.warn("drain time over; ending open streams", { drain_ms: config.drainMs, streams, requests });
            else log.warn("drain ended by a second stop signal; ending open streams", { streams, requests });
            if (!(await resolvesWithin(drained, STREAM_FLUSH_MS))) {
              log.warn("closing remaining connections");
              await server.stop(true);
            }
          });
          drainOver = true;
          clearInterval(sweep);
          await step("metrics", () => metricsServer?.stop(true));
          await step("inference", () => inference.stop());
          // Usage first: it is what is billed, and stored responses add none to it.
          // Stored responses wait at most ANSWER_TIMEOUT_MS (store-queue.ts); before, their write waited on a locked table
          // with no bound, ahead of the usage, until the service manager killed the process (responses-metering.test.ts).
          await step("usage", () => quota.stop());
          await step("responses", () => responsesApi?.stop());
          await step("security", () => security.drain());
          await step("keys", () => verifier.stop());
          if (ownsDb) await step("database", () => database.close());
          log.debug("shutdown complete", { ms: Math.round(performance.now() - t0) });
        })();
        return stopping;
      },
      hurry() {
        if (drainOver || hurried) return false;
        hurried = true;
        endDrain();
        return true;
      },
    };
  } catch (e) {
    for (const stop of started.reverse()) await Promise.resolve().then(stop).catch(() => {});
    metricsServer?.stop(true);
    if (ownsDb) await database.close().catch(() => {});
    throw e;
  }
}

function httpUrl(host: string, port: number): string {
  return `http://${host.includes(":") ? `[${host}]` : host}:${port}`;
}

/** The metrics listener: GET /metrics and nothing else; it takes no request bodies. */
function serveMetrics(listen: string, metrics: Metrics): ReturnType<typeof Bun.serve> {
  const notFound = () => Response.json(errorBody("not_found", "Only GET /metrics is served here."), { status: 404 });
  try {
    return Bun.serve({
      ...listenAddress(listen),
      maxRequestBodySize: 64 * 1024,
      idleTimeout: 30,
      fetch: async (req) => {
        if (new URL(req.url).pathname !== "/metrics" || (req.method !== "GET" && req.method !== "HEAD")) return notFound();
        return new Response(await metrics.registry.metrics(), { headers: { "content-type": metrics.registry.contentType } });
      },
    });
  } catch (e) {
    throw new Error(`metrics.listen ${listen}: cannot listen (${e instanceof Error ? e.message : String(e)}); set another host:port, or "main"`);
  }
}

/** Gauges and counters read from components' own counters at scrape time (nothing on the hot path). */
function observeInternals(
  metrics: Metrics,
  verifier: KeyVerifier,
  quota: QuotaManager,
  limiter: Limiter,
  database: Database,
  bounds: Record<string, Bound>,
  security: SecurityAuditor,
) {
  let seenHits = 0;
  let seenDropped = 0;
  let seenTransactions = 0;
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
    metrics.keyLookupsUnanswered.set(v.unansweredLookups);
    const q = quota.stats();
    metrics.usageBuffered.set(q.bufferedEvents);
    metrics.usagePendingTokens.set(q.pendingTokens);
    metrics.usageFlushFailures.set(q.flushFailures);
    metrics.usageUnanswered.set(q.unansweredWrites);
    for (const [work, b] of Object.entries(bounds)) metrics.dbUnanswered.set({ work }, b.unanswered());
    metrics.rateLimitOrgs.set(limiter.size());
    const dropped = security.stats().dropped;
    metrics.securityDropped.inc(dropped - seenDropped);
    seenDropped = dropped;
    if (database.transactions) {
      const t = database.transactions();
      metrics.dbTransactions.inc(t - seenTransactions);
      seenTransactions = t;
    }
  };
  metrics.onScrape(sync);
}
