import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { eq, sql } from "drizzle-orm";
import type { AliasConfig } from "../../src/config/schema.ts";
import type { Database } from "../../src/db/client.ts";
import { usageCounters } from "../../src/db/schema.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { setOrg } from "../../src/admin/service.ts";
import { until } from "../helpers/poll.ts";
import { errorOf, seedOrg, sharedDatabase, startTestGateway } from "../helpers/harness.ts";
import { TEST_PLANS, chatAlias, testAliases, upstreamSettings } from "./inference-fixtures.ts";

/** A plan whose request rate never binds: these tests are about the quota. */
const UNLIMITED_RATE = { plan: "Test", plans: Object.keys(TEST_PLANS) };

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(60_000);

/**
 * The quota bound through HTTP (README "Quota"): a request is admitted only
 * against tokens granted from the shared counter, reserving the most its
 * prompt can be (one token per byte, the template's allowances, each image at
 * the alias's imageTokens) plus max_tokens (or plus quota.defaultMaxTokens when unset, and
 * then sent upstream as its max_tokens). When less remains, a request with
 * max_tokens is refused (429 budget_exceeded) and one without goes upstream
 * with max_tokens lowered to what remains after the prompt.
 * The simulator generates more tokens than any quota here, so only the
 * forwarded max_tokens keeps a completion within the quota.
 */

/** 40 characters: the gateway's prompt estimate (and the simulator's count) is 3 + 4 + 40/4 = 17 tokens. */
const PROMPT = "x".repeat(40);
const PROMPT_TOKENS = 17;
/**
 * What the quota reserves for that prompt: the most it can be (src/inference/tokens.ts, promptTokenBound):
 * one token per byte (40), 16 for the message's template markers, 512 for the template's fixed text.
 */
const PROMPT_RESERVE = 512 + 16 + 40;
/** quota.defaultMaxTokens's default. */
const DEFAULT_RESERVE = 4_096;

let sim: Simulator;
let gwA: Gateway;
let gwB: Gateway;
let db: Database;

/** An alias that declares no context window, so max_tokens has no upper bound there. */
function openAlias(simUrl: string): AliasConfig {
  const { contextWindow: _, ...alias } = chatAlias([{ baseUrl: simUrl }]);
  return alias;
}

const overrides = (simUrl: string) => ({
  aliases: { ...testAliases(simUrl), "svc-open": openAlias(simUrl) },
  plans: TEST_PLANS,
  upstream: upstreamSettings({ attempts: 1 }),
  quota: { leaseTokens: 20_000, flushMs: 100, maxBuffered: 100_000 },
});

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 200_000 });
  db = await sharedDatabase();
  gwA = await startTestGateway(overrides(sim.url));
  gwB = await startTestGateway(overrides(sim.url));
});
afterAll(async () => {
  await gwA?.stop();
  await gwB?.stop();
  await sim?.stop();
});

function chat(gw: Gateway, key: string, extra: Record<string, unknown> = {}): Promise<Response> {
  return fetch(`${gw.url}/v1/chat/completions`, {
    method: "POST",
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
    body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: PROMPT }], ...extra }),
  });
}

/**
 * chat() as the openai SDK sends it: a 503 with `retry-after: 1` (the rest of the quota held by requests
 * in flight, or by the other instance until it returns its unused lease at its next flushes; docs/decisions.md
 * "Quota") is retried after that second, up to twice (the SDK's default). For the tests of two instances
 * taking turns on a small quota, where a loaded machine can delay the other instance's flushes past the wait.
 */
async function chatAsSdk(gw: Gateway, key: string, extra: Record<string, unknown> = {}): Promise<Response> {
  for (let retries = 0; ; retries++) {
    const res = await chat(gw, key, extra);
    if (res.status !== 503 || res.headers.get("retry-after") !== "1" || retries === 2) return res;
    await res.arrayBuffer();
    await Bun.sleep(1_000);
  }
}

async function used(orgId: string): Promise<{ used: number; leased: number }> {
  const rows = await db.db.select().from(usageCounters).where(eq(usageCounters.orgId, orgId));
  return rows.reduce((a, r) => ({ used: a.used + r.used, leased: a.leased + r.leased }), { used: 0, leased: 0 });
}

/** The max_tokens the simulator received in the last chat request (undefined when none was sent). */
function forwardedMaxTokens(): unknown {
  const b = sim.stats.lastBody as Record<string, unknown>;
  return b.max_tokens ?? b.max_completion_tokens;
}

/** Twice: a flush already under way (the timer's) returns without what settled after it began. */
async function flushAll(): Promise<void> {
  for (let i = 0; i < 2; i++) {
    await gwA.quota.flush();
    await gwB.quota.flush();
  }
}

/**
 * Three small requests (max_tokens 10) on gwA in turn, each of which must be served, with the usage written
 * after each (so the instance's lease goes back between them); the tokens they used.
 */
async function threeSmallServed(key: string): Promise<number> {
  let received = 0;
  for (let i = 0; i < 3; i++) {
    const res = await chat(gwA, key, { max_tokens: 10 });
    expect(`request ${i}: ${res.status}`).toBe(`request ${i}: 200`);
    // Read first, then add (see docs/testing.md).
    const { usage } = (await res.json()) as { usage: { total_tokens: number } };
    received += usage.total_tokens;
    await flushAll();
  }
  return received;
}

/**
 * Waits until a quota of at most 1,000 has reached `gw` (the key cache's org invalidation): until a
 * reservation above it (max_tokens 2,000) is refused outright. On Postgres the invalidation comes by NOTIFY,
 * a little after the change commits, so a probe may still be admitted under the old setting: it asks the
 * simulator to refuse, which answers a few tokens, not 2,000. Returns the tokens such probes used.
 */
async function newQuotaServed(gw: Gateway, key: string): Promise<number> {
  let spent = 0;
  await until(async () => {
    const res = await chat(gw, key, { max_tokens: 2_000, messages: [{ role: "user", content: "refuse" }] });
    if (res.status !== 200) {
      await res.text();
      return res.status === 429;
    }
    const { usage } = (await res.json()) as { usage: { total_tokens: number } };
    spent += usage.total_tokens;
    return false;
  }, "the new quota");
  return spent;
}

describe("the reservation is the prompt's bound plus max_tokens (or plus quota.defaultMaxTokens)", () => {
  test("max_tokens far beyond the quota: 429 budget_exceeded, nothing sent upstream, nothing used", async () => {
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 1_000, quotaWindow: "day" });
    const before = sim.stats.requests;
    for (const field of ["max_tokens", "max_completion_tokens"]) {
      const res = await chat(gwA, org.serviceKey, { [field]: 100_000 });
      expect(res.status).toBe(429);
      const err = await errorOf(res);
      expect(err.code).toBe("budget_exceeded");
      expect(err.message).toContain("budget_exceeded");
      expect(res.headers.get("x-should-retry")).toBe("false");
    }
    expect(sim.stats.requests).toBe(before);
    await flushAll();
    expect((await used(org.orgId)).used).toBe(0);
  });

  test("max_completion_tokens is the bound: under a quota the upstream gets it as max_tokens too", async () => {
    // vLLM takes max_completion_tokens over max_tokens; a server that knows only max_tokens (or takes it first)
    // would run to the client's max_tokens, or unbounded, past the reservation.
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 100_000, quotaWindow: "day" });
    for (const extra of [{ max_completion_tokens: 40, max_tokens: 5_000 }, { max_completion_tokens: 40 }]) {
      const res = await chat(gwA, org.serviceKey, extra);
      expect(res.status).toBe(200);
      await res.arrayBuffer();
      const sent = sim.stats.lastBody as Record<string, unknown>;
      expect({ max_tokens: sent.max_tokens, max_completion_tokens: sent.max_completion_tokens }).toEqual({ max_tokens: 40, max_completion_tokens: 40 });
    }
    // Without a quota there is nothing to protect: sent as asked.
    const free = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: null });
    const res = await chat(gwA, free.serviceKey, { max_completion_tokens: 40, max_tokens: 5_000 });
    expect(res.status).toBe(200);
    await res.arrayBuffer();
    const sent = sim.stats.lastBody as Record<string, unknown>;
    expect({ max_tokens: sent.max_tokens, max_completion_tokens: sent.max_completion_tokens }).toEqual({ max_tokens: 5_000, max_completion_tokens: 40 });
  });

  test("a quota of exactly the prompt's bound + max_tokens admits; one token less refuses", async () => {
    const maxTokens = 300;
    const exact = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: PROMPT_RESERVE + maxTokens, quotaWindow: "day" });
    const res = await chat(gwA, exact.serviceKey, { max_tokens: maxTokens });
    expect(res.status).toBe(200);
    const body = (await res.json()) as { usage: { prompt_tokens: number; completion_tokens: number } };
    expect(body.usage).toMatchObject({ prompt_tokens: PROMPT_TOKENS, completion_tokens: maxTokens });
    expect(forwardedMaxTokens()).toBe(maxTokens);

    const short = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: PROMPT_RESERVE + maxTokens - 1, quotaWindow: "day" });
    const refused = await chat(gwA, short.serviceKey, { max_tokens: maxTokens });
    expect(refused.status).toBe(429);
    expect((await errorOf(refused)).code).toBe("budget_exceeded");
    await flushAll();
    expect((await used(exact.orgId)).used).toBe(PROMPT_TOKENS + maxTokens);
    expect((await used(short.orgId)).used).toBe(0);
  });

  test("without max_tokens: bounded by the default reservation, else lowered to what remains; no quota, sent as is", async () => {
    // The simulator would generate 200,000 tokens: only the forwarded bound keeps the answer within the reservation.
    const roomy = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 10 * (PROMPT_RESERVE + DEFAULT_RESERVE), quotaWindow: "day" });
    for (const stream of [false, true]) {
      sim.reset();
      const res = await chat(gwA, roomy.serviceKey, { stream });
      expect(res.status).toBe(200);
      await res.arrayBuffer();
      expect(forwardedMaxTokens()).toBe(DEFAULT_RESERVE);
    }
    await flushAll();
    expect((await used(roomy.orgId)).used).toBe(2 * (PROMPT_TOKENS + DEFAULT_RESERVE));

    // An organisation without a quota has nothing to overshoot: the request goes as the client sent it.
    const free = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: null });
    sim.reset();
    const unbounded = await chat(gwA, free.serviceKey, { max_tokens: undefined });
    expect(unbounded.status).toBe(200);
    await unbounded.arrayBuffer();
    expect(forwardedMaxTokens()).toBeUndefined();

    for (const stream of [false, true]) {
      const tight = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: PROMPT_RESERVE + DEFAULT_RESERVE - 1, quotaWindow: "day" });
      const r = await chat(gwA, tight.serviceKey, { stream });
      expect(r.status).toBe(200);
      await r.arrayBuffer();
      expect(forwardedMaxTokens()).toBe(DEFAULT_RESERVE - 1);
      await flushAll();
      // Charged what the upstream counted: the prompt's 17 tokens, not its bound.
      expect((await used(tight.orgId)).used).toBe(PROMPT_TOKENS + DEFAULT_RESERVE - 1);
      // Less than the prompt's bound is left now: no request can be sure to fit.
      const nothingLeft = await chat(gwA, tight.serviceKey, { stream });
      expect(nothingLeft.status).toBe(429);
      expect((await errorOf(nothingLeft)).code).toBe("budget_exceeded");
    }

    // Only the prompt's bound fits: no completion is possible, so 429 rather than max_tokens 0.
    const promptOnly = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: PROMPT_RESERVE, quotaWindow: "day" });
    const r0 = await chat(gwA, promptOnly.serviceKey);
    expect(r0.status).toBe(429);
    expect((await errorOf(r0)).code).toBe("budget_exceeded");
  });

  test("the default bound leaves the prompt room in the context window (vLLM refuses prompt + max_tokens beyond it)", async () => {
    // svc-text's window is 4,096 tokens, the default bound's size: a 1,000-token prompt leaves room for 3,096.
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 100_000, quotaWindow: "day" });
    sim.reset();
    const res = await fetch(`${gwA.url}/v1/chat/completions`, {
      method: "POST",
      headers: { authorization: `Bearer ${org.serviceKey}`, "content-type": "application/json" },
      body: JSON.stringify({ model: "svc-text", messages: [{ role: "user", content: "y".repeat(3_972) }] }),
    });
    expect(res.status).toBe(200);
    await res.arrayBuffer();
    // 3 + 4 + 3,972 / 4 = 1,000 tokens of prompt estimate.
    expect(forwardedMaxTokens()).toBe(4_096 - 1_000);
  });

  test("an unset max_tokens is lowered by what earlier requests used, on either instance", async () => {
    const quota = 2_500;
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: quota, quotaWindow: "day" });
    let received = 0;
    for (let i = 0; i < 8; i++) {
      const res = await chatAsSdk(i % 2 === 0 ? gwA : gwB, org.serviceKey, { max_tokens: 200 });
      expect(res.status).toBe(200);
      // Read first, then add: `received += await …` reads `received` before the await and loses what other clients added meanwhile.
      const { usage } = (await res.json()) as { usage: { total_tokens: number } };
      received += usage.total_tokens;
    }
    expect(received).toBe(8 * (PROMPT_TOKENS + 200));
    // 764 tokens remain, fewer than the prompt's bound and the default reservation: the completion is bounded by what this instance can still get.
    const res = await chatAsSdk(gwB, org.serviceKey);
    expect(res.status).toBe(200);
    const last = ((await res.json()) as { usage: { total_tokens: number } }).usage.total_tokens;
    const lowered = forwardedMaxTokens();
    expect(typeof lowered).toBe("number");
    expect(lowered as number).toBeGreaterThan(0);
    expect(lowered as number).toBeLessThanOrEqual(quota - received - PROMPT_RESERVE);
    expect(last).toBe(PROMPT_TOKENS + (lowered as number));
    received += last;
    await flushAll();
    const u = await used(org.orgId);
    expect(u.used).toBe(received);
    expect(u.used).toBeLessThanOrEqual(quota);
  });
});

describe("n choices: each may run to the completion bound, so the reservation counts every one", () => {
  test("with max_tokens: the reservation is the prompt plus n × max_tokens; one choice's worth of quota refuses", async () => {
    const n = 8;
    const maxTokens = 100;
    for (const stream of [false, true]) {
      // Room for one choice of 100 tokens, not eight: the upstream would generate 800.
      const short = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: PROMPT_RESERVE + maxTokens, quotaWindow: "day" });
      const before = sim.stats.requests;
      const refused = await chat(gwA, short.serviceKey, { n, max_tokens: maxTokens, stream });
      expect(refused.status).toBe(429);
      expect((await errorOf(refused)).code).toBe("budget_exceeded");
      expect(sim.stats.requests).toBe(before);

      const exact = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: PROMPT_RESERVE + n * maxTokens, quotaWindow: "day" });
      const res = await chat(gwA, exact.serviceKey, { n, max_tokens: maxTokens, stream });
      expect(res.status).toBe(200);
      await res.arrayBuffer();
      expect(forwardedMaxTokens()).toBe(maxTokens);
      await flushAll();
      expect((await used(short.orgId)).used).toBe(0);
      expect((await used(exact.orgId)).used).toBe(PROMPT_TOKENS + n * maxTokens);
    }
  });

  test("without max_tokens: the bound the gateway sets is shared by the n choices, so usage stays within the quota", async () => {
    const n = 8;
    for (const stream of [false, true]) {
      // Plenty of quota: each choice gets the default bound, and all of them are reserved.
      const roomy = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 2 * (PROMPT_RESERVE + n * DEFAULT_RESERVE), quotaWindow: "day" });
      const r1 = await chat(gwA, roomy.serviceKey, { n, stream });
      expect(r1.status).toBe(200);
      await r1.arrayBuffer();
      expect(forwardedMaxTokens()).toBe(DEFAULT_RESERVE);

      // 800 completion tokens remain beyond the prompt's bound: 100 for each of the eight choices.
      const quota = PROMPT_RESERVE + 800;
      const tight = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: quota, quotaWindow: "day" });
      const r2 = await chat(gwA, tight.serviceKey, { n, stream });
      expect(r2.status).toBe(200);
      await r2.arrayBuffer();
      expect(forwardedMaxTokens()).toBe(100);

      // Seven completion tokens remain: not one for each choice.
      const tiny = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: PROMPT_RESERVE + n - 1, quotaWindow: "day" });
      const before = sim.stats.requests;
      const r3 = await chat(gwA, tiny.serviceKey, { n, stream });
      expect(r3.status).toBe(429);
      expect((await errorOf(r3)).code).toBe("budget_exceeded");
      expect(sim.stats.requests).toBe(before);

      await flushAll();
      expect((await used(roomy.orgId)).used).toBe(PROMPT_TOKENS + n * DEFAULT_RESERVE);
      // Charged the prompt's count, not its bound: the quota is not reached, and never passed.
      expect((await used(tight.orgId)).used).toBe(PROMPT_TOKENS + 800);
      expect((await used(tiny.orgId)).used).toBe(0);
    }
  });
});

describe("a reservation larger than what remains", () => {
  test("is refused, and what remains still serves the organisation's next requests (no false budget_exceeded)", async () => {
    const quota = 10_000;
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: quota, quotaWindow: "day" });
    const big = await chat(gwA, org.serviceKey, { max_tokens: 50_000 });
    expect(big.status).toBe(429);
    expect((await errorOf(big)).code).toBe("budget_exceeded");
    // 10,000 tokens remain: each of these fits, also after a write has given this instance's lease back.
    const received = await threeSmallServed(org.serviceKey);
    expect(received).toBe(3 * (PROMPT_TOKENS + 10));
    expect((await used(org.orgId)).used).toBe(received);
  });
});

describe("a quota lowered below the lease an instance holds", () => {
  test("the instance stops admitting at the new quota, not at the end of its lease", async () => {
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 100_000, quotaWindow: "day" });
    // One request: this instance now holds a 20,000-token lease.
    const first = await chat(gwA, org.serviceKey, { max_tokens: 60 });
    expect(first.status).toBe(200);
    await first.text();
    await setOrg(db, { id: org.orgId, plans: Object.keys(TEST_PLANS), quotaTokens: 1_000 });
    const probes = await newQuotaServed(gwA, org.serviceKey);
    let received = PROMPT_TOKENS + 60 + probes;
    for (let i = 0; i < 400; i++) {
      const res = await chat(gwA, org.serviceKey, { max_tokens: 60 });
      if (res.status !== 200) {
        expect((await errorOf(res)).code).toBe("budget_exceeded");
        break;
      }
      const { usage } = (await res.json()) as { usage: { total_tokens: number } };
      received += usage.total_tokens;
    }
    await flushAll();
    expect((await used(org.orgId)).used).toBe(received);
    // Before: requests were admitted against the lease held before the change (11,858 used of a 1,000 quota in one run).
    expect(received).toBeLessThanOrEqual(1_000);
    // Refused once less than a request's reservation (the prompt's bound and 60) remained.
    expect(received).toBeGreaterThan(1_000 - (PROMPT_RESERVE + 60));
  });
});

describe("a request authenticated before a quota change, admitted after", () => {
  /**
   * A POST whose body arrives in two parts: the key is checked when the head
   * arrives (with the principal cached then), the body read after. Resolves
   * with the answer's status line and body once `finish` is called.
   */
  async function slowBody(gw: Gateway, key: string, body: string): Promise<{ finish: () => void; answer: Promise<string> }> {
    const url = new URL(gw.url);
    let received = "";
    let done: (s: string) => void = () => {};
    const answer = new Promise<string>((r) => (done = r));
    const socket = await Bun.connect({
      hostname: url.hostname,
      port: Number(url.port),
      socket: {
        data(_s, d) {
          received += new TextDecoder().decode(d);
        },
        close() {
          done(received);
        },
      },
    });
    const bytes = new TextEncoder().encode(body);
    const cut = 20;
    socket.write(`POST /v1/chat/completions HTTP/1.1\r\nhost: ${url.host}\r\nauthorization: Bearer ${key}\r\ncontent-type: application/json\r\ncontent-length: ${bytes.length}\r\nconnection: close\r\n\r\n`);
    socket.write(bytes.subarray(0, cut));
    return { finish: () => void socket.write(bytes.subarray(cut)), answer };
  }

  /**
   * A request (max_tokens 50,000) whose key is checked now, its body still on the way, while `change`
   * is made to its organisation and a request under the new setting is served; then its body is sent.
   * Its raw answer, what the probes used, and the organisation's usage after.
   */
  async function acrossChange(org: { serviceKey: string; orgId: string }, change: () => Promise<unknown>): Promise<{ answer: string; probes: number; used: number }> {
    const slow = await slowBody(gwA, org.serviceKey, JSON.stringify({ model: "svc-fast", max_tokens: 50_000, messages: [{ role: "user", content: PROMPT }] }));
    await Bun.sleep(300);
    await change();
    const probes = await newQuotaServed(gwA, org.serviceKey);
    slow.finish();
    const answer = await slow.answer;
    await flushAll();
    return { answer, probes, used: (await used(org.orgId)).used };
  }

  test("is held to the new quota, and does not take the instance back to the old one", async () => {
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 100_000, quotaWindow: "day" });
    const first = await chat(gwA, org.serviceKey, { max_tokens: 60 });
    expect(first.status).toBe(200);
    await first.text();
    // Its key checked under the quota of 100,000; its body (max_tokens 50,000) sent after the change.
    const { answer, probes, used: after } = await acrossChange(org, () => setOrg(db, { id: org.orgId, plans: Object.keys(TEST_PLANS), quotaTokens: 1_000 }));
    // Before: 200, and 50,017 + 77 tokens used of a quota of 1,000 (admitted under the quota its key was checked with).
    expect({ status: answer.split(" ")[1], used: after }).toEqual({ status: "429", used: PROMPT_TOKENS + 60 + probes });
    expect(answer).toContain("budget_exceeded");
    // The instance still admits at the new quota.
    const big = await chat(gwA, org.serviceKey, { max_tokens: 2_000 });
    expect(big.status).toBe(429);
    await big.text();
  });

  /** A raw answer's status and, when it has one, its usage's total_tokens. */
  function statusAndTotal(answer: string): { status: string | undefined; total: number | undefined } {
    const m = /"total_tokens":(\d+)/.exec(answer);
    return { status: answer.split(" ")[1], total: m ? Number(m[1]) : undefined };
  }

  test("a quota first set (there was none): held to it, and its bound is sent upstream", async () => {
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: null, quotaWindow: "day" });
    const first = await chat(gwA, org.serviceKey, { max_tokens: 60 });
    expect(first.status).toBe(200);
    await first.text();
    // Keys checked now, while the organisation has no quota; their bodies still on the way.
    const big = await slowBody(gwA, org.serviceKey, JSON.stringify({ model: "svc-fast", max_tokens: 50_000, messages: [{ role: "user", content: PROMPT }] }));
    const unbounded = await slowBody(gwA, org.serviceKey, JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: PROMPT }] }));
    await Bun.sleep(300);
    await setOrg(db, { id: org.orgId, plans: Object.keys(TEST_PLANS), quotaTokens: 1_000 });
    const probes = await newQuotaServed(gwA, org.serviceKey);
    // What was used so far is on the shared counter before the next lease reads it.
    await flushAll();
    big.finish();
    const bigAnswer = await big.answer;
    sim.reset();
    unbounded.finish();
    const answer = statusAndTotal(await unbounded.answer);
    await flushAll();
    const after = await used(org.orgId);
    // Before: 200 and 50,017 tokens charged (admitted as if the organisation still had no quota).
    expect({ status: bigAnswer.split(" ")[1], budgetExceeded: bigAnswer.includes("budget_exceeded") }).toEqual({ status: "429", budgetExceeded: true });
    // Before: sent upstream without max_tokens, 200,017 tokens charged. The usage of the first request (77,
    // counted for the day though there was no quota then, and of any probe served before the change arrived)
    // leaves 923 (or a little less): the prompt's bound (568) and 355.
    expect({ status: answer.status, forwarded: forwardedMaxTokens() }).toEqual({ status: "200", forwarded: 1_000 - (PROMPT_TOKENS + 60) - probes - PROMPT_RESERVE });
    expect(after.used).toBe(PROMPT_TOKENS + 60 + probes + (answer.total ?? 0));
    expect(after.used).toBeLessThanOrEqual(1_000);
  });

  test("a quota period changed (month to day): held to the new period's quota", async () => {
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 100_000, quotaWindow: "month" });
    // This instance now holds a lease of the month's quota.
    const first = await chat(gwA, org.serviceKey, { max_tokens: 60 });
    expect(first.status).toBe(200);
    await first.text();
    const { answer, probes, used: after } = await acrossChange(org, () => setOrg(db, { id: org.orgId, plans: Object.keys(TEST_PLANS), quotaTokens: 1_000, quotaWindow: "day" }));
    // Before: 200, and 50,017 more tokens charged to the month (admitted against the month's quota and lease).
    expect({ status: answer.split(" ")[1], used: after }).toEqual({ status: "429", used: PROMPT_TOKENS + 60 + probes });
    expect(answer).toContain("budget_exceeded");
    const big = await chat(gwA, org.serviceKey, { max_tokens: 2_000 });
    expect(big.status).toBe(429);
    await big.text();
  });

  test("the first request of the organisation in a new period: held to the new quota, not the one its key was checked with", async () => {
    // The quota's clock (StartOptions.now) runs at real speed and is moved past the end of the hour below.
    const HOUR = 3_600_000;
    let offset = 0;
    const gw = await startTestGateway(overrides(sim.url), db, { now: () => Date.now() + offset });
    try {
      const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 100_000, quotaWindow: "hour" });
      const first = await chat(gw, org.serviceKey, { max_tokens: 60 });
      expect(first.status).toBe(200);
      await first.text();
      const slow = await slowBody(gw, org.serviceKey, JSON.stringify({ model: "svc-fast", max_tokens: 50_000, messages: [{ role: "user", content: PROMPT }] }));
      await Bun.sleep(300);
      await setOrg(db, { id: org.orgId, plans: Object.keys(TEST_PLANS), quotaTokens: 1_000 });
      const probes = await newQuotaServed(gw, org.serviceKey);
      // The hour ends: its state is written and dropped, and the slow request is the organisation's first in the next.
      const t = Date.now();
      offset = (Math.floor(t / HOUR) + 1) * HOUR + 1_000 - t;
      await gw.quota.flush();
      await gw.quota.flush();
      slow.finish();
      const answer = await slow.answer;
      await gw.quota.flush();
      await gw.quota.flush();
      const after = await used(org.orgId);
      // Before: 200, and 50,017 tokens charged to the new hour (its state started from the request's principal, quota 100,000).
      expect({ status: answer.split(" ")[1], used: after.used }).toEqual({ status: "429", used: PROMPT_TOKENS + 60 + probes });
      expect(answer).toContain("budget_exceeded");
    } finally {
      await gw.stop();
    }
  });
});

describe("a reservation larger than the whole quota", () => {
  test("n above 128 (OpenAI's maximum) is a 400 naming n, before anything is reserved or sent", async () => {
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 10_000, quotaWindow: "day" });
    const before = sim.stats.requests;
    for (const n of [129, 1e306]) {
      const res = await chat(gwA, org.serviceKey, { n });
      expect(res.status).toBe(400);
      const err = await errorOf(res);
      expect(`${err.code} ${err.param}`).toBe("invalid_request_error n");
    }
    expect(sim.stats.requests).toBe(before);
  });

  test("is refused however large, and the organisation's next requests are unharmed", async () => {
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 10_000, quotaWindow: "day" });
    // On an alias without a context window max_tokens is bounded only by 2^53 - 1 (decisions.md: whole numbers past it are
    // refused, 400); 128 choices of that many tokens is past 2^53 too, where a sum of counts is no longer exact.
    for (const extra of [{ max_tokens: Number.MAX_SAFE_INTEGER }, { n: 128, max_tokens: Number.MAX_SAFE_INTEGER }]) {
      const res = await chat(gwA, org.serviceKey, { model: "svc-open", ...extra });
      expect(res.status).toBe(429);
      expect((await errorOf(res)).code).toBe("budget_exceeded");
    }
    // Past what a whole number holds exactly (1e300, 1.5e306 of 128 choices, past Number.MAX_VALUE in all): the body is refused first.
    for (const extra of [{ max_tokens: 1e300 }, { n: 128, max_tokens: 1.5e306 }]) {
      const res = await chat(gwA, org.serviceKey, { model: "svc-open", ...extra });
      expect(res.status).toBe(400);
      const err = await errorOf(res);
      expect(`${err.code} ${err.param}`).toBe("invalid_request_error max_tokens");
    }
    const received = await threeSmallServed(org.serviceKey);
    expect((await used(org.orgId)).used).toBe(received);
  });
});

describe("a reservation larger than the whole quota, before any lease", () => {
  // decisions.md, Quota: "a reservation larger than the whole quota is refused with 429 `budget_exceeded` before any lease is taken".
  test("a first request asking more than the whole quota takes no lease: no counter row is touched", async () => {
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 10_000, quotaWindow: "day" });
    const res = await chat(gwA, org.serviceKey, { max_tokens: 15_000 });
    expect(res.status).toBe(429);
    expect((await errorOf(res)).code).toBe("budget_exceeded");
    const rows = await db.db.select().from(usageCounters).where(eq(usageCounters.orgId, org.orgId));
    expect(rows.map((r) => ({ used: r.used, leased: r.leased }))).toEqual([]);
  });
});

describe("two instances, one quota, completions far larger than the quota", () => {
  test("concurrent clients on both instances never take usage past the quota", async () => {
    // The simulator would answer 200,000 tokens to a request without max_tokens: only the gateway's bound keeps it within the quota.
    for (const quota of [1_000, 5_000, 12_000]) {
      const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: quota, quotaWindow: "day" });
      let received = 0;
      let refused = 0;
      let held = 0;
      const client = async (i: number) => {
        const gw = i % 2 === 0 ? gwA : gwB;
        for (;;) {
          // Half the clients set max_tokens (refused when it does not fit), half do not (lowered).
          const res = await chat(gw, org.serviceKey, i % 4 < 2 ? { max_tokens: 60 } : {});
          if (res.status === 200) {
            // Read first, then add: `received += await …` reads `received` before the await and loses what other clients added meanwhile.
            const { usage } = (await res.json()) as { usage: { total_tokens: number } };
            received += usage.total_tokens;
            continue;
          }
          const err = await errorOf(res);
          // docs/decisions.md "Quota": the rest held by requests in flight (on either instance) is a 503 to
          // retry, not budget_exceeded; once they settle, what is left decides.
          if (res.status === 503 && err.code === "service_unavailable" && res.headers.get("retry-after") === "1") {
            held++;
            await Bun.sleep(50);
            continue;
          }
          expect(`${res.status} ${err.code} ${err.message}`).toStartWith("429 budget_exceeded");
          refused++;
          return;
        }
      };
      await Promise.all(Array.from({ length: 8 }, (_, i) => client(i)));
      // A few at the end at most: each client retries until the quota is settled.
      expect(held).toBeLessThan(200);
      await flushAll();
      const u = await used(org.orgId);
      expect(u.used).toBe(received);
      expect(refused).toBe(8);
      // The bound: the simulator's prompt count equals the estimate here, so not one token over.
      expect(u.used).toBeLessThanOrEqual(quota);
    }
    sim.reset();
  });
});

describe("budget exceeded over HTTP", () => {
  test("x-should-retry false, no retry-after for a day window; /v1/me, /v1/models and the audit log still answer", async () => {
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: PROMPT_RESERVE + 10, quotaWindow: "day" });
    const ok = await chat(gwA, org.serviceKey, { max_tokens: 10 });
    expect(ok.status).toBe(200);
    await ok.arrayBuffer();
    for (const gw of [gwA, gwB]) {
      const res = await chat(gw, org.serviceKey, { max_tokens: 1 });
      expect(res.status).toBe(429);
      expect((await errorOf(res)).code).toBe("budget_exceeded");
      expect(res.headers.get("x-should-retry")).toBe("false");
      // The window resets at midnight UTC, more than 60 s away unless the test runs in the last minute of the day.
      const untilMidnight = Date.UTC(new Date().getUTCFullYear(), new Date().getUTCMonth(), new Date().getUTCDate() + 1) - Date.now();
      if (untilMidnight > 61_000) expect(res.headers.get("retry-after")).toBeNull();
      for (const path of ["/v1/me", "/v1/models", "/v1/audit-events"]) {
        const r = await fetch(`${gw.url}${path}`, { headers: { authorization: `Bearer ${org.serviceKey}` } });
        expect(`${path} ${r.status}`).toBe(`${path} 200`);
        await r.arrayBuffer();
      }
    }
    // Audited once for the window, though both instances refused.
    const deadline = Date.now() + 10_000;
    let n = 0;
    while (Date.now() < deadline) {
      const rows = await db.rows<{ n: number }>(sql`select count(*)::int as n from audit_events where org_id = ${org.orgId} and action = 'billing.budget_exceeded'`);
      n = Number(rows[0]?.n);
      if (n > 0) break;
      await Bun.sleep(20);
    }
    expect(n).toBe(1);
  });

  test("billing.budget_exceeded (docs/decisions.md, Budget exceeded): not for a request larger than the whole quota; at the first request the window's usage leaves too little for, though smaller ones still fit; once a window", async () => {
    const quota = 2_000;
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: quota, quotaWindow: "day" });
    /** The organisation's billing.budget_exceeded events, read as its operators read them. */
    const events = async () => {
      const r = await fetch(`${gwA.url}/v1/audit-events?action=billing.budget_exceeded`, { headers: { authorization: `Bearer ${org.serviceKey}` } });
      expect(r.status).toBe(200);
      return ((await r.json()) as { data: { action: string; details: Record<string, unknown> }[] }).data;
    };
    const ok = await chat(gwA, org.serviceKey, { max_tokens: 10 });
    expect(ok.status).toBe(200);
    await ok.arrayBuffer();

    // Larger than the whole quota: refused, as it would be in any window, but the quota is not spent.
    const tooLarge = await chat(gwA, org.serviceKey, { max_tokens: 5 * quota });
    expect(tooLarge.status).toBe(429);
    expect((await errorOf(tooLarge)).code).toBe("budget_exceeded");
    // Before: the window's one event was written for it (and none came when the quota later ran out).
    const deadline = Date.now() + 1_000;
    while (Date.now() < deadline && (await events()).length === 0) await Bun.sleep(50);
    expect(await events()).toEqual([]);

    // Within the quota, more than the 2,000 - 27 left: the window's usage left it too little. Recorded.
    const left = quota - (PROMPT_TOKENS + 10);
    const maxTokens = quota - PROMPT_RESERVE;
    expect(PROMPT_RESERVE + maxTokens).toBeGreaterThan(left);
    const refused = await chat(gwA, org.serviceKey, { max_tokens: maxTokens });
    expect(refused.status).toBe(429);
    expect((await errorOf(refused)).code).toBe("budget_exceeded");
    await until(async () => (await events()).length === 1, "the budget_exceeded audit event", 10_000, 50);
    expect((await events())[0]?.details).toMatchObject({ quota_tokens: quota, window: "day" });
    // A smaller request still fits what is left (the event marks the first refusal for want of what is left).
    const small = await chat(gwA, org.serviceKey, { max_tokens: 10 });
    expect(small.status).toBe(200);
    await small.arrayBuffer();
    // Until nothing fits: still the one event.
    for (let i = 0; i < 10; i++) {
      const res = await chat(gwA, org.serviceKey);
      await res.arrayBuffer();
      if (res.status === 429) break;
      expect(res.status).toBe(200);
    }
    const last = await chat(gwA, org.serviceKey, { max_tokens: 1 });
    expect(last.status).toBe(429);
    await last.arrayBuffer();
    await Bun.sleep(200);
    expect(await events()).toHaveLength(1);
  });
});

describe("quota store unreachable", () => {
  test("an organisation WITH a quota gets 503 service_unavailable, not budget_exceeded, when no lease can be taken", async () => {
    let broken = false;
    const base = await sharedDatabase();
    // Fault injection at the driver boundary: leases (transactions) fail, key lookups still work.
    const flaky: Database = {
      ...base,
      db: new Proxy(base.db, {
        get(target, prop, recv) {
          if (broken && prop === "transaction") {
            return () => Promise.reject(new Error("connection refused"));
          }
          return Reflect.get(target, prop, recv);
        },
      }),
    };
    const gw = await startTestGateway(overrides(sim.url), flaky);
    try {
      const org = await seedOrg(base, { quotaTokens: 1_000_000, quotaWindow: "day" });
      // A request that fits the first lease is served.
      const ok = await chat(gw, org.serviceKey, { max_tokens: 10 });
      expect(ok.status).toBe(200);
      await ok.arrayBuffer();
      broken = true;
      // Larger than any lease this instance holds: it must lease, and cannot.
      const res = await chat(gw, org.serviceKey, { max_tokens: 100_000 });
      expect(res.status).toBe(503);
      const err = await errorOf(res);
      expect(err.code).toBe("service_unavailable");
      expect(err.message).not.toContain("budget_exceeded");
      const audit = await base.rows<{ n: number }>(
        sql`select count(*)::int as n from audit_events where org_id = ${org.orgId} and action = 'billing.budget_exceeded'`,
      );
      expect(Number(audit[0]?.n)).toBe(0);
    } finally {
      broken = false;
      await gw.stop();
    }
  });
});
