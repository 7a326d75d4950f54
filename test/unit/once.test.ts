import { describe, expect, test } from "bun:test";
import { firstSeen } from "../../src/lib/once.ts";

describe("firstSeen", () => {
  test("true the first time a key is seen, false after", () => {
    const first = firstSeen();
    expect([first("a"), first("b"), first("a"), first("b")]).toEqual([true, true, false, false]);
  });

  test("bounded: at max keys all are forgotten, so they count as new again", () => {
    const first = firstSeen(2);
    expect([first("a"), first("b"), first("a")]).toEqual([true, true, false]);
    expect(first("c")).toBe(true);
    expect([first("a"), first("c")]).toEqual([true, false]);
  });
});
