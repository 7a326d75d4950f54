import { sql } from "drizzle-orm";
import type { Principal } from "../auth/types.ts";
import type { Database } from "../db/client.ts";
import { type Bound, BoundFull, boundedCall, createBound, maxOutAtOnce } from "../db/bounded.ts";
import { rowsOf } from "../db/raw.ts";
import { pgArray } from "../db/arrays.ts";
import type { Logger } from "../lib/log.ts";
import { isRecord } from "../lib/guards.ts";
import { AppError } from "../lib/errors.ts";
import { type InputItem, isReplayable } from "./request.ts";
import { createSaveQueue } from "./store-queue.ts";
import type { StoredItem } from "./translate.ts";
import { firstSeen } from "../lib/once.ts";

/**
 * Stored responses (table `responses`, migration 0007): conversation content,
 * kept `retentionDays` and then deleted by a background sweep in small
 * batches; a row past its expiry is invisible before the sweep reaches it.
 *
 * Ownership: a personal key's responses belong to its user (any of that
 * user's personal keys reads them); a service key's to its rotation lineage
 * (the key and the keys rotated from it, `Principal.keyRoot`). Anyone else
 * gets "not found", never the content, so ids cannot be probed.
 *
 * Saves are queued and written in batches (store-queue.ts); this module reads
 * (retrieve, replay, item references), deletes and sweeps.
 */

export interface StoredResponse {
  response: Record<string, unknown>;
  inputItems: StoredItem[];
}

/** Conversations longer than this many responses are replayed from their newest part only. */
const MAX_CHAIN = 1_000;
/**
 * A stored row (input items and Response together) larger than this is not
 * read at all: far beyond what one request and its answer hold, so it was
 * written by hand or damaged, and reading it could take the process's memory.
 */
export const MAX_ROW_BYTES = 64 * 1024 * 1024;
/** Rows deleted per statement by the sweep, so it never holds many locks or a long transaction. */
const SWEEP_BATCH = 500;
const SWEEP_EVERY_MS = 10 * 60_000;

/** What `items` found for the ids asked: each id's item, and the ids whose response lies beyond the byte bound. */
export interface ReferencedItems {
  found: Map<string, InputItem>;
  tooLarge: Set<string>;
}

function owner(p: Principal) {
  return p.kind === "personal" ? sql`owner_user_id = ${p.userId} and owner_key_id is null` : sql`owner_key_id = ${p.keyRoot} and owner_user_id is null`;
}

/** A stored JSON column; undefined when it does not parse (a damaged row is never a crash). */
function parse(text: unknown): unknown {
  if (typeof text !== "string") return undefined;
  try {
    return JSON.parse(text);
  } catch {
    return undefined;
  }
}

function parseArray(text: unknown): Record<string, unknown>[] {
  const v = parse(text);
  return Array.isArray(v) ? v.filter(isRecord) : [];
}

export interface StoreOptions {
  retentionDays: number;
  log: Logger;
  /**
   * The most stored text (input items and Response, as JSON) one replay reads:
   * older responses beyond it are left out, so a long chain of large answers
   * costs no more memory than the largest request a client may send.
   */
  maxReplayBytes: number;
  /**
   * The least time between the starts of two writes (0: none). Saves that
   * arrive meanwhile wait and share the next statement (store-queue.ts, writeSpacingFor).
   */
  writeSpacingMs?: number;
  /** Reads out at once, and how long one may wait (default: maxOutAtOnce of the pool, ANSWER_TIMEOUT_MS). */
  readBound?: Bound;
}

export function createResponseStore(database: Database, opts: StoreOptions) {
  const { log } = opts;
  let timer: ReturnType<typeof setInterval> | undefined;
  let sweeping: Promise<number> | undefined;
  const reads = opts.readBound ?? createBound("stored-response read", maxOutAtOnce(database.poolMax), log);
  /** Saves, batched and spaced (store-queue.ts). */
  const saves = createSaveQueue(database, { retentionDays: opts.retentionDays, log, writeSpacingMs: opts.writeSpacingMs });

  /**
   * A read the request needs: input is validated before it runs, so a failure
   * means the database is unreachable or overloaded, a 503 to retry (as the
   * audit log's), never a 500. At most maxOutAtOnce(dbPoolMax) are out at
   * once, each waiting at most ANSWER_TIMEOUT_MS (docs/decisions.md:
   * stored-response reads while the database does not answer).
   */
  async function read<T>(what: string, query: ReturnType<typeof sql>): Promise<T[]> {
    try {
      // Ended by the server after ANSWER_TIMEOUT_MS, as the bound gives up on it then (boundedCall).
      return await reads.run(async (left) => rowsOf<T>(await boundedCall(database, (q) => q.execute(query), left)));
    } catch (e) {
      // Refused at once while earlier reads are unanswered: the bound logged that once.
      if (!(e instanceof BoundFull)) {
        const cause = e instanceof Error && e.cause instanceof Error ? e.cause : e;
        log.error(`reading stored responses failed (${what})`, { err: cause instanceof Error ? cause.message : String(cause) });
      }
      throw new AppError("service_unavailable", "The response store is temporarily unavailable; retry with backoff.");
    }
  }

  const firstReport = firstSeen();
  /** A stored row that cannot be served as it is: logged once per row and problem (docs/decisions.md, Rows read from the database). */
  function unreadable(id: string, problem: string): void {
    if (!firstReport(`${id}|${problem}`)) return;
    log.error("a stored response is unreadable", { response_id: id, problem });
  }

  /** A stored response; for `input_items` its Response need only be a JSON object (its items are what is listed). */
  async function get(p: Principal, id: string, part: "response" | "input_items" = "response"): Promise<StoredResponse | undefined> {
    const rows = await read<{ input_items: string | null; response: string | null; bytes: number | string }>(
      "retrieve",
      sql`
      select case when t.bytes <= ${MAX_ROW_BYTES} then input_items end as input_items,
        case when t.bytes <= ${MAX_ROW_BYTES} then response end as response, t.bytes
      from responses, lateral (select octet_length(input_items)::bigint + octet_length(response)::bigint as bytes) t
      where id = ${id} and org_id = ${p.orgId} and ${owner(p)} and expires_at > now()`,
    );
    const row = rows[0];
    if (!row) return undefined;
    // Nothing to answer with: reported, and to the caller as gone.
    if (row.response === null) {
      unreadable(id, `the row holds ${row.bytes} bytes (at most ${MAX_ROW_BYTES} are read)`);
      return undefined;
    }
    const response = parse(row.response);
    if (!isRecord(response)) {
      unreadable(id, "the Response is not a JSON object");
      return undefined;
    }
    if (part === "response" && (response.id !== id || response.object !== "response")) {
      unreadable(id, "the Response is not this response (its id or object differ)");
      return undefined;
    }
    return { response, inputItems: parseArray(row.input_items).filter((i): i is StoredItem => typeof i.id === "string" && typeof i.type === "string") };
  }

  /** Whether response `id` is this caller's and unexpired, read without its content (cancel answers on that alone). */
  async function owns(p: Principal, id: string): Promise<boolean> {
    const rows = await read<{ one: number }>(
      "cancel",
      sql`
      select 1 as one from responses where id = ${id} and org_id = ${p.orgId} and ${owner(p)} and expires_at > now()`,
    );
    return rows.length > 0;
  }

  async function remove(p: Principal, id: string): Promise<boolean> {
    const rows = await read<{ id: string }>(
      "delete",
      sql`
      delete from responses where id = ${id} and org_id = ${p.orgId} and ${owner(p)} and expires_at > now() returning id`,
    );
    return rows.length > 0;
  }

  /**
   * The conversation up to and including response `id`, oldest first: each
   * response's input items, then its output items. Undefined when `id` is not
   * this caller's (or unknown, deleted, expired). A link that has expired or
   * been deleted ends the walk: the conversation is replayed from after it.
   * Older responses that would take the replay past `maxReplayBytes` are left
   * out too (the newest one is always replayed), counted in the database so
   * that no more than that is ever read.
   */
  async function conversation(p: Principal, id: string): Promise<InputItem[] | undefined> {
    const rows = await read<{ id: string; input_items: string | null; response: string | null }>(
      "previous_response_id",
      sql`
      with recursive chain(id, previous_response_id, input_items, response, depth, total, path) as (
        select id, previous_response_id, input_items, response, 0, octet_length(input_items)::bigint + octet_length(response)::bigint, array[id]
        from responses
        where id = ${id} and org_id = ${p.orgId} and ${owner(p)} and expires_at > now()
        union all
        select r.id, r.previous_response_id, r.input_items, r.response, c.depth + 1,
          c.total + octet_length(r.input_items)::bigint + octet_length(r.response)::bigint, c.path || r.id
        from responses r join chain c on r.id = c.previous_response_id
        where r.org_id = ${p.orgId} and r.expires_at > now() and c.depth < ${MAX_CHAIN - 1} and c.total <= ${opts.maxReplayBytes}
          and r.id <> all(c.path)
      )
      select id, case when total - coalesce(lag(total) over (order by depth), 0) <= ${MAX_ROW_BYTES} then input_items end as input_items,
        case when total - coalesce(lag(total) over (order by depth), 0) <= ${MAX_ROW_BYTES} then response end as response
      from chain where depth = 0 or total <= ${opts.maxReplayBytes} order by depth desc`,
    );
    if (rows.length === 0) return undefined;
    const items: InputItem[] = [];
    for (const row of rows) {
      // A link that was edited to point back into the chain ends it (each response is replayed once); one
      // past MAX_ROW_BYTES (only ever the newest: older ones stop at maxReplayBytes) is left out, as a damaged row.
      if (row.response === null) unreadable(row.id, `the row is larger than ${MAX_ROW_BYTES} bytes: left out of a replay`);
      for (const item of parseArray(row.input_items)) if (isReplayable(item)) items.push(item);
      const response = parse(row.response);
      if (isRecord(response) && Array.isArray(response.output)) for (const item of response.output) if (isReplayable(item)) items.push(item);
    }
    return items;
  }

  /**
   * The output items named by `ids` (in the order the request names them),
   * among this caller's stored, unexpired responses. The responses holding
   * them are read in that order up to `maxReplayBytes` in all, counted in the
   * database (as for a replay); the ids of those beyond are in `tooLarge`. An
   * id not found, or whose stored item is no longer a valid input item, is in
   * neither.
   */
  async function items(p: Principal, ids: readonly string[]): Promise<ReferencedItems> {
    const wanted = pgArray(ids);
    // One probe of the GIN index on output_item_ids per id asked (in order: u.n), then the rows hit: linear
    // in both. The lateral subquery is a fence (offset 0) holding only the probe, so no plan can scan the
    // caller's rows once per id (what an unanalyzed table got without it) or read another index per probe.
    // Each row counts at its first id asked. Migration 0011 keeps the index without a pending list.
    const rows = await read<{ response: string | null; output_item_ids: string }>(
      "item_reference",
      sql`
      select case when total <= ${opts.maxReplayBytes} then response end as response, array_to_string(output_item_ids, ',') as output_item_ids from (
        select r.response, r.output_item_ids, sum(octet_length(r.response)::bigint) over (order by hits.pos, hits.id) as total
        from (
          select hit.id, min(u.n) as pos
          from unnest(${wanted}::text[]) with ordinality as u(v, n)
          cross join lateral (
            select id, org_id, owner_user_id, owner_key_id, expires_at from responses where output_item_ids @> array[u.v] offset 0
          ) hit
          where org_id = ${p.orgId} and ${owner(p)} and expires_at > now()
          group by hit.id
        ) hits
        join responses r on r.id = hits.id
      ) counted`,
    );
    const found = new Map<string, InputItem>();
    const tooLarge = new Set<string>();
    const asked = new Set(ids);
    for (const row of rows) {
      if (row.response === null) {
        for (const id of row.output_item_ids.split(",")) if (asked.has(id)) tooLarge.add(id);
        continue;
      }
      const response = parse(row.response);
      if (!isRecord(response) || !Array.isArray(response.output)) continue;
      for (const item of response.output) {
        if (isRecord(item) && typeof item.id === "string" && asked.has(item.id) && isReplayable(item)) found.set(item.id, item);
      }
    }
    return { found, tooLarge };
  }

  /** Deletes expired rows in batches until none are left; returns how many went. */
  function sweep(): Promise<number> {
    sweeping ??= (async () => {
      let total = 0;
      try {
        for (;;) {
          // Each batch ended by the server after ANSWER_TIMEOUT_MS (a locked table): the next run tries again.
          const gone = rowsOf<{ id: string }>(
            await boundedCall(database, (q) =>
              q.execute(sql`
                delete from responses where id in (
                  select id from responses where expires_at <= now() order by expires_at limit ${SWEEP_BATCH}
                ) returning id`),
            ),
          );
          total += gone.length;
          if (gone.length < SWEEP_BATCH) break;
        }
      } catch (e) {
        log.warn("response retention sweep failed; retried at the next run", { err: e instanceof Error ? e.message : String(e), deleted: total });
      } finally {
        sweeping = undefined;
      }
      if (total > 0) log.info("expired responses deleted", { deleted: total });
      return total;
    })();
    return sweeping;
  }

  return {
    save: saves.save,
    get,
    owns,
    remove,
    conversation,
    items,
    sweep,
    /** Reads given up on that have not settled (each may hold a connection). */
    unansweredReads: () => reads.unanswered(),
    start() {
      void sweep();
      timer = setInterval(() => void sweep(), SWEEP_EVERY_MS);
      timer.unref?.();
    },
    /** Stops the sweep and writes what is still queued (store-queue.ts: waited for at most ANSWER_TIMEOUT_MS). */
    async stop() {
      clearInterval(timer);
      await sweeping;
      await saves.stop();
    },
  };
}

export type ResponseStore = ReturnType<typeof createResponseStore>;
