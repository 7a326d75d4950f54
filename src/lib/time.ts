/**
 * The one timestamp grammar for times read from outside (the audit query's
 * from/to, `gateway audit import`'s created_at, the CLI's --since and
 * --expires-at, and the audit cursor's position).
 *
 * ISO 8601 date and time with a zone: `YYYY-MM-DDThh:mm[:ss[.f…]]` then `Z`
 * or an offset `±hh:mm`, `±hhmm` or `±hh`. Seconds are optional, the fraction
 * (1 to 9 digits, after `.` or `,`) too. A zone is required: a bare local time
 * would depend on the server's clock settings. `T` and `Z` may be lower case.
 */

const ISO = /^(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2})(?::(\d{2})(?:[.,](\d{1,9}))?)?(?:([Zz])|([+-])(\d{2})(?::?(\d{2}))?)$/;
const DATE = /^(\d{4})-(\d{2})-(\d{2})$/;

/** Bounds of what Date#toISOString and Postgres both read back as four-digit years. */
export const MIN_TIME = new Date("0001-01-01T00:00:00.000Z").getTime();
export const MAX_TIME = new Date("9999-12-31T23:59:59.999Z").getTime();

/** An instant with the sub-millisecond remainder kept, so inclusive bounds can round the right way. */
export interface Instant {
  /** Epoch milliseconds (the fraction truncated to the millisecond). */
  ms: number;
  /** Nanoseconds beyond `ms`, 0–999,999. */
  subNs: number;
  /** How many fraction digits were given (0 without a fraction). */
  fractionDigits: number;
  /** Whether the seconds were given. */
  seconds: boolean;
}

function daysIn(year: number, month: number): number {
  const d = new Date(0);
  d.setUTCFullYear(year, month, 0);
  return d.getUTCDate();
}

function validDate(year: number, month: number, day: number): boolean {
  return month >= 1 && month <= 12 && day >= 1 && day <= daysIn(year, month);
}

/** The instant `text` names in the grammar above, or null (impossible dates and times included). */
export function parseInstant(text: string): Instant | null {
  const m = ISO.exec(text);
  if (!m) return null;
  const [, y, mo, d, h, mi, sec, frac, z, sign, oh, om] = m;
  const year = Number(y);
  const month = Number(mo);
  const day = Number(d);
  const hour = Number(h);
  const minute = Number(mi);
  const second = Number(sec ?? "0");
  if (!validDate(year, month, day)) return null;
  if (hour > 23 || minute > 59 || second > 59) return null;
  let offsetMin = 0;
  if (!z) {
    const offH = Number(oh);
    const offM = Number(om ?? "0");
    if (offH > 23 || offM > 59) return null;
    offsetMin = (sign === "-" ? -1 : 1) * (offH * 60 + offM);
  }
  const digits = (frac ?? "").padEnd(9, "0");
  const t = new Date(0);
  t.setUTCFullYear(year, month - 1, day);
  t.setUTCHours(hour, minute, second, Number(digits.slice(0, 3)));
  return { ms: t.getTime() - offsetMin * 60_000, subNs: Number(digits.slice(3)), fractionDigits: frac?.length ?? 0, seconds: sec !== undefined };
}

/**
 * The grammar above, or a bare date `YYYY-MM-DD` meaning the start of that day
 * in UTC (as JavaScript reads it too): the CLI's shorthand, e.g. `--since 2025-01-01`.
 */
export function parseInstantOrDate(text: string): Instant | null {
  const m = DATE.exec(text);
  if (!m) return parseInstant(text);
  const year = Number(m[1]);
  const month = Number(m[2]);
  const day = Number(m[3]);
  if (!validDate(year, month, day)) return null;
  const t = new Date(0);
  t.setUTCFullYear(year, month - 1, day);
  return { ms: t.getTime(), subNs: 0, fractionDigits: 0, seconds: false };
}

export function compareInstants(a: Instant, b: Instant): number {
  return a.ms !== b.ms ? a.ms - b.ms : a.subNs - b.subNs;
}

/** Whether the instant lies in years 0001–9999, where Postgres and Date#toISOString agree. */
export function inStorableRange(t: Instant): boolean {
  return t.ms >= MIN_TIME && t.ms <= MAX_TIME;
}
