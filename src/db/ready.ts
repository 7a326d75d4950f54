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
 * `onChecked(up)`: whether the database answered the check's first query;
 * false as soon as a poll has waited READY_TIMEOUT_MS for a check whose
 * first query has no answer yet (the poll's 503), not only once that check
 * ends: under a partition it ends when TCP gives up, and
 * `gateway_database_up` said 1 for seconds while /readyz said 503. Only the
 * newest check that has something to say is heard: an older one ending
 * later does not undo it.
 */
export function createReadiness(database: Database, onChecked?: (up: boolean) => void): Readiness {
  interface Check {
    /** When it started (performance.now()). */
    at: number;
    seq: number;
    /** The database answered its first query. */
    reached: boolean;
    result: Promise<boolean>;
  }
  /** Checks out, oldest first. */
  const checks: Check[] = [];
  let started = 0;
  /** The newest check that reported to onChecked. */
  let heard = 0;

  function report(c: Check, up: boolean) {
    if (c.seq < heard) return;
    heard = c.seq;
    onChecked?.(up);
  }

  async function check(c: Check): Promise<boolean> {
    try {
      const tags =
        database.kind === "postgres"
          ? await database.db.transaction(async (tx) => {
              await tx.execute(sql.raw(`set local statement_timeout = ${READY_TIMEOUT_MS}`));
              await tx.execute(sql`select 1`);
              c.reached = true;
              return rowsOf<{ tag: string }>(await tx.execute(sql`select tag from gateway_migrations`));
            })
          : await (async () => {
              await database.rows(sql`select 1`);
              c.reached = true;
              return database.rows<{ tag: string }>(sql`select tag from gateway_migrations`);
            })();
      return migrationsApplied(tags.map((r) => r.tag));
    } catch {
      return false;
    } finally {
      report(c, c.reached);
    }
  }

  function current(now: number): Check | undefined {
    const newest = checks.at(-1);
    if (newest && now - newest.at < ANSWER_TIMEOUT_MS) return newest;
    if (checks.length >= MAX_CHECKS) return newest;
    const c: Check = { at: now, seq: ++started, reached: false, result: Promise.resolve(false) };
    c.result = check(c);
    checks.push(c);
    void c.result.finally(() => checks.splice(checks.indexOf(c), 1));
    return c;
  }

  return {
    async ready() {
      const c = current(performance.now());
      if (!c) return false;
      return answeredWithin(c.result, READY_TIMEOUT_MS, "readiness check").catch(() => {
        // The check goes on (it may still answer, and then says so); meanwhile the database has not answered.
        if (!c.reached) report(c, false);
        return false;
      });
    },
    out: () => checks.length,
  };
}
