import { describe, expect, test } from "bun:test";
import { contentLength } from "../../src/inference/upstream/http1-conn.ts";

describe("contentLength", () => {
  test("one decimal value, or the same value repeated as a list (RFC 9110 8.6)", () => {
    expect(contentLength("42")).toBe(42);
    expect(contentLength(" 0 ")).toBe(0);
    expect(contentLength("42, 42")).toBe(42);
    expect(contentLength("42,42,042")).toBe(42);
    expect(contentLength(`${"0".repeat(30)}7`)).toBe(7);
    expect(contentLength(String(Number.MAX_SAFE_INTEGER))).toBe(Number.MAX_SAFE_INTEGER);
  });

  test("anything else is refused: values that differ, not decimal, empty, past 2^53", () => {
    for (const v of ["42, 43", "", " ", "42,", ",42", "-1", "+1", "0x10", "1e3", "4 2", "42;", String(Number.MAX_SAFE_INTEGER + 1), "9".repeat(400)]) {
      expect(`${v}: ${contentLength(v)}`).toBe(`${v}: undefined`);
    }
  });
});
