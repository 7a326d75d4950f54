import { describe, expect, test } from "bun:test";
import { Counter, Gauge, Histogram, Registry } from "../../src/metrics/exposition.ts";
import { createMetrics } from "../../src/metrics/registry.ts";
import { type Family, parseExposition } from "../helpers/prom-text.ts";

/**
 * Our own Prometheus exposition (src/metrics/exposition.ts) replaced
 * prom-client: it must write what prom-client wrote for the same metrics,
 * and what it writes must be valid 0.0.4 text (test/helpers/prom-text.ts, a
 * strict line-by-line reader).
 */
const BUCKETS = [0.001, 0.01, 0.1, 1];

/** What prom-client 15.1.3 wrote for the observations of `observe` below (captured 2026-11-27, before it was removed). */
const PROM_CLIENT = `# HELP c_total c
# TYPE c_total counter
c_total{route="/a",status="200"} 8
c_total{route="/b\\"\\\\\\n",status="201"} 10
c_total{route="/a",status="202"} 3
c_total{route="/b\\"\\\\\\n",status="200"} 4
c_total{route="/a",status="201"} 5
c_total{route="/b\\"\\\\\\n",status="202"} 6

# HELP h_seconds h
# TYPE h_seconds histogram
h_seconds_bucket{le="0.001",route="/a"} 1
h_seconds_bucket{le="0.01",route="/a"} 2
h_seconds_bucket{le="0.1",route="/a"} 2
h_seconds_bucket{le="1",route="/a"} 3
h_seconds_bucket{le="+Inf",route="/a"} 4
h_seconds_sum{route="/a"} 7.5055
h_seconds_count{route="/a"} 4
h_seconds_bucket{le="0.001",route="/b\\"\\\\\\n"} 2
h_seconds_bucket{le="0.01",route="/b\\"\\\\\\n"} 2
h_seconds_bucket{le="0.1",route="/b\\"\\\\\\n"} 3
h_seconds_bucket{le="1",route="/b\\"\\\\\\n"} 4
h_seconds_bucket{le="+Inf",route="/b\\"\\\\\\n"} 4
h_seconds_sum{route="/b\\"\\\\\\n"} 1.101
h_seconds_count{route="/b\\"\\\\\\n"} 4

# HELP plain_total a help with \\\\ and\\nnewline and "quotes"
# TYPE plain_total counter
plain_total 2.5

# HELP g g
# TYPE g gauge
g 1

# HELP gl gl
# TYPE gl gauge
gl{target="t1"} 1
gl{target="t0"} 0
`;

function observe() {
  const r = new Registry();
  const c = new Counter({ name: "c_total", help: "c", labelNames: ["route", "status"] as const, registers: [r] });
  const h = new Histogram({ name: "h_seconds", help: "h", labelNames: ["route"] as const, buckets: BUCKETS, registers: [r] });
  const plain = new Counter({ name: "plain_total", help: 'a help with \\ and\nnewline and "quotes"', registers: [r] });
  const g = new Gauge({ name: "g", help: "g", registers: [r] });
  const gl = new Gauge({ name: "gl", help: "gl", labelNames: ["target"] as const, registers: [r] });
  // Values on the bucket bounds, between them, above all of them; labels needing escapes.
  const values = [0.0005, 0.001, 0.005, 0.1, 0.5, 1, 7, 0];
  const routes = ["/a", '/b"\\\n'];
  for (const [i, v] of values.entries()) {
    const route = routes[i % 2] ?? "";
    c.inc({ route, status: 200 + (i % 3) }, i + 1);
    h.record(route, v);
  }
  plain.inc(2.5);
  g.inc();
  g.inc();
  g.dec();
  gl.set({ target: "t1" }, 1);
  gl.set({ target: "t0" }, 0);
  return { r, c, h };
}

describe("metrics exposition", () => {
  test("writes byte for byte what prom-client wrote for the same observations", () => {
    const { r, c } = observe();
    expect(r.metrics()).toBe(PROM_CLIENT);
    // A scrape changes nothing: increments after it are added once.
    expect(r.metrics()).toBe(PROM_CLIENT);
    c.inc({ route: "/a", status: 200 });
    expect(r.metrics()).toBe(PROM_CLIENT.replace('c_total{route="/a",status="200"} 8', 'c_total{route="/a",status="200"} 9'));
  });

  test("label values and HELP keep backslash, quote and newline through escaping", () => {
    const families = parseExposition(observe().r.metrics());
    expect(families.get("plain_total")?.help).toBe('a help with \\ and\nnewline and "quotes"');
    const routes = families.get("c_total")?.samples.map((s) => s.labels.route);
    expect(new Set(routes)).toEqual(new Set(["/a", '/b"\\\n']));
    const h = families.get("h_seconds");
    expect(h?.type).toBe("histogram");
    expect(h?.samples.filter((s) => s.name === "h_seconds_bucket" && s.labels.le === "+Inf").map((s) => s.value)).toEqual([4, 4]);
  });

  test("reset empties a histogram", () => {
    const r = new Registry();
    const h = new Histogram({ name: "h_seconds", help: "h", labelNames: ["route"] as const, buckets: BUCKETS, registers: [r] });
    h.record("/a", 0.5);
    r.resetMetrics();
    expect(r.metrics()).not.toContain('route="/a"');
  });

  test("a counter does not go down; names and label names are checked", () => {
    const c = new Counter({ name: "x_total", help: "x" });
    expect(() => c.inc(-1)).toThrow();
    expect(() => c.inc(Number.NaN)).toThrow();
    expect(() => new Counter({ name: "bad-name", help: "x" })).toThrow();
    expect(() => new Gauge({ name: "g", help: "x", labelNames: ["__reserved"] })).toThrow();
    expect(() => new Histogram({ name: "h", help: "x", labelNames: ["le"], buckets: [1] })).toThrow();
    const r = new Registry();
    new Gauge({ name: "dup", help: "x", registers: [r] });
    expect(() => new Gauge({ name: "dup", help: "x", registers: [r] })).toThrow();
  });

  test("the strict reader refuses what Prometheus would refuse or misread", () => {
    const ok = "# HELP a_total a\n# TYPE a_total counter\na_total 1\n";
    expect(parseExposition(ok).get("a_total")?.samples[0]?.value).toBe(1);
    const hist = (buckets: string) =>
      `# HELP h h\n# TYPE h histogram\n${buckets}h_sum{r="x"} 1\nh_count{r="x"} 2\n`;
    expect(() => parseExposition(hist('h_bucket{le="1",r="x"} 1\nh_bucket{le="+Inf",r="x"} 2\n'))).not.toThrow();
    const bad = [
      "# HELP a_total a\n# TYPE a_total counter\na_total 1", // no final newline
      "a_total 1\n", // no HELP or TYPE
      "# HELP a_total a\n# TYPE a_total counter\na_total{x=\"1\"} 1 1700000000\n", // timestamp
      "# HELP a_total a\n# TYPE a_total counter\na_total{x=\"a\\qb\"} 1\n", // invalid escape in a label value
      "# HELP a_total a\n# TYPE a_total counter\na_total{x=\"a\nb\"} 1\n", // raw newline in a label value
      "# HELP a_total a \\q\n# TYPE a_total counter\na_total 1\n", // invalid escape in HELP
      "# HELP a_total a\n# TYPE a_total counter\na_total{x=\"1\",x=\"2\"} 1\n", // label twice
      "# HELP a_total a\n# TYPE a_total counter\na_total{1x=\"1\"} 1\n", // label name
      "# HELP a_total a\n# TYPE a_total counter\na_total one\n", // value
      "# HELP a_total a\n# TYPE a_total counter\na_total -1\n", // a counter below 0
      "# HELP a_total a\n# TYPE a_total counter\na_total 1\na_total 2\n", // series twice
      "# HELP a_total a\n# TYPE a_total counter\na_total 1\n# HELP b b\n# TYPE b gauge\nb 1\na_total{x=\"1\"} 1\n", // family resumed
      "# HELP a_total a\n# TYPE a_total counter\n# TYPE a_total counter\na_total 1\n", // TYPE twice
      "# HELP a_total a\n# TYPE a_total count\na_total 1\n", // unknown type
      "# HELP a_total a\n# TYPE a_total counter\n# a comment\na_total 1\n", // other comment
      hist('h_bucket{le="1",r="x"} 1\n'), // no +Inf
      hist('h_bucket{le="1",r="x"} 2\nh_bucket{le="+Inf",r="x"} 1\n'), // not cumulative
      hist('h_bucket{le="+Inf",r="x"} 2\nh_bucket{le="1",r="x"} 1\n'), // le descending
      hist('h_bucket{le="1",r="x"} 1\nh_bucket{le="+Inf",r="x"} 3\n'), // +Inf is not _count
      hist('h_bucket{r="x"} 1\nh_bucket{le="+Inf",r="x"} 2\n'), // bucket without le
    ];
    for (const text of bad) expect(() => parseExposition(text), text).toThrow();
  });

  test("the gateway's whole registry is valid 0.0.4 text with the families operators had", () => {
    const m = createMetrics();
    m.requests.inc({ route: "/v1/chat/completions", method: "POST", status: 200, code: "" });
    m.duration.record("/v1/chat/completions", 0.012);
    m.upstreamFirstByte.record("svc", 0.003);
    m.upstreamAttempts.inc({ alias: "svc", target: 'http://u/v1|m"o\\d\nel', outcome: "ok" });
    m.tokens.inc({ alias: "svc", direction: "prompt" }, 12);
    m.breakerOpen.set({ target: 'http://u/v1|m"o\\d\nel' }, 0);
    m.activeStreams.inc();
    const families = parseExposition(m.registry.metrics());
    // The second scrape too (collect hooks ran, the event-loop figures were reset).
    parseExposition(m.registry.metrics());
    const types = Object.fromEntries([...families.values()].map((f) => [f.name, f.type]));
    // Every family prom-client's collectDefaultMetrics gave an operator, less those Bun always left empty
    // (active resources, handles and requests; GC durations) and the per-space heap gauges (docs/decisions.md).
    const processFamilies: Record<string, Family["type"]> = {
      gateway_process_cpu_user_seconds_total: "counter",
      gateway_process_cpu_system_seconds_total: "counter",
      gateway_process_cpu_seconds_total: "counter",
      gateway_process_start_time_seconds: "gauge",
      gateway_process_resident_memory_bytes: "gauge",
      gateway_process_virtual_memory_bytes: "gauge",
      gateway_process_heap_bytes: "gauge",
      gateway_process_open_fds: "gauge",
      gateway_process_max_fds: "gauge",
      gateway_nodejs_eventloop_lag_seconds: "gauge",
      gateway_nodejs_eventloop_lag_min_seconds: "gauge",
      gateway_nodejs_eventloop_lag_max_seconds: "gauge",
      gateway_nodejs_eventloop_lag_mean_seconds: "gauge",
      gateway_nodejs_eventloop_lag_stddev_seconds: "gauge",
      gateway_nodejs_eventloop_lag_p50_seconds: "gauge",
      gateway_nodejs_eventloop_lag_p90_seconds: "gauge",
      gateway_nodejs_eventloop_lag_p99_seconds: "gauge",
      gateway_nodejs_heap_size_total_bytes: "gauge",
      gateway_nodejs_heap_size_used_bytes: "gauge",
      gateway_nodejs_external_memory_bytes: "gauge",
      gateway_nodejs_version_info: "gauge",
    };
    const own: Record<string, Family["type"]> = {
      gateway_http_requests_total: "counter",
      gateway_http_request_duration_seconds: "histogram",
      gateway_upstream_first_byte_seconds: "histogram",
      gateway_tokens_total: "counter",
      gateway_rate_limited_total: "counter",
      gateway_budget_exceeded_total: "counter",
      gateway_active_streams: "gauge",
      gateway_upstream_attempts_total: "counter",
      gateway_usage_buffered_events: "gauge",
      gateway_upstream_breaker_open: "gauge",
      gateway_rate_limit_orgs: "gauge",
      gateway_usage_pending_tokens: "gauge",
      gateway_usage_flush_failures: "gauge",
      gateway_usage_unanswered_writes: "gauge",
      gateway_database_unanswered: "gauge",
      gateway_key_lookups_unanswered: "gauge",
      gateway_key_cache_total: "counter",
      gateway_security_events_dropped_total: "counter",
      gateway_database_transactions_total: "counter",
      gateway_database_up: "gauge",
    };
    expect(types).toEqual({ ...processFamilies, ...own });
    const one = (name: string) => families.get(name)?.samples[0]?.value ?? Number.NaN;
    // The process figures are the process's: CPU since it started, its memory, its descriptors, its start.
    expect(one("gateway_process_cpu_seconds_total")).toBeCloseTo(
      one("gateway_process_cpu_user_seconds_total") + one("gateway_process_cpu_system_seconds_total"),
      6,
    );
    expect(one("gateway_process_cpu_seconds_total")).toBeGreaterThan(0);
    expect(one("gateway_process_resident_memory_bytes")).toBeGreaterThan(10_000_000);
    expect(one("gateway_process_open_fds")).toBeGreaterThan(2);
    expect(one("gateway_process_max_fds")).toBeGreaterThanOrEqual(one("gateway_process_open_fds"));
    // The wall time the process started, as it read at the start (performance.timeOrigin): now - uptime moves
    // with any step of the wall clock since (CI saw one of ~10 s during a run), the start time does not.
    expect(Math.abs(one("gateway_process_start_time_seconds") - performance.timeOrigin / 1000)).toBeLessThan(2);
    expect(one("gateway_nodejs_heap_size_used_bytes")).toBeGreaterThan(0);
    expect(families.get("gateway_nodejs_version_info")?.samples[0]?.labels.version).toBe(process.version);
    const target = families.get("gateway_upstream_attempts_total")?.samples[0]?.labels.target;
    expect(target).toBe('http://u/v1|m"o\\d\nel');
    expect(one("gateway_active_streams")).toBe(1);
  });
});
