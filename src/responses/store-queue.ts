import { sql } from "drizzle-orm";
import type { Principal } from "../auth/types.ts";
import { ANSWER_TIMEOUT_MS, type Database } from "../db/client.ts";
import { pgArray } from "../db/arrays.ts";
import { isDataError } from "../db/errors.ts";
import type { Logger } from "../lib/log.ts";
import { isRecord } from "../lib/guards.ts";
import type { StoredItem } from "./translate.ts";
import { resolvesWithin } from "../lib/within.ts";

/**
 * The save queue of stored responses (store.ts): rows waiting to be written,
 * and the flush writing them. Responses that end together (a burst of
 * streams) are written in multi-row INSERTs of up to SAVE_BATCH rows, one
 * flush at a time (spaced by writeSpacingMs), instead of one statement each: a
 * queue of thousands of single inserts held every waiting answer's memory
 * until its own turn (docs/benchmarks.md, phase r). Each save still settles
 * when its own row is committed, so a client that has its answer can use the
 * id at once.
 */

export interface SaveInput {
  id: string;
  principal: Principal;
  previousResponseId: string | null;
  inputItems: StoredItem[];
  /** The whole Response object (src/responses/output.ts). */
  response: object;
}

/** Rows written by one INSERT of the save queue. */
const SAVE_BATCH = 100;

interface NewResponseRow {
  id: string;
  orgId: string;
  ownerUserId: string | null;
  ownerKeyId: string | null;
  previousResponseId: string | null;
  inputItems: string;
  response: string;
  /** The output items' ids, comma-separated (each is [A-Za-z0-9_-]+). */
  outputItemIds: string;
  expiresAt: Date;
}
interface PendingSave {
  row: NewResponseRow;
  resolve(): void;
  reject(e: unknown): void;
}

const ITEM_ID = /^[A-Za-z0-9_-]{1,128}$/;

/** The ids of a Response's output items: what an item_reference may name. */
function outputItemIds(response: object): string[] {
  const output = isRecord(response) ? response.output : undefined;
  if (!Array.isArray(output)) return [];
  const ids: string[] = [];
  for (const item of output) if (isRecord(item) && typeof item.id === "string" && ITEM_ID.test(item.id)) ids.push(item.id);
  return ids;
}

export interface SaveQueueOptions {
  retentionDays: number;
  log: Logger;
  /**
   * The least time between the starts of two writes (0: none). Saves that
   * arrive meanwhile wait and share the next statement. See writeSpacingFor.
   */
  writeSpacingMs?: number;
}

/**
 * The embedded database pays a large fixed cost per statement, in this
 * process (docs/benchmarks.md, phase r run 18), so there writes start at most
 * every 50 ms, each taking every row queued meanwhile: a save under load
 * waits up to 50 ms longer, one after a quiet spell not at all. A Postgres
 * server pays its statements on its own cores: no spacing.
 */
export function writeSpacingFor(kind: Database["kind"]): number {
  return kind === "pglite" ? 50 : 0;
}

export function createSaveQueue(database: Database, opts: SaveQueueOptions) {
  const { log } = opts;
  const spacing = opts.writeSpacingMs ?? 0;
  let queue: PendingSave[] = [];
  let flushing: Promise<void> | undefined;
  /** The rows of the write under way (taken off the queue), for the stop's word on what was not written. */
  let writing: readonly PendingSave[] = [];

  /**
   * Queues a response; settles when its row is committed or refused. Never
   * throws: a row that cannot even be built (its JSON) is a rejection, which
   * the caller's catch logs like any failed write.
   */
  function save(r: SaveInput): Promise<void> {
    let row: NewResponseRow;
    try {
      row = rowOf(r);
    } catch (e) {
      return Promise.reject(e);
    }
    return new Promise<void>((resolve, reject) => {
      queue.push({ row, resolve, reject });
      flushing ??= flush();
    });
  }

  function rowOf(r: SaveInput): NewResponseRow {
    const p = r.principal;
    return {
      id: r.id,
      orgId: p.orgId,
      ownerUserId: p.kind === "personal" ? p.userId : null,
      ownerKeyId: p.kind === "personal" ? null : p.keyRoot,
      previousResponseId: r.previousResponseId,
      inputItems: JSON.stringify(r.inputItems),
      response: JSON.stringify(r.response),
      outputItemIds: outputItemIds(r.response).join(","),
      expiresAt: new Date(Date.now() + opts.retentionDays * 86_400_000),
    };
  }

  /** When the last write started (performance.now()). */
  let lastWriteAt = Number.NEGATIVE_INFINITY;

  /** Until the next write may start: at least one turn of the event loop, so the rows of the same moment share a statement. */
  function nextSlot(): Promise<void> {
    const wait = lastWriteAt + spacing - performance.now();
    return new Promise<void>((resolve) => (wait > 0 ? setTimeout(resolve, wait) : setImmediate(resolve)));
  }

  async function flush(): Promise<void> {
    try {
      while (queue.length > 0) {
        await nextSlot();
        lastWriteAt = performance.now();
        const batch = queue.slice(0, SAVE_BATCH);
        queue = queue.slice(SAVE_BATCH);
        writing = batch;
        await writeBatch(batch);
      }
    } finally {
      writing = [];
      flushing = undefined;
    }
  }

  /**
   * One statement: each column one array parameter, unnested into rows (as
   * the usage writer does). drizzle's insert builder cost ~10 % of the request
   * thread at 660 stored streams a second (a cpu profile); this is a few
   * string joins.
   */
  async function insertRows(rows: NewResponseRow[]): Promise<void> {
    const insert = sql`
      insert into responses (id, org_id, owner_user_id, owner_key_id, previous_response_id, input_items, response, output_item_ids, expires_at)
      select i, o, u, k, p, ii, r, string_to_array(oi, ','), timestamptz 'epoch' + e * interval '1 millisecond' from unnest(
        ${pgArray(rows.map((x) => x.id))}::text[], ${pgArray(rows.map((x) => x.orgId))}::uuid[],
        ${pgArray(rows.map((x) => x.ownerUserId ?? null))}::uuid[], ${pgArray(rows.map((x) => x.ownerKeyId ?? null))}::uuid[],
        ${pgArray(rows.map((x) => x.previousResponseId ?? null))}::text[], ${pgArray(rows.map((x) => x.inputItems))}::text[],
        ${pgArray(rows.map((x) => x.response))}::text[], ${pgArray(rows.map((x) => x.outputItemIds))}::text[],
        ${pgArray(rows.map((x) => x.expiresAt.getTime()))}::float8[])
        as t(i, o, u, k, p, ii, r, oi, e)`;
    // Not ended by the server, unlike the reads: the row of a response whose id the client has (it stops
    // waiting after STORE_WAIT_MS, routes.ts) is written once the table is free, not lost. One flush at a
    // time, so a locked table holds one connection, never the pool (responses-metering, pg-statement-timeout).
    await database.db.execute(insert);
  }

  async function writeBatch(batch: PendingSave[]): Promise<void> {
    try {
      await insertRows(batch.map((b) => b.row));
      for (const b of batch) b.resolve();
    } catch (e) {
      // A row the database refuses must not lose the others: those are written one by one.
      // Any other failure (unreachable, shutting down) fails the whole batch; its callers log it.
      if (batch.length === 1 || !isDataError(e)) {
        for (const b of batch) b.reject(e);
        return;
      }
      for (const b of batch) {
        try {
          await insertRows([b.row]);
          b.resolve();
        } catch (one) {
          b.reject(one);
        }
      }
    }
  }

  return {
    save,
    /**
     * Writes what is still queued, so a clean stop loses no stored response; but waits for that at most
     * ANSWER_TIMEOUT_MS, as the stop's other writes do (docs/decisions.md, Quota: a graceful stop while the
     * database does not answer). The writes are not ended by the server (insertRows): a locked table held the
     * stop for as long as the lock was held, until the service manager killed the process. Past the wait, the
     * responses not written are named in an error line and the stop goes on.
     */
    async stop() {
      const out = flushing;
      if (!out) return;
      if (await resolvesWithin(out, ANSWER_TIMEOUT_MS)) return;
      log.error("stored responses not written at shutdown: the database did not take them in time", {
        waited_ms: ANSWER_TIMEOUT_MS,
        response_ids: [...writing, ...queue].map((b) => b.row.id),
      });
    },
  };
}

export type SaveQueue = ReturnType<typeof createSaveQueue>;
