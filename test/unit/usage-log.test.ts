import { describe, expect, test } from "bun:test";
import { aggregate, UsageLog } from "../../src/limits/usage-log.ts";

/** Pushes record i with fields derived from i, so order and content can be checked. */
function pushN(log: UsageLog, from: number, to: number): void {
  for (let i = from; i < to; i++) log.push(`org${i}`, `key${i}`, "svc-fast", "t", i, 2 * i, 200 + (i % 3), i % 1000, i % 2 === 0, 1_700_000_000_000 + i);
}

function ids(log: UsageLog, n: number): number[] {
  return Array.from(log.take(n).promptTokens);
}

describe("UsageLog", () => {
  test("take returns the oldest records first, column by column, and removes them", () => {
    const log = new UsageLog(100);
    pushN(log, 0, 5);
    const c = log.take(3);
    expect(c.length).toBe(3);
    expect(c.orgId).toEqual(["org0", "org1", "org2"]);
    expect(c.keyId).toEqual(["key0", "key1", "key2"]);
    expect(c.alias).toEqual(["svc-fast", "svc-fast", "svc-fast"]);
    expect(Array.from(c.completionTokens)).toEqual([0, 2, 4]);
    expect(Array.from(c.status)).toEqual([200, 201, 202]);
    expect(Array.from(c.streamed)).toEqual([1, 0, 1]);
    expect(Array.from(c.createdAt)).toEqual([1_700_000_000_000, 1_700_000_000_001, 1_700_000_000_002]);
    expect(log.length).toBe(2);
    expect(ids(log, 10)).toEqual([3, 4]);
    expect(log.length).toBe(0);
    expect(log.take(5).length).toBe(0);
  });

  test("growing while the ring has wrapped keeps the order", () => {
    const log = new UsageLog(1_000_000);
    pushN(log, 0, 1000);
    expect(ids(log, 600)).toEqual(Array.from({ length: 600 }, (_, i) => i));
    // The ring now wraps past the end of its initial 1,024 slots, then has to grow twice.
    pushN(log, 1000, 4000);
    expect(log.length).toBe(3400);
    expect(ids(log, 5000)).toEqual(Array.from({ length: 3400 }, (_, i) => 600 + i));
    expect(log.dropped).toBe(0);
  });

  test("at the bound the oldest record gives way to the newest, and is counted", () => {
    const log = new UsageLog(5);
    pushN(log, 0, 8);
    expect(log.length).toBe(5);
    expect(log.dropped).toBe(3);
    expect(ids(log, 5)).toEqual([3, 4, 5, 6, 7]);
    pushN(log, 8, 10);
    expect(ids(log, 5)).toEqual([8, 9]);
  });

  test("numbers are stored as non-negative integers; huge ones saturate instead of wrapping", () => {
    const log = new UsageLog(10);
    log.push("o", "k", "a", "t", 12.6, -3, 499, 3e12, false, 1);
    const c = log.take(1);
    expect(c.promptTokens[0]).toBe(13);
    expect(c.completionTokens[0]).toBe(0);
    expect(c.status[0]).toBe(499);
    expect(c.latencyMs[0]).toBe(2_147_483_647);
  });

  test("a bound below one is refused", () => {
    expect(() => new UsageLog(0)).toThrow(RangeError);
  });
});

describe("aggregate", () => {
  test("sums records per organisation, key, alias, target, status and streamed-or-not, keeping the newest time", () => {
    const log = new UsageLog(100);
    const t0 = 1_700_000_000_000;
    // key a: three 200s unstreamed (one group), one streamed, one 503; key b: one 200.
    log.push("o1", "a", "svc-fast", "t1", 10, 1, 200, 5, false, t0 + 3);
    log.push("o1", "a", "svc-fast", "t1", 20, 2, 200, 7, false, t0 + 1);
    log.push("o1", "a", "svc-fast", "t1", 30, 3, 200, 9, true, t0 + 2);
    log.push("o1", "b", "svc-fast", "t1", 40, 4, 200, 11, false, t0 + 4);
    log.push("o1", "a", "svc-fast", "t1", 50, 5, 503, 13, false, t0 + 5);
    log.push("o1", "a", "svc-fast", "t1", 60, 6, 200, 15, false, t0 + 0);
    log.push("o1", "a", "svc-fast", "t2", 70, 7, 200, 17, false, t0 + 6);
    const c = aggregate(log.take(10));
    expect(c.length).toBe(5);
    const rows = Array.from({ length: c.length }, (_, i) => [c.keyId[i], c.target[i], c.status[i], c.streamed[i], c.requests[i], c.promptTokens[i], c.completionTokens[i], c.latencyMs[i], (c.createdAt[i] as number) - t0]);
    expect(rows).toEqual([
      ["a", "t1", 200, 0, 3, 90, 9, 27, 3],
      ["a", "t1", 200, 1, 1, 30, 3, 9, 2],
      ["b", "t1", 200, 0, 1, 40, 4, 11, 4],
      ["a", "t1", 503, 0, 1, 50, 5, 13, 5],
      ["a", "t2", 200, 0, 1, 70, 7, 17, 6],
    ]);
    // Every column has the aggregated length (the insert unnests them side by side).
    for (const col of [c.orgId, c.keyId, c.alias, c.target, c.requests, c.promptTokens, c.completionTokens, c.status, c.latencyMs, c.streamed, c.createdAt]) expect(col.length).toBe(5);
  });

  test("totals are conserved over many records, and a sum that would pass int32 starts a new row", () => {
    const log = new UsageLog(10_000);
    for (let i = 0; i < 5_000; i++) log.push("o", i % 2 ? "k1" : "k2", "svc-fast", "t", 1_000_000, 3, 200, 1, false, i);
    const c = aggregate(log.take(5_000));
    const sum = (a: ArrayLike<number>) => Array.from(a).reduce((x, y) => x + y, 0);
    expect(sum(c.requests)).toBe(5_000);
    expect(sum(c.promptTokens)).toBe(5_000 * 1_000_000);
    expect(sum(c.completionTokens)).toBe(15_000);
    for (const p of c.promptTokens) expect(p).toBeLessThanOrEqual(2_147_483_647);
    // 2,500 records of 10^6 prompt tokens per key: 2,147 fit in one int32 row, so two rows per key.
    expect(c.length).toBe(4);
  });

  test("nothing in, nothing out", () => {
    expect(aggregate(new UsageLog(10).take(5)).length).toBe(0);
  });
});

