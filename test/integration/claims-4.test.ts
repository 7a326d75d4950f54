import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import OpenAI from "openai";
import { VERSION as OPENAI_VERSION } from "openai/version";
import { eq, sql } from "drizzle-orm";
import { revokeKey, rotateKey, setOrg } from "../../src/admin/service.ts";
import { usageEvents } from "../../src/db/schema.ts";
import { createLogger } from "../../src/lib/log.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { TEST_DATABASE_URL, bearer, errorOf, freshDatabase, seedOrg, sharedDatabase, startTestGateway, testConfig } from "../helpers/harness.ts";
import { eventually } from "../helpers/poll.ts";
import { cleanEnv, exitWithin, listeningUrl, onlyJson, removeScratch, runGateway, scratchDir, startGatewayProcess, waitFor200 } from "../helpers/process.ts";
import { TEST_PLANS, chatAlias, sseData, testAliases, upstreamSettings } from "./inference-fixtures.ts";
import { scrapeOf } from "../helpers/scrape.ts";

// Servers, child processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(90_000);

/**
 * Claims of README.md, docs/operations.md and docs/decisions.md that the
 * earlier rounds (claims-*.test.ts) left without a test able to fail on them.
 * Each test names the claim it holds.
 */

let sim: Simulator;
let gw: Gateway;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 5 });
  gw = await startTestGateway({
    aliases: testAliases(sim.url),
    plans: TEST_PLANS,
    // One attempt after another without waiting; the breaker never opens on the test's own faults.
    upstream: upstreamSettings({ attempts: 2, breakerFailures: 1_000 }),
    quota: { flushMs: 600_000 },
    responses: { enabled: true },
  });
});
const stops: (() => unknown)[] = [];
afterAll(async () => {
  for (const stop of stops.reverse()) await stop();
  await gw.stop();
  await sim.stop();
});

/** The value of an unlabelled series in a scrape. */
function sample(text: string, name: string): number {
  for (const line of text.split("\n")) {
    const m = /^([a-z_:]+) (\S+)$/.exec(line);
    if (m && m[1] === name) return Number(m[2]);
  }
  throw new Error(`${name} not in the scrape`);
}

const chat = (key: string, extra: Record<string, unknown> = {}, g: Gateway = gw) =>
  fetch(`${g.url}/v1/chat/completions`, {
    method: "POST",
    headers: bearer(key, { "content-type": "application/json" }),
    body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }], ...extra }),
  });

describe("gateway_rate_limited_total counts the limiter's refusals (docs/operations.md: refusals by the limiter)", () => {
  test("an upstream overloaded on every attempt and the unknown-key budget answer 429 rate_limit_error too, but are not the limiter's: they do not move it", async () => {
    // One lookup of an unknown key a minute from this test's network: the second is throttled.
    const gw = await startTestGateway({ aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: upstreamSettings({ attempts: 2, breakerFailures: 1_000 }), keyCache: { unknownPerPrefixPerMin: 1 } });
    stops.push(() => gw.stop());
    const scrape = () => scrapeOf(gw);
    const org = await seedOrg(gw.database, { plan: "Tiny", plans: Object.keys(TEST_PLANS) });
    const before = sample(await scrape(), "gateway_rate_limited_total");

    // Every attempt 429: the client's 429 says the model is overloaded, not that the organisation is limited.
    sim.setFault({ kind: "status", status: 429 });
    try {
      const overloaded = await chat(org.serviceKey, {}, gw);
      const err = await errorOf(overloaded);
      expect({ status: overloaded.status, code: err.code, message: err.message }).toMatchObject({ status: 429, code: "rate_limit_error", message: expect.stringContaining("overloaded") });
    } finally {
      sim.setFault(null);
    }
    // Unknown keys beyond the network's lookup budget: 429 without a lookup (counted as throttled by the key cache).
    const statuses: number[] = [];
    for (let i = 0; i < 3; i++) {
      const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(`sk-gw-${String(i).repeat(43)}`) });
      statuses.push(res.status);
      await res.arrayBuffer();
    }
    expect(statuses).toEqual([401, 429, 429]);
    expect(sample(await scrape(), "gateway_rate_limited_total") - before).toBe(0);

    // The limiter's own refusal (Tiny: 2 a minute, one used above) is counted, once.
    expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(org.serviceKey) })).status).toBe(200);
    const limited = await fetch(`${gw.url}/v1/me`, { headers: bearer(org.serviceKey) });
    expect({ status: limited.status, code: (await errorOf(limited)).code }).toEqual({ status: 429, code: "rate_limit_error" });
    expect(sample(await scrape(), "gateway_rate_limited_total") - before).toBe(1);
  });
});

/** The organisation's audit events of one action, read as its operators read them. */
async function auditEvents(serviceKey: string, action: string): Promise<Record<string, unknown>[]> {
  const res = await fetch(`${gw.url}/v1/audit-events?action=${action}`, { headers: bearer(serviceKey) });
  expect(res.status).toBe(200);
  return ((await res.json()) as { data: Record<string, unknown>[] }).data;
}

describe("origin.user_agent_summary of the official SDK (docs/decisions.md: like `openai-node/6.1`)", () => {
  test("a revoked key used through the openai SDK: the summary names the SDK and its version (`OpenAI/JS 7.57`), not only `OpenAI/JS`", async () => {
    const org = await seedOrg(gw.database);
    await revokeKey(gw.database, org.personalKeyId);
    const client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: org.personalKey, maxRetries: 0 });
    const thrown = await client.models.list().then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(thrown instanceof OpenAI.AuthenticationError).toBe(true);
    const [event] = await eventually(
      () => auditEvents(org.serviceKey, "security.revoked_key_used"),
      (events) => events.length === 1,
      "the security.revoked_key_used event",
    );
    // The SDK sends `User-Agent: OpenAI/JS 7.57.0`: its name and version are two words.
    const [major, minor] = OPENAI_VERSION.split(".");
    expect(event?.origin).toEqual({ ip_prefix: "127.0.0.0/24", user_agent_summary: `OpenAI/JS ${major}.${minor}` });
  });
});

describe("api_key.rotated details (docs/decisions.md: `api_key.rotated` also carries `new_key_expires_at`)", () => {
  test("the new key's expiry as /v1/me shows it, the old key's end of grace, both ids; ISO 8601 UTC with milliseconds", async () => {
    const org = await seedOrg(gw.database);
    const rotated = await rotateKey(gw.database, { id: org.personalKeyId, graceMs: 3_600_000, tag: "gw" });
    const me = (await (await fetch(`${gw.url}/v1/me`, { headers: bearer(rotated.key) })).json()) as { key: { id: string; expires_at: string } };
    expect(me.key.id).toBe(rotated.id);
    const [event] = await auditEvents(org.serviceKey, "api_key.rotated");
    const details = event?.details as Record<string, string>;
    expect(details).toEqual({
      key_id: org.personalKeyId,
      new_key_id: rotated.id,
      new_key_expires_at: me.key.expires_at,
      old_key_expires_at: expect.stringMatching(/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/),
    });
    expect(details.new_key_expires_at).toMatch(/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/);
    // The grace: about an hour from now (the old key had a year left).
    expect(Math.abs(Date.parse(details.old_key_expires_at ?? "") - (Date.now() + 3_600_000))).toBeLessThan(60_000);
  });
});

describe("a stored response retrieve finds damaged is still 400 on cancel (docs/decisions.md, Cancel: ownership is read without the row's content)", () => {
  test("a Response that does not parse, and one of the wrong shape: retrieve 404, cancel 400 'Cannot cancel a synchronous response', not 404", async () => {
    const org = await seedOrg(gw.database);
    const damage = [`{not json`, `{"id":"resp_someone_else","object":"response","output":[]}`, `{"object":"list","data":[]}`];
    for (const response of damage) {
      const made = await fetch(`${gw.url}/v1/responses`, {
        method: "POST",
        headers: bearer(org.personalKey, { "content-type": "application/json" }),
        body: JSON.stringify({ model: "svc-fast", input: "hello" }),
      });
      expect(made.status).toBe(200);
      const { id } = (await made.json()) as { id: string };
      await gw.database.rows(sql`update responses set response = ${response} where id = ${id}`);
      const retrieved = await fetch(`${gw.url}/v1/responses/${id}`, { headers: bearer(org.personalKey) });
      expect({ response, status: retrieved.status, code: (await errorOf(retrieved)).code }).toEqual({ response, status: 404, code: "not_found" });
      const cancelled = await fetch(`${gw.url}/v1/responses/${id}/cancel`, { method: "POST", headers: bearer(org.personalKey) });
      const err = await errorOf(cancelled);
      expect({ response, status: cancelled.status, code: err.code }).toEqual({ response, status: 400, code: "invalid_request_error" });
      expect(err.message).toContain("Cannot cancel a synchronous response");
      // Still the owner's only: another organisation's key gets the 404 an unknown id gets.
      const other = await seedOrg(gw.database);
      const foreign = await fetch(`${gw.url}/v1/responses/${id}/cancel`, { method: "POST", headers: bearer(other.personalKey) });
      expect({ status: foreign.status, code: (await errorOf(foreign)).code }).toEqual({ status: 404, code: "not_found" });
    }
  });
});

describe("a spent quota (docs/decisions.md, Budget exceeded; Input token counts: answered under an exhausted quota, as retrieve is)", () => {
  test("chat, embeddings and Responses create are 429 budget_exceeded; the Responses API's reads, delete and token count, and /v1/models, still answer", async () => {
    const org = await seedOrg(gw.database, { quotaTokens: 1_000_000, quotaWindow: "day" });
    const post = (path: string, body: unknown) =>
      fetch(`${gw.url}${path}`, { method: "POST", headers: bearer(org.personalKey, { "content-type": "application/json" }), body: JSON.stringify(body) });
    const made = await post("/v1/responses", { model: "svc-fast", input: "hello" });
    expect(made.status).toBe(200);
    const { id } = (await made.json()) as { id: string };
    // Spent: the quota lowered to one token (the key's cache learns it from the change's NOTIFY).
    await setOrg(gw.database, { id: org.orgId, plans: ["Standard", "Ultra"], quotaTokens: 1 });
    const refused = async (res: Response) => {
      const err = await errorOf(res);
      return { status: res.status, code: err.code, retry: res.headers.get("x-should-retry") };
    };
    const spent = { status: 429, code: "budget_exceeded", retry: "false" };
    await eventually(
      async () => refused(await chat(org.personalKey)),
      (r) => r.code === "budget_exceeded",
      "the lowered quota to reach the gateway",
    );
    expect(await refused(await chat(org.personalKey, { stream: true }))).toEqual(spent);
    expect(await refused(await post("/v1/embeddings", { model: "svc-embed", input: "hello" }))).toEqual(spent);
    expect(await refused(await post("/v1/responses", { model: "svc-fast", input: "again" }))).toEqual(spent);
    const before = sim.stats.requests;
    const answers: Record<string, number> = {};
    for (const [name, res] of [
      ["retrieve", await fetch(`${gw.url}/v1/responses/${id}`, { headers: bearer(org.personalKey) })],
      ["input items", await fetch(`${gw.url}/v1/responses/${id}/input_items`, { headers: bearer(org.personalKey) })],
      ["input tokens", await post("/v1/responses/input_tokens", { model: "svc-fast", input: "again", previous_response_id: id })],
      ["models", await fetch(`${gw.url}/v1/models`, { headers: bearer(org.personalKey) })],
      ["me", await fetch(`${gw.url}/v1/me`, { headers: bearer(org.personalKey) })],
      ["delete", await fetch(`${gw.url}/v1/responses/${id}`, { method: "DELETE", headers: bearer(org.personalKey) })],
    ] as const) {
      answers[name] = res.status;
      await res.arrayBuffer();
    }
    expect(answers).toEqual({ retrieve: 200, "input items": 200, "input tokens": 200, models: 200, me: 200, delete: 200 });
    expect(sim.stats.requests).toBe(before);
  });
});

describe("gateway_http_request_duration_seconds times the headers (docs/decisions.md, Access log of streams)", () => {
  test("a stream of about 1.5 s: the histogram adds well under a second for it, the access line's latency_ms the whole stream", async () => {
    const slow = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 150, completionTokens: 10 });
    stops.push(() => slow.stop());
    const lines: Record<string, unknown>[] = [];
    const config = await testConfig({ aliases: testAliases(slow.url), plans: TEST_PLANS, accessLog: true });
    const g = await startGateway({ config, database: await sharedDatabase(), log: createLogger("info", (l) => lines.push(JSON.parse(l) as Record<string, unknown>)) });
    stops.push(() => g.stop());
    const org = await seedOrg(g.database, { plan: "Test", plans: Object.keys(TEST_PLANS) });
    const seconds = async () => {
      const m = /^gateway_http_request_duration_seconds_sum\{route="\/v1\/chat\/completions"\} (\S+)$/m.exec(await scrapeOf(g));
      return m ? Number(m[1]) : 0;
    };
    const before = await seconds();
    const t0 = performance.now();
    const res = await chat(org.serviceKey, { stream: true }, g);
    expect(res.status).toBe(200);
    const headersAfter = performance.now() - t0;
    await res.text();
    const whole = performance.now() - t0;
    expect(whole).toBeGreaterThan(1_300);
    const line = await eventually(
      () => lines.find((l) => l.msg === "request" && l.route === "/v1/chat/completions"),
      (l) => l !== undefined,
      "the stream's access line",
    );
    expect(line?.status).toBe(200);
    expect(Number(line?.latency_ms)).toBeGreaterThan(1_300);
    // Time to the headers: what the client waited for them, not the stream's 1.5 s.
    const timed = (await seconds()) - before;
    expect(timed).toBeGreaterThan(0);
    expect(timed * 1_000).toBeLessThan(Math.max(headersAfter + 100, 500));
  });
});

// The embedded database counts its transactions (database.transactions); Postgres leaves them to pg_stat_database.
describe.skipIf(!!TEST_DATABASE_URL)("the hot path touches no database in steady state (docs/architecture.md; docs/operations.md: ≤ 0.01 transactions a request)", () => {
  test("400 requests with a cached key, under a quota with a lease held, between two usage writes: at most 4 transactions", async () => {
    const db = await freshDatabase();
    stops.push(() => db.close());
    const g = await startTestGateway({ aliases: testAliases(sim.url), plans: TEST_PLANS, quota: { flushMs: 600_000 } }, db);
    stops.push(() => g.stop());
    const org = await seedOrg(db, { plan: "Test", plans: Object.keys(TEST_PLANS), quotaTokens: 10_000_000, quotaWindow: "day" });
    const send = async (n: number) => {
      const answers = await Promise.all(Array.from({ length: n }, () => chat(org.serviceKey, { max_tokens: 5 }, g)));
      for (const a of answers) {
        expect(a.status).toBe(200);
        await a.arrayBuffer();
      }
    };
    // Warm: the key in the cache, a lease taken (and refilled ahead of need), the key's last use written.
    await send(20);
    await Bun.sleep(200);
    const transactions = () => db.transactions?.() ?? Number.NaN;
    const before = transactions();
    for (let i = 0; i < 20; i++) await send(20);
    expect(transactions() - before).toBeLessThanOrEqual(4);
  });

  test("a Responses request with store: false touches no database (docs/decisions.md, Responses API: Storage)", async () => {
    const db = await freshDatabase();
    stops.push(() => db.close());
    const g = await startTestGateway({ aliases: testAliases(sim.url), plans: TEST_PLANS, quota: { flushMs: 600_000 }, responses: { enabled: true } }, db);
    stops.push(() => g.stop());
    const org = await seedOrg(db, { plan: "Test", plans: Object.keys(TEST_PLANS) });
    const create = async (stream: boolean) => {
      const res = await fetch(`${g.url}/v1/responses`, {
        method: "POST",
        headers: bearer(org.personalKey, { "content-type": "application/json" }),
        body: JSON.stringify({ model: "svc-fast", input: "hello", store: false, stream }),
      });
      expect(res.status).toBe(200);
      await res.text();
    };
    // Warm: the key in the cache and its first use written.
    await create(false);
    await Bun.sleep(200);
    const transactions = () => db.transactions?.() ?? Number.NaN;
    const before = transactions();
    for (let i = 0; i < 10; i++) await create(i % 2 === 0);
    expect(transactions() - before).toBe(0);
    // With store (the default) each answer is one row: the count moves.
    const stored = await fetch(`${g.url}/v1/responses`, {
      method: "POST",
      headers: bearer(org.personalKey, { "content-type": "application/json" }),
      body: JSON.stringify({ model: "svc-fast", input: "hello" }),
    });
    expect(stored.status).toBe(200);
    await stored.text();
    expect(transactions() - before).toBeGreaterThan(0);
  });
});

describe("a streamed request answered with one JSON error document and a 200 (docs/decisions.md: `error`, `object: \"error\"`, `detail`)", () => {
  test("each of the three shapes ends the stream with the upstream's message, in the gateway's error event; recorded as 503", async () => {
    let answer: unknown;
    const upstream = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: () => Response.json(answer) });
    stops.push(() => upstream.stop(true));
    const g = await startTestGateway({
      aliases: { "svc-fast": chatAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }]) },
      plans: TEST_PLANS,
      upstream: upstreamSettings({ attempts: 1 }),
      quota: { flushMs: 600_000 },
    });
    stops.push(() => g.stop());
    const org = await seedOrg(g.database, { plan: "Test", plans: Object.keys(TEST_PLANS) });
    const shapes: [string, unknown][] = [
      ["error", { error: { message: "the engine is overloaded (vLLM)", type: "ServiceUnavailable", code: 503 } }],
      ["object error", { object: "error", message: "the engine is overloaded (old vLLM)", type: "ServiceUnavailable", code: 503 }],
      ["detail", { detail: "the engine is overloaded (FastAPI)" }],
    ];
    for (const [name, body] of shapes) {
      answer = body;
      const res = await chat(org.serviceKey, { stream: true }, g);
      expect(res.status).toBe(200);
      const data = sseData(await res.text());
      expect({ name, events: data.length }).toEqual({ name, events: 1 });
      const error = (JSON.parse(data[0] ?? "null") as { error: { message: string; code: string } }).error;
      expect({ name, code: error.code }).toEqual({ name, code: "service_unavailable" });
      expect(error.message).toContain("the engine is overloaded");
    }
    await g.quota.flush();
    const rows = await g.database.db.select().from(usageEvents).where(eq(usageEvents.orgId, org.orgId));
    expect(rows.map((r) => [r.status, r.requests, r.promptTokens, r.completionTokens])).toEqual([[503, 3, 0, 0]]);
  });
});

describe("the embedded database belongs to one process (README: any other second process on the same directory is refused; exit 1, data directory in use, one error: line)", () => {
  test("migrate (with and without --json) and a second serve on a directory a serve holds: exit 1, one line naming the directory and the holder, nothing on stdout; the first serves on; once it stops, migrate runs", async () => {
    const dataDir = join(scratchDir(), "data");
    const env = cleanEnv({ UPSTREAM_BASE_URL: sim.url, LOG_LEVEL: "error" });
    const server = startGatewayProcess(["serve", "--port", "0", "--data-dir", dataDir], { env: { ...env, LOG_LEVEL: "info" } });
    let stopped = false;
    try {
      const url = await listeningUrl(server);
      await waitFor200(`${url}/readyz`, 60_000);
      for (const args of [["migrate"], ["migrate", "--json"], ["serve", "--port", "0"]]) {
        const r = await runGateway([...args, "--data-dir", dataDir], { env, timeoutMs: 60_000 });
        expect({ args, code: r.code, stdout: r.stdout }).toEqual({ args, code: 1, stdout: "" });
        expect(r.stderr.split("\n")).toEqual([expect.stringMatching(/^error: /), ""]);
        expect(r.stderr).toContain(`the data directory ${dataDir} is in use by process ${server.pid}`);
      }
      // The holder is unharmed: still ready, still the lock's owner.
      expect((await fetch(`${url}/readyz`)).status).toBe(200);
      expect(readFileSync(join(dataDir, "gateway.pid"), "utf8").trim()).toBe(String(server.pid));
      server.kill("SIGTERM");
      expect(await exitWithin(server, 20_000)).toBe(0);
      stopped = true;
      const after = await runGateway(["migrate", "--json", "--data-dir", dataDir], { env, timeoutMs: 60_000 });
      expect({ code: after.code, stderr: after.stderr }).toEqual({ code: 0, stderr: "" });
      expect(onlyJson(after.stdout)).toEqual({ applied: [], unknown: [] });
    } finally {
      if (!stopped) server.kill("SIGKILL");
      removeScratch();
    }
  });
});

describe("a Cookie header that names no cookie still marks a browser (docs/decisions.md, Browser-looking requests: any other cookie, or none named)", () => {
  test("`;`, `=abc`, ` ; ` and a load balancer's cookie name in another case: 403 browser_request_rejected; the load balancer's own cookie alone passes", async () => {
    const org = await seedOrg(gw.database);
    for (const cookie of [";", "=abc", " ; ", "awsalb=abc"]) {
      const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(org.serviceKey, { cookie }) });
      expect({ cookie, status: res.status, code: (await errorOf(res)).code }).toEqual({ cookie, status: 403, code: "browser_request_rejected" });
    }
    const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(org.serviceKey, { cookie: "AWSALB=abc" }) });
    expect(res.status).toBe(200);
  });
});
