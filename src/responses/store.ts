import { sql } from "drizzle-orm";
import type { Principal } from "../auth/types.ts";
import type { Database } from "../db/client.ts";
import { responses } from "../db/schema.ts";
import type { Logger } from "../lib/log.ts";
import { isRecord } from "../lib/guards.ts";
import type { StoredItem } from "./translate.ts";

/**
 * Stored responses (table `responses`, migration 0007): conversation content,
 * kept `retentionDays` and then deleted by a background sweep in small
 * batches; a row past its expiry is invisible before the sweep reaches it.
 *
 * Ownership: a personal key's responses belong to its user (any of that
 * user's personal keys reads them); a service key's to its rotation lineage
 * (the key and the keys rotated from it, `Principal.keyRoot`). Anyone else
 * gets "not found", never the content, so ids cannot be probed.
 */

export interface StoredResponse {
  response: Record<string, unknown>;
  inputItems: StoredItem[];
}

export interface SaveInput {
  id: string;
  principal: Principal;
  previousResponseId: string | null;
  inputItems: StoredItem[];
  /** The whole Response object (src/responses/output.ts). */
  response: object;
}

/** Conversations longer than this many responses are replayed from their newest part only. */
const MAX_CHAIN = 1_000;
/** Rows deleted per statement by the sweep, so it never holds many locks or a long transaction. */
const SWEEP_BATCH = 500;
const SWEEP_EVERY_MS = 10 * 60_000;

function owner(p: Principal) {
  return p.kind === "personal" ? sql`owner_user_id = ${p.userId} and owner_key_id is null` : sql`owner_key_id = ${p.keyRoot} and owner_user_id is null`;
}

function parseArray(text: string): Record<string, unknown>[] {
  const v: unknown = JSON.parse(text);
  return Array.isArray(v) ? v.filter(isRecord) : [];
}

export function createResponseStore(database: Database, opts: { retentionDays: number; log: Logger }) {
  const { log } = opts;
  let timer: ReturnType<typeof setInterval> | undefined;
  let sweeping: Promise<number> | undefined;

  async function save(r: SaveInput): Promise<void> {
    const p = r.principal;
    await database.db.insert(responses).values({
      id: r.id,
      orgId: p.orgId,
      ownerUserId: p.kind === "personal" ? p.userId : null,
      ownerKeyId: p.kind === "personal" ? null : p.keyRoot,
      previousResponseId: r.previousResponseId,
      inputItems: JSON.stringify(r.inputItems),
      response: JSON.stringify(r.response),
      expiresAt: new Date(Date.now() + opts.retentionDays * 86_400_000),
    });
  }

  async function get(p: Principal, id: string): Promise<StoredResponse | undefined> {
    const rows = await database.rows<{ input_items: string; response: string }>(sql`
      select input_items, response from responses
      where id = ${id} and org_id = ${p.orgId} and ${owner(p)} and expires_at > now()`);
    const row = rows[0];
    if (!row) return undefined;
    const response: unknown = JSON.parse(row.response);
    return { response: isRecord(response) ? response : {}, inputItems: parseArray(row.input_items) as StoredItem[] };
  }

  async function remove(p: Principal, id: string): Promise<boolean> {
    const rows = await database.rows<{ id: string }>(sql`
      delete from responses where id = ${id} and org_id = ${p.orgId} and ${owner(p)} and expires_at > now() returning id`);
    return rows.length > 0;
  }

  /**
   * The conversation up to and including response `id`, oldest first: each
   * response's input items, then its output items. Undefined when `id` is not
   * this caller's (or unknown, deleted, expired). A link that has expired or
   * been deleted ends the walk: the conversation is replayed from after it.
   */
  async function conversation(p: Principal, id: string): Promise<Record<string, unknown>[] | undefined> {
    const rows = await database.rows<{ input_items: string; response: string }>(sql`
      with recursive chain(id, previous_response_id, input_items, response, depth) as (
        select id, previous_response_id, input_items, response, 0 from responses
        where id = ${id} and org_id = ${p.orgId} and ${owner(p)} and expires_at > now()
        union all
        select r.id, r.previous_response_id, r.input_items, r.response, c.depth + 1
        from responses r join chain c on r.id = c.previous_response_id
        where r.org_id = ${p.orgId} and r.expires_at > now() and c.depth < ${MAX_CHAIN - 1}
      )
      select input_items, response from chain order by depth desc`);
    if (rows.length === 0) return undefined;
    const items: Record<string, unknown>[] = [];
    for (const row of rows) {
      items.push(...parseArray(row.input_items));
      const response: unknown = JSON.parse(row.response);
      if (isRecord(response) && Array.isArray(response.output)) items.push(...response.output.filter(isRecord));
    }
    return items;
  }

  /** Deletes expired rows in batches until none are left; returns how many went. */
  function sweep(): Promise<number> {
    sweeping ??= (async () => {
      let total = 0;
      try {
        for (;;) {
          const gone = await database.rows<{ id: string }>(sql`
            delete from responses where id in (
              select id from responses where expires_at <= now() order by expires_at limit ${SWEEP_BATCH}
            ) returning id`);
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
    save,
    get,
    remove,
    conversation,
    sweep,
    start() {
      void sweep();
      timer = setInterval(() => void sweep(), SWEEP_EVERY_MS);
      timer.unref?.();
    },
    async stop() {
      clearInterval(timer);
      await sweeping;
    },
  };
}

export type ResponseStore = ReturnType<typeof createResponseStore>;
