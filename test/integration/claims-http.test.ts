import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { sql } from "drizzle-orm";
import { upstreamAliases } from "../../src/config/load.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { bearer, errorOf, seedOrg, startTestGateway } from "../helpers/harness.ts";
import { eventually } from "../helpers/poll.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(90_000);

/**
 * Claims of docs/operations.md and docs/decisions.md that had no test able to
 * fail: the refusal counters operators alert on, the usage gauges, and the
 * load-balancer cookies the browser rule lets through.
 */

let gw: Gateway;
let sim: Simulator;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 5 });
  gw = await startTestGateway({
    aliases: upstreamAliases(sim.url),
    // Usage is written only when the test flushes it.
    quota: { flushMs: 600_000 },
    plans: { Standard: { requestsPerMinute: 1_000 }, Ultra: { requestsPerMinute: 1 } },
  });
});
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

async function scrape(): Promise<string> {
  if (!gw.metricsUrl) throw new Error("metrics are not served");
  const res = await fetch(gw.metricsUrl);
  expect(res.status).toBe(200);
  return res.text();
}

function sample(text: string, name: string): number {
  for (const line of text.split("\n")) {
    const m = /^([a-z_:]+) (\S+)$/.exec(line);
    if (m && m[1] === name) return Number(m[2]);
  }
  throw new Error(`${name} not in the scrape`);
}

const chat = (key: string, extra: Record<string, unknown> = {}) =>
  fetch(`${gw.url}/v1/chat/completions`, {
    method: "POST",
    headers: bearer(key, { "content-type": "application/json" }),
    body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }], ...extra }),
  });

describe("metrics operators alert on (docs/operations.md)", () => {
  test("gateway_rate_limited_total counts the limiter's refusals, gateway_budget_exceeded_total the quota's; nothing else moves them", async () => {
    const limited = await seedOrg(gw.database, { plan: "Ultra" });
    const capped = await seedOrg(gw.database, { quotaTokens: 100 });
    const before = await scrape();

    // Served and refused-for-other-reasons requests move neither counter.
    expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(capped.serviceKey) })).status).toBe(200);
    expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(`sk-gw-${"Z".repeat(43)}`) })).status).toBe(401);
    // The limiter: a plan of 1 a minute, the second request refused.
    expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(limited.serviceKey) })).status).toBe(200);
    for (let i = 0; i < 2; i++) {
      const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(limited.serviceKey) });
      expect(res.status).toBe(429);
      expect((await errorOf(res)).code).toBe("rate_limit_error");
    }
    // The quota: a bound larger than the whole quota of 100 tokens.
    for (let i = 0; i < 3; i++) {
      const res = await chat(capped.serviceKey, { max_tokens: 1_000 });
      expect(res.status).toBe(429);
      expect((await errorOf(res)).code).toBe("budget_exceeded");
    }

    const after = await scrape();
    const moved = (name: string) => sample(after, name) - sample(before, name);
    expect(moved("gateway_rate_limited_total")).toBe(2);
    expect(moved("gateway_budget_exceeded_total")).toBe(3);
  });

  test("gateway_usage_pending_tokens and gateway_usage_buffered_events hold settled usage until it is written, then fall to 0", async () => {
    const org = await seedOrg(gw.database);
    await gw.quota.flush();
    const idle = await scrape();
    expect(sample(idle, "gateway_usage_pending_tokens")).toBe(0);
    expect(sample(idle, "gateway_usage_buffered_events")).toBe(0);

    for (let i = 0; i < 2; i++) {
      const res = await chat(org.serviceKey);
      expect(res.status).toBe(200);
      const body = (await res.json()) as { usage: { total_tokens: number } };
      expect(body.usage.total_tokens).toBeGreaterThan(0);
    }
    const held = await scrape();
    // Two requests of the simulator's 5 completion tokens each, plus their prompts.
    expect(sample(held, "gateway_usage_pending_tokens")).toBeGreaterThanOrEqual(10);
    expect(sample(held, "gateway_usage_buffered_events")).toBeGreaterThanOrEqual(1);

    await gw.quota.flush();
    const written = await scrape();
    expect(sample(written, "gateway_usage_pending_tokens")).toBe(0);
    expect(sample(written, "gateway_usage_buffered_events")).toBe(0);
    expect(sample(written, "gateway_usage_flush_failures")).toBe(0);
  });
});

describe("the browser rule's load-balancer cookies (docs/decisions.md)", () => {
  test("AWSELB, SERVERID and BIGipServer<pool> cookies alone are a server-side client's; beside any other cookie, a browser's", async () => {
    const org = await seedOrg(gw.database);
    const me = (cookie: string) => fetch(`${gw.url}/v1/me`, { headers: bearer(org.serviceKey, { cookie }) });
    for (const cookie of ["AWSELB=ABCD1234", "AWSELB=a; AWSELBCORS=a", "SERVERID=app2", "BIGipServer~Common~pool_web=1677787402.36895.0000", "BIGipServerpool_api=rd5o00000000000000000000ffff0a000a05o443"]) {
      const res = await me(cookie);
      expect({ cookie, status: res.status }).toEqual({ cookie, status: 200 });
    }
    for (const cookie of ["SERVERID=app2; session=abc", "BIGipServerpool=1; sid=1", "AWSELBX=1", "AWSALBX=1"]) {
      const res = await me(cookie);
      expect({ cookie, status: res.status }).toEqual({ cookie, status: 403 });
      expect((await errorOf(res)).code).toBe("browser_request_rejected");
    }
  });
});

describe("keys at rest (docs/decisions.md: only SHA-256 of the key and a display prefix are stored)", () => {
  test("after a key is made and used, no row of any table holds its secret, nor more of it than the display prefix", async () => {
    const org = await seedOrg(gw.database);
    expect((await chat(org.serviceKey)).status).toBe(200);
    expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(org.personalKey) })).status).toBe(200);
    await gw.quota.flush();
    const tables = await gw.database.rows<{ name: string }>(
      sql`select table_name as name from information_schema.tables where table_schema = current_schema() and table_type = 'BASE TABLE'`,
    );
    expect(tables.map((t) => t.name)).toContain("api_keys");
    for (const key of [org.serviceKey, org.personalKey]) {
      // The display prefix is sk-gw- and a few characters; the rest of the secret is never stored, in any form we could grep.
      const tail = key.slice(-24);
      const hits: string[] = [];
      for (const { name } of tables) {
        const rows = await gw.database.rows<{ row: string }>(sql`select row_to_json(t)::text as row from ${sql.identifier(name)} t`);
        for (const r of rows) if (r.row.includes(tail)) hits.push(name);
      }
      expect(hits).toEqual([]);
      const [stored] = await gw.database.rows<{ prefix: string; hash: string }>(
        sql`select prefix, hash from api_keys where id = ${key === org.serviceKey ? org.serviceKeyId : org.personalKeyId}`,
      );
      expect(stored?.hash).toBe(new Bun.CryptoHasher("sha256").update(key).digest("hex"));
      expect(key.startsWith(stored?.prefix ?? "none")).toBe(true);
      expect((stored?.prefix ?? "").length).toBeLessThan(16);
    }
  });
});

describe("gateway_active_streams (docs/operations.md: streams in progress)", () => {
  test("counts a stream while it is open, and falls back to 0 when the client reads it to the end, leaves mid-stream, or leaves at the headers; each such request is recorded", async () => {
    const slow = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 20, completionTokens: 200 });
    const g = await startTestGateway({ aliases: upstreamAliases(slow.url), quota: { flushMs: 600_000 } });
    try {
      const org = await seedOrg(g.database);
      const active = async () => {
        if (!g.metricsUrl) throw new Error("metrics are not served");
        return sample(await (await fetch(g.metricsUrl)).text(), "gateway_active_streams");
      };
      const open = (signal?: AbortSignal) =>
        fetch(`${g.url}/v1/chat/completions`, {
          method: "POST",
          headers: bearer(org.serviceKey, { "content-type": "application/json" }),
          body: JSON.stringify({ model: "svc-fast", stream: true, messages: [{ role: "user", content: "hi" }] }),
          ...(signal ? { signal } : {}),
        });
      const settledRequests = async () => {
        await g.quota.flush();
        const rows = await g.database.rows<{ n: number | string }>(sql`select coalesce(sum(requests), 0)::int as n from usage_events where org_id = ${org.orgId}`);
        return Number(rows[0]?.n ?? 0);
      };
      expect(await active()).toBe(0);

      // Open, read one chunk: 1. Left mid-stream: back to 0.
      const first = new AbortController();
      const res = await open(first.signal);
      expect(res.status).toBe(200);
      const reader = res.body?.getReader();
      await reader?.read();
      expect(await active()).toBe(1);
      first.abort();
      await eventually(active, (n) => n === 0, "the stream left mid-way no longer counted");

      // Ten clients that leave as soon as the headers arrive, without reading a byte of the body.
      for (let i = 0; i < 10; i++) {
        const c = new AbortController();
        const r = await open(c.signal);
        expect(r.status).toBe(200);
        c.abort();
      }
      await eventually(active, (n) => n === 0, "streams left at the headers no longer counted", 15_000);
      // A stream read to the end.
      const whole = await open();
      expect((await whole.text()).endsWith("data: [DONE]\n\n")).toBe(true);
      expect(await active()).toBe(0);
      // Every one of the 12 was settled (a ticket never settled would hold its reservation and go unrecorded).
      await eventually(settledRequests, (n) => n === 12, "all 12 streamed requests recorded", 15_000);
    } finally {
      await g.stop();
      await slow.stop();
    }
  });
});

describe("gateway_upstream_attempts_total outcomes (docs/operations.md)", () => {
  test("ok, http_<status>, timeout and connect_error, one per attempt; a target skipped for its open breaker is no attempt", async () => {
    const failing = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 3 });
    const hanging = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 3 });
    failing.setFault({ kind: "status", status: 503 });
    hanging.setFault({ kind: "hang" });
    const alias = (baseUrl: string) => ({ kind: "chat", contextWindow: 128_000, capabilities: [], ownedBy: "gateway", targets: [{ baseUrl, model: "m", weight: 1 }] });
    const g = await startTestGateway({
      aliases: { "svc-fast": alias(failing.url), "svc-smart": alias(hanging.url), "svc-bigthink": alias("http://127.0.0.1:9/v1"), "svc-embed": alias(sim.url) },
      upstream: { attempts: 1, backoffMs: 1, breakerFailures: 1, breakerCooldownMs: 600_000, timeouts: { connectMs: 2_000, firstByteMs: 300, idleMs: 10_000 } },
    });
    try {
      const org = await seedOrg(g.database);
      const ask = async (model: string) => {
        const res = await fetch(`${g.url}/v1/chat/completions`, {
          method: "POST",
          headers: bearer(org.serviceKey, { "content-type": "application/json" }),
          body: JSON.stringify({ model, messages: [{ role: "user", content: "hi" }] }),
        });
        await res.text();
        return res.status;
      };
      const attempts = async () => {
        if (!g.metricsUrl) throw new Error("metrics are not served");
        const text = await (await fetch(g.metricsUrl)).text();
        const seen: Record<string, number> = {};
        for (const m of text.matchAll(/^gateway_upstream_attempts_total\{([^}]*)\} (\S+)$/gm)) {
          const labels = Object.fromEntries([...(m[1] ?? "").matchAll(/(\w+)="([^"]*)"/g)].map((l) => [l[1], l[2]]));
          seen[`${labels.alias} ${labels.outcome}`] = Number(m[2]);
        }
        return seen;
      };
      expect(await ask("svc-embed")).toBe(200);
      expect(await ask("svc-fast")).toBe(503);
      expect(await ask("svc-smart")).toBe(503);
      expect(await ask("svc-bigthink")).toBe(503);
      expect(await attempts()).toEqual({ "svc-embed ok": 1, "svc-fast http_503": 1, "svc-smart timeout": 1, "svc-bigthink connect_error": 1 });
      // Each breaker opened on its one failure: the next requests are refused without an attempt.
      for (const model of ["svc-fast", "svc-smart", "svc-bigthink"]) expect(await ask(model)).toBe(503);
      expect(failing.stats.requests).toBe(1);
      expect(await attempts()).toEqual({ "svc-embed ok": 1, "svc-fast http_503": 1, "svc-smart timeout": 1, "svc-bigthink connect_error": 1 });
    } finally {
      await g.stop();
      await failing.stop();
      await hanging.stop();
    }
  });
});
