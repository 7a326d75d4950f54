import { Counter, Gauge, Histogram, Registry } from "./exposition.ts";
import { registerProcessMetrics } from "./process.ts";

/**
 * Prometheus metrics, in our own text exposition (./exposition.ts; prom-client
 * until 2026-11-27, see docs/decisions.md). Labels come from small closed sets
 * only — route patterns, status codes, alias names from the config, target
 * labels — never a key, a prompt, a reply or a raw path.
 */

const LATENCY_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300];

/**
 * The route label of a request: the route pattern that served it when it is
 * one of the app's own (`paths`: its route list; `/v1/responses/:id`), or a
 * path that names one exactly, with or without one trailing slash (Elysia
 * serves `/v1/models/` as `/v1/models`); else "other", so scanners cannot grow
 * the label set.
 */
export function routeLabeler(paths: Iterable<string>): (path: string) => string {
  const known = new Set(paths);
  return (path) => {
    if (known.has(path)) return path;
    const trimmed = path.length > 1 && path.endsWith("/") ? path.slice(0, -1) : undefined;
    return trimmed !== undefined && known.has(trimmed) ? trimmed : "other";
  };
}

const KNOWN_METHODS = new Set(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]);

/** Any other method a client invents is "other": labels stay a small closed set. */
export function methodLabel(method: string): string {
  return KNOWN_METHODS.has(method) ? method : "other";
}

export function createMetrics() {
  const registry = new Registry();
  const registers = [registry];
  // Without the per-space heap gauges: Bun answers v8.getHeapSpaceStatistics()
  // by walking the whole heap, on the request thread: 40 ms at 200,000 live
  // objects, over 100 ms at a million, a stall for every request and stream at
  // each scrape. The heap's size and use (process.memoryUsage, no walk) stay as
  // nodejs_heap_size_*_bytes.
  registerProcessMetrics(registry, "gateway_");
  // Values owned by other components (cache and buffer counters) are read at scrape time, never on the hot path.
  const scrapeHooks: (() => void)[] = [];
  return {
    registry,
    onScrape(fn: () => void) {
      scrapeHooks.push(fn);
    },
    requests: new Counter({
      name: "gateway_http_requests_total",
      help: "HTTP requests by route, method, status and error code",
      labelNames: ["route", "method", "status", "code"] as const,
      registers,
    }),
    duration: new Histogram({
      name: "gateway_http_request_duration_seconds",
      help: "Time to the response headers, by route (streams: until the stream starts)",
      labelNames: ["route"] as const,
      buckets: LATENCY_BUCKETS,
      registers,
    }),
    upstreamFirstByte: new Histogram({
      name: "gateway_upstream_first_byte_seconds",
      help: "Upstream time to response headers, by alias",
      labelNames: ["alias"] as const,
      buckets: LATENCY_BUCKETS,
      registers,
    }),
    tokens: new Counter({
      name: "gateway_tokens_total",
      help: "Tokens by alias and direction (prompt, completion)",
      labelNames: ["alias", "direction"] as const,
      registers,
    }),
    rateLimited: new Counter({ name: "gateway_rate_limited_total", help: "Requests refused by the rate limit", registers }),
    budgetExceeded: new Counter({ name: "gateway_budget_exceeded_total", help: "Requests refused because the quota is spent", registers }),
    activeStreams: new Gauge({ name: "gateway_active_streams", help: "Streamed responses in progress", registers }),
    upstreamAttempts: new Counter({
      name: "gateway_upstream_attempts_total",
      help: "Upstream attempts by alias, target and outcome (ok, http_<status>, timeout, connect_error)",
      labelNames: ["alias", "target", "outcome"] as const,
      registers,
    }),
    usageBuffered: new Gauge({
      name: "gateway_usage_buffered_events",
      help: "Usage records waiting to be written",
      registers,
      // The registry runs every collect hook before it writes anything, so a
      // scrape shows the values of its own moment, the first scrape included.
      collect() {
        for (const fn of scrapeHooks) fn();
      },
    }),
    breakerOpen: new Gauge({
      name: "gateway_upstream_breaker_open",
      help: "1 while a target's circuit breaker is open",
      labelNames: ["target"] as const,
      registers,
    }),
    rateLimitOrgs: new Gauge({ name: "gateway_rate_limit_orgs", help: "Organisations the rate limiter holds a window for", registers }),
    usagePendingTokens: new Gauge({ name: "gateway_usage_pending_tokens", help: "Settled tokens not yet written to the database", registers }),
    usageFlushFailures: new Gauge({ name: "gateway_usage_flush_failures", help: "Failed usage writes since start (retried)", registers }),
    usageUnanswered: new Gauge({
      name: "gateway_usage_unanswered_writes",
      help: "Usage writes given up on without an answer from the database that have not settled yet (each may hold a database connection)",
      registers,
    }),
    dbUnanswered: new Gauge({
      name: "gateway_database_unanswered",
      help: "Database work given up on without an answer that has not settled yet, by kind (each may hold a database connection)",
      labelNames: ["work"] as const,
      registers,
    }),
    keyLookupsUnanswered: new Gauge({
      name: "gateway_key_lookups_unanswered",
      help: "Key lookups given up on without an answer from the database that have not settled yet (each may hold a database connection)",
      registers,
    }),
    keyCache: new Counter({
      name: "gateway_key_cache_total",
      help: "Key verifications served from the cache (hit), the database (miss), or refused without a lookup (throttled)",
      labelNames: ["result"] as const,
      registers,
    }),
    securityDropped: new Counter({
      name: "gateway_security_events_dropped_total",
      help: "Security audit events dropped because the writes were busy and the queue full (docs/decisions.md: security audit writes are bounded)",
      registers,
    }),
    dbTransactions: new Counter({
      name: "gateway_database_transactions_total",
      help: "Transactions started on the embedded database (statements outside a transaction and BEGINs); 0 on Postgres, whose pg_stat_database counts them",
      registers,
    }),
    dbUp: new Gauge({ name: "gateway_database_up", help: "1 when the last readiness check reached the database", registers }),
  };
}

export type Metrics = ReturnType<typeof createMetrics>;
