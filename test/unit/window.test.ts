import { describe, expect, test } from "bun:test";
import {
  type Decision,
  type Ring,
  admit,
  createRing,
  formatDuration,
  isIdle,
  newestTime,
  rateLimitHeaders,
  resize,
} from "../../src/limits/window.ts";

const W = 60_000;

/** mulberry32: tiny seeded PRNG so the randomized checks are reproducible. */
function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Ring contents oldest-first, for assertions. */
function contents(ring: Ring): number[] {
  const out: number[] = [];
  for (let i = 0; i < ring.count; i++) out.push(ring.times[(ring.head + i) % ring.times.length] ?? Number.NaN);
  return out;
}

/** Max admissions in any half-open window [t, t + w) — only windows starting at an admission matter. */
function maxInAnyWindow(sorted: number[], w: number): number {
  let best = 0;
  let j = 0;
  for (let i = 0; i < sorted.length; i++) {
    const start = sorted[i] ?? 0;
    if (j < i) j = i;
    while (j < sorted.length && (sorted[j] ?? 0) < start + w) j++;
    best = Math.max(best, j - i);
  }
  return best;
}

function copyRing(r: Ring): Ring {
  return { times: r.times.slice(), head: r.head, count: r.count };
}

describe("createRing", () => {
  test("allocates the limit by default, or a smaller lazy capacity", () => {
    expect(createRing(60).times.length).toBe(60);
    expect(createRing(300, 16).times.length).toBe(16);
    expect(createRing(4, 16).times.length).toBe(4);
    expect(createRing(1).count).toBe(0);
  });

  test("rejects invalid limits", () => {
    for (const bad of [0, -1, 1.5, Number.NaN, Number.POSITIVE_INFINITY]) {
      expect(() => createRing(bad)).toThrow(RangeError);
    }
  });
});

describe("admit: boundaries", () => {
  test("N at the same ms are admitted, the N+1th waits exactly 60000 ms", () => {
    for (const n of [1, 2, 60, 300]) {
      const ring = createRing(n);
      const t0 = 1_700_000_000_000;
      for (let i = 0; i < n; i++) {
        const d = admit(ring, t0, n);
        expect(d.allowed).toBe(true);
        expect(d.remaining).toBe(n - i - 1);
        expect(d.retryAfterMs).toBe(0);
        expect(d.resetMs).toBe(i === n - 1 ? W : 0);
      }
      const denied = admit(ring, t0, n);
      expect(denied).toEqual({ allowed: false, limit: n, remaining: 0, resetMs: W, retryAfterMs: W });
    }
  });

  test("an admission frees its slot exactly at t + 60000 (exclusive end)", () => {
    const ring = createRing(2);
    admit(ring, 1000, 2);
    admit(ring, 5000, 2);
    expect(admit(ring, 1000 + W - 1, 2)).toMatchObject({ allowed: false, retryAfterMs: 1 });
    const d = admit(ring, 1000 + W, 2);
    expect(d.allowed).toBe(true);
    expect(d.remaining).toBe(0);
    // Full again: the next slot is the one admitted at 5000.
    expect(d.resetMs).toBe(5000 + W - (1000 + W));
    expect(admit(ring, 5000 + W - 1, 2)).toMatchObject({ allowed: false, retryAfterMs: 1, resetMs: 1 });
    expect(admit(ring, 5000 + W, 2).allowed).toBe(true);
  });

  test("denial does not mutate the ring", () => {
    const ring = createRing(3);
    for (const t of [0, 10, 20]) admit(ring, t, 3);
    const before = copyRing(ring);
    for (const t of [30, 100, W - 1]) expect(admit(ring, t, 3).allowed).toBe(false);
    // Even a denied probe with a much smaller limit must not lose history.
    expect(admit(ring, 50, 1).allowed).toBe(false);
    expect(ring.count).toBe(before.count);
    expect(ring.head).toBe(before.head);
    expect(Array.from(ring.times)).toEqual(Array.from(before.times));
  });

  test("remaining counts down and recovers as admissions expire", () => {
    const ring = createRing(3);
    expect(admit(ring, 0, 3).remaining).toBe(2);
    expect(admit(ring, 1, 3).remaining).toBe(1);
    expect(admit(ring, W, 3).remaining).toBe(1); // t=0 left, t=1 and t=W live
    expect(admit(ring, W + 1, 3).remaining).toBe(1); // t=1 left
    expect(contents(ring)).toEqual([W, W + 1]);
  });

  test("works across ring wrap-around many times", () => {
    const ring = createRing(5);
    let allowed = 0;
    for (let t = 0; t < 20 * W; t += 1000) if (admit(ring, t, 5).allowed) allowed++;
    // 5 per 60 s over 20 windows, every 1 s arrival: exactly 100.
    expect(allowed).toBe(100);
  });

  test("limit 1", () => {
    const ring = createRing(1);
    expect(admit(ring, 0, 1)).toEqual({ allowed: true, limit: 1, remaining: 0, resetMs: W, retryAfterMs: 0 });
    expect(admit(ring, 59_999, 1)).toEqual({ allowed: false, limit: 1, remaining: 0, resetMs: 1, retryAfterMs: 1 });
    expect(admit(ring, W, 1).allowed).toBe(true);
  });

  test("custom windowMs", () => {
    const ring = createRing(2);
    admit(ring, 0, 2, 1000);
    admit(ring, 0, 2, 1000);
    expect(admit(ring, 999, 2, 1000)).toMatchObject({ allowed: false, retryAfterMs: 1 });
    expect(admit(ring, 1000, 2, 1000).allowed).toBe(true);
  });

  test("fractional clocks round waits up", () => {
    const ring = createRing(1);
    admit(ring, 0.25, 1);
    const d = admit(ring, 0.5, 1);
    expect(d.retryAfterMs).toBe(W); // 59999.75 -> 60000
    expect(admit(ring, 0.5 + d.retryAfterMs - 1, 1).allowed).toBe(false);
    expect(admit(ring, 0.5 + d.retryAfterMs, 1).allowed).toBe(true);
  });

  test("a clock stepping backwards keeps the ring sorted and stays conservative", () => {
    const ring = createRing(2);
    admit(ring, 10_000, 2);
    admit(ring, 5_000, 2); // recorded as 10_000
    expect(contents(ring)).toEqual([10_000, 10_000]);
    expect(admit(ring, 5_000 + W, 2).allowed).toBe(false);
    expect(admit(ring, 10_000 + W, 2).allowed).toBe(true);
  });

  test("rejects bad arguments", () => {
    const ring = createRing(2);
    expect(() => admit(ring, Number.NaN, 2)).toThrow(RangeError);
    expect(() => admit(ring, 0, 0)).toThrow(RangeError);
    expect(() => admit(ring, 0, 2, 0)).toThrow(RangeError);
    expect(() => admit(ring, 0, 2, Number.NaN)).toThrow(RangeError);
    expect(ring.count).toBe(0);
  });
});

describe("admit: capacity differs from limit", () => {
  test("a lazily allocated ring grows up to the limit", () => {
    const ring = createRing(300, 1);
    for (let i = 0; i < 300; i++) expect(admit(ring, 0, 300).allowed).toBe(true);
    expect(ring.times.length).toBe(300);
    expect(admit(ring, 0, 300)).toMatchObject({ allowed: false, retryAfterMs: W });
  });

  test("growth preserves order when the ring has wrapped", () => {
    const ring = createRing(10, 4);
    for (const t of [0, 5, 6, 7]) admit(ring, t, 4, 1000); // fill a 4-slot ring at limit 4
    admit(ring, 1000, 4, 1000); // t=0 leaves; written at slot 0, head moves to 1
    expect(contents(ring)).toEqual([5, 6, 7, 1000]);
    expect(ring.head).toBe(1);
    // Upgrade to 10: the full, wrapped 4-slot buffer must grow without scrambling order.
    expect(admit(ring, 1001, 10, 1000)).toMatchObject({ allowed: true, remaining: 5 });
    expect(contents(ring)).toEqual([5, 6, 7, 1000, 1001]);
    expect(ring.times.length).toBe(8);
  });

  test("upgrade (60 -> 300) admits the difference at once", () => {
    const ring = createRing(60);
    for (let i = 0; i < 60; i++) admit(ring, 0, 60);
    expect(admit(ring, 1, 60).allowed).toBe(false);
    for (let i = 0; i < 240; i++) expect(admit(ring, 1, 300).allowed).toBe(true);
    expect(admit(ring, 1, 300)).toMatchObject({ allowed: false, retryAfterMs: W - 1 });
  });

  test("downgrade (300 -> 60) waits until fewer than 60 are live, then shrinks", () => {
    const ring = createRing(300);
    for (let i = 0; i < 300; i++) admit(ring, i * 100, 300); // t = 0 .. 29_900
    // 300 live; a slot under limit 60 frees when only 59 remain, i.e. when the
    // admission at index 240 (t = 24_000) leaves.
    const d = admit(ring, 30_000, 60);
    expect(d).toEqual({ allowed: false, limit: 60, remaining: 0, resetMs: 24_000 + W - 30_000, retryAfterMs: 54_000 });
    expect(admit(ring, 30_000 + d.retryAfterMs - 1, 60).allowed).toBe(false);
    const ok = admit(ring, 30_000 + d.retryAfterMs, 60);
    expect(ok.allowed).toBe(true);
    expect(ok.remaining).toBe(0);
    expect(ring.times.length).toBe(60);
    expect(ring.count).toBe(60);
  });

  test("flip-flopping plans never admit more than the current limit in any window", () => {
    const rand = prng(7);
    const ring = createRing(10, 2);
    const admitted: number[] = [];
    let now = 0;
    for (let i = 0; i < 20_000; i++) {
      now += Math.floor(rand() * 400);
      const limit = rand() < 0.5 ? 10 : 3;
      if (admit(ring, now, limit).allowed) {
        admitted.push(now);
        // Window ending at this admission holds at most `limit` admissions.
        const inWindow = admitted.filter((t) => t > now - W).length;
        expect(inWindow).toBeLessThanOrEqual(limit);
      }
      if (admitted.length > 200) admitted.splice(0, admitted.length - 50);
    }
  });
});

describe("admit: randomized exactness", () => {
  const cases: Array<{ seed: number; limit: number; arrivals: number; meanGapMs: number; burst: number }> = [
    { seed: 1, limit: 60, arrivals: 5000, meanGapMs: 900, burst: 0.3 },
    { seed: 2, limit: 300, arrivals: 8000, meanGapMs: 150, burst: 0.5 },
    { seed: 3, limit: 1, arrivals: 3000, meanGapMs: 20_000, burst: 0.2 },
    { seed: 4, limit: 7, arrivals: 4000, meanGapMs: 5000, burst: 0.6 },
    { seed: 5, limit: 60, arrivals: 4000, meanGapMs: 1000, burst: 0.9 },
  ];

  for (const c of cases) {
    test(`seed ${c.seed}: limit ${c.limit}, ${c.arrivals} arrivals`, () => {
      const rand = prng(c.seed);
      const ring = createRing(c.limit, c.seed % 2 === 0 ? 1 : c.limit);
      const admitted: number[] = [];
      let now = 1_000_000;
      let denials = 0;
      for (let i = 0; i < c.arrivals; i++) {
        // Mix same-ms bursts with exponential-ish gaps.
        if (rand() >= c.burst) now += Math.floor(-Math.log(1 - rand()) * c.meanGapMs);
        // The rule, computed independently: how many admissions are live at now.
        const live = admitted.filter((t) => t + W > now).length;
        const probe = copyRing(ring);
        const d: Decision = admit(ring, now, c.limit);
        expect(d.allowed).toBe(live < c.limit);
        if (d.allowed) {
          admitted.push(now);
          expect(d.remaining).toBe(c.limit - live - 1);
          expect(d.retryAfterMs).toBe(0);
        } else {
          denials++;
          expect(d.retryAfterMs).toBeGreaterThanOrEqual(1);
          expect(d.resetMs).toBe(d.retryAfterMs);
          // The wait is the true wait: one ms earlier still fails, exactly then succeeds.
          expect(admit(copyRing(probe), now + d.retryAfterMs - 1, c.limit).allowed).toBe(false);
          expect(admit(copyRing(probe), now + d.retryAfterMs, c.limit).allowed).toBe(true);
        }
        if (d.allowed && d.remaining === 0) {
          // resetMs when full is also the true wait for the next admission.
          expect(admit(copyRing(ring), now + d.resetMs - 1, c.limit).allowed).toBe(false);
          expect(admit(copyRing(ring), now + d.resetMs, c.limit).allowed).toBe(true);
        }
        // Keep the reference list short; nothing older than a window matters.
        if (admitted.length > 4 * c.limit + 100) admitted.splice(0, admitted.length - 2 * c.limit);
      }
      expect(denials).toBeGreaterThan(0); // the case actually exercised the limit
    });
  }

  test("no 60 s window ever holds more than N admissions (full history)", () => {
    const rand = prng(42);
    const limit = 60;
    const ring = createRing(limit);
    const admitted: number[] = [];
    let now = 0;
    for (let i = 0; i < 20_000; i++) {
      if (rand() < 0.7) now += Math.floor(rand() * 2000);
      if (admit(ring, now, limit).allowed) admitted.push(now);
    }
    expect(maxInAnyWindow(admitted, W)).toBe(limit); // saturated, never exceeded
    // And it's not trivially conservative: shifting the window end by 1 ms would allow more.
    expect(maxInAnyWindow(admitted, W + 1)).toBeGreaterThan(limit);
  });
});

describe("helpers", () => {
  test("newestTime / isIdle", () => {
    const ring = createRing(3);
    expect(newestTime(ring)).toBe(Number.NEGATIVE_INFINITY);
    expect(isIdle(ring, 0)).toBe(true);
    admit(ring, 100, 3);
    admit(ring, 200, 3);
    expect(newestTime(ring)).toBe(200);
    expect(isIdle(ring, 200 + W - 1)).toBe(false);
    expect(isIdle(ring, 200 + W)).toBe(true);
    expect(isIdle(ring, 250, 50)).toBe(true);
  });

  test("resize keeps the newest entries in order", () => {
    const ring = createRing(4);
    for (const t of [1, 2, 3, 4]) admit(ring, t, 4, 10);
    admit(ring, 11, 4, 10); // wraps
    expect(contents(ring)).toEqual([2, 3, 4, 11]);
    const small = resize(ring, 2);
    expect(small.times.length).toBe(2);
    expect(contents(small)).toEqual([4, 11]);
    const big = resize(ring, 8);
    expect(big.times.length).toBe(8);
    expect(contents(big)).toEqual([2, 3, 4, 11]);
    expect(contents(ring)).toEqual([2, 3, 4, 11]); // original untouched
  });

  test("resize to a lower limit stays exact for that limit", () => {
    const ring = createRing(5);
    for (const t of [0, 10, 20, 30, 40]) admit(ring, t, 5);
    const r = resize(ring, 2);
    expect(admit(r, 50, 2)).toMatchObject({ allowed: false, retryAfterMs: 30 + W - 50 });
    expect(admit(r, 30 + W, 2).allowed).toBe(true);
  });
});

describe("formatDuration", () => {
  test("Go/OpenAI duration strings", () => {
    const cases: Array<[number, string]> = [
      [0, "0s"],
      [-5, "0s"],
      [1, "1ms"],
      [20, "20ms"],
      [999, "999ms"],
      [1000, "1s"],
      [1500, "1.5s"],
      [1050, "1.05s"],
      [1001, "1.001s"],
      [7660, "7.66s"],
      [59_999, "59.999s"],
      [60_000, "1m0s"],
      [90_500, "1m30.5s"],
      [360_000, "6m0s"],
      [179_560, "2m59.56s"],
      [3_600_000, "1h0m0s"],
      [3_661_001, "1h1m1.001s"],
      [0.2, "1ms"], // rounds up, never understates
    ];
    for (const [ms, s] of cases) expect(formatDuration(ms)).toBe(s);
  });
});

describe("rateLimitHeaders", () => {
  test("allowed: limit/remaining/reset only", () => {
    expect(rateLimitHeaders({ allowed: true, limit: 60, remaining: 59, resetMs: 0, retryAfterMs: 0 })).toEqual({
      "x-ratelimit-limit-requests": "60",
      "x-ratelimit-remaining-requests": "59",
      "x-ratelimit-reset-requests": "0s",
    });
    expect(rateLimitHeaders({ allowed: true, limit: 1, remaining: 0, resetMs: 60_000, retryAfterMs: 0 })).toEqual({
      "x-ratelimit-limit-requests": "1",
      "x-ratelimit-remaining-requests": "0",
      "x-ratelimit-reset-requests": "1m0s",
    });
  });

  test("denied: retry-after (ceil seconds, >= 1) and retry-after-ms", () => {
    const h = (ms: number) => rateLimitHeaders({ allowed: false, limit: 300, remaining: 0, resetMs: ms, retryAfterMs: ms });
    expect(h(1)).toEqual({
      "x-ratelimit-limit-requests": "300",
      "x-ratelimit-remaining-requests": "0",
      "x-ratelimit-reset-requests": "1ms",
      "retry-after": "1",
      "retry-after-ms": "1",
    });
    expect(h(1000)["retry-after"]).toBe("1");
    expect(h(1001)["retry-after"]).toBe("2");
    expect(h(54_000)).toMatchObject({ "retry-after": "54", "retry-after-ms": "54000", "x-ratelimit-reset-requests": "54s" });
    expect(h(60_000)).toMatchObject({ "retry-after": "60", "retry-after-ms": "60000", "x-ratelimit-reset-requests": "1m0s" });
  });

  test("headers from a real denial parse the way the openai SDK reads them", () => {
    const ring = createRing(2);
    admit(ring, 0, 2);
    admit(ring, 250, 2);
    const d = admit(ring, 30_000, 2);
    const h = rateLimitHeaders(d);
    // openai v7 retryRequest: parseFloat(retry-after-ms), else parseFloat(retry-after) * 1000; ignored if > 60 s.
    const sdkWait = Number.parseFloat(h["retry-after-ms"] ?? "");
    expect(sdkWait).toBe(30_000);
    expect(sdkWait).toBeLessThanOrEqual(60_000);
    expect(Number.parseFloat(h["retry-after"] ?? "") * 1000).toBeGreaterThanOrEqual(sdkWait);
  });
});
