import { type SQL, and, eq, gte, lte, sql } from "drizzle-orm";
import type { Database, Db } from "../db/client.ts";
import { type AuditTarget, auditEvents } from "../db/schema.ts";
import { AppError } from "../http/errors.ts";
import { isUuid } from "../lib/ids.ts";
import type { Logger } from "../lib/log.ts";
import { type CursorPosition, decodeCursor, encodeCursor } from "./cursor.ts";
import { CATEGORIES, type Category } from "./record.ts";

/**
 * Reading the audit log (spec 4.5): parameter validation, the keyset query and
 * the cursor that binds a position to one organisation and one filter set.
 */

export interface AuditFilter {
  from?: Date;
  to?: Date;
  actorId?: string;
  category?: Category;
  action?: string;
  q?: string;
}

export interface AuditQuery {
  filter: AuditFilter;
  cursor: string | null;
  limit: number;
}

/** Spec 2.6, exactly these fields. */
export interface AuditEventView {
  id: string;
  created_at: string;
  action: string;
  category: string;
  actor: { type: string; id: string; name: string; email: string; key_id: string | null };
  targets: AuditTarget[];
  details: Record<string, unknown>;
  origin: { ip_prefix: string; user_agent_summary: string };
}

export interface AuditPage {
  data: AuditEventView[];
  /** `""` on the last page (README "Decisions"). */
  next_cursor: string;
}

export const DEFAULT_LIMIT = 50;
export const MAX_LIMIT = 200;
export const MAX_Q_CHARS = 200;

const PARAMS = new Set(["from", "to", "actor_id", "category", "action", "q", "cursor", "limit"]);
/** Same shape as `gateway audit import` accepts, so every stored action can be asked for. */
const ACTION = /^[a-z][a-z0-9_]*\.[a-z][a-z0-9_.]*$/;
const MAX_ACTION_CHARS = 200;
// Rejected in q: NUL cannot be sent as Postgres text, and the others never occur in names.
const CONTROL = /[\u0000-\u001f\u007f]/;
/**
 * ISO 8601 date and time with a zone: seconds and fraction optional, `Z` or an
 * offset (`+02:00`, `+0200`, `+02`). A zone is required: a bare local time
 * would depend on the server's clock settings.
 */
const ISO = /^(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2})(?::(\d{2})(?:[.,](\d{1,9}))?)?(?:([Zz])|([+-])(\d{2})(?::?(\d{2}))?)$/;
/** Bounds of what Date#toISOString and Postgres both read back as four-digit years. */
const MIN_TIME = new Date("0001-01-01T00:00:00.000Z").getTime();
const MAX_TIME = new Date("9999-12-31T23:59:59.999Z").getTime();

function invalid(param: string | null, message: string): AppError {
  return new AppError("invalid_body", message, param);
}

/** An instant with the sub-millisecond remainder kept, so `from`/`to` round the right way. */
interface Instant {
  ms: number;
  /** Nanoseconds beyond `ms`, 0–999,999. */
  subNs: number;
}

function daysIn(year: number, month: number): number {
  const d = new Date(0);
  d.setUTCFullYear(year, month, 0);
  return d.getUTCDate();
}

export function parseInstant(s: string): Instant | null {
  const m = ISO.exec(s);
  if (!m) return null;
  const [, y, mo, d, h, mi, sec, frac, z, sign, oh, om] = m;
  const year = Number(y);
  const month = Number(mo);
  const day = Number(d);
  const hour = Number(h);
  const minute = Number(mi);
  const second = Number(sec ?? "0");
  if (month < 1 || month > 12 || day < 1 || day > daysIn(year, month)) return null;
  if (hour > 23 || minute > 59 || second > 59) return null;
  let offsetMin = 0;
  if (!z) {
    const offH = Number(oh);
    const offM = Number(om ?? "0");
    if (offH > 23 || offM > 59) return null;
    offsetMin = (sign === "-" ? -1 : 1) * (offH * 60 + offM);
  }
  const digits = (frac ?? "").padEnd(9, "0");
  const fracMs = Number(digits.slice(0, 3));
  const subNs = Number(digits.slice(3));
  const t = new Date(0);
  t.setUTCFullYear(year, month - 1, day);
  t.setUTCHours(hour, minute, second, fracMs);
  return { ms: t.getTime() - offsetMin * 60_000, subNs };
}

function compareInstants(a: Instant, b: Instant): number {
  return a.ms !== b.ms ? a.ms - b.ms : a.subNs - b.subNs;
}

/** `+02:00` sent unencoded in a query string arrives as ` 02:00`; a space can mean nothing else there. */
const SPACE_OFFSET = /(\d) (\d{2}(?::?\d{2})?)$/;

function parseTime(param: "from" | "to", value: string): Instant {
  const t = parseInstant(value.replace(SPACE_OFFSET, "$1+$2"));
  if (!t) {
    throw invalid(param, `${param} must be an ISO 8601 date and time with a zone, e.g. 2025-01-31T09:00:00Z or 2025-01-31T10:00:00.250+01:00.`);
  }
  return t;
}

/**
 * Validate the query string by hand: TypeBox on Elysia's parsed `query` would
 * merge repeated parameters and could not name the offending one. Every
 * parameter may appear once; an empty value is invalid (omit it instead).
 */
export function parseAuditQuery(search: string): AuditQuery {
  const seen = new Map<string, string>();
  for (const [name, value] of new URLSearchParams(search)) {
    if (!PARAMS.has(name)) {
      const shown = name.slice(0, 64);
      throw invalid(shown, `Unknown parameter ${JSON.stringify(shown)}; allowed: ${[...PARAMS].join(", ")}.`);
    }
    if (seen.has(name)) throw invalid(name, `Parameter ${name} is given more than once.`);
    if (value === "") throw invalid(name, `Parameter ${name} is empty; omit it instead.`);
    seen.set(name, value);
  }

  const filter: AuditFilter = {};
  const fromRaw = seen.get("from");
  const toRaw = seen.get("to");
  const from = fromRaw === undefined ? undefined : parseTime("from", fromRaw);
  const to = toRaw === undefined ? undefined : parseTime("to", toRaw);
  if (from && to && compareInstants(from, to) > 0) throw invalid("from", "from must not be after to.");
  // Rows are stored to the millisecond: an inclusive lower bound rounds up, an
  // inclusive upper bound rounds down. Clamping to years 0001–9999 changes no
  // result (no row lies outside) and keeps the values printable for Postgres.
  if (from) filter.from = new Date(Math.min(Math.max(from.ms + (from.subNs > 0 ? 1 : 0), MIN_TIME), MAX_TIME));
  if (to) filter.to = new Date(Math.max(Math.min(to.ms, MAX_TIME), MIN_TIME));

  const actorId = seen.get("actor_id");
  if (actorId !== undefined) {
    if (!isUuid(actorId)) throw invalid("actor_id", "actor_id must be a UUID.");
    filter.actorId = actorId.toLowerCase();
  }
  const category = seen.get("category");
  if (category !== undefined) {
    if (!(CATEGORIES as readonly string[]).includes(category)) throw invalid("category", `category must be one of: ${CATEGORIES.join(", ")}.`);
    filter.category = category as Category;
  }
  const action = seen.get("action");
  if (action !== undefined) {
    if (action.length > MAX_ACTION_CHARS || !ACTION.test(action)) {
      throw invalid("action", "action must be a dotted action name such as api_key.revoked.");
    }
    filter.action = action;
  }
  const q = seen.get("q");
  if (q !== undefined) {
    if ([...q].length > MAX_Q_CHARS) throw invalid("q", `q must be at most ${MAX_Q_CHARS} characters.`);
    if (CONTROL.test(q)) throw invalid("q", "q must not contain control characters.");
    filter.q = q;
  }

  let limit = DEFAULT_LIMIT;
  const limitRaw = seen.get("limit");
  if (limitRaw !== undefined) {
    limit = /^\d{1,3}$/.test(limitRaw) ? Number(limitRaw) : 0;
    if (limit < 1 || limit > MAX_LIMIT) throw invalid("limit", `limit must be a whole number from 1 to ${MAX_LIMIT}.`);
  }
  return { filter, cursor: seen.get("cursor") ?? null, limit };
}

/**
 * What a cursor is bound to: the organisation and every filter, in canonical
 * form (parsed times, lower-case uuid), so `+01:00` and `Z` spellings of one
 * instant share cursors but any other change of filter does not. `limit` is
 * not bound: a client may change its page size between pages.
 */
export function cursorBinding(orgId: string, f: AuditFilter): string {
  return JSON.stringify([
    "audit-events",
    orgId,
    f.from?.toISOString() ?? null,
    f.to?.toISOString() ?? null,
    f.actorId ?? null,
    f.category ?? null,
    f.action ?? null,
    f.q ?? null,
  ]);
}

/** `%`, `_` and the escape character itself match literally. */
export function likePattern(q: string): string {
  return `%${q.replace(/[\\%_]/g, (c) => `\\${c}`)}%`;
}

type Row = typeof auditEvents.$inferSelect;

function view(r: Row): AuditEventView {
  return {
    id: r.id,
    created_at: r.createdAt.toISOString(),
    action: r.action,
    category: r.category,
    actor: { type: r.actorType, id: r.actorId, name: r.actorName, email: r.actorEmail, key_id: r.actorKeyId },
    targets: r.targets.map((t) => ({ key: t.key, kind: t.kind, id: t.id, name: t.name, email: t.email })),
    details: r.details,
    origin: { ip_prefix: r.originIpPrefix, user_agent_summary: r.originUserAgentSummary },
  };
}

/**
 * How many of the newest rows (per row requested) the `q` fast path reads in
 * index order before it gives up and asks the trigram index instead. At 40 a
 * term must be in at least 1 of 40 rows (2.5%) to be served by the fast path;
 * rarer terms leave at most 2.5% of the organisation's rows to the bitmap path.
 */
const Q_SCAN_FACTOR = 40;

/**
 * One page, newest first, ties broken by id. The keyset condition compares the
 * row value `(created_at, id)` in the same order as the indexes
 * `(org_id[, category | actor_id | action], created_at desc, id desc)`, so a
 * page deep in the log is an index range scan like the first (no OFFSET).
 * Fetches `limit + 1` rows: the extra one only says whether a next page exists,
 * so a full last page is never followed by an empty one.
 *
 * `q` has two plans, because the planner cannot know how common a term is in
 * one organisation (its LIKE estimate is global) and picks badly either way:
 * - a term in many of the org's rows is found fastest by walking the
 *   `(org_id, created_at desc, id desc)` index and filtering: 51 hits turn up
 *   within a few hundred rows, whereas collecting every hit through the
 *   trigram index and sorting them costs hundreds of ms at 60k hits;
 * - a rare or absent term makes that walk read the whole organisation (1.2 s
 *   at 200k rows), whereas the trigram index finds the few hits directly.
 * So: walk at most Q_SCAN_FACTOR × (limit + 1) rows in index order; if that
 * fills the page it is the exact answer (rows were read in order), otherwise
 * ask again through the trigram index. The second plan is forced by ordering
 * on `created_at + 0 ms`, which no btree can provide, so the planner takes the
 * bitmap path and sorts the (few) hits; the order is the same.
 */
export async function listAuditEvents(
  db: Db,
  orgId: string,
  filter: AuditFilter,
  cursor: CursorPosition | null,
  limit: number,
): Promise<{ events: AuditEventView[]; next: CursorPosition | null }> {
  const t = auditEvents;
  const where: SQL[] = [eq(t.orgId, orgId)];
  if (filter.from) where.push(gte(t.createdAt, filter.from));
  if (filter.to) where.push(lte(t.createdAt, filter.to));
  if (filter.actorId) where.push(eq(t.actorId, filter.actorId));
  if (filter.category) where.push(eq(t.category, filter.category));
  if (filter.action) where.push(eq(t.action, filter.action));
  if (cursor) where.push(sql`(${t.createdAt}, ${t.id}) < (${cursor.createdAt}::timestamptz, ${cursor.id}::uuid)`);
  // `nulls last` as in the indexes (drizzle-kit writes DESC NULLS LAST): with
  // Postgres' default DESC NULLS FIRST the planner cannot read the index in
  // order (it does not infer it from NOT NULL) and sorts the whole org instead.
  const newestFirst = [sql`${t.createdAt} desc nulls last`, sql`${t.id} desc nulls last`];

  let rows: Row[];
  if (!filter.q) {
    rows = await db
      .select()
      .from(t)
      .where(and(...where))
      .orderBy(...newestFirst)
      .limit(limit + 1);
  } else {
    // search_text is stored lower-cased; ILIKE keeps q case-insensitive either way.
    const pattern = likePattern(filter.q);
    const head = db
      .select()
      .from(t)
      .where(and(...where))
      .orderBy(...newestFirst)
      .limit(Q_SCAN_FACTOR * (limit + 1))
      .as("head");
    rows = await db
      .select()
      .from(head)
      .where(sql`${head.searchText} ilike ${pattern}`)
      .orderBy(sql`${head.createdAt} desc nulls last`, sql`${head.id} desc nulls last`)
      .limit(limit + 1);
    if (rows.length <= limit) {
      rows = await db
        .select()
        .from(t)
        .where(and(...where, sql`${t.searchText} ilike ${pattern}`))
        .orderBy(sql`${t.createdAt} + interval '0 ms' desc`, sql`${t.id} desc`)
        .limit(limit + 1);
    }
  }
  const page = rows.slice(0, limit);
  const last = page[page.length - 1];
  const next = rows.length > limit && last ? { createdAt: last.createdAt.toISOString(), id: last.id } : null;
  return { events: page.map(view), next };
}

export interface AuditReadDeps {
  database: Database;
  cursorSecret: string;
  /** Where a failed query is reported; the caller only sees 503. */
  log?: Logger;
}

/** The whole read: validate, check the cursor, query, mint the next cursor. */
export async function readAuditEvents(deps: AuditReadDeps, orgId: string, search: string): Promise<AuditPage> {
  const { filter, cursor, limit } = parseAuditQuery(search);
  const binding = cursorBinding(orgId, filter);
  let position: CursorPosition | null = null;
  if (cursor !== null) {
    position = decodeCursor(cursor, binding, deps.cursorSecret);
    if (!position) {
      throw invalid("cursor", "cursor is not a next_cursor issued for this organisation and these filters; start again without cursor.");
    }
  }
  let result: Awaited<ReturnType<typeof listAuditEvents>>;
  try {
    result = await listAuditEvents(deps.database.db, orgId, filter, position, limit);
  } catch (e) {
    // Input is fully validated above, so a failing query means the database is
    // unreachable or overloaded; the caller should retry with backoff.
    // drizzle wraps the driver's error (message = the SQL); the cause says what went wrong.
    const cause = e instanceof Error && e.cause instanceof Error ? e.cause : e;
    deps.log?.error("audit query failed", { org_id: orgId, err: cause instanceof Error ? cause.message : String(cause) });
    throw new AppError("service_unavailable", "The audit log is temporarily unavailable; retry with backoff.");
  }
  return {
    data: result.events,
    next_cursor: result.next ? encodeCursor(result.next, binding, deps.cursorSecret) : "",
  };
}
