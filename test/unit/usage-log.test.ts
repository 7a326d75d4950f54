import { describe, expect, test } from "bun:test";
import { UsageLog } from "../../src/limits/usage-log.ts";

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
