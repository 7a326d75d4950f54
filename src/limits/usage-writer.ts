import { eq, sql } from "drizzle-orm";
import { ANSWER_TIMEOUT_MS, type Database, DatabaseTimeout, answeredWithin } from "../db/client.ts";
import { pgArray } from "../db/arrays.ts";
import { epochMs, rowsOf } from "../db/raw.ts";
import { usageBatches, usageDeadLetters } from "../db/schema.ts";
import type { Logger } from "../lib/log.ts";
import { aggregate, columnsAt, eventRecord, type UsageColumns, UsageLog } from "./usage-log.ts";
import { isDataError } from "../db/errors.ts";
import { type Tx, boundedTx } from "../db/bounded.ts";

/**
 * The batched usage writer: every flushMs, one transaction adds the settled
 * usage to the shared counters (usage_counters) and inserts the usage
 * records (usage_events), summed per organisation, key, alias, target, status
 * and streamed-or-not (one row per group and write).
 *
 * - Idempotent: a batch is retried unchanged until it lands, under one id
 *   recorded in usage_batches in the same transaction, so a commit we never
 *   heard back from is not applied twice.
 * - Isolating: a batch that fails twice while the database answers is written
 *   item by item, and only the item that still fails is set aside
 *   (usage_dead_letters, and the log), so one bad record never blocks the rest.
 * - Bounded: per-request records wait in a UsageLog of `maxBuffered`; token
 *   counters are never dropped.
 * - Bounded in time: each statement or transaction of a flush waits at most
 *   ANSWER_TIMEOUT_MS for the database, then the flush fails and its batch
 *   waits for the next one (answered() below).
 *
 * What the counters should change by comes from a CounterSource (the quota's
 * lease accounting, src/limits/quota.ts); the writer tells it what the shared
 * counter holds after each change and when a change has landed.
 */

/** A change of one shared counter: one organisation, one quota period. */
export interface CounterDelta {
  orgId: string;
  /** Start of the quota period, epoch ms (usage_counters.window_start). */
  start: number;
  used: number;
  /** Change of the shared `leased` column: converted to usage, or returned. */
  leased: number;
}

/** The shared counter right after a delta was added to it. */
export interface CounterRow {
  used: number;
  leased: number;
  /** Another instance asked for unused lease recently (usage_counters.wanted_at). */
  wanted: boolean;
}

/** The owner of the counters' pending changes. */
export interface CounterSource {
  /** Moves every pending change into deltas (synchronous: no settle interleaves). `final` on shutdown. */
  cut(final: boolean): CounterDelta[];
  /** What the shared counter holds after `d` was added (inside the write's transaction). */
  observed(d: CounterDelta, row: CounterRow): void;
  /** `d` has reached the shared counter. */
  landed(d: CounterDelta): void;
  /** Tokens settled but not yet cut into a batch. */
  pendingTokens(): number;
  /** Runs before each flush; a failure only delays it. */
  beforeFlush(): Promise<void>;
}

export interface UsageWriterOptions {
  flushMs: number;
  maxBuffered: number;
  /** Usage records (requests) per batch (default 5,000), summed into rows per key, alias, target and status; a larger backlog goes out as several. */
  eventsPerBatch?: number;
  /** How recent a request for lease counts as `wanted`. */
  wantedWithinMs: number;
}

export interface UsageWriter {
  /** Queue one request's usage record (bounded: when full, the oldest record gives way). */
  record(orgId: string, keyId: string, alias: string, target: string, prompt: number, completion: number, status: number, latencyMs: number, streamed: boolean, at: number): void;
  start(): void;
  /** Write pending usage and records now; resolves when written (or re-buffered on failure). */
  flush(): Promise<void>;
  /** Stop the timer and write everything, the source's final changes included. */
  stop(): Promise<void>;
  stats(): { bufferedEvents: number; pendingTokens: number; droppedEvents: number; flushFailures: number; deadLettered: number; unansweredWrites: number };
}

interface Batch {
  id: string;
  deltas: CounterDelta[];
  events: UsageColumns;
  /** Records were already waiting beyond this batch when it was cut (a backlog larger than one batch). */
  more: boolean;
  /** Once the batch failed with the database reachable: written item by item, each with its own id, from `next` on. */
  items?: { ids: string[]; next: number };
}

/**
 * Writes given up on (no answer within ANSWER_TIMEOUT_MS) that may still hold
 * a pool connection, since a query sent cannot be taken back: while this many
 * are outstanding no flush touches the database, so a database that stops
 * answering never has the writer take the whole pool. Two, not one: a single
 * dead connection (a NAT that dropped its flow) then delays the usage by one
 * flush, not until TCP gives up on it. A smaller pool leaves one connection
 * to the request path (maxUnanswered): one with a pool of two, and one with a
 * pool of one too (that write holds the only connection whatever the writer
 * does, but no second one queues behind it ahead of key lookups).
 */
const MAX_UNANSWERED = 2;

/**
 * What a stop gives the final usage write, retries included: two answer
 * times, so one write left unanswered is followed by one on another
 * connection. systemd's TimeoutStopSec (45 s) less the drain (30 s) leaves
 * room for it and the rest of the stop (docs/operations.md).
 */
const STOP_WRITE_MS = 2 * ANSWER_TIMEOUT_MS;

/** How long a stop's probe waits for the database after a write left unanswered, before trying again. */
const STOP_PROBE_MS = 1_000;

/** The bound for a pool of `poolMax` connections: MAX_UNANSWERED, at most poolMax - 1, at least 1. */
export function maxUnanswered(poolMax: number | undefined): number {
  if (poolMax === undefined) return MAX_UNANSWERED;
  return Math.max(1, Math.min(MAX_UNANSWERED, poolMax - 1));
}

export function createUsageWriter(database: Database, log: Logger, source: CounterSource, opts: UsageWriterOptions): UsageWriter {
  const events = new UsageLog(opts.maxBuffered);
  let flushFailures = 0;
  let timer: ReturnType<typeof setInterval> | undefined;
  let flushing: Promise<void> | undefined;
  /** The batch being written; retried as it is until it lands, so its id makes the write idempotent. */
  let batch: Batch | undefined;
  let applied = 0;
  let deadLettered = 0;
  /** The source's final changes (unused lease returned) were cut: a stop that wrote only an older batch has not. */
  let finalCut = false;
  /** Database calls given up on that have not settled yet (each may hold a connection). */
  let unanswered = 0;
  /** The stop is under way: the pool is closed after it, so writes left unanswered no longer hold anything back. */
  let stopping = false;
  const unansweredLimit = maxUnanswered(database.poolMax);

  /**
   * Runs one database call of a flush, waiting at most ANSWER_TIMEOUT_MS for
   * it. A call with no answer by then is given up on (DatabaseTimeout): the
   * flush fails and its batch is retried at the next one under the same id.
   * The call itself runs on (postgres.js cannot take back a query it sent)
   * and may still commit; `live()` is then false, so its late answer tells the
   * source nothing, and whichever of it and the retry inserts the batch id
   * first applies the batch (the id is unique, inserted in the write's own
   * transaction: the other finds it and writes nothing). Until it settles it
   * may hold its pool connection: at most maxUnanswered() are left so.
   */
  async function answered<T>(what: string, call: (live: () => boolean) => Promise<T>, timeoutMs = ANSWER_TIMEOUT_MS): Promise<T> {
    if (unanswered >= unansweredLimit && !stopping) throw new DatabaseTimeout(`${what}: ${unanswered} earlier usage writes are still unanswered`);
    let givenUp = false;
    const running = call(() => !givenUp);
    try {
      return await answeredWithin(running, timeoutMs, what);
    } catch (e) {
      if (e instanceof DatabaseTimeout && !givenUp) {
        givenUp = true;
        unanswered++;
        const settled = () => {
          unanswered--;
        };
        running.then(settled, settled);
      }
      throw e;
    }
  }

  /** Move everything pending into a new batch (synchronous: no settle interleaves). */
  function cut(final: boolean): Batch | undefined {
    const deltas = source.cut(final);
    if (final) finalCut = true;
    // A batch carries at most eventsPerBatch usage records; larger backlogs go out as several batches.
    const taken = events.take(opts.eventsPerBatch ?? 5_000);
    if (deltas.length === 0 && taken.length === 0) return undefined;
    // One row per organisation, key, alias, target, status and streamed-or-not (aggregate()).
    return { id: crypto.randomUUID(), deltas, events: aggregate(taken), more: events.length > 0 };
  }

  /**
   * Adds one delta to the shared counter and tells the source what the counter has left.
   *
   * A template, not drizzle's query builder (src/db/raw.ts): one statement
   * per organisation with usage in every flush.
   */
  async function applyDelta(tx: Tx, d: CounterDelta, live: () => boolean): Promise<void> {
    const [row] = rowsOf<{ used: unknown; leased: unknown; wanted: unknown }>(
      await tx.execute(sql`
        insert into usage_counters (org_id, window_start, used, leased)
        values (${d.orgId}, ${epochMs(d.start)}, ${d.used}, 0)
        on conflict (org_id, window_start) do update
          set used = usage_counters.used + excluded.used, leased = greatest(0, usage_counters.leased + ${d.leased})
        returning used, leased, coalesce(wanted_at > now() - make_interval(secs => ${opts.wantedWithinMs / 1000}), false) as wanted`),
    );
    // bigint columns arrive as numbers (PGlite) or strings (postgres.js).
    if (row && live()) source.observed(d, { used: Number(row.used), leased: Number(row.leased), wanted: row.wanted === true });
  }

  /**
   * Runs `write` in a transaction unless `id` was applied before (an earlier
   * attempt committed although we never heard back, or an attempt given up on
   * commits while this one runs: the id's row is inserted first, so one waits
   * for the other's and then writes nothing). Within ANSWER_TIMEOUT_MS.
   */
  function once(what: string, id: string, write: (tx: Tx, live: () => boolean) => Promise<void>): Promise<void> {
    // Postgres ends each statement that runs as long as we wait for its answer (blocked on a lock, say): boundedTx.
    return answered(what, (live) =>
      boundedTx(database, async (tx) => {
        const fresh = rowsOf(await tx.execute(sql`insert into usage_batches (id) values (${id}) on conflict do nothing returning id`));
        if (fresh.length > 0) await write(tx, live);
      }),
    );
  }

  async function apply(b: Batch): Promise<void> {
    await once("usage write", b.id, async (tx, live) => {
      for (const d of b.deltas) await applyDelta(tx, d, live);
      if (b.events.length > 0) await insertEvents(tx, b.events);
    });
    for (const d of b.deltas) source.landed(d);
    // Batch ids only guard retries of the last few seconds; keep a day of them.
    if (++applied % 1000 === 1) {
      await answered("usage batch cleanup", () => database.db.execute(sql`delete from usage_batches where created_at < now() - interval '1 day'`)).catch(() => {});
    }
  }

  /** Whether the database takes transactions now (the path every write uses), so a failed write was the data's fault. */
  async function reachable(timeoutMs = ANSWER_TIMEOUT_MS): Promise<boolean> {
    try {
      await answered(
        "usage write check",
        () =>
          boundedTx(database, async (tx) => {
            await tx.execute(sql`select 1`);
          }),
        timeoutMs,
      );
      return true;
    } catch {
      return false;
    }
  }

  async function batchLanded(id: string): Promise<boolean> {
    const rows = await answered("usage batch check", () => database.db.select({ id: usageBatches.id }).from(usageBatches).where(eq(usageBatches.id, id)));
    return rows.length > 0;
  }

  /**
   * A batch that failed twice with a data error (SQLSTATE class 22 or 23)
   * while the database answers holds something that cannot be written (a
   * value out of range, a broken constraint): write
   * it item by item — each counter delta, then each usage record, in its own
   * idempotent transaction — and set aside only the item that fails, so one
   * bad record never blocks the rest. If the database stops answering midway,
   * the batch keeps its position and the next flush continues from there.
   */
  async function applyIsolated(b: Batch, cause: Error): Promise<void> {
    if (!b.items) {
      // The failed attempts may have committed all the same (an ambiguous commit).
      if (await batchLanded(b.id)) {
        for (const d of b.deltas) source.landed(d);
        return;
      }
      log.warn("usage batch failed with the database reachable; writing it record by record", { err: cause.message, deltas: b.deltas.length, events: b.events.length });
      b.items = { ids: Array.from({ length: b.deltas.length + b.events.length }, () => crypto.randomUUID()), next: 0 };
    }
    const items = b.items;
    for (; items.next < items.ids.length; items.next++) {
      const i = items.next;
      const id = items.ids[i] as string;
      const delta = i < b.deltas.length ? b.deltas[i] : undefined;
      try {
        if (delta) await once("usage write", id, (tx, live) => applyDelta(tx, delta, live));
        else await once("usage write", id, (tx) => insertEvents(tx, columnsAt(b.events, i - b.deltas.length)));
      } catch (e) {
        // Only the data's own fault sets a record aside; anything else keeps the batch for the next flush.
        if (!isDataError(e) || !(await reachable())) throw e;
        const record = delta ? { kind: "counter", org_id: delta.orgId, window_start: new Date(delta.start).toISOString(), used: delta.used, leased: delta.leased } : eventRecord(b.events, i - b.deltas.length);
        await deadLetter(record, e as Error);
      }
      if (delta) source.landed(delta);
    }
  }

  /** Sets one unwritable item aside: in usage_dead_letters, and always in the log with the full record. */
  async function deadLetter(record: Record<string, unknown>, err: Error): Promise<void> {
    deadLettered++;
    log.error("usage record could not be written; set aside", { err: err.message, record });
    try {
      await answered("usage dead letter", () => database.db.insert(usageDeadLetters).values({ record: JSON.stringify(record), error: err.message }));
    } catch (e) {
      log.error("usage dead letter could not be stored; the log line above is its only copy", { err: (e as Error).message });
    }
  }

  /** One statement per batch: each column is one array parameter, unnested into rows. */
  async function insertEvents(tx: Pick<Database["db"], "execute">, c: UsageColumns): Promise<void> {
    // Times travel as epoch milliseconds (exact), turned into timestamptz by the database.
    await tx.execute(sql`
      insert into usage_events (requests, org_id, key_id, alias, target, prompt_tokens, completion_tokens, status, latency_ms, streamed, created_at)
      select r, o, k, a, t, p, c, s, l, st, timestamptz 'epoch' + ms * interval '1 millisecond' from unnest(
        ${pgArray(c.requests)}::int[],
        ${pgArray(c.orgId)}::uuid[], ${pgArray(c.keyId)}::uuid[], ${pgArray(c.alias)}::text[], ${pgArray(c.target)}::text[],
        ${pgArray(c.promptTokens)}::int[], ${pgArray(c.completionTokens)}::int[], ${pgArray(c.status)}::int[],
        ${pgArray(c.latencyMs)}::int[], ${pgArray(Array.from(c.streamed, (x) => x === 1))}::bool[], ${pgArray(c.createdAt)}::float8[])
        as u(r, o, k, a, t, p, c, s, l, st, ms)`);
  }

  /**
   * What of a batch is not written yet: all of it, or, once it is written
   * item by item, the items from `next` on (those before it landed or were
   * set aside, and must not be reported as unwritten a second time).
   */
  function unwrittenDeltas(b: Batch | undefined): CounterDelta[] {
    if (!b) return [];
    return b.items ? b.deltas.slice(b.items.next) : b.deltas;
  }
  function unwrittenRequests(b: Batch | undefined): number {
    if (!b) return 0;
    const from = b.items ? Math.max(0, b.items.next - b.deltas.length) : 0;
    return b.events.requests.subarray(from).reduce((a, r) => a + r, 0);
  }

  function bufferedTokens(): number {
    let n = source.pendingTokens();
    for (const d of unwrittenDeltas(batch)) n += d.used;
    return n;
  }

  /** One transaction for the batch; a batch that fails twice while the database answers is written item by item. */
  async function write(b: Batch): Promise<void> {
    if (b.items) return applyIsolated(b, new Error("continuing"));
    try {
      await apply(b);
    } catch (first) {
      // No answer at all: asking whether the database answers would only wait as long again.
      if (first instanceof DatabaseTimeout || !(await reachable())) throw first;
      try {
        await apply(b);
      } catch (second) {
        if (!isDataError(second) || !(await reachable())) throw second;
        await applyIsolated(b, second as Error);
      }
    }
  }

  async function flushOnce(final: boolean): Promise<void> {
    try {
      // Best effort: a failure here only delays handing lease over, never the usage write; but a database
      // that did not answer it would not answer the write either.
      await answered("lease request check", () => source.beforeFlush()).catch((e: Error) => {
        if (e instanceof DatabaseTimeout) throw e;
        log.debug("lease request check failed", { err: e.message });
      });
      for (;;) {
        // A batch that failed before is written first, unchanged; new usage waits for the next one.
        batch ??= cut(final);
        if (!batch) return;
        await write(batch);
        const more = batch.more;
        batch = undefined;
        // Only a backlog that was already there continues at once; what
        // requests settled during the write waits for the next interval, or a
        // busy instance would write back to back instead of once per flushMs.
        if (!more) return;
        // Let requests run between batches of a backlog.
        await new Promise((r) => setImmediate(r));
      }
    } catch (e) {
      flushFailures++;
      // Nothing is lost: the batch stays buffered and the next flush retries it.
      log.warn("usage flush failed; buffered for retry", {
        err: (e as Error).message,
        buffered_events: events.length + unwrittenRequests(batch),
        pending_tokens: bufferedTokens(),
      });
      throw e;
    }
  }

  /**
   * Shutdown gave up on a database that would not take the last writes: the
   * process is about to exit with usage only it knows. One error line with
   * each organisation's tokens per quota period is then their only copy, so
   * an operator can still bill them (the per-request records are counted).
   * `unansweredBatch`: the batch whose write was still unanswered, which the
   * operator checks against usage_batches before billing it.
   */
  function reportUnwritten(unansweredBatch: string | undefined): void {
    const used = new Map<string, { org_id: string; window_start: string; used: number }>();
    for (const d of [...unwrittenDeltas(batch), ...source.cut(true)]) {
      if (d.used <= 0) continue;
      const k = `${d.orgId}|${d.start}`;
      const c = used.get(k) ?? { org_id: d.orgId, window_start: new Date(d.start).toISOString(), used: 0 };
      c.used += d.used;
      used.set(k, c);
    }
    const requests = unwrittenRequests(batch) + events.length;
    // A batch whose write got no answer may have committed all the same (only the answer lost): it did if
    // usage_batches holds its id, and then its part of this line is already counted.
    log.error("usage not written at shutdown: the database did not take it; this line is its only copy", {
      counters: [...used.values()],
      requests,
      ...(unansweredBatch ? { unanswered_batch: unansweredBatch } : {}),
    });
  }

  /** The flush a caller who asks now will have its own records written by (queued behind a running one). */
  let queued: Promise<void> | undefined;

  /**
   * One flush at a time. A caller's flush covers everything settled before
   * the call: while a flush is under way (its batch was cut before some of
   * those records), one more follows it, shared by every caller who asked
   * in the meantime.
   */
  function flush(final = false): Promise<void> {
    if (!flushing) {
      flushing = flushOnce(final).finally(() => {
        flushing = undefined;
      });
      return flushing;
    }
    queued ??= flushing
      .catch(() => {})
      .then(() => {
        queued = undefined;
        return flush(final);
      });
    return queued;
  }

  return {
    record(orgId, keyId, alias, target, prompt, completion, status, latencyMs, streamed, at) {
      events.push(orgId, keyId, alias, target, prompt, completion, status, latencyMs, streamed, at);
    },
    start() {
      timer = setInterval(() => {
        // The timer skips a tick while a write is under way (it is not waiting for anything in particular).
        if (!flushing) void flush(false).catch(() => {});
      }, opts.flushMs);
      timer.unref?.();
    },
    flush: () => flush(false),
    async stop() {
      if (timer) clearInterval(timer);
      stopping = true;
      // A write the database never answers (a partition, a paused host) would hold the stop until the
      // service manager kills the process, and the usage would be lost without the line below; so every
      // wait here is bounded, and the whole stop by STOP_WRITE_MS. Within that time a write left
      // unanswered is tried again under its batch id (idempotent), on another connection: one stranded
      // connection (postgres.js reconnecting after the server ended its session can wait for its
      // connect_timeout) must not cost the usage while the database answers on the others. A database
      // that does not answer a probe within STOP_PROBE_MS gets no such try: the stop's other steps need
      // their time too.
      const deadline = Date.now() + STOP_WRITE_MS;
      let unanswered = false;
      const bounded = (p: Promise<void>) =>
        answeredWithin(p, Math.max(1, Math.min(ANSWER_TIMEOUT_MS, deadline - Date.now())), "usage write").then(
          () => {
            unanswered = false;
          },
          (e: Error) => {
            if (e instanceof DatabaseTimeout) unanswered = true;
            throw e;
          },
        );
      if (flushing) await bounded(flushing).catch(() => {});
      // Write everything and return unused leases; retry while time is left, since a
      // shutdown during a database blip should still land the usage.
      for (let attempt = 0; Date.now() < deadline; attempt++) {
        if (unanswered && !(await reachable(Math.max(1, Math.min(STOP_PROBE_MS, deadline - Date.now()))))) break;
        try {
          await bounded(flush(true));
          // A batch kept from a failed write goes first, unchanged: the final cut (lease returned) comes after it.
          if (finalCut && !batch && bufferedTokens() === 0 && events.length === 0) break;
        } catch {
          await Bun.sleep(Math.max(0, Math.min(200 * (attempt + 1), deadline - Date.now())));
        }
      }
      if (batch || bufferedTokens() > 0 || events.length > 0) reportUnwritten(unanswered ? batch?.id : undefined);
    },
    stats() {
      return {
        bufferedEvents: events.length + unwrittenRequests(batch),
        pendingTokens: bufferedTokens(),
        droppedEvents: events.dropped,
        flushFailures,
        deadLettered,
        unansweredWrites: unanswered,
      };
    },
  };
}
