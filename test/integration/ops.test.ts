import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import SwaggerParser from "@apidevtools/swagger-parser";
import { upstreamAliases } from "../../src/config/load.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { bearer, type SeededOrg, seedOrg, startTestGateway } from "../helpers/harness.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

let gw: Gateway;
let sim: Simulator;
let org: SeededOrg;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 5 });
  gw = await startTestGateway({ aliases: upstreamAliases(sim.url) });
  org = await seedOrg(gw.database);
});
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

function sample(text: string, name: string, labels: Record<string, string> = {}): number {
  let total = 0;
  for (const line of text.split("\n")) {
    if (!line.startsWith(name)) continue;
    const m = /^([a-z_:]+)(\{[^}]*\})? (\S+)$/.exec(line);
    if (!m || m[1] !== name) continue;
    const l = m[2] ?? "";
    if (Object.entries(labels).every(([k, v]) => l.includes(`${k}="${v}"`))) total += Number(m[3]);
  }
  return total;
}

describe("GET /metrics", () => {
  test("counters and histograms move with real traffic; no key or content in labels", async () => {
    const before = await (await fetch(`${gw.url}/metrics`)).text();
    const chat = async (stream: boolean) => {
      const res = await fetch(`${gw.url}/v1/chat/completions`, {
        method: "POST",
        headers: bearer(org.serviceKey, { "content-type": "application/json" }),
        body: JSON.stringify({ model: "svc-fast", stream, messages: [{ role: "user", content: "secret prompt text" }] }),
      });
      expect(res.status).toBe(200);
      await res.text();
    };
    await chat(false);
    await chat(true);
    await fetch(`${gw.url}/v1/me`, { headers: bearer(org.serviceKey) });
    await fetch(`${gw.url}/v1/me`, { headers: bearer(`sk-gw-${"Z".repeat(43)}`) });
    // A method a client invents becomes "other", so clients cannot grow the label set.
    await fetch(`${gw.url}/v1/me`, { method: "PROPFIND", headers: bearer(org.serviceKey) });
    await gw.quota.flush();
    const res = await fetch(`${gw.url}/metrics`);
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toContain("text/plain");
    const after = await res.text();
    const route = { route: "/v1/chat/completions", status: "200" };
    expect(sample(after, "gateway_http_requests_total", route) - sample(before, "gateway_http_requests_total", route)).toBe(2);
    expect(sample(after, "gateway_http_requests_total", { route: "/v1/me", status: "401", code: "unauthorized" })).toBeGreaterThanOrEqual(1);
    expect(sample(after, "gateway_http_request_duration_seconds_count", { route: "/v1/chat/completions" })).toBeGreaterThanOrEqual(2);
    expect(sample(after, "gateway_tokens_total", { alias: "svc-fast", direction: "completion" })).toBeGreaterThanOrEqual(10);
    expect(sample(after, "gateway_key_cache_total", { result: "miss" })).toBeGreaterThanOrEqual(1);
    expect(sample(after, "gateway_upstream_attempts_total", { alias: "svc-fast", outcome: "ok" })).toBeGreaterThanOrEqual(2);
    expect(sample(after, "gateway_upstream_first_byte_seconds_count", { alias: "svc-fast" })).toBeGreaterThanOrEqual(2);
    expect(sample(after, "gateway_active_streams")).toBe(0);
    expect(after).toMatch(/gateway_upstream_breaker_open\{target="[^"]+"\} 0/);
    expect(after).toContain("gateway_usage_buffered_events");
    expect(after).toContain("gateway_process_resident_memory_bytes");
    expect(after).not.toContain("gateway_process_process_");
    expect(after).not.toContain(org.serviceKey);
    expect(after).not.toContain("secret prompt text");
    expect(sample(after, "gateway_http_requests_total", { method: "other" })).toBeGreaterThanOrEqual(1);
    expect(after).not.toContain("PROPFIND");
  });

  test("metrics.listen moves /metrics to its own address", async () => {
    const port = Bun.serve({ port: 0, fetch: () => new Response() });
    const free = port.port;
    port.stop(true);
    const separate = await startTestGateway({ metrics: { enabled: true, listen: `127.0.0.1:${free}` } });
    try {
      expect((await fetch(`${separate.url}/metrics`)).status).toBe(404);
      const res = await fetch(`http://127.0.0.1:${free}/metrics`);
      expect(res.status).toBe(200);
      expect(await res.text()).toContain("gateway_http_requests_total");
    } finally {
      await separate.stop();
    }
  });
});

describe("GET /openapi.json", () => {
  test("is a valid OpenAPI 3.1 document covering every route, with bearer auth", async () => {
    const res = await fetch(`${gw.url}/openapi.json`);
    expect(res.status).toBe(200);
    const doc = (await res.json()) as { openapi: string; paths: Record<string, Record<string, { security?: unknown[] }>>; components: { securitySchemes: Record<string, unknown> } };
    expect(doc.openapi).toBe("3.1.0");
    await SwaggerParser.validate(structuredClone(doc) as never);
    for (const [path, method] of [
      ["/v1/chat/completions", "post"],
      ["/v1/embeddings", "post"],
      ["/v1/models", "get"],
      ["/v1/me", "get"],
      ["/v1/audit-events", "get"],
      ["/healthz", "get"],
      ["/readyz", "get"],
      ["/metrics", "get"],
    ] as const) {
      expect(doc.paths[path]?.[method]).toBeDefined();
    }
    expect(doc.paths["/v1/me"]?.get?.security).toEqual([{ bearer: [] }]);
    expect(doc.components.securitySchemes.bearer).toMatchObject({ type: "http", scheme: "bearer" });
    // The request schema is the validator's own: it rejects what the endpoint rejects.
    const chatSchema = JSON.stringify(doc).includes('"additionalProperties":false');
    expect(chatSchema).toBe(true);
  });
});
