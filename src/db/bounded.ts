import { sql } from "drizzle-orm";
import { ANSWER_TIMEOUT_MS, type Database, DatabaseTimeout, type Db } from "./client.ts";
import type { Logger } from "../lib/log.ts";

/**
 * Database work of one kind that may be out at once (each holding, or queued
 * for, a pool connection): a quarter of the pool, at least one. Work given up
 * on (no answer within ANSWER_TIMEOUT_MS) cannot be taken back and keeps its
 * connection until the database answers it, so without a bound each kind
 * (quota leases, budget_exceeded audit writes, audit-log reads, stored-response
 * reads) could take every connection while a table it needs is locked or
 * the server hangs: key lookups (half the pool, maxKeyLookups), the usage
 * writer (at most three) and /readyz then got none. A quarter of the
 * default ten is two; a healthy database answers each in a few milliseconds.
 * The embedded database (no pool) is not bounded.
 */
export function maxOutAtOnce(poolMax: number | undefined): number {
  if (poolMax === undefined) return Number.POSITIVE_INFINITY;
  return Math.max(1, Math.floor(poolMax / 4));
}

/** Refused at once: as many earlier calls of the kind are given up on and still unanswered as may be out. */
export class BoundFull extends DatabaseTimeout {}

export interface Bound {
  /**
   * Runs `call` when fewer than the limit are out, waiting for a turn
   * otherwise; the wait and the call together get `timeoutMs`, then the
   * caller gets a DatabaseTimeout. A call given up on stays out (it may hold
   * its connection) until it settles; `givenUp` is told of it. While the
   * limit's worth are out so, a new call is refused at once (BoundFull).
   * `call` gets the time left of `timeoutMs` when its turn comes, for the
   * server to end its work then (boundedTx): a call that waited for its turn
   * is given up on that much sooner.
   */
  run<T>(call: (leftMs: number) => Promise<T>, givenUp?: (running: Promise<T>) => void): Promise<T>;
  /** Calls given up on that have not settled. */
  unanswered(): number;
}

export function createBound(what: string, limit: number, log?: Logger, timeoutMs = ANSWER_TIMEOUT_MS): Bound {
  let out = 0;
  let unanswered = 0;
  const queue: (() => void)[] = [];
  /** The refusals of this episode (the limit reached) were logged. */
  let logged = false;

  return {
    run<T>(call: (leftMs: number) => Promise<T>, givenUp?: (running: Promise<T>) => void): Promise<T> {
      if (unanswered >= limit) {
        if (!logged) {
          logged = true;
          log?.warn(`${what}: refused at once while earlier ones are unanswered`, { unanswered, limit });
        }
        return Promise.reject(new BoundFull(`${what}: ${unanswered} earlier ones are still unanswered by the database`));
      }
      return new Promise<T>((resolve, reject) => {
        let running: Promise<T> | undefined;
        let over = false;
        let abandoned = false;
        const queuedAt = performance.now();
        const start = () => {
          out++;
          let q: Promise<T>;
          try {
            q = call(Math.max(1, timeoutMs - (performance.now() - queuedAt)));
          } catch (e) {
            q = Promise.reject(e);
          }
          running = q;
          const settled = () => {
            out--;
            if (abandoned) {
              unanswered--;
              if (unanswered < limit) logged = false;
            }
            queue.shift()?.();
          };
          q.then(settled, settled);
          q.then(
            (v) => {
              if (over) return;
              over = true;
              clearTimeout(timer);
              resolve(v);
            },
            (e: unknown) => {
              if (over) return;
              over = true;
              clearTimeout(timer);
              reject(e);
            },
          );
        };
        const timer = setTimeout(() => {
          if (over) return;
          over = true;
          if (running) {
            abandoned = true;
            unanswered++;
            givenUp?.(running);
          } else {
            const at = queue.indexOf(start);
            if (at >= 0) queue.splice(at, 1);
          }
          reject(new DatabaseTimeout(`${what}: no answer from the database within ${timeoutMs} ms`));
        }, timeoutMs);
        if (out < limit) start();
        else queue.push(start);
      });
    },
    unanswered: () => unanswered,
  };
}

/** A transaction on either driver (what `Db.transaction` hands its callback). */
export type Tx = Parameters<Parameters<Db["transaction"]>[0]>[0];

/**
 * Postgres ends a statement of ours that runs as long as we wait for its
 * answer: blocked on a lock another session holds, or on an overloaded
 * server. Set per transaction (`SET LOCAL`), never as a startup parameter,
 * which PgBouncer in transaction mode refuses.
 */
const STATEMENT_TIMEOUT = sql.raw(`set local statement_timeout = ${ANSWER_TIMEOUT_MS}`);
/** `set local statement_timeout` for `ms` (a whole number of milliseconds, at least 1). */
function statementTimeout(ms: number) {
  const n = Math.max(1, Math.ceil(ms));
  return n === ANSWER_TIMEOUT_MS ? STATEMENT_TIMEOUT : sql.raw(`set local statement_timeout = ${n}`);
}

/**
 * Runs `fn` in a transaction each of whose statements Postgres ends after
 * `timeoutMs` (ANSWER_TIMEOUT_MS, or what a bound's wait for a turn left of
 * it: Bound.run) (SQLSTATE 57014, isServerTimeout). The caller gives up
 * on the work after the same time, counted from before the transaction began,
 * so the server ends a statement only after the caller stopped waiting for
 * it: without this, work given up on kept its pool connection for as long as
 * the lock it waited on was held, and given-up key lookups, leases, reads and
 * audit writes between them could hold every connection for good. A lock
 * wait is a statement's wait, so no lock_timeout is set: a shorter one would
 * fail work the caller still waits for. The cost is one round trip (the SET)
 * per transaction. On the embedded database (its own worker thread, no other
 * sessions, no pool) a plain transaction.
 */
export function boundedTx<T>(database: Database, fn: (tx: Tx) => Promise<T>, timeoutMs = ANSWER_TIMEOUT_MS): Promise<T> {
  return database.db.transaction(async (tx) => {
    if (database.kind === "postgres") await tx.execute(statementTimeout(timeoutMs));
    return fn(tx);
  });
}

/**
 * Work that needs no transaction of its own (a read, one write), bounded on
 * the server as boundedTx: on Postgres inside one (BEGIN, SET LOCAL, the
 * work, COMMIT: three round trips more than the statement alone, paid only
 * on the request path's database calls, never by a request whose key is
 * cached and needs no lease); on the embedded database a plain call, which
 * adds nothing to its per-statement cost.
 */
export function boundedCall<T>(database: Database, fn: (q: Db) => Promise<T>, timeoutMs = ANSWER_TIMEOUT_MS): Promise<T> {
  if (database.kind !== "postgres") return fn(database.db);
  return boundedTx(database, (tx) => fn(tx), timeoutMs);
}
