import { describe, expect, test } from "bun:test";
import { Breaker } from "../../src/inference/upstream/breaker.ts";
import { pickTarget, type Target } from "../../src/inference/upstream/targets.ts";

/** A target with a real breaker; the fields pickTarget does not read are left out. */
function target(label: string, weight: number): Target {
  return { label, cfg: { baseUrl: `http://${label}/v1`, model: "m", weight }, breaker: new Breaker({ failures: 1, cooldownMs: 1_000 }) } as unknown as Target;
}

/** The choice as written before the one-target path (the general algorithm), to compare against. */
function reference(list: readonly Target[], tried: Set<Target>, t: number, random: () => number): Target | undefined {
  let pool = list.filter((x) => !tried.has(x) && x.breaker.available(t));
  if (pool.length === 0) {
    tried.clear();
    pool = list.filter((x) => x.breaker.available(t));
  }
  const weighted = pool.filter((x) => x.cfg.weight > 0);
  const from = weighted.length > 0 ? weighted : pool;
  if (from.length <= 1) return from[0];
  const total = from.reduce((s, x) => s + x.cfg.weight, 0);
  if (total <= 0) return from[Math.floor(random() * from.length)];
  let r = random() * total;
  for (const x of from) {
    r -= x.cfg.weight;
    if (r < 0) return x;
  }
  return from[from.length - 1];
}

describe("pickTarget", () => {
  test("one target: the same choice and the same tried set as the general algorithm, in every breaker state", () => {
    const states = ["closed", "open", "half-open", "half-open probing"] as const;
    for (const weight of [0, 1]) {
      for (const state of states) {
        for (const wasTried of [false, true]) {
          const run = (pick: typeof pickTarget) => {
            const x = target("a", weight);
            // Open the breaker at t=0 (one failure) for the states that need it; t=500 is open, t=2000 half-open.
            if (state !== "closed") {
              x.breaker.acquire(0);
              x.breaker.failure(0);
            }
            const t = state === "open" ? 500 : 2_000;
            if (state === "half-open probing") x.breaker.acquire(t);
            const tried = new Set<Target>(wasTried ? [x] : []);
            const got = pick([x], tried, t, () => 0.5);
            return { got: got?.label ?? null, tried: tried.size };
          };
          expect({ weight, state, wasTried, ...run(pickTarget) }).toEqual({ weight, state, wasTried, ...run(reference) });
        }
      }
    }
  });

  test("several targets: by weight, untried first, weight 0 only as a standby", () => {
    const a = target("a", 3);
    const b = target("b", 1);
    const standby = target("s", 0);
    const list = [a, b, standby];
    const counts = new Map<string, number>();
    for (let i = 0; i < 400; i++) {
      const got = pickTarget(list, new Set(), 0, () => i / 400);
      counts.set(got?.label ?? "none", (counts.get(got?.label ?? "none") ?? 0) + 1);
    }
    expect(Object.fromEntries(counts)).toEqual({ a: 300, b: 100 });
    expect(pickTarget(list, new Set([a]), 0, () => 0)?.label).toBe("b");
    expect(pickTarget(list, new Set([a, b]), 0, () => 0)?.label).toBe("s");
    // Every target tried: the set starts over.
    const tried = new Set([a, b, standby]);
    expect(pickTarget(list, tried, 0, () => 0)?.label).toBe("a");
    expect(tried.size).toBe(0);
  });
});
