import { describe, expect, test } from "bun:test";
import { createLimiter } from "../../src/limits/store.ts";

const W = 60_000;

describe("createLimiter: per-org limiting", () => {
  test("limits each org independently", () => {
    const lim = createLimiter();
    for (let i = 0; i < 60; i++) expect(lim.check("a", 60, 1000).allowed).toBe(true);
    expect(lim.check("a", 60, 1000)).toEqual({ allowed: false, limit: 60, remaining: 0, resetMs: W, retryAfterMs: W });
    expect(lim.check("b", 60, 1000)).toMatchObject({ allowed: true, remaining: 59 });
    expect(lim.check("a", 60, 1000 + W).allowed).toBe(true);
    expect(lim.size()).toBe(2);
  });

  test("Ultra limit (300) on a lazily grown ring", () => {
    const lim = createLimiter();
    for (let i = 0; i < 300; i++) expect(lim.check("ultra", 300, 5).allowed).toBe(true);
    expect(lim.check("ultra", 300, 5)).toMatchObject({ allowed: false, retryAfterMs: W });
  });

  test("plan change takes effect on the same key", () => {
    const lim = createLimiter();
    for (let i = 0; i < 60; i++) lim.check("org", 60, 0);
    expect(lim.check("org", 60, 1).allowed).toBe(false);
    expect(lim.check("org", 300, 1)).toMatchObject({ allowed: true, limit: 300, remaining: 239 });
    // Downgrade while 61 are live: wait until fewer than 60 are live (index 1 -> t=0 leaves).
    expect(lim.check("org", 60, 2)).toMatchObject({ allowed: false, limit: 60, retryAfterMs: W - 2 });
    expect(lim.check("org", 60, W).allowed).toBe(true);
  });

  test("custom windowMs", () => {
    const lim = createLimiter({ windowMs: 1000 });
    expect(lim.check("a", 1, 0).allowed).toBe(true);
    expect(lim.check("a", 1, 999)).toMatchObject({ allowed: false, retryAfterMs: 1 });
    expect(lim.check("a", 1, 1000).allowed).toBe(true);
  });

  test("instances divides the limit (floor, min 1)", () => {
    const three = createLimiter({ instances: 3 });
    for (let i = 0; i < 20; i++) expect(three.check("a", 60, 0).allowed).toBe(true);
    expect(three.check("a", 60, 0)).toMatchObject({ allowed: false, limit: 20 });
    for (let i = 0; i < 33; i++) expect(three.check("b", 100, 0).allowed).toBe(true); // floor(100/3)
    expect(three.check("b", 100, 0).allowed).toBe(false);
    const many = createLimiter({ instances: 500 });
    expect(many.check("c", 60, 0)).toMatchObject({ allowed: true, limit: 1, remaining: 0 });
    expect(many.check("c", 60, 0).allowed).toBe(false);
  });

  test("rejects invalid options and limits", () => {
    expect(() => createLimiter({ maxKeys: 0 })).toThrow(RangeError);
    expect(() => createLimiter({ instances: 0 })).toThrow(RangeError);
    expect(() => createLimiter({ instances: 1.5 })).toThrow(RangeError);
    expect(() => createLimiter({ windowMs: 0 })).toThrow(RangeError);
    const lim = createLimiter();
    expect(() => lim.check("a", 0, 0)).toThrow(RangeError);
    expect(() => lim.check("a", 2.5, 0)).toThrow(RangeError);
    expect(lim.size()).toBe(0);
  });
});

describe("sweep", () => {
  test("removes only keys whose newest admission left the window", () => {
    const lim = createLimiter();
    lim.check("old", 60, 0);
    lim.check("mid", 60, 0);
    lim.check("mid", 60, 30_000);
    lim.check("new", 60, 50_000);
    expect(lim.sweep(W - 1)).toBe(0);
    expect(lim.sweep(W)).toBe(1); // "old" (newest 0) leaves exactly at 60000
    expect(lim.size()).toBe(2);
    expect(lim.sweep(30_000 + W)).toBe(1);
    expect(lim.sweep(50_000 + W)).toBe(1);
    expect(lim.size()).toBe(0);
    expect(lim.sweep(10 * W)).toBe(0);
  });

  test("a swept key starts fresh, which is safe because it was idle", () => {
    const lim = createLimiter();
    for (let i = 0; i < 3; i++) lim.check("a", 3, 0);
    expect(lim.sweep(W)).toBe(1);
    for (let i = 0; i < 3; i++) expect(lim.check("a", 3, W).allowed).toBe(true);
    expect(lim.check("a", 3, W).allowed).toBe(false);
  });
});

describe("bound (maxKeys)", () => {
  test("never holds more than maxKeys", () => {
    const lim = createLimiter({ maxKeys: 50 });
    for (let i = 0; i < 1000; i++) {
      lim.check(`org${i}`, 60, i * 1000); // each org goes idle 60 s after its request
      expect(lim.size()).toBeLessThanOrEqual(50);
    }
  });

  test("a full table of idle keys makes room for a new org", () => {
    const lim = createLimiter({ maxKeys: 3 });
    lim.check("a", 60, 0);
    lim.check("b", 60, 10);
    lim.check("c", 60, 20);
    expect(lim.check("d", 60, 10 + W)).toMatchObject({ allowed: true }); // a and b idle
    expect(lim.size()).toBeLessThanOrEqual(3);
    expect(lim.check("c", 60, 10 + W)).toMatchObject({ allowed: true, remaining: 58 }); // c kept its history
  });

  test("evicts idle keys, never live ones, even if the idle key is more recently used", () => {
    const lim = createLimiter({ maxKeys: 2 });
    lim.check("idle", 1, 0); // newest admission at 0
    lim.check("live", 1, 30_000);
    // Touch "idle" with a denied request so it is the most recently used key.
    expect(lim.check("idle", 1, 50_000).allowed).toBe(false);
    // At W, "idle" has no live admission but "live" (the LRU one) still does.
    expect(lim.check("new", 1, W).allowed).toBe(true);
    expect(lim.check("live", 1, W)).toMatchObject({ allowed: false, retryAfterMs: 30_000 });
  });

  test("fails closed for new orgs when every tracked org is live", () => {
    const lim = createLimiter({ maxKeys: 3 });
    lim.check("a", 2, 0);
    lim.check("b", 2, 5_000);
    lim.check("c", 2, 10_000);
    const d = lim.check("d", 2, 20_000);
    // Oldest live key ("a") goes idle at 60 000: wait 40 000.
    expect(d).toEqual({ allowed: false, limit: 2, remaining: 0, resetMs: 40_000, retryAfterMs: 40_000 });
    expect(lim.size()).toBe(3);
    // Existing orgs are unaffected.
    expect(lim.check("a", 2, 20_000)).toMatchObject({ allowed: true, remaining: 0 });
    // "a" is now live until 80 000, so the earliest idle key is "b" at 65 000.
    // (Cached bound says 60 000; at that time a sweep finds the real one.)
    expect(lim.check("d", 2, W)).toMatchObject({ allowed: false, retryAfterMs: 5_000 });
    expect(lim.check("d", 2, 65_000)).toMatchObject({ allowed: true, remaining: 1 });
    expect(lim.size()).toBe(3);
  });

  test("fail-closed wait is at least 1000 ms", () => {
    const lim = createLimiter({ maxKeys: 1 });
    lim.check("a", 1, 0);
    expect(lim.check("b", 1, W - 1)).toMatchObject({ allowed: false, retryAfterMs: 1000, resetMs: 1000 });
    expect(lim.check("b", 1, W).allowed).toBe(true);
  });

  test("fail-closed wait never exceeds one window (clock stepped back)", () => {
    const lim = createLimiter({ maxKeys: 1 });
    lim.check("a", 1, 10 * W);
    expect(lim.check("b", 1, 0)).toMatchObject({ allowed: false, retryAfterMs: W });
  });

  test("finds an idle key behind many live ones (full sweep fallback)", () => {
    const lim = createLimiter({ maxKeys: 40 });
    for (let i = 0; i < 39; i++) lim.check(`live${i}`, 5, 0);
    lim.check("idle", 5, 1000); // created last: at the back of the Map
    for (let i = 0; i < 39; i++) lim.check(`live${i}`, 5, 50_000);
    expect(lim.check("new", 5, 1000 + W).allowed).toBe(true);
    expect(lim.size()).toBe(40);
    for (let i = 0; i < 39; i++) expect(lim.check(`live${i}`, 5, 1000 + W).remaining).toBe(3); // history intact
  });

  test("a sweep of an empty table does not block later evictions", () => {
    const lim = createLimiter({ maxKeys: 2 });
    expect(lim.sweep(0)).toBe(0);
    lim.check("a", 1, 10);
    lim.check("b", 1, 20);
    expect(lim.check("c", 1, 20 + W).allowed).toBe(true);
  });

  test("the cached no-idle bound is ignored after the clock steps back", () => {
    const lim = createLimiter({ maxKeys: 2 });
    lim.check("a", 1, 10 * W);
    lim.sweep(10 * W); // learns: nothing idle before 11 W
    lim.check("b", 1, 0); // clock stepped back; b goes idle at W
    expect(lim.check("c", 1, W).allowed).toBe(true); // b evicted, a kept
    expect(lim.check("a", 1, W).allowed).toBe(false);
  });

  test("an org can never exceed its limit through eviction pressure", () => {
    // Adversary: org "x" saturates its limit, then floods with new org ids to
    // try to push "x" out of the table and get a fresh ring.
    const lim = createLimiter({ maxKeys: 10 });
    for (let i = 0; i < 5; i++) expect(lim.check("x", 5, 0).allowed).toBe(true);
    let t = 0;
    for (let i = 0; i < 5000; i++) {
      t = Math.floor((i * W) / 5000); // stays inside x's window
      lim.check(`junk${i}`, 5, t);
      if (i % 50 === 0) expect(lim.check("x", 5, t).allowed).toBe(false);
      expect(lim.size()).toBeLessThanOrEqual(10);
    }
    expect(lim.check("x", 5, W).allowed).toBe(true);
  });

  test("randomized: many orgs under a tight bound never exceed their limits", () => {
    let s = 12345;
    const rand = () => {
      s = (Math.imul(s, 1103515245) + 12345) >>> 0;
      return s / 4294967296;
    };
    const lim = createLimiter({ maxKeys: 20 });
    const admitted = new Map<string, number[]>();
    let now = 0;
    for (let i = 0; i < 20_000; i++) {
      now += Math.floor(rand() * 50);
      const org = `o${Math.floor(rand() * 40)}`;
      const limit = org.endsWith("7") ? 300 : 3;
      const d = lim.check(org, limit, now);
      if (d.allowed) {
        const list = (admitted.get(org) ?? []).filter((t) => t + W > now);
        list.push(now);
        admitted.set(org, list);
        expect(list.length).toBeLessThanOrEqual(limit);
      } else {
        expect(d.retryAfterMs).toBeGreaterThanOrEqual(1);
      }
      expect(lim.size()).toBeLessThanOrEqual(20);
    }
  });
});
