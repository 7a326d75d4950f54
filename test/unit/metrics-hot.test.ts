import { describe, expect, test } from "bun:test";
import { Counter, Histogram, Registry } from "prom-client";
import { HotCounter, HotHistogram } from "../../src/metrics/hot.ts";

/**
 * The per-request metrics keep their own sums and hand them to prom-client
 * at scrape time: the exposition must be what prom-client itself writes for
 * the same observations.
 */
const BUCKETS = [0.001, 0.01, 0.1, 1];

describe("hot metrics", () => {
  test("a HotCounter and a HotHistogram expose exactly what prom-client's own would", async () => {
    const ref = new Registry();
    const hot = new Registry();
    const refCounter = new Counter({ name: "c_total", help: "c", labelNames: ["route", "status"] as const, registers: [ref] });
    const refHist = new Histogram({ name: "h_seconds", help: "h", labelNames: ["route"] as const, buckets: BUCKETS, registers: [ref] });
    const hotCounter = new HotCounter({ name: "c_total", help: "c", labelNames: ["route", "status"] as const, registers: [hot] });
    const hotHist = new HotHistogram({ name: "h_seconds", help: "h", labelNames: ["route"] as const, buckets: BUCKETS, registers: [hot] });
    // Values on the bucket bounds, between them, above all of them; labels needing escapes.
    const values = [0.0005, 0.001, 0.005, 0.1, 0.5, 1, 7, 0];
    const routes = ["/a", '/b"\\\n'];
    for (const [i, v] of values.entries()) {
      const route = routes[i % 2] ?? "";
      refCounter.inc({ route, status: 200 + (i % 3) }, i + 1);
      hotCounter.inc({ route, status: 200 + (i % 3) }, i + 1);
      refHist.observe({ route }, v);
      hotHist.record(route, v);
    }
    expect(await hot.metrics()).toBe(await ref.metrics());
    // Increments after a scrape are added once, not twice.
    refCounter.inc({ route: "/a", status: 200 });
    hotCounter.inc({ route: "/a", status: 200 });
    expect(await hot.metrics()).toBe(await ref.metrics());
  });

  test("reset empties a HotHistogram", async () => {
    const r = new Registry();
    const h = new HotHistogram({ name: "h_seconds", help: "h", labelNames: ["route"] as const, buckets: BUCKETS, registers: [r] });
    h.record("/a", 0.5);
    r.resetMetrics();
    expect(await r.metrics()).not.toContain('route="/a"');
  });
});
