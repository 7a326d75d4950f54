import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import OpenAI from "openai";
import { eq } from "drizzle-orm";
import { loadConfig } from "../../src/config/load.ts";
import { migrate, openDatabase } from "../../src/db/client.ts";
import { usageEvents } from "../../src/db/schema.ts";
import { SYSTEM_ACTOR_ID } from "../../src/lib/ids.ts";
import { createLogger } from "../../src/lib/log.ts";
import { VERSION } from "../../src/lib/version.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { captureCli, withoutEnv } from "../helpers/cli.ts";
import { startFreezeProxy } from "../helpers/freeze-proxy.ts";
import { TEST_DATABASE_URL, bearer, errorOf, freshDatabase, seedOrg, startTestGateway } from "../helpers/harness.ts";
import { eventually } from "../helpers/poll.ts";
import { createScratchDatabase, onlyJson, removeScratch, scratchDir } from "../helpers/process.ts";
import { TEST_PLANS, testAliases } from "./inference-fixtures.ts";
import { scrapeOf, sample } from "../helpers/scrape.ts";

// Servers, CLI runs on an embedded database and PGlite start-ups on a busy 2-core machine.
setDefaultTimeout(120_000);

/**
 * Claims of README.md, docs/operations.md, docs/decisions.md and the CLI's
 * help that the earlier rounds (claims-*.test.ts) left without a test able
 * to fail on them: the budget_exceeded error's OpenAI type, the
 * billing.budget_exceeded audit event's content, the token and database
 * gauges operators alert on, and what `keys rotate`, `keys list` and `usage
 * report` print. Each test names the claim it holds.
 */

// runCli reads process.env: keep a developer's own settings out of these tests.
withoutEnv(["DATABASE_URL", "GATEWAY_CONFIG", "GATEWAY_DATA_DIR", "GATEWAY_CURSOR_SECRET", "LOG_LEVEL"]);

let sim: Simulator;
let gw: Gateway;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 5 });
  // Usage is written only when a test flushes it or the gateway stops.
  gw = await startTestGateway({ aliases: testAliases(sim.url), plans: TEST_PLANS, quota: { flushMs: 600_000 } });
});
const stops: (() => unknown)[] = [];
afterAll(async () => {
  for (const stop of stops.reverse()) await stop();
  await gw.stop();
  await sim.stop();
  removeScratch();
});

const chat = (key: string, extra: Record<string, unknown> = {}, g: Gateway = gw) =>
  fetch(`${g.url}/v1/chat/completions`, {
    method: "POST",
    headers: bearer(key, { "content-type": "application/json" }),
    body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }], ...extra }),
  });

/** What the quota reserves for the prompt "hi" (src/inference/tokens.ts): a token a byte (2), 16 for the message, 512 for the template. */
const HI_RESERVE = 512 + 16 + 2;

describe("budget_exceeded's OpenAI type (docs/decisions.md, Error body: `type` the OpenAI class, … `insufficient_quota`)", () => {
  test("a refusal for want of quota is type insufficient_quota, as OpenAI's own quota error, on the wire and as the openai SDK reads it", async () => {
    const org = await seedOrg(gw.database, { plan: "Test", plans: Object.keys(TEST_PLANS), quotaTokens: 1_000, quotaWindow: "day" });
    const refused = await chat(org.serviceKey, { max_tokens: 5_000 });
    expect(refused.status).toBe(429);
    expect(await refused.json()).toEqual({ error: { message: expect.stringContaining("usage quota"), type: "insufficient_quota", param: null, code: "budget_exceeded" } });
    // Streamed and embeddings: the same error, from the same table.
    const streamed = await chat(org.serviceKey, { max_tokens: 5_000, stream: true });
    expect({ status: streamed.status, error: await errorOf(streamed) }).toMatchObject({ status: 429, error: { type: "insufficient_quota", code: "budget_exceeded" } });
    const client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: org.serviceKey, maxRetries: 0 });
    const err = await client.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "hi" }], max_tokens: 5_000 }).then(
      () => null,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(OpenAI.RateLimitError);
    expect({ type: (err as InstanceType<typeof OpenAI.APIError>).type, code: (err as InstanceType<typeof OpenAI.APIError>).code }).toEqual({
      type: "insufficient_quota",
      code: "budget_exceeded",
    });
  });
});

describe("the billing.budget_exceeded event (docs/decisions.md, Origin of events: the gateway's own, actor `system`; Time and names: `window`/`window_start`)", () => {
  test("written by the system actor on the host, its target the organisation, its details the quota, the window and the window's start", async () => {
    const quota = 2_000;
    const org = await seedOrg(gw.database, { plan: "Test", plans: Object.keys(TEST_PLANS), quotaTokens: quota, quotaWindow: "day" });
    const ok = await chat(org.serviceKey, { max_tokens: 10 });
    expect(ok.status).toBe(200);
    await ok.arrayBuffer();
    // Fits the whole quota, not what the first request left: the quota has run out for it, and the event is written.
    const refused = await chat(org.serviceKey, { max_tokens: quota - HI_RESERVE });
    expect(refused.status).toBe(429);
    expect((await errorOf(refused)).code).toBe("budget_exceeded");
    type Event = { action: string; category: string; created_at: string; actor: unknown; targets: unknown; details: Record<string, unknown>; origin: unknown };
    const [event] = await eventually(
      async () => {
        const res = await fetch(`${gw.url}/v1/audit-events?action=billing.budget_exceeded`, { headers: bearer(org.serviceKey) });
        expect(res.status).toBe(200);
        return ((await res.json()) as { data: Event[] }).data;
      },
      (events) => events.length > 0,
      "the billing.budget_exceeded event",
    );
    if (!event) throw new Error("no event");
    const at = new Date(event.created_at);
    const dayStart = new Date(Date.UTC(at.getUTCFullYear(), at.getUTCMonth(), at.getUTCDate())).toISOString();
    expect(event).toEqual({
      ...event,
      category: "billing",
      actor: { type: "system", id: SYSTEM_ACTOR_ID, name: "gateway", email: "", key_id: null },
      targets: [{ key: "org_id", kind: "organization", id: org.orgId, name: "", email: "" }],
      details: { org_id: org.orgId, quota_tokens: quota, window: "day", window_start: dayStart },
      origin: { ip_prefix: "127.0.0.0/8", user_agent_summary: `gateway-cli/${VERSION}` },
    });
  });
});

describe("gateway_tokens_total{alias,direction} (docs/operations.md: prompt and completion tokens)", () => {
  test("both directions move by the tokens charged, JSON and streamed, as the answers' usage says", async () => {
    const org = await seedOrg(gw.database, { plan: "Test", plans: Object.keys(TEST_PLANS) });
    // An alias no other test here calls, so the series moves only by these requests.
    const labels = (direction: string) => ({ alias: "svc-smart", direction });
    const before = await scrapeOf(gw);
    let prompt = 0;
    let completion = 0;
    const whole = await chat(org.serviceKey, { model: "svc-smart", messages: [{ role: "user", content: "a prompt of some length, counted in tokens" }] });
    expect(whole.status).toBe(200);
    const usage = ((await whole.json()) as { usage: { prompt_tokens: number; completion_tokens: number } }).usage;
    prompt += usage.prompt_tokens;
    completion += usage.completion_tokens;
    const streamed = await chat(org.serviceKey, { model: "svc-smart", stream: true, stream_options: { include_usage: true } });
    expect(streamed.status).toBe(200);
    const text = await streamed.text();
    const last = text
      .split("\n")
      .filter((l) => l.startsWith("data: {") && l.includes('"usage"'))
      .map((l) => JSON.parse(l.slice(6)) as { usage?: { prompt_tokens: number; completion_tokens: number } | null })
      .findLast((c) => c.usage);
    if (!last?.usage) throw new Error(`no usage chunk in ${text}`);
    prompt += last.usage.prompt_tokens;
    completion += last.usage.completion_tokens;
    expect(prompt).toBeGreaterThan(0);
    expect(completion).toBeGreaterThan(0);
    // Counted when each request settles, which for a stream may come just after its last bytes.
    const movedBy = async () => {
      const after = await scrapeOf(gw);
      const d = (direction: string) => sample(after, "gateway_tokens_total", labels(direction)) - sample(before, "gateway_tokens_total", labels(direction));
      return { prompt: d("prompt"), completion: d("completion") };
    };
    let moved = await movedBy();
    for (let i = 0; i < 50 && (moved.prompt !== prompt || moved.completion !== completion); i++) {
      await Bun.sleep(100);
      moved = await movedBy();
    }
    expect(moved).toEqual({ prompt, completion });
  });
});

describe("gateway_database_up (docs/operations.md: last readiness check reached the database)", () => {
  test("1 while /readyz is ready; 0 once a readiness check finds the database gone (closed under the gateway)", async () => {
    const own = await freshDatabase();
    const g = await startTestGateway({ drainMs: 100 }, own);
    try {
      expect((await fetch(`${g.url}/readyz`)).status).toBe(200);
      expect(sample(await scrapeOf(g), "gateway_database_up")).toBe(1);
      await own.close();
      const res = await fetch(`${g.url}/readyz`);
      expect(res.status).toBe(503);
      await res.arrayBuffer();
      expect(sample(await scrapeOf(g), "gateway_database_up")).toBe(0);
    } finally {
      await Promise.race([g.stop().catch(() => {}), Bun.sleep(3_000)]);
    }
  });

  test.skipIf(!TEST_DATABASE_URL)("a database that stops answering (partition): 0 by the scrape after the first /readyz that answered 503, not seconds later", async () => {
    const scratch = await createScratchDatabase(TEST_DATABASE_URL as string, "c5_dbup");
    stops.push(() => scratch.drop());
    const held = await openDatabase({ databaseUrl: scratch.url, dataDir: "", poolMax: 2 });
    await migrate(held);
    await held.close();
    const proxy = await startFreezeProxy(scratch.url, 0);
    const db = await openDatabase({ databaseUrl: proxy.url, dataDir: "", poolMax: 4 });
    const g = await startTestGateway({ drainMs: 100 }, db);
    try {
      expect((await fetch(`${g.url}/readyz`)).status).toBe(200);
      expect(sample(await scrapeOf(g), "gateway_database_up")).toBe(1);
      proxy.freeze();
      // The poll waits READY_TIMEOUT_MS (2 s) for the check, which never gets an answer, and says 503.
      const res = await fetch(`${g.url}/readyz`);
      expect(res.status).toBe(503);
      await res.arrayBuffer();
      // Before: 1 for another ~7 s, until a second check's new connection timed out.
      expect(sample(await scrapeOf(g), "gateway_database_up")).toBe(0);
      proxy.thaw();
      await eventually(
        async () => (await fetch(`${g.url}/readyz`)).status,
        (s) => s === 200,
        "/readyz ready again once the database answers",
        20_000,
        200,
      );
      expect(sample(await scrapeOf(g), "gateway_database_up")).toBe(1);
    } finally {
      proxy.thaw();
      await Promise.race([g.stop().catch(() => {}), Bun.sleep(10_000)]);
      await db.close();
      proxy.stop();
    }
  });
});

describe("the CLI on a data directory (or the suite's Postgres)", () => {
  /** A config file on the suite's Postgres when it runs on one (its databaseUrl), else an embedded database in a scratch directory. */
  function setup(extra: Record<string, unknown> = {}) {
    const work = scratchDir("gw-claims5-");
    const dataDir = join(work, "data");
    const file = join(work, "gateway.json");
    writeFileSync(file, JSON.stringify({ ...extra, ...(TEST_DATABASE_URL ? { databaseUrl: TEST_DATABASE_URL } : {}) }));
    const cli = async (...args: string[]) => {
      const r = await captureCli([...args, "--config", file, "--data-dir", dataDir]);
      expect({ args, code: r.code, stderr: r.stderr }).toEqual({ args, code: 0, stderr: "" });
      return r;
    };
    return { dataDir, file, cli };
  }

  test("keys rotate without --grace (README: `[--grace 24h]`; decisions.md, Rotation: default 24 h): the old key works 24 hours more, as keys list and the output say", async () => {
    const { cli } = setup();
    const org = onlyJson<{ id: string }>((await cli("orgs", "create", "--name", "Grace", "--json")).stdout).id;
    const key = onlyJson<{ id: string }>((await cli("keys", "create", "--org", org, "--kind", "service", "--scopes", "inference", "--json")).stdout);
    const t0 = Date.now();
    const rotated = onlyJson<{ id: string; old_key_expires_at: string }>((await cli("keys", "rotate", key.id, "--json")).stdout);
    const day = 24 * 3_600_000;
    expect(Math.abs(Date.parse(rotated.old_key_expires_at) - (t0 + day))).toBeLessThan(60_000);
    const listed = onlyJson<{ id: string; expires_at: string }[]>((await cli("keys", "list", "--org", org, "--json")).stdout);
    expect(listed.find((k) => k.id === key.id)?.expires_at).toBe(rotated.old_key_expires_at);
    // The human form says the same: 24h, and the old key does work that long.
    const again = await cli("keys", "rotate", rotated.id);
    expect(again.stdout).toContain("(the old key works for 24h more)");
    const after = onlyJson<{ id: string; expires_at: string }[]>((await cli("keys", "list", "--org", org, "--json")).stdout);
    expect(Math.abs(Date.parse(after.find((k) => k.id === rotated.id)?.expires_at ?? "") - (Date.now() + day))).toBeLessThan(60_000);
  });

  test("keys list (its help: an organisation's keys, newest first): JSON and human form in the reverse order of creation", async () => {
    const { cli } = setup();
    const org = onlyJson<{ id: string }>((await cli("orgs", "create", "--name", "Order", "--json")).stdout).id;
    const made: string[] = [];
    for (const name of ["first", "second", "third"]) {
      made.push(onlyJson<{ id: string }>((await cli("keys", "create", "--org", org, "--kind", "service", "--scopes", "inference", "--name", name, "--json")).stdout).id);
    }
    const newestFirst = [...made].reverse();
    const listed = onlyJson<{ id: string }[]>((await cli("keys", "list", "--org", org, "--json")).stdout);
    expect(listed.map((k) => k.id)).toEqual(newestFirst);
    const human = (await cli("keys", "list", "--org", org)).stdout;
    expect(human.trimEnd().split("\n").map((line) => line.split("  ")[0])).toEqual(newestFirst);
  });

  test("usage report's requests (README: requests and tokens per alias and key; decisions.md, Usage rows are sums): the requests served, not the rows they were summed into", async () => {
    const { dataDir, file, cli } = setup({ quota: { flushMs: 600_000 }, plans: TEST_PLANS });
    const org = onlyJson<{ id: string }>((await cli("orgs", "create", "--name", "Usage", "--plan", "Test", "--json")).stdout).id;
    const key = onlyJson<{ id: string; key: string }>((await cli("keys", "create", "--org", org, "--kind", "service", "--scopes", "inference", "--json")).stdout);

    const N = 7;
    const database = await openDatabase({ databaseUrl: TEST_DATABASE_URL, dataDir });
    let prompt = 0;
    let completion = 0;
    let rows: { requests: number }[] = [];
    try {
      const config = {
        ...(await loadConfig({ env: {}, file, overrides: { host: "127.0.0.1", port: 0 } })),
        aliases: testAliases(sim.url),
        metrics: { enabled: false, listen: "127.0.0.1:0" },
        logLevel: "error" as const,
        accessLog: false,
      };
      const g = await startGateway({ config, database, log: createLogger("error") });
      try {
        for (let i = 0; i < N; i++) {
          const res = await chat(key.key, {}, g);
          expect(res.status).toBe(200);
          const usage = ((await res.json()) as { usage: { prompt_tokens: number; completion_tokens: number } }).usage;
          prompt += usage.prompt_tokens;
          completion += usage.completion_tokens;
        }
      } finally {
        // The stop writes the usage settled since the last write: one write, so the requests share one row.
        await g.stop();
      }
      rows = await database.db.select({ requests: usageEvents.requests }).from(usageEvents).where(eq(usageEvents.keyId, key.id));
    } finally {
      await database.close();
    }
    // What makes the report's count matter: fewer rows than requests.
    expect(rows).toEqual([{ requests: N }]);

    const report = onlyJson<unknown[]>((await cli("usage", "report", "--org", org, "--json")).stdout);
    expect(report).toEqual([{ alias: "svc-fast", key_id: key.id, requests: N, prompt_tokens: prompt, completion_tokens: completion, total_tokens: prompt + completion }]);
    const human = (await cli("usage", "report", "--org", org)).stdout;
    expect(human).toMatch(new RegExp(`^svc-fast\\s+${key.id}\\s+${N} req\\s+${prompt + completion} tokens\\n$`));
  });
});
