/**
 * The SQLSTATE of a database error, from postgres.js, PGlite (its worker
 * keeps the field) or drizzle's wrapper around either (the code is on its
 * `cause`). Undefined for anything that is not a database's answer (a lost
 * connection, a timeout).
 */
export function sqlState(e: unknown): string | undefined {
  let cur: unknown = e;
  for (let depth = 0; depth < 4 && typeof cur === "object" && cur !== null; depth++) {
    const code = (cur as { code?: unknown }).code;
    if (typeof code === "string" && /^[0-9A-Z]{5}$/.test(code)) return code;
    cur = (cur as { cause?: unknown }).cause;
  }
  return undefined;
}

/**
 * The database refused the data itself (SQLSTATE class 22, data exception,
 * or 23, integrity constraint violation): writing the same row again can
 * never succeed. Anything else (a missing table, a killed connection, a lock
 * timeout, a server shutting down) may pass on a later try.
 */
export function isDataError(e: unknown): boolean {
  const s = sqlState(e);
  return s !== undefined && (s.startsWith("22") || s.startsWith("23"));
}

/**
 * Postgres ended the statement (SQLSTATE 57014, query_canceled): our own
 * statement_timeout (src/db/bounded.ts boundedTx), which fires only after the
 * caller gave up waiting. Retrying such work is pointless: nobody waits for it,
 * and the retry would hold a connection on the same lock for as long again.
 */
export function isServerTimeout(e: unknown): boolean {
  return sqlState(e) === "57014";
}
