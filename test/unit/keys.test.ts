import { describe, expect, test } from "bun:test";
import { createHash } from "node:crypto";
import { validateKeyInput } from "../../src/admin/service.ts";
import { keysCreate } from "../../src/cli/commands/keys.ts";
import { SCOPES, SECRET_LENGTH, bearerToken, createKeyMatcher, displayPrefix, hashKey, isScope, mintKey, parseDuration } from "../../src/auth/keys.ts";
import { maxKeyLookups } from "../../src/auth/verify.ts";
import { maxUnanswered } from "../../src/limits/usage-writer.ts";
import { FieldError, InputError } from "../../src/lib/errors.ts";

describe("key format", () => {
  test("sk-<tag>-<43 base62 characters>", () => {
    const { key } = mintKey("gw");
    expect(key).toMatch(/^sk-gw-[0-9A-Za-z]{43}$/);
    expect(SECRET_LENGTH).toBe(43);
    expect(mintKey("acme1").key).toMatch(/^sk-acme1-[0-9A-Za-z]{43}$/);
  });

  test("keys are unique and use the whole alphabet (no obvious bias)", () => {
    const counts = new Map<string, number>();
    const seen = new Set<string>();
    for (let i = 0; i < 2_000; i++) {
      const { key } = mintKey("gw");
      seen.add(key);
      for (const ch of key.slice(6)) counts.set(ch, (counts.get(ch) ?? 0) + 1);
    }
    expect(seen.size).toBe(2_000);
    expect(counts.size).toBe(62);
    // 86,000 draws over 62 symbols: ~1,387 each; a biased mapping (e.g. b % 62 without rejection) skews the low ones.
    const values = [...counts.values()];
    expect(Math.min(...values)).toBeGreaterThan(1_150);
    expect(Math.max(...values)).toBeLessThan(1_650);
  });

  test("the display prefix is sk-<tag>- plus 6 secret characters, and never the whole key", () => {
    const { key, prefix } = mintKey("gw");
    expect(prefix).toBe(key.slice(0, 12));
    expect(prefix).toMatch(/^sk-gw-[0-9A-Za-z]{6}$/);
    expect(displayPrefix("sk-acme1-abcdefghij", "acme1")).toBe("sk-acme1-abcdef");
  });
});

describe("hashing", () => {
  test("SHA-256 hex of the whole key; mintKey stores that and only that", () => {
    const { key, hash } = mintKey("gw");
    expect(hash).toBe(createHash("sha256").update(key).digest("hex"));
    expect(hash).toMatch(/^[0-9a-f]{64}$/);
    expect(hashKey(key)).toBe(hash);
    expect(hash).not.toContain(key.slice(6));
  });

  test("known vector", () => {
    expect(hashKey("abc")).toBe("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  });
});

describe("matcher", () => {
  const matches = createKeyMatcher("gw");
  test("accepts minted keys", () => {
    for (let i = 0; i < 20; i++) expect(matches(mintKey("gw").key)).toBe(true);
  });

  test("rejects everything else before any lookup", () => {
    const good = mintKey("gw").key;
    for (const bad of [
      "",
      "sk-gw-",
      good.slice(0, -1),
      `${good}x`,
      good.replace("sk-gw-", "sk-xx-"),
      good.replace("sk-", "pk-"),
      `${good.slice(0, -1)}-`,
      `${good.slice(0, -1)}_`,
      ` ${good}`,
      `${good}\n`,
      good.toUpperCase(),
      "sk-proj-abc",
    ]) {
      expect(matches(bad)).toBe(false);
    }
  });

  test("is bound to its tag", () => {
    expect(createKeyMatcher("acme")(mintKey("gw").key)).toBe(false);
    expect(createKeyMatcher("acme")(mintKey("acme").key)).toBe(true);
  });
});

describe("bearer parsing", () => {
  test("the token of a Bearer header", () => {
    expect(bearerToken("Bearer sk-gw-abc")).toBe("sk-gw-abc");
    expect(bearerToken("bearer sk-gw-abc")).toBe("sk-gw-abc");
    expect(bearerToken("BEARER   sk-gw-abc  ")).toBe("sk-gw-abc");
    expect(bearerToken("Bearer\tsk-gw-abc")).toBe("sk-gw-abc");
  });

  test("null for anything else", () => {
    for (const h of [null, "", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "sk-gw-abc", "Bearer a b", "Token sk-gw-abc", "Bearersk-gw-abc"]) {
      expect(bearerToken(h)).toBeNull();
    }
  });
});

describe("durations", () => {
  test("s, m, h, d", () => {
    expect(parseDuration("45s")).toBe(45_000);
    expect(parseDuration("30m")).toBe(1_800_000);
    expect(parseDuration("24h")).toBe(86_400_000);
    expect(parseDuration("90d")).toBe(90 * 86_400_000);
    expect(parseDuration("0s")).toBe(0);
  });

  test("null when malformed", () => {
    for (const s of ["", "90", "d", "1.5h", "-1d", "1w", "1 d", "1D", "1000000d", "1h30m"]) expect(parseDuration(s)).toBeNull();
  });
});

describe("key input validation (before anything is written)", () => {
  const org = "7f8f3c2a-1b2c-4d5e-8f90-123456789abc";
  const user = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
  const base = { orgId: org, kind: "service", scopes: ["inference"], knownModels: ["svc-fast", "svc-embed"], tag: "gw" };
  const error = (patch: Record<string, unknown>): FieldError => {
    try {
      validateKeyInput({ ...base, ...patch } as Parameters<typeof validateKeyInput>[0]);
    } catch (e) {
      expect(e).toBeInstanceOf(InputError);
      if (e instanceof FieldError) return e;
      throw e;
    }
    throw new Error("accepted");
  };
  /** The message as `gateway keys create` prints it: each field named by its flag. */
  const refused = (patch: Record<string, unknown>): string => keysCreate.describe(error(patch));

  test("accepts a service key and a personal key; dedupes scopes", () => {
    expect(validateKeyInput({ ...base, scopes: ["inference", "audit:read", "inference"] })).toEqual({ kind: "service", scopes: ["inference", "audit:read"] });
    expect(validateKeyInput({ ...base, kind: "personal", userId: user })).toEqual({ kind: "personal", scopes: ["inference"] });
  });

  test("refuses bad input with a clear message", () => {
    expect(refused({ orgId: "acme" })).toContain("--org must be a UUID");
    expect(refused({ kind: "robot" })).toBe("--kind must be personal or service");
    expect(refused({ kind: "personal" })).toContain("needs --user");
    expect(refused({ userId: user })).toContain("drop --user");
    expect(refused({ scopes: [] })).toContain("at least one scope");
    expect(refused({ scopes: ["inference", "admin"] })).toBe('unknown scope "admin"');
    expect(refused({ kind: "personal", userId: user, scopes: ["inference", "audit:read"] })).toContain("audit:read is for service keys only");
    expect(refused({ models: ["gpt-4"] })).toContain('unknown model alias "gpt-4"');
    expect(refused({ expiresAt: new Date("nope") })).toContain("--expires-at");
  });

  test("says what is wrong in the service's own words, with the field machine-readable", () => {
    expect(error({ orgId: "acme" })).toMatchObject({ field: "orgId", message: 'orgId must be a UUID, got "acme"' });
    expect(error({ kind: "robot" })).toMatchObject({ field: "kind", message: "kind must be personal or service" });
    expect(error({ kind: "personal" })).toMatchObject({ field: "userId", message: "a personal key needs userId (the person it belongs to)" });
    expect(error({ userId: user })).toMatchObject({ field: "userId" });
    expect(error({ scopes: [] })).toMatchObject({ field: "scopes", message: "scopes must name at least one scope" });
    expect(error({ models: ["gpt-4"] })).toMatchObject({ field: "models" });
    expect(error({ expiresAt: new Date("nope") })).toMatchObject({ field: "expiresAt", message: "expiresAt is not a valid ISO 8601 time" });
    expect(error({ expiresAt: new Date(), expiresInMs: 1 })).toMatchObject({ field: "expiresAt", message: "give expiresAt or expiresInMs, not both" });
    for (const patch of [{ orgId: "acme" }, { kind: "robot" }, { kind: "personal" }, { userId: user }, { scopes: [] }, { expiresAt: new Date("nope") }]) {
      expect(error(patch).message).not.toContain("--");
    }
  });

  test("every listed scope is recognised", () => {
    for (const s of SCOPES) expect(isScope(s)).toBe(true);
    expect(isScope("Inference")).toBe(false);
  });
});

describe("key lookups out at once (maxKeyLookups)", () => {
  test("half the pool, at least one; the embedded database (no pool) is not bounded", () => {
    expect([1, 2, 3, 4, 5, 10, 11, 200].map(maxKeyLookups)).toEqual([1, 1, 1, 2, 2, 5, 5, 100]);
    expect(maxKeyLookups(undefined)).toBe(Number.POSITIVE_INFINITY);
  });

  test("key lookups leave a connection to the rest from two on; with the usage writer's given-up writes, from five on", () => {
    for (let pool = 2; pool <= 200; pool++) {
      expect(maxKeyLookups(pool)).toBeLessThan(pool);
      if (pool >= 5) expect(maxKeyLookups(pool) + maxUnanswered(pool)).toBeLessThan(pool);
    }
    // The default pool: 5 lookups and 2 writes given up on (3 with the writer's current one) leave 2.
    expect(10 - maxKeyLookups(10) - maxUnanswered(10) - 1).toBe(2);
  });
});
