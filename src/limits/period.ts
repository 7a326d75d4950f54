import type { QuotaPeriod } from "../db/schema.ts";

/**
 * The calendar periods a token quota runs over (hour, day, month), in UTC.
 * Not the rate limit's rolling window (src/limits/window.ts).
 */

export type { QuotaPeriod };

/** Start of the UTC period containing `t`. */
export function periodStart(period: QuotaPeriod, t: number): number {
  const d = new Date(t);
  if (period === "hour") return Date.UTC(d.getUTCFullYear(), d.getUTCMonth(), d.getUTCDate(), d.getUTCHours());
  if (period === "day") return Date.UTC(d.getUTCFullYear(), d.getUTCMonth(), d.getUTCDate());
  return Date.UTC(d.getUTCFullYear(), d.getUTCMonth(), 1);
}

/** Start of the next period after the one containing `t`. */
export function periodEnd(period: QuotaPeriod, t: number): number {
  const d = new Date(periodStart(period, t));
  if (period === "hour") return d.getTime() + 3_600_000;
  if (period === "day") return d.getTime() + 86_400_000;
  return Date.UTC(d.getUTCFullYear(), d.getUTCMonth() + 1, 1);
}
