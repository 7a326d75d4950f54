import { type SQL, sql } from "drizzle-orm";

/**
 * Raw statements for the quota's periodic writes (the usage flush, the lease).
 * They run a few times a second at most, so drizzle's query builder never gets
 * warm there: 0.2-3 ms of the request thread per statement on its first calls
 * against 3-15 µs for a template (bench/hot-path-micro.ts, section 6).
 */

/** The rows of a raw statement's result: an array (postgres.js) or `{ rows }` (PGlite). */
export function rowsOf<T = Record<string, unknown>>(result: unknown): T[] {
  return (Array.isArray(result) ? result : ((result as { rows?: T[] } | null)?.rows ?? [])) as T[];
}

/** A timestamptz from epoch milliseconds, exact (no Date or text on the way). */
export function epochMs(ms: number): SQL {
  return sql`(timestamptz 'epoch' + ${ms}::float8 * interval '1 millisecond')`;
}
