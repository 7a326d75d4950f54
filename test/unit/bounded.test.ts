import { describe, expect, test } from "bun:test";
import { BoundFull, createBound, maxOutAtOnce } from "../../src/db/bounded.ts";
import { DatabaseTimeout } from "../../src/db/client.ts";
import { maxKeyLookups } from "../../src/auth/verify.ts";
import { maxUnanswered } from "../../src/limits/usage-writer.ts";

describe("database work of one kind out at once (maxOutAtOnce)", () => {
  test("a quarter of the pool, at least one; the embedded database (no pool) is not bounded", () => {
    expect([1, 2, 3, 4, 7, 8, 10, 11, 200].map(maxOutAtOnce)).toEqual([1, 1, 1, 1, 1, 2, 2, 2, 50]);
    expect(maxOutAtOnce(undefined)).toBe(Number.POSITIVE_INFINITY);
  });

  test("one kind leaves a connection to key lookups from three on, to the usage writer (one running) from five on", () => {
    for (let pool = 3; pool <= 200; pool++) expect(maxOutAtOnce(pool) + maxKeyLookups(pool)).toBeLessThan(pool);
    for (let pool = 5; pool <= 200; pool++) expect(maxOutAtOnce(pool) + maxUnanswered(pool) + 1).toBeLessThan(pool);
    // The default pool: a kind stuck on a locked table holds 2 of 10, whatever the other kinds do.
    expect(maxOutAtOnce(10)).toBe(2);
  });
});

describe("usage writes left unanswered at once (maxUnanswered)", () => {
  test("two; one with a pool of two, and one (not none) with a pool of one; two on the embedded database", () => {
    // docs/decisions.md (usage writes while the database does not answer). None would fail every flush at once.
    expect([1, 2, 3, 4, 10, 200].map(maxUnanswered)).toEqual([1, 1, 2, 2, 2, 2]);
    expect(maxUnanswered(undefined)).toBe(2);
  });
});

/** A call that settles when told. */
function pending<T>() {
  let settle: (v: T) => void = () => {};
  const p = new Promise<T>((r) => {
    settle = r;
  });
  return { p, settle };
}

async function outcome(p: Promise<unknown>): Promise<string> {
  try {
    return `ok ${String(await p)}`;
  } catch (e) {
    return e instanceof BoundFull ? "full" : e instanceof DatabaseTimeout ? "timeout" : `error ${(e as Error).message}`;
  }
}

describe("createBound", () => {
  test("at most `limit` calls out; others wait their turn within the same timeout; a freed place goes to the next", async () => {
    const b = createBound("test", 2, undefined, 2_000);
    const calls = [pending<number>(), pending<number>(), pending<number>()];
    let started = 0;
    const runs = calls.map((c) =>
      b.run(() => {
        started++;
        return c.p;
      }),
    );
    expect(started).toBe(2);
    calls[0]?.settle(1);
    expect(await runs[0]).toBe(1);
    expect(started).toBe(3);
    calls[1]?.settle(2);
    calls[2]?.settle(3);
    expect(await Promise.all(runs)).toEqual([1, 2, 3]);
    expect(b.unanswered()).toBe(0);
  });

  test("calls given up on keep their places until they settle; while `limit` are so, a new call is refused at once", async () => {
    const b = createBound("test", 2, undefined, 50);
    const calls = [pending<string>(), pending<string>()];
    const told: Promise<string>[] = [];
    const first = calls.map((c) => outcome(b.run(() => c.p, (running) => told.push(running))));
    // A third waits for a place and gives up with the same timeout, never started.
    let thirdStarted = false;
    const third = outcome(
      b.run(() => {
        thirdStarted = true;
        return Promise.resolve("x");
      }),
    );
    expect(await Promise.all([...first, third])).toEqual(["timeout", "timeout", "timeout"]);
    expect({ thirdStarted, unanswered: b.unanswered(), told: told.length }).toEqual({ thirdStarted: false, unanswered: 2, told: 2 });
    const t = performance.now();
    expect(await outcome(b.run(() => Promise.resolve("y")))).toBe("full");
    expect(performance.now() - t).toBeLessThan(20);
    // One settles: its place is free again.
    calls[0]?.settle("late");
    expect(await told[0]).toBe("late");
    expect(b.unanswered()).toBe(1);
    expect(await outcome(b.run(() => Promise.resolve("z")))).toBe("ok z");
    calls[1]?.settle("late");
    await told[1];
    expect(b.unanswered()).toBe(0);
  });

  test("a call that throws or rejects is the caller's error and frees its place", async () => {
    const b = createBound("test", 1, undefined, 1_000);
    expect(
      await outcome(
        b.run(() => {
          throw new Error("sync");
        }),
      ),
    ).toBe("error sync");
    expect(await outcome(b.run(() => Promise.reject(new Error("async"))))).toBe("error async");
    expect(await outcome(b.run(() => Promise.resolve(7)))).toBe("ok 7");
  });
});
