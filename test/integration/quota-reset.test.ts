import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import type { Database } from "../../src/db/client.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { errorOf, seedOrg, sharedDatabase, startTestGateway } from "../helpers/harness.ts";
import { TEST_PLANS, testAliases, upstreamSettings } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(60_000);

/**
 * docs/decisions.md "Budget exceeded": 429 budget_exceeded carries
 * `x-should-retry: false`, and `retry-after` (the seconds until the quota
 * period resets) only when that reset is within 60 s. Through HTTP, with the
 * quota's clock (StartOptions.now) running at real speed but placed shortly
 * before the end of an hour: the period, its counter row and the refusal are
 * real, only the wait for the hour's end is not.
 */

/** 3 + 4 + 40 / 4 = 17 prompt tokens (the estimate and the simulator agree). */
const PROMPT = "q".repeat(40);
/** What the quota reserves for it: its bound, 512 + 16 + 40 (src/inference/tokens.ts, promptTokenBound); it is charged 17. */
const PROMPT_RESERVE = 512 + 16 + 40;
const HOUR = 3_600_000;

let sim: Simulator;
let db: Database;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 1_000 });
  db = await sharedDatabase();
});
afterAll(async () => {
  await sim?.stop();
});

describe("retry-after on budget_exceeded, over HTTP", () => {
  // 50 s before the reset: a header, whatever a busy machine adds; 70 s: none, unless a request takes 10 s.
  for (const [beforeEnd, header] of [
    [50_000, true],
    [70_000, false],
  ] as const) {
    test(`the hour's quota resets in ${beforeEnd / 1000} s: ${header ? "retry-after with the seconds left" : "no retry-after"}; x-should-retry false`, async () => {
      // A future hour's end, so the period is one no other test touches.
      const end = (Math.floor(Date.now() / HOUR) + 2) * HOUR;
      const offset = end - beforeEnd - Date.now();
      const now = () => Date.now() + offset;
      const gw = await startTestGateway(
        { aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: upstreamSettings({ attempts: 1 }), quota: { leaseTokens: 1_000, flushMs: 100, maxBuffered: 100_000 } },
        db,
        { now },
      );
      try {
        const org = await seedOrg(db, { plan: "Test", plans: Object.keys(TEST_PLANS), quotaTokens: PROMPT_RESERVE + 10, quotaWindow: "hour" });
        const chat = (maxTokens: number) =>
          fetch(`${gw.url}/v1/chat/completions`, {
            method: "POST",
            headers: { authorization: `Bearer ${org.serviceKey}`, "content-type": "application/json" },
            body: JSON.stringify({ model: "svc-fast", max_tokens: maxTokens, messages: [{ role: "user", content: PROMPT }] }),
          });
        const ok = await chat(10);
        expect(ok.status).toBe(200);
        await ok.arrayBuffer();

        const sentAt = now();
        const res = await chat(1);
        const answeredAt = now();
        expect(res.status).toBe(429);
        const err = await errorOf(res);
        expect(err.code).toBe("budget_exceeded");
        expect(err.message).toContain(new Date(end).toISOString());
        expect(res.headers.get("x-should-retry")).toBe("false");
        const retryAfter = res.headers.get("retry-after");
        if (!header) {
          expect(retryAfter).toBeNull();
          return;
        }
        // Whole seconds until the reset, rounded up, as the clock read it between sending and the answer.
        expect(retryAfter).toMatch(/^\d+$/);
        expect(Number(retryAfter)).toBeGreaterThanOrEqual(Math.ceil((end - answeredAt) / 1000));
        expect(Number(retryAfter)).toBeLessThanOrEqual(Math.ceil((end - sentAt) / 1000));
      } finally {
        await gw.stop();
      }
    });
  }
});
