import { describe, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { join, resolve } from "node:path";

/**
 * `total += await f()` reads `total` before the await and writes the old
 * value plus the result after it, so whatever other tasks added to `total`
 * in the meantime is lost. In a test that sums what concurrent clients
 * received, that undercounts, and the test then fails against a gateway
 * that metered correctly (quota-http failed that way in CI on 2026-11-25:
 * counter 12,000, clients' sum 11,846). ESLint calls the rule
 * require-atomic-updates; Biome has none, so this scan stands in for it.
 */

const ROOT = resolve(import.meta.dir, "../..");
/**
 * An arithmetic compound assignment whose right-hand side starts with `await`
 * (possibly inside parentheses). Logical ones (`x ??= await init()`) combine
 * nothing: at worst two lazy initialisations race, and no sum loses a part.
 */
const AWAIT_IN_COMPOUND = /(?:\*\*|[+\-*/%])=\s*\(*\s*await\b/;
const SELF = "test/unit/atomic-updates.test.ts";

function offenders(): string[] {
  const found: string[] = [];
  for (const dir of ["src", "test", "bench"]) {
    for (const file of new Bun.Glob("**/*.ts").scanSync(join(ROOT, dir))) {
      const lines = readFileSync(join(ROOT, dir, file), "utf8").split("\n");
      lines.forEach((line, i) => {
        const code = !/^\s*(\/\/|\*|\/\*)/.test(line);
        if (code && `${dir}/${file}` !== SELF && AWAIT_IN_COMPOUND.test(line)) found.push(`${dir}/${file}:${i + 1}: ${line.trim()}`);
      });
    }
  }
  return found;
}

describe("no lost updates across an await", () => {
  test("the pattern is recognised, and only it", () => {
    for (const bad of ["received += await f();", "received += ((await res.json()) as T).n;", "x -= (await y).v", "n *= await k", "p **= await e"]) {
      expect(AWAIT_IN_COMPOUND.test(bad)).toBe(true);
    }
    for (const fine of ["const { usage } = await res.json();", "received += usage.total_tokens;", "for (let i = 0; i < n; i += 500) await write(i);", "x = await y;", "if (a >= await b) {}", "org ??= await seedOrg(db);", "a === await b"]) {
      expect(AWAIT_IN_COMPOUND.test(fine)).toBe(false);
    }
  });

  test("src, test and bench read the awaited value first, then update", () => {
    expect(offenders()).toEqual([]);
  });
});
