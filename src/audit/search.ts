import { type AnyColumn, type SQL, and, eq, getTableColumns, gte, lte, sql } from "drizzle-orm";
import type { Db } from "../db/client.ts";
import { type AuditTarget, auditEvents } from "../db/schema.ts";
import { isRecord } from "../lib/guards.ts";
import { MAX_TIME, MIN_TIME } from "../lib/time.ts";
import type { CursorPosition } from "./cursor.ts";
import type { AuditFilter } from "./params.ts";

/** The keyset query behind GET /v1/audit-events: one page of one organisation's events. */

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

/** `%`, `_` and the escape character itself match literally. */
export function likePattern(q: string): string {
  return `%${q.replace(/[\\%_]/g, (c) => `\\${c}`)}%`;
}

/**
 * A row's time, read in SQL rather than from the driver's Date, which
 * misreads what Postgres prints for some times: years 0001–0099 as 19xx or
 * 20xx, and Invalid Date for years past 9999, BC, ±infinity and offsets in
 * seconds (a server TimeZone's local mean time before ~1900).
 * - `createdMs`: epoch milliseconds (float8, ±Infinity for ±infinity; within
 *   0.02 ms for years 0001–9999, so rounding gives the stored millisecond).
 *   date_part, not extract: extract's numeric costs ten times as much, and
 *   Postgres computes these for every row a sort takes (the trigram path).
 * - `oddKey`: only for a time outside years 0001–9999 (written by hand or by a
 *   partial restore), which RFC 3339 text cannot show: text Postgres reads
 *   back as exactly the stored value (`infinity`, or
 *   `10000-01-01T00:00:00.001000Z AD`). Such a row is listed with its time
 *   clamped, and its cursor holds this text: the keyset moves on from the
 *   stored value, never from the clamped one (which would list again, or
 *   skip, the rows between the two).
 * Computed in the outermost query only (not in the q fast path's head).
 */
function timeColumns(c: AnyColumn) {
  return {
    createdMs: sql<number | string>`date_part('epoch', ${c}) * 1000`.as("created_ms"),
    oddKey: sql<string | null>`case when ${c} < '0001-01-01T00:00:00Z'::timestamptz or ${c} >= '10000-01-01T00:00:00Z'::timestamptz then
      case when isfinite(${c}) then to_char(${c} at time zone 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z" BC') else ${c}::text end end`.as("odd_key"),
  };
}

type Row = typeof auditEvents.$inferSelect & { createdMs: number | string; oddKey: string | null };

/** Where a row read past recordAudit's rules is reported: its id and what was wrong. */
export type AuditRowReport = (id: string, problem: string) => void;

const text = (v: unknown) => (typeof v === "string" ? v : "");

/** The row's time as RFC 3339 text; one outside years 0001–9999 clamped to them. */
function timeOf(r: Row): string {
  // float8 arrives as a number (PGlite, postgres.js); Number() also reads the text a driver might give.
  const ms = Math.round(Number(r.createdMs));
  if (r.oddKey === null && ms >= MIN_TIME && ms <= MAX_TIME) return new Date(ms).toISOString();
  return new Date(ms > MAX_TIME ? MAX_TIME : MIN_TIME).toISOString();
}

/**
 * A row as the spec's event. `targets` and `details` are jsonb, which the
 * schema does not shape: a row written past recordAudit (by hand, by another
 * version) is listed with what is readable (targets that are not objects
 * dropped, their fields that are not strings empty; details that are not an
 * object empty) and reported, never failing its page.
 */
function view(r: Row, report?: AuditRowReport): AuditEventView {
  const raw: unknown = r.targets;
  const targets: AuditTarget[] = [];
  let odd = !Array.isArray(raw);
  for (const t of Array.isArray(raw) ? raw : []) {
    if (!isRecord(t)) {
      odd = true;
      continue;
    }
    const target = { key: text(t.key), kind: text(t.kind), id: text(t.id), name: text(t.name), email: text(t.email) };
    if (target.key !== t.key || target.kind !== t.kind || target.id !== t.id || target.name !== t.name || target.email !== t.email) odd = true;
    targets.push(target);
  }
  const details = isRecord(r.details) ? r.details : {};
  const problems = [
    ...(odd ? ["targets is not an array of {key, kind, id, name, email} strings: listed with what is readable"] : []),
    ...(details !== r.details ? ["details is not a JSON object: listed as {}"] : []),
  ];
  const createdAt = timeOf(r);
  if (r.oddKey !== null) problems.push(`created_at ${r.oddKey} is outside years 0001-9999: listed as ${createdAt}`);
  if (problems.length > 0) report?.(r.id, problems.join("; "));
  return {
    id: r.id,
    created_at: createdAt,
    action: r.action,
    category: r.category,
    actor: { type: r.actorType, id: r.actorId, name: r.actorName, email: r.actorEmail, key_id: r.actorKeyId },
    targets,
    details,
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
  report?: AuditRowReport,
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

  const columns = { ...getTableColumns(t), ...timeColumns(t.createdAt) };
  let rows: Row[];
  if (!filter.q) {
    rows = await db
      .select(columns)
      .from(t)
      .where(and(...where))
      .orderBy(...newestFirst)
      .limit(limit + 1);
  } else {
    // search_text is stored folded and q arrives folded the same way (record.ts foldSearch); ILIKE adds nothing beyond that.
    const pattern = likePattern(filter.q);
    const head = db
      .select()
      .from(t)
      .where(and(...where))
      .orderBy(...newestFirst)
      .limit(Q_SCAN_FACTOR * (limit + 1))
      .as("head");
    const headColumns = Object.fromEntries(Object.keys(getTableColumns(t)).map((k) => [k, head[k as keyof Row & keyof typeof head]]));
    rows = await db
      .select({ ...(headColumns as typeof head._.selectedFields), ...timeColumns(head.createdAt) })
      .from(head)
      .where(sql`${head.searchText} ilike ${pattern}`)
      .orderBy(sql`${head.createdAt} desc nulls last`, sql`${head.id} desc nulls last`)
      .limit(limit + 1);
    if (rows.length <= limit) {
      rows = await db
        .select(columns)
        .from(t)
        .where(and(...where, sql`${t.searchText} ilike ${pattern}`))
        .orderBy(sql`${t.createdAt} + interval '0 ms' desc`, sql`${t.id} desc`)
        .limit(limit + 1);
    }
  }
  const page = rows.slice(0, limit);
  const last = page[page.length - 1];
  const next = rows.length > limit && last ? { createdAt: last.oddKey ?? timeOf(last), id: last.id } : null;
  return { events: page.map((r) => view(r, report)), next };
}

