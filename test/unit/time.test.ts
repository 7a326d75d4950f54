import { describe, expect, test } from "bun:test";
import { compareInstants, inStorableRange, parseInstant, parseInstantOrDate } from "../../src/lib/time.ts";

const ms = (s: string) => parseInstant(s)?.ms ?? null;

describe("parseInstant: the one grammar", () => {
  test("every zone form names the same instant", () => {
    const want = Date.UTC(2025, 2, 1, 11, 59, 59, 750);
    for (const s of [
      "2025-03-01T11:59:59.750Z",
      "2025-03-01t11:59:59.750z",
      "2025-03-01T13:59:59.750+02:00",
      "2025-03-01T13:59:59.750+0200",
      "2025-03-01T13:59:59.750+02",
      "2025-03-01T13:59:59,750+02",
      "2025-03-01T06:29:59.750-05:30",
    ]) {
      expect(ms(s)).toBe(want);
    }
  });

  test("seconds and fraction are optional; up to nine fraction digits are kept", () => {
    expect(ms("2025-03-01T12:00Z")).toBe(Date.UTC(2025, 2, 1, 12));
    expect(ms("2025-03-01T12:00:07Z")).toBe(Date.UTC(2025, 2, 1, 12, 0, 7));
    expect(parseInstant("2025-03-01T12:00:00.123456789Z")).toEqual({ ms: Date.UTC(2025, 2, 1, 12, 0, 0, 123), subNs: 456_789, fractionDigits: 9, seconds: true });
    expect(parseInstant("2025-03-01T12:00Z")).toEqual({ ms: Date.UTC(2025, 2, 1, 12), subNs: 0, fractionDigits: 0, seconds: false });
  });

  test("refuses what is not a zoned date and time", () => {
    for (const s of [
      "",
      "yesterday",
      "1735689600",
      "2025-01-01",
      "2025-01-01T00:00:00", // no zone: would depend on the server's clock settings
      "2025-01-01 00:00:00Z",
      " 2025-01-01T00:00:00Z",
      "2025-01-01T00:00:00Z ",
      "2025-01-01T00:00:00.Z",
      "2025-01-01T00:00:00.1234567890Z",
      "2025-01-01T00Z",
      "2025-01-01T00:00:00+2",
      "2025-01-01T00:00:00+02:0",
      "+2025-01-01T00:00:00Z",
    ]) {
      expect(parseInstant(s)).toBeNull();
    }
  });

  test("refuses impossible dates, times and offsets", () => {
    for (const s of [
      "2025-13-01T00:00:00Z",
      "2025-00-01T00:00:00Z",
      "2025-02-29T00:00:00Z",
      "2025-04-31T00:00:00Z",
      "2025-01-00T00:00:00Z",
      "2025-01-01T24:00:00Z",
      "2025-01-01T12:60:00Z",
      "2025-01-01T12:00:60Z",
      "2025-01-01T12:00:00+24:00",
      "2025-01-01T12:00:00+01:60",
    ]) {
      expect(parseInstant(s)).toBeNull();
    }
    expect(ms("2024-02-29T00:00:00Z")).toBe(Date.UTC(2024, 1, 29));
  });

  test("years outside 0001-9999 parse but are not storable", () => {
    const low = parseInstant("0001-01-01T00:30:00+01:00");
    expect(low).not.toBeNull();
    expect(low && inStorableRange(low)).toBe(false);
    const high = parseInstant("9999-12-31T23:59:59.999Z");
    expect(high && inStorableRange(high)).toBe(true);
    const over = parseInstant("9999-12-31T23:59:59.999-00:01");
    expect(over && inStorableRange(over)).toBe(false);
  });

  test("compareInstants orders by the sub-millisecond remainder too", () => {
    const a = parseInstant("2025-01-01T00:00:00.0001Z");
    const b = parseInstant("2025-01-01T00:00:00.0002Z");
    if (!a || !b) throw new Error("unparsed");
    expect(a.ms).toBe(b.ms);
    expect(compareInstants(a, b)).toBeLessThan(0);
    expect(compareInstants(b, a)).toBeGreaterThan(0);
    expect(compareInstants(a, a)).toBe(0);
  });
});

describe("parseInstantOrDate: the grammar plus a bare date", () => {
  test("a bare date is the start of that day in UTC", () => {
    expect(parseInstantOrDate("2025-01-31")?.ms).toBe(Date.UTC(2025, 0, 31));
    expect(parseInstantOrDate("2025-01-31T10:00:00+02")?.ms).toBe(Date.UTC(2025, 0, 31, 8));
  });

  test("an impossible or partial date is refused", () => {
    for (const s of ["2025-02-29", "2025-1-1", "2025-01", "2025-01-01T10:00:00", "tomorrow"]) expect(parseInstantOrDate(s)).toBeNull();
  });
});
