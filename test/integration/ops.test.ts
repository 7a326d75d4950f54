import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { join } from "node:path";
import SwaggerParser from "@apidevtools/swagger-parser";
import { sql } from "drizzle-orm";
import { loadConfig, upstreamAliases } from "../../src/config/load.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { bearer, errorOf, freshDatabase, rejectionOf, type SeededOrg, seedOrg, startTestGateway } from "../helpers/harness.ts";
import { ROOT } from "../helpers/process.ts";
import { parseExposition } from "../helpers/prom-text.ts";
import { sample } from "../helpers/scrape.ts";

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

function metricsUrl(g: Gateway): string {
  if (!g.metricsUrl) throw new Error("metrics are not served");
  return g.metricsUrl;
}

describe("GET /metrics", () => {
  test("counters and histograms move with real traffic; no key or content in labels", async () => {
    const before = await (await fetch(metricsUrl(gw))).text();
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
    const res = await fetch(metricsUrl(gw));
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toContain("text/plain");
    const after = await res.text();
    // Exact differences: each request counted once, never twice.
    const moved = (name: string, labels: Record<string, string> = {}) => sample(after, name, labels) - sample(before, name, labels);
    expect(moved("gateway_http_requests_total", { route: "/v1/chat/completions", status: "200" })).toBe(2);
    expect(moved("gateway_http_requests_total", { route: "/v1/me", status: "200" })).toBe(1);
    expect(moved("gateway_http_requests_total", { route: "/v1/me", status: "401", code: "unauthorized" })).toBe(1);
    expect(moved("gateway_http_request_duration_seconds_count", { route: "/v1/chat/completions" })).toBe(2);
    expect(moved("gateway_tokens_total", { alias: "svc-fast", direction: "completion" })).toBe(10);
    // The service key's first use and the unknown key miss the cache; its later uses hit.
    expect(moved("gateway_key_cache_total", { result: "miss" })).toBe(2);
    expect(moved("gateway_upstream_attempts_total", { alias: "svc-fast", outcome: "ok" })).toBe(2);
    expect(moved("gateway_upstream_first_byte_seconds_count", { alias: "svc-fast" })).toBe(2);
    expect(sample(after, "gateway_active_streams")).toBe(0);
    expect(after).toMatch(/gateway_upstream_breaker_open\{target="[^"]+"\} 0/);
    expect(after).toContain("gateway_usage_buffered_events");
    expect(after).toContain("gateway_process_resident_memory_bytes");
    expect(after).not.toContain("gateway_process_process_");
    expect(after).not.toContain(org.serviceKey);
    expect(after).not.toContain("secret prompt text");
    expect(moved("gateway_http_requests_total", { method: "other" })).toBe(1);
    expect(after).not.toContain("PROPFIND");
  });

  test("the method label is the request's own for GET, POST, PUT, PATCH, DELETE, HEAD and OPTIONS (other only beyond them); key verifications from the cache count as hit", async () => {
    const own = await startTestGateway({ aliases: upstreamAliases(sim.url) });
    try {
      const fresh = await seedOrg(own.database);
      const before = await (await fetch(metricsUrl(own))).text();
      // Requests the guard admitted (they carry the rate-limit state): each verified the key once.
      let verified = 0;
      const send = async (method: string) => {
        const res = await fetch(`${own.url}/v1/models`, { method, headers: bearer(fresh.serviceKey) });
        await res.arrayBuffer();
        if (res.headers.has("x-ratelimit-limit-requests")) verified++;
      };
      const methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "PROPFIND", "TRACE"];
      for (const m of methods) await send(m);
      for (let i = 0; i < 3; i++) await send("GET");
      const after = await (await fetch(metricsUrl(own))).text();
      const moved = (name: string, labels: Record<string, string>) => sample(after, name, labels) - sample(before, name, labels);
      expect(Object.fromEntries(methods.map((m) => [m, moved("gateway_http_requests_total", { method: m })]))).toEqual({
        GET: 4,
        POST: 1,
        PUT: 1,
        PATCH: 1,
        DELETE: 1,
        HEAD: 1,
        OPTIONS: 1,
        PROPFIND: 0,
        TRACE: 0,
      });
      expect(moved("gateway_http_requests_total", { method: "other" })).toBe(2);
      // The key's first verification was a lookup (miss); those of the requests after it came from the cache.
      expect(verified).toBeGreaterThanOrEqual(4);
      expect(moved("gateway_key_cache_total", { result: "miss" })).toBe(1);
      expect(moved("gateway_key_cache_total", { result: "hit" })).toBe(verified - 1);
    } finally {
      await own.stop();
    }
  });

  test("the route label is the route that served the request (a path with an id under its pattern, a trailing slash under its route), other for every unknown path", async () => {
    const own = await startTestGateway({ aliases: upstreamAliases(sim.url), responses: { enabled: true } });
    try {
      const before = await (await fetch(metricsUrl(own))).text();
      const get = async (path: string, init: RequestInit = {}) => {
        const res = await fetch(`${own.url}${path}`, { ...init, headers: bearer(org.serviceKey, (init.headers as Record<string, string>) ?? {}) });
        await res.text();
        return res.status;
      };
      // Served under their patterns: each id was its own path, labelled other with the scanners' 404s.
      expect(await get("/v1/responses/resp_one")).toBe(404);
      expect(await get("/v1/responses/resp_two", { method: "DELETE" })).toBe(404);
      expect(await get("/v1/responses/resp_one/input_items")).toBe(404);
      // A trailing slash is served as the route without it (Elysia's default): it was labelled other.
      expect(await get("/v1/models/")).toBe(200);
      expect(await get("/v1/me/")).toBe(200);
      // Refused before routing (the browser rule): labelled by the path it named.
      expect(await get("/v1/me", { headers: { origin: "https://app.example" } })).toBe(403);
      // Paths no route serves: other, never the path itself.
      for (const path of ["/v1/models/no-such-model", "/v1//models", "/V1/models", "/wp-login.php", "/v1/me/x"]) expect(await get(path)).toBe(404);
      const after = await (await fetch(metricsUrl(own))).text();
      const moved = (labels: Record<string, string>) => sample(after, "gateway_http_requests_total", labels) - sample(before, "gateway_http_requests_total", labels);
      expect({
        retrieve: moved({ route: "/v1/responses/:id", method: "GET", status: "404" }),
        del: moved({ route: "/v1/responses/:id", method: "DELETE", status: "404" }),
        items: moved({ route: "/v1/responses/:id/input_items", method: "GET", status: "404" }),
        models: moved({ route: "/v1/models", method: "GET", status: "200" }),
        me: moved({ route: "/v1/me", method: "GET", status: "200" }),
        browser: moved({ route: "/v1/me", method: "GET", status: "403" }),
        other: moved({ route: "other", status: "404", code: "not_found" }),
      }).toEqual({ retrieve: 1, del: 1, items: 1, models: 1, me: 1, browser: 1, other: 5 });
      for (const raw of ["resp_one", "resp_two", "no-such-model", "wp-login", "/v1/models/", "/v1/me/"]) expect(after).not.toContain(raw);
    } finally {
      await own.stop();
    }
  });

  test("the whole scrape is strict 0.0.4 text, a target label with a quote, a backslash and a newline included", async () => {
    // The target label is `<baseUrl>|<model>`, and an upstream model id is the operator's to choose.
    const model = 'odd"mo\\del\nname';
    const aliases = upstreamAliases(sim.url) as Record<string, { targets: { model: string }[] }>;
    for (const t of aliases["svc-fast"]?.targets ?? []) t.model = model;
    const own = await startTestGateway({ aliases });
    try {
      for (const stream of [false, true]) {
        const res = await fetch(`${own.url}/v1/chat/completions`, {
          method: "POST",
          headers: bearer(org.serviceKey, { "content-type": "application/json" }),
          body: JSON.stringify({ model: "svc-fast", stream, messages: [{ role: "user", content: "hi" }] }),
        });
        expect(res.status).toBe(200);
        await res.text();
      }
      expect((await fetch(`${own.url}/v1/me`, { headers: bearer(`sk-gw-${"Z".repeat(43)}`) })).status).toBe(401);
      await own.quota.flush();
      // Twice: the first scrape and one after the collect hooks and the event-loop monitor have run.
      for (let i = 0; i < 2; i++) {
        const res = await fetch(metricsUrl(own));
        expect(res.headers.get("content-type")).toBe("text/plain; version=0.0.4; charset=utf-8");
        const families = parseExposition(await res.text());
        const target = `${sim.url}|${model}`;
        const attempts = families.get("gateway_upstream_attempts_total")?.samples.filter((x) => x.labels.target === target) ?? [];
        expect(attempts.map((x) => [x.labels.alias, x.labels.outcome, x.value])).toEqual([["svc-fast", "ok", 2]]);
        expect(families.get("gateway_upstream_breaker_open")?.samples.some((x) => x.labels.target === target && x.value === 0)).toBe(true);
        const chat = families.get("gateway_http_request_duration_seconds")?.samples.filter((x) => x.labels.route === "/v1/chat/completions");
        expect(chat?.find((x) => x.name.endsWith("_count"))?.value).toBe(2);
        expect(families.get("gateway_process_resident_memory_bytes")?.samples[0]?.value).toBeGreaterThan(0);
      }
    } finally {
      await own.stop();
    }
  });

  test("gateway_upstream_breaker_open is current on the scrape that reads it, the first one included", async () => {
    // The default aliases point at a closed port; one failure opens a target's breaker.
    const dead = await startTestGateway({ upstream: { breakerFailures: 1, attempts: 1, backoffMs: 0 } });
    try {
      const scrape = async () => (await fetch(metricsUrl(dead))).text();
      expect(await scrape()).toMatch(/^gateway_upstream_breaker_open\{target="[^"]+"\} 0$/m);
      const res = await fetch(`${dead.url}/v1/chat/completions`, {
        method: "POST",
        headers: bearer(org.serviceKey, { "content-type": "application/json" }),
        body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }),
      });
      expect(res.status).toBe(503);
      await res.text();
      expect(await scrape()).toMatch(/^gateway_upstream_breaker_open\{target="[^"]+"\} 1$/m);
    } finally {
      await dead.stop();
    }
  });

  test("every series docs/operations.md lists is exported, with the labels it names", async () => {
    const doc = await Bun.file(join(ROOT, "docs/operations.md")).text();
    const listed = [...doc.matchAll(/^\| (`gateway_[^|]+)\|/gm)].flatMap((m) => [...(m[1] ?? "").matchAll(/`(gateway_[a-z_*]+)(?:\{([a-z_,]+)\})?`/g)]);
    expect(listed.length).toBeGreaterThanOrEqual(15);
    // Traffic for the labelled series, and the readiness check that sets gateway_database_up.
    const chat = await fetch(`${gw.url}/v1/chat/completions`, {
      method: "POST",
      headers: bearer(org.serviceKey, { "content-type": "application/json" }),
      body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }),
    });
    expect(chat.status).toBe(200);
    await chat.text();
    expect((await fetch(`${gw.url}/readyz`)).status).toBe(200);
    const text = await (await fetch(metricsUrl(gw))).text();
    const types = new Map([...text.matchAll(/^# TYPE (\S+) (\S+)$/gm)].map((m) => [m[1] ?? "", m[2] ?? ""]));
    for (const [, name = "", labels] of listed) {
      const re = new RegExp(`^${name.replaceAll("*", "[a-z_]+")}$`);
      const found = [...types.keys()].filter((n) => re.test(n));
      expect({ name, found: found.length > 0 }).toEqual({ name, found: true });
      if (labels === undefined) continue;
      // Each sample of the series carries exactly the documented labels (a histogram's buckets add `le`).
      const samples = text.split("\n").filter((l) => l.startsWith(`${name}{`) || l.startsWith(`${name}_count{`));
      expect({ name, samples: samples.length > 0 }).toEqual({ name, samples: true });
      for (const l of samples) {
        const keys = [...(l.match(/\{(.*)\}/)?.[1] ?? "").matchAll(/([a-z_]+)="/g)].map((m) => m[1]);
        expect({ name, keys: keys.sort() }).toEqual({ name, keys: labels.split(",").sort() });
      }
    }
    expect(sample(text, "gateway_database_up")).toBe(1);
    // Counted on the embedded database only; on Postgres, pg_stat_database does.
    if (gw.database.kind !== "pglite") expect(sample(text, "gateway_database_transactions_total")).toBe(0);
  });

  test("by default only on a loopback listener of its own; the public port answers 404", async () => {
    // The default address, with port 0 instead of 9464 (tests never take the real port).
    const defaults = (await loadConfig({ env: {} })).metrics;
    expect(defaults).toEqual({ enabled: true, listen: "127.0.0.1:9464" });
    const own = await startTestGateway({ metrics: { ...defaults, listen: defaults.listen.replace(/:9464$/, ":0") } });
    try {
      const pub = await fetch(`${own.url}/metrics`);
      expect(pub.status).toBe(404);
      expect((await errorOf(pub)).code).toBe("not_found");
      const url = new URL(metricsUrl(own));
      expect(url.hostname).toBe("127.0.0.1");
      expect(url.port).not.toBe(new URL(own.url).port);
      const res = await fetch(url);
      expect(res.status).toBe(200);
      expect(await res.text()).toContain("gateway_http_requests_total");
      // Nothing else is served there.
      const other = await fetch(new URL("/v1/me", url), { headers: bearer(org.serviceKey) });
      expect(other.status).toBe(404);
      expect((await errorOf(other)).code).toBe("not_found");
      expect((await fetch(url, { method: "POST", body: "x" })).status).toBe(404);
    } finally {
      await own.stop();
    }
    // Stopped with the gateway.
    expect(await fetch(metricsUrl(own)).then(
      () => "answered",
      () => "refused",
    )).toBe("refused");
  });

  test('metrics.listen "main" serves them on the public port (the operator\'s choice)', async () => {
    const main = await startTestGateway({ metrics: { enabled: true, listen: "main" } });
    try {
      expect(main.metricsUrl).toBe(`${main.url}/metrics`);
      const res = await fetch(`${main.url}/metrics`);
      expect(res.status).toBe(200);
      expect(await res.text()).toContain("gateway_http_requests_total");
    } finally {
      await main.stop();
    }
  });

  test("metrics.enabled false serves them nowhere", async () => {
    const off = await startTestGateway({ metrics: { enabled: false, listen: "main" } });
    try {
      expect(off.metricsUrl).toBeUndefined();
      expect((await fetch(`${off.url}/metrics`)).status).toBe(404);
    } finally {
      await off.stop();
    }
  });

  test("an address already taken stops the start with a message naming metrics.listen", async () => {
    const taken = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: () => new Response() });
    try {
      const err = await rejectionOf(startTestGateway({ metrics: { enabled: true, listen: `127.0.0.1:${taken.port}` } }));
      expect(String(err)).toContain(`metrics.listen 127.0.0.1:${taken.port}`);
    } finally {
      taken.stop(true);
    }
  });
});

describe("health", () => {
  test("/healthz answers while alive; /readyz is 503 while a migration is missing, 200 once applied", async () => {
    // On Postgres this is the suite's database: the row taken away is put back whatever happens.
    const database = await freshDatabase();
    const g = await startTestGateway({}, database);
    let removed: string | undefined;
    try {
      expect(await (await fetch(`${g.url}/healthz`)).json()).toEqual({ status: "ok" });
      expect(await (await fetch(`${g.url}/readyz`)).json()).toEqual({ status: "ready" });
      // As if this binary were newer than the database: its last migration not yet applied.
      const [last] = await database.rows<{ tag: string }>(sql`delete from gateway_migrations where tag = (select max(tag) from gateway_migrations) returning tag`);
      removed = last?.tag;
      const pending = await fetch(`${g.url}/readyz`);
      expect(pending.status).toBe(503);
      expect((await errorOf(pending)).code).toBe("service_unavailable");
      expect((await fetch(`${g.url}/healthz`)).status).toBe(200);
      await database.rows(sql`insert into gateway_migrations (tag) values (${removed ?? ""})`);
      removed = undefined;
      expect((await fetch(`${g.url}/readyz`)).status).toBe(200);
    } finally {
      if (removed !== undefined) await database.rows(sql`insert into gateway_migrations (tag) values (${removed})`);
      await g.stop();
      await database.close();
    }
  });

  test("/readyz matches this binary's migrations by tag: a newer release's neither makes up for one of ours missing nor counts against it", async () => {
    // decisions.md, Command line: before, the rows were counted, so one unknown migration made up for one of ours missing.
    const database = await freshDatabase();
    const g = await startTestGateway({}, database);
    const NEWER = "9000_newer_release_readyz";
    let removed: string | undefined;
    try {
      await database.rows(sql`insert into gateway_migrations (tag) values (${NEWER})`);
      // A newer release's migration beside all of ours: ready (a rolling deploy's old instances keep serving).
      expect((await fetch(`${g.url}/readyz`)).status).toBe(200);
      const [last] = await database.rows<{ tag: string }>(
        sql`delete from gateway_migrations where tag = (select max(tag) from gateway_migrations where tag <> ${NEWER}) returning tag`,
      );
      removed = last?.tag;
      expect(removed).toBeDefined();
      // As many rows as this binary has migrations, one of them not ours: not ready.
      const pending = await fetch(`${g.url}/readyz`);
      expect(pending.status).toBe(503);
      expect((await errorOf(pending)).code).toBe("service_unavailable");
      await database.rows(sql`insert into gateway_migrations (tag) values (${removed ?? ""})`);
      removed = undefined;
      expect((await fetch(`${g.url}/readyz`)).status).toBe(200);
    } finally {
      if (removed !== undefined) await database.rows(sql`insert into gateway_migrations (tag) values (${removed})`);
      await database.rows(sql`delete from gateway_migrations where tag = ${NEWER}`);
      await g.stop();
      await database.close();
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
      ["/openapi.json", "get"],
    ] as const) {
      expect(doc.paths[path]?.[method]).toBeDefined();
    }
    expect(doc.paths["/v1/me"]?.get?.security).toEqual([{ bearer: [] }]);
    expect(doc.components.securitySchemes.bearer).toMatchObject({ type: "http", scheme: "bearer" });
    // Answers and request schemas are checked against real traffic in openapi.test.ts.
  });
});
