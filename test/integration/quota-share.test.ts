import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { eq, sql } from "drizzle-orm";
import type { Database } from "../../src/db/client.ts";
import { usageCounters } from "../../src/db/schema.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { errorOf, seedOrg, sharedDatabase, startTestGateway } from "../helpers/harness.ts";
import { TEST_PLANS, testAliases, upstreamSettings } from "./inference-fixtures.ts";

/** A plan whose request rate never binds: these tests are about the quota. */
const UNLIMITED_RATE = { plan: "Test", plans: Object.keys(TEST_PLANS) };

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(120_000);

/**
 * Issue 13 item 14: with the default lease size (20,000 tokens) one instance
 * used to lease all of a small quota, so the other answered budget_exceeded
 * while the organisation had used nothing (and stamped the audit event then).
 * Two gateways on one database, clients on both: the first budget_exceeded
 * may come only when what is left of the quota is less than one request's
 * reservation, and the audit event is written once, at that moment.
 */

/** 3 + 4 + 40/4 = 17 prompt tokens (the gateway's estimate and the simulator's count agree). */
const PROMPT = "y".repeat(40);
const MAX_TOKENS = 40;
/** The prompt is reserved at its bound (512 + 16 + 40, src/inference/tokens.ts) and charged 17. */
const RESERVATION = 512 + 16 + 40 + MAX_TOKENS;
const CLIENTS_PER_INSTANCE = 6;

let sim: Simulator;
let db: Database;
let gws: Gateway[] = [];

beforeAll(async () => {
  // A little latency, so that requests overlap on both instances.
  sim = await startSimulator({ port: 0, ttftMs: 5, interTokenMs: 0, completionTokens: 100_000 });
  db = await sharedDatabase();
  // The default quota settings (leaseTokens 20,000, flushMs 1,000): the case the issue measured.
  const overrides = { aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: upstreamSettings({ attempts: 1 }) };
  gws = [await startTestGateway(overrides), await startTestGateway(overrides)];
});
afterAll(async () => {
  for (const gw of gws) await gw.stop();
  await sim?.stop();
});

describe("two instances split a small quota", () => {
  for (const quota of [1_000, 20_000, 30_000]) {
    test(`quota ${quota}: no budget_exceeded while a reservation still fits; audited once, then`, async () => {
      const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: quota, quotaWindow: "day" });
      // Both instances know the key before the run, so neither starts late on a key lookup.
      for (const gw of gws) expect((await fetch(`${gw.url}/v1/me`, { headers: { authorization: `Bearer ${org.serviceKey}` } })).status).toBe(200);
      let received = 0;
      let refusedAt: number | undefined;
      const served = [0, 0];
      const held = [0, 0];
      const client = async (i: number) => {
        const which = i % 2;
        const gw = gws[which] as Gateway;
        while (refusedAt === undefined) {
          const res = await fetch(`${gw.url}/v1/chat/completions`, {
            method: "POST",
            headers: { authorization: `Bearer ${org.serviceKey}`, "content-type": "application/json" },
            body: JSON.stringify({ model: "svc-fast", max_tokens: MAX_TOKENS, messages: [{ role: "user", content: PROMPT }] }),
          });
          if (res.status === 200) {
            // Read first, then add: `received += await …` reads `received` before the await and loses what other clients added meanwhile.
            const { usage } = (await res.json()) as { usage: { total_tokens: number } };
            received += usage.total_tokens;
            served[which] = (served[which] ?? 0) + 1;
            continue;
          }
          const err = await errorOf(res);
          // The rest of the quota held by the other instance's requests in flight: not spent yet, retry.
          if (res.status === 503 && err.code === "service_unavailable") {
            held[which] = (held[which] ?? 0) + 1;
            await Bun.sleep(Number(res.headers.get("retry-after") ?? 1) * 100);
            continue;
          }
          expect(`${res.status} ${err.code}`).toBe("429 budget_exceeded");
          // The first refusal ends the run: no new requests, so what was used by then is what the database will hold.
          if (refusedAt === undefined) console.log(`quota-share: first refusal on instance ${which}: ${err.message}`);
          refusedAt ??= Date.now();
          return;
        }
      };
      await Promise.all(Array.from({ length: 2 * CLIENTS_PER_INSTANCE }, (_, i) => client(i)));
      for (let k = 0; k < 2; k++) for (const gw of gws) await gw.quota.flush();

      const rows = await db.db.select().from(usageCounters).where(eq(usageCounters.orgId, org.orgId));
      const used = rows.reduce((a, r) => a + r.used, 0);
      console.log(`quota-share: quota=${quota} used=${used} served=${served.join("+")} held=${held.join("+")}`);
      expect(used).toBe(received);
      expect(used).toBeLessThanOrEqual(quota);
      // Refused only once what was left could not hold one more reservation.
      expect(used).toBeGreaterThan(quota - RESERVATION);
      // Both instances served a fair share (one instance no longer takes a small quota whole);
      // 17 requests of a 1,000 quota are too few to say anything about shares.
      if (quota >= 20_000) expect(Math.min(served[0] ?? 0, served[1] ?? 0)).toBeGreaterThan((served[0] ?? 0) / 4 + (served[1] ?? 0) / 4 - 1);
      // Audited once across both instances, stamped at the refusal, not before.
      const audit = await db.rows<{ n: number; first: string | Date }>(
        sql`select count(*)::int as n, min(created_at) as first from audit_events where org_id = ${org.orgId} and action = 'billing.budget_exceeded'`,
      );
      const deadline = Date.now() + 10_000;
      let row = audit[0];
      // The audit write is not awaited by the refused request: poll for it.
      while (Number(row?.n) === 0 && Date.now() < deadline) {
        await Bun.sleep(20);
        row = (await db.rows<{ n: number; first: string | Date }>(
          sql`select count(*)::int as n, min(created_at) as first from audit_events where org_id = ${org.orgId} and action = 'billing.budget_exceeded'`,
        ))[0];
      }
      expect(Number(row?.n)).toBe(1);
      const stamped = rows[0]?.exceededAt?.getTime();
      expect(stamped).toBeDefined();
      // Not before the run ended with its first refusal (a second of slack for clock reads across the database).
      expect(stamped as number).toBeGreaterThanOrEqual((refusedAt as number) - 1_000);
    });
  }

  // Written first: the idle instance has no usage left to write, so it learns of the busy one's need only from
  // usage_counters.wanted_at (a lease that came up short stamps it; the holder looks at every flush).
  for (const writtenFirst of [false, true]) {
    test(`an idle instance's unused lease is handed over: the busy one is not refused while it holds tokens${writtenFirst ? " (its usage written before, so through wanted_at)" : ""}`, async () => {
      const quota = 1_000;
      const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: quota, quotaWindow: "day" });
      const [busy, idle] = gws as [Gateway, Gateway];
      const one = (gw: Gateway) =>
        fetch(`${gw.url}/v1/chat/completions`, {
          method: "POST",
          headers: { authorization: `Bearer ${org.serviceKey}`, "content-type": "application/json" },
          body: JSON.stringify({ model: "svc-fast", max_tokens: MAX_TOKENS, messages: [{ role: "user", content: PROMPT }] }),
        });
      // One request on the idle instance: it leases more than that request needs, then sits on the rest.
      const first = await one(idle);
      expect(first.status).toBe(200);
      let received = ((await first.json()) as { usage: { total_tokens: number } }).usage.total_tokens;
      if (writtenFirst) {
        await idle.quota.flush();
        const [row] = await db.db.select().from(usageCounters).where(eq(usageCounters.orgId, org.orgId));
        // The idle instance still holds unused lease, and the counter shows it.
        expect(row?.used).toBe(received);
        expect(row?.leased).toBeGreaterThan(0);
      }
      for (;;) {
        const res = await one(busy);
        if (res.status !== 200) {
          expect(`${res.status} ${(await errorOf(res)).code}`).toBe("429 budget_exceeded");
          break;
        }
        // Read first, then add: `received += await …` reads `received` before the await and loses what other clients added meanwhile.
        const { usage } = (await res.json()) as { usage: { total_tokens: number } };
        received += usage.total_tokens;
      }
      for (let k = 0; k < 2; k++) for (const gw of gws) await gw.quota.flush();
      const rows = await db.db.select().from(usageCounters).where(eq(usageCounters.orgId, org.orgId));
      const used = rows.reduce((a, r) => a + r.used, 0);
      console.log(`quota-share idle holder: quota=${quota} used=${used}`);
      expect(used).toBe(received);
      expect(used).toBeGreaterThan(quota - RESERVATION);
    });
  }
});
