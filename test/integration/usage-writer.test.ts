import { describe, expect, test } from "bun:test";
import { and, eq, sql } from "drizzle-orm";
import { usageCounters } from "../../src/db/schema.ts";
import { createLogger } from "../../src/lib/log.ts";
import { type CounterDelta, type CounterRow, type CounterSource, createUsageWriter } from "../../src/limits/usage-writer.ts";
import { seedOrg, sharedDatabase } from "../helpers/harness.ts";

/**
 * The usage writer's counter update against the real database (PGlite, or
 * Postgres with TEST_DATABASE_URL): what the shared counter holds after a
 * delta is what the quota is told (`observed`), as numbers on both drivers.
 * The quota decides from it whether to hand its unused lease back (another
 * instance asked for lease: `wanted`; nothing left on the counter), so a
 * wrong figure here keeps lease from the instance that waits for it.
 *
 * The source is a recorder of the writer's contract (src/limits/usage-writer.ts,
 * CounterSource); the quota's own behaviour is tested in quota*.test.ts.
 */

const WANTED_WITHIN_MS = 3_250;

function recorder(pending: CounterDelta[]) {
  const seen: { delta: CounterDelta; row: CounterRow }[] = [];
  const landed: CounterDelta[] = [];
  const source: CounterSource = {
    cut: () => pending.splice(0),
    observed: (delta, row) => seen.push({ delta, row }),
    landed: (d) => landed.push(d),
    pendingTokens: () => pending.reduce((n, d) => n + d.used, 0),
    beforeFlush: async () => {},
  };
  return { source, seen, landed };
}

async function writeOnce(deltas: CounterDelta[]) {
  const database = await sharedDatabase();
  const r = recorder(deltas);
  const writer = createUsageWriter(database, createLogger("silent"), r.source, { flushMs: 60_000, maxBuffered: 100, wantedWithinMs: WANTED_WITHIN_MS });
  await writer.flush();
  return r;
}

async function counter(orgId: string, start: number) {
  const database = await sharedDatabase();
  const [row] = await database.db
    .select()
    .from(usageCounters)
    .where(and(eq(usageCounters.orgId, orgId), eq(usageCounters.windowStart, new Date(start))));
  return row;
}

describe("usage writer: the counter after each delta", () => {
  test("a new counter: the delta's usage, no lease, not wanted", async () => {
    const org = await seedOrg(await sharedDatabase());
    const start = Date.UTC(2026, 10, 1);
    const { seen, landed } = await writeOnce([{ orgId: org.orgId, start, used: 120, leased: -40 }]);
    expect(seen).toHaveLength(1);
    // A fresh row starts with no lease (nothing was leased from it), whatever the delta returns.
    expect(seen[0]?.row).toEqual({ used: 120, leased: 0, wanted: false });
    expect(landed).toHaveLength(1);
    const row = await counter(org.orgId, start);
    expect(row?.used).toBe(120);
    expect(row?.leased).toBe(0);
    expect(row?.windowStart.getTime()).toBe(start);
  });

  test("an existing counter: usage added, lease returned (never below zero), another instance's request seen", async () => {
    const database = await sharedDatabase();
    const org = await seedOrg(database);
    const start = Date.UTC(2026, 10, 2, 13);
    // Another instance holds 5,000 of lease and asked for more a moment ago.
    await database.db.insert(usageCounters).values({ orgId: org.orgId, windowStart: new Date(start), used: 3_000_000_000, leased: 5_000, wantedAt: sql`now()` });
    const first = await writeOnce([{ orgId: org.orgId, start, used: 250, leased: -1_200 }]);
    // Beyond 2^31: bigint columns come back as exact numbers on both drivers.
    expect(first.seen[0]?.row).toEqual({ used: 3_000_000_250, leased: 3_800, wanted: true });

    // A return larger than the lease left clamps at zero; a request older than the window is no longer wanted.
    await database.db
      .update(usageCounters)
      .set({ wantedAt: sql`now() - interval '1 minute'` })
      .where(and(eq(usageCounters.orgId, org.orgId), eq(usageCounters.windowStart, new Date(start))));
    const second = await writeOnce([{ orgId: org.orgId, start, used: 0, leased: -10_000 }]);
    expect(second.seen[0]?.row).toEqual({ used: 3_000_000_250, leased: 0, wanted: false });
    const row = await counter(org.orgId, start);
    expect(row?.used).toBe(3_000_000_250);
    expect(row?.leased).toBe(0);
  });

  test("writes add up on one counter", async () => {
    const org = await seedOrg(await sharedDatabase());
    const start = Date.UTC(2026, 10, 3);
    await writeOnce([{ orgId: org.orgId, start, used: 7, leased: 0 }]);
    const second = await writeOnce([{ orgId: org.orgId, start, used: 5, leased: 0 }]);
    expect(second.seen[0]?.row).toEqual({ used: 12, leased: 0, wanted: false });
    expect((await counter(org.orgId, start))?.used).toBe(12);
  });
});
