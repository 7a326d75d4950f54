import { sql } from "drizzle-orm";
import { ANSWER_TIMEOUT_MS, type Database, answeredWithin, migrationsApplied } from "./client.ts";
import { rowsOf } from "./raw.ts";

/**
 * How long GET /readyz waits for the database: a load balancer polls it every
 * second or two with a short timeout of its own (AWS target groups 5 s by
 * default, Kubernetes probes 1 s), so a database that does not answer must
 * get a 503 in time, not a timeout that says nothing.
 */
export const READY_TIMEOUT_MS = 2_000;

/** Readiness checks that may be out at once: one, and a second once the first went unanswered for ANSWER_TIMEOUT_MS. */
const MAX_CHECKS = 2;

export interface Readiness {
  /** Database reachable and migrations applied; false (not ready) when the answer takes longer than READY_TIMEOUT_MS. */
  ready(): Promise<boolean>;
  /** Checks out now, each holding (or waiting for) a pool connection. */
  out(): number;
}

/**
 * GET /readyz's check, shared (docs/decisions.md, /readyz is bounded): one
 * check is out at a time and concurrent polls share it, each waiting at most
 * READY_TIMEOUT_MS for it (503 after that; the check goes on, and the next
 * polls share it). On Postgres the check runs with statement_timeout =
 * READY_TIMEOUT_MS, so behind a lock (a migration of another instance, an
 * operator's LOCK) the server ends it and frees its connection. A check that
 * gets no answer at all (a partition, a connection that died without a word)
 * keeps its connection until TCP gives up, so once one has been out for
 * ANSWER_TIMEOUT_MS a second may run, on another connection: one dead
 * connection does not keep /readyz at 503 for as long, and a database that
 * answers nothing holds two connections of the pool for readiness, never
 * more. Before, each poll ran its own queries, each waited up to 5 s (503
 * after 5 to 10 s), and each stayed on its connection while the lock was
 * held: a poll a second took the whole pool in ten seconds.
 * `onChecked(up)`: whether the database answered the check's first query.
 */
export function createReadiness(database: Database, onChecked?: (up: boolean) => void): Readiness {
  /** Checks out, oldest first, with when each started. */
  const checks: { at: number; result: Promise<boolean> }[] = [];

  async function check(): Promise<boolean> {
    let up = false;
    try {
      const tags =
        database.kind === "postgres"
          ? await database.db.transaction(async (tx) => {
              await tx.execute(sql.raw(`set local statement_timeout = ${READY_TIMEOUT_MS}`));
              await tx.execute(sql`select 1`);
              up = true;
              return rowsOf<{ tag: string }>(await tx.execute(sql`select tag from gateway_migrations`));
            })
          : await (async () => {
              await database.rows(sql`select 1`);
              up = true;
              return database.rows<{ tag: string }>(sql`select tag from gateway_migrations`);
            })();
      return migrationsApplied(tags.map((r) => r.tag));
    } catch {
      return false;
    } finally {
      onChecked?.(up);
    }
  }

  function current(now: number): Promise<boolean> | undefined {
    const newest = checks.at(-1);
    if (newest && now - newest.at < ANSWER_TIMEOUT_MS) return newest.result;
    if (checks.length >= MAX_CHECKS) return newest?.result;
    const entry = { at: now, result: check() };
    checks.push(entry);
    void entry.result.finally(() => checks.splice(checks.indexOf(entry), 1));
    return entry.result;
  }

  return {
    async ready() {
      const result = current(performance.now());
      if (!result) return false;
      return answeredWithin(result, READY_TIMEOUT_MS, "readiness check").catch(() => false);
    },
    out: () => checks.length,
  };
}
