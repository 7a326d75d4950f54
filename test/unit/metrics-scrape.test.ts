import { describe, expect, test } from "bun:test";
import v8 from "node:v8";
import { createMetrics, methodLabel } from "../../src/metrics/registry.ts";

/**
 * A scrape runs on the request thread. Bun answers v8.getHeapSpaceStatistics()
 * by walking the whole heap (~40 ms for 200,000 live objects, ~110–170 ms for
 * a million, measured 2026-11-24): prom-client's default heap-space gauges
 * (prom-client until 2026-11-27) would stall every request and stream for
 * that long at each Prometheus scrape. The gateway exports the cheap heap
 * figures (process.memoryUsage) and not those.
 */
describe("metrics scrape", () => {
  test("never walks the heap; the cheap heap figures stay", async () => {
    const metrics = createMetrics();
    const original = v8.getHeapSpaceStatistics;
    let walks = 0;
    v8.getHeapSpaceStatistics = () => {
      walks++;
      return original();
    };
    try {
      const text = await metrics.registry.metrics();
      expect(walks).toBe(0);
      expect(text).not.toContain("heap_space");
      expect(text).toMatch(/^gateway_nodejs_heap_size_used_bytes \d+/m);
      expect(text).toMatch(/^gateway_process_resident_memory_bytes \d+/m);
    } finally {
      v8.getHeapSpaceStatistics = original;
    }
  });
});

// docs/operations.md, gateway_http_requests_total: "a method outside GET, POST, PUT, PATCH, DELETE, HEAD and OPTIONS is `other`".
describe("the method label", () => {
  test("each of the seven methods is its own label; any other method, or another case, is other", () => {
    for (const m of ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]) expect(methodLabel(m)).toBe(m);
    for (const m of ["PROPFIND", "TRACE", "CONNECT", "get", "", "__proto__"]) expect(methodLabel(m)).toBe("other");
  });
});
