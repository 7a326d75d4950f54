import { describe, expect, test } from "bun:test";
import { Attempt, InFlight } from "../../src/inference/upstream/attempt.ts";
import type { Target } from "../../src/inference/upstream/targets.ts";

/** The router's list of attempts in flight (attempt.ts InFlight), which the shutdown ends (router.ts endCalls). */
describe("InFlight", () => {
  const attempt = () => {
    const a = new Attempt({} as Target, new AbortController().signal, 60_000);
    a.clearTimer();
    return a;
  };

  test("holds what was added and not deleted, whatever the order of deletes; a second delete or one never added changes nothing", () => {
    const list = new InFlight();
    const [a, b, c, d] = [attempt(), attempt(), attempt(), attempt()];
    for (const x of [a, b, c, d]) list.add(x);
    expect(list.size).toBe(4);
    list.delete(c); // middle
    list.delete(d); // head (the last added)
    list.delete(d);
    list.delete(attempt());
    expect(list.size).toBe(2);
    expect(new Set(list.toArray())).toEqual(new Set([a, b]));
    list.delete(a); // tail
    expect(list.toArray()).toEqual([b]);
    list.delete(b);
    expect({ size: list.size, all: list.toArray() }).toEqual({ size: 0, all: [] });
    list.add(c);
    expect(list.toArray()).toEqual([c]);
  });

  test("an attempt ended while the list is walked (endCalls) leaves the others to be ended", () => {
    const list = new InFlight();
    const all = Array.from({ length: 5 }, attempt);
    for (const x of all) list.add(x);
    const seen: Attempt[] = [];
    for (const x of list.toArray()) {
      seen.push(x);
      list.delete(x);
    }
    expect(new Set(seen)).toEqual(new Set(all));
    expect(list.size).toBe(0);
  });
});
