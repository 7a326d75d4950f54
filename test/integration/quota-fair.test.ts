import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { eq } from "drizzle-orm";
import type { Database } from "../../src/db/client.ts";
import { usageCounters } from "../../src/db/schema.ts";
import { periodStart } from "../../src/limits/period.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { errorOf, sharedDatabase, startTestGateway } from "../helpers/harness.ts";
import { TEST_PLANS, post, seedTestOrg, testAliases, upstreamSettings, userMessages } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(60_000);

/**
 * Requests waiting for quota on one instance are admitted in arrival order
 * (docs/decisions.md, Quota: waiters in arrival order): a request that arrives
 * while an earlier one waits queues behind it, even when what is free would
 * cover the later one, so a large request is not starved by a stream of
 * small ones that each fit into what the large one is waiting for. The
 * oldest waiter's wait is its own, from its turn; when it is refused because
 * the quota is spent, those behind it that the same looks refuse go with it.
 */

/** 40 characters; reserved at its bound 512 + 16 + 40 (src/inference/tokens.ts) plus max_tokens. */
const PROMPT = "z".repeat(40);
const SMALL = 512 + 16 + 40 + 1;
const LARGE_MAX_TOKENS = 5_000;
const LARGE = 512 + 16 + 40 + LARGE_MAX_TOKENS;
const QUOTA = 8_000;
/** Small requests in flight at once: together they want more than the quota, so some always wait. */
const SMALL_CLIENTS = 20;
/** How long a waiter waits for lease held elsewhere: 3 × quota.flushMs (1,000 here) + 250 ms. */
const WAIT_MS = 3 * 1_000 + 250;

let sim: Simulator;
let db: Database;
let gw: Gateway;

beforeAll(async () => {
  // Each answer takes ~400 ms, so a small request holds its reservation that long; one token of completion.
  sim = await startSimulator({ port: 0, ttftMs: 400, interTokenMs: 0, completionTokens: 1 });
  db = await sharedDatabase();
  // flushMs 1,000: a request that finds the quota held by requests in flight waits up to 3 × 1 s + 250 ms (WAIT_MS).
  gw = await startTestGateway({
    aliases: testAliases(sim.url),
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 1 }),
    quota: { leaseTokens: 1_000, flushMs: 1_000, maxBuffered: 100_000 },
  });
});
afterAll(async () => {
  await gw?.stop();
  await sim?.stop();
});

const chat = (key: string, maxTokens: number) =>
  post(gw, "/v1/chat/completions", key, { model: "svc-fast", max_tokens: maxTokens, messages: userMessages(PROMPT) });

describe("waiters for quota, one instance", () => {
  test("a large request is admitted in its turn while small ones keep coming, not starved by them", async () => {
    // Seen failing before: the large request waited while each small one that arrived took what the ones
    // before it freed; after its wait it was refused 503 ("held by requests in flight"), never admitted.
    const org = await seedTestOrg(db, { quotaTokens: QUOTA, quotaWindow: "day" });
    let flooding = true;
    let smallServed = 0;
    const statuses = new Map<string, number>();
    const client = async () => {
      while (flooding) {
        const res = await chat(org.serviceKey, 1);
        const status = res.status === 200 ? "200" : `${res.status} ${(await errorOf(res)).code}`;
        if (res.status === 200) {
          await res.arrayBuffer();
          smallServed++;
        }
        statuses.set(status, (statuses.get(status) ?? 0) + 1);
      }
    };
    const clients = Array.from({ length: SMALL_CLIENTS }, client);
    // The small ones hold the whole quota by now, some of them waiting for it.
    await Bun.sleep(1_000);
    const sent = performance.now();
    const large = await chat(org.serviceKey, LARGE_MAX_TOKENS);
    const waited = performance.now() - sent;
    const largeStatus = large.status === 200 ? "200" : `${large.status} ${(await errorOf(large)).code}`;
    flooding = false;
    await Promise.all(clients);
    console.log(`quota-fair: large ${largeStatus} after ${Math.round(waited)} ms; small ${JSON.stringify(Object.fromEntries(statuses))}`);
    // Admitted once the small ones before it had ended (each ~400 ms), within its wait of 3.25 s.
    expect(largeStatus).toBe("200");
    expect(smallServed).toBeGreaterThan(SMALL_CLIENTS);
    // Never more than the quota, as ever.
    for (let i = 0; i < 2; i++) await gw.quota.flush();
    const [row] = await db.db.select().from(usageCounters).where(eq(usageCounters.orgId, org.orgId));
    expect(row?.used ?? 0).toBeLessThanOrEqual(QUOTA);
    expect(LARGE + SMALL).toBeLessThan(QUOTA);
  });

  test("a spent quota refuses the waiters behind the oldest with it, not one wait each", async () => {
    // A dead instance's lease of 1,500 on a counter of 2,000 (it never moves): 500 left, and four requests of
    // 608 each, which cannot fit unless that lease came back. The oldest waits its whole wait for it, then
    // budget_exceeded; the three behind it were refused on the same looks, at once. Seen failing without
    // that (each waiter's wait counted from its own turn): answered ~3.3 s apart, one wait each in series.
    const org = await seedTestOrg(db, { quotaTokens: 2_000, quotaWindow: "day" });
    await db.db.insert(usageCounters).values({ orgId: org.orgId, windowStart: new Date(periodStart("day", Date.now())), used: 0, leased: 1_500 });
    const sent = performance.now();
    const answers = await Promise.all(
      Array.from({ length: 4 }, async () => {
        const res = await chat(org.serviceKey, 40);
        const at = performance.now() - sent;
        return { status: `${res.status} ${(await errorOf(res)).code}`, at };
      }),
    );
    const times = answers.map((a) => Math.round(a.at));
    console.log(`quota-fair spent queue: answered after ${times.join(", ")} ms`);
    expect(answers.map((a) => a.status)).toEqual(Array(4).fill("429 budget_exceeded"));
    // Each waited for the stranded lease (the oldest its whole wait), and none waited one more wait after it.
    expect(Math.min(...times)).toBeGreaterThanOrEqual(WAIT_MS - 100);
    expect(Math.max(...times) - Math.min(...times)).toBeLessThan(WAIT_MS / 2);
    expect(512 + 16 + 40 + 40).toBeGreaterThan(500);
  });
});
