import { type AnyColumn, type SQL, eq, sql } from "drizzle-orm";
import type { Database, Db } from "../db/client.ts";
import { boundedCall } from "../db/bounded.ts";
import { rowsOf } from "../db/raw.ts";
import { QUOTA_PERIODS, type QuotaPeriod, apiKeys, organizations, users } from "../db/schema.ts";
import { MAX_TIME, MIN_TIME } from "../lib/time.ts";
import { type Scope, isScope } from "./keys.ts";
import type { Principal } from "./types.ts";

/**
 * Reading a key's rows (the key, its organisation, its user) into a checked
 * Principal; the cache around it is verify.ts.
 */

/** More model aliases than any configuration has: a longer list is a damaged row (and would cost every request a long scan). */
export const MAX_KEY_MODELS = 1_000;

/** A timestamp column read as epoch milliseconds (float8: ±Infinity for ±infinity, finite past JavaScript's date range). */
const epochOf = (column: SQL.Aliased | AnyColumn) => sql<number | null>`(extract(epoch from ${column}) * 1000)::float8`;

/** What one lookup reads: the key's row, its organisation's and its user's (left-joined: the user may be missing). */
export interface KeyRow {
  keyId: string;
  orgId: string;
  userId: string | null;
  kind: string;
  scopes: readonly (string | null)[];
  models: readonly (string | null)[] | null;
  /** Epoch ms, as read (may be ±Infinity or out of JavaScript's date range). */
  expiresMs: number | string | null;
  revokedMs: number | string | null;
  orgAcademyOnly: boolean;
  userAcademyOnly: boolean | null;
  plan: string;
  quotaTokens: number | null;
  quotaWindow: string;
  keyName: string;
  /** The joined user's own id and organisation: null when the row is gone. */
  joinedUserId: string | null;
  userOrgId: string | null;
  userName: string | null;
  userEmail: string | null;
  rotatedFrom: string | null;
}

/** A row the gateway read past its own rules: what was wrong, and whose row it was. */
export interface RowProblem {
  table: "api_keys" | "organizations";
  id: string;
  problem: string;
}

/** A key's instants are read within what RFC 3339 text (and `/v1/me`) can show, years 0001–9999. */
const clampMs = (ms: number) => Math.min(MAX_TIME, Math.max(MIN_TIME, ms));

/**
 * A key's rows as a principal, checked (docs/decisions.md, "Rows read from the
 * database"): validated once, when loaded, so the cached verdict costs nothing
 * per request. Values the gateway never writes are read the safe way and
 * reported in `problems`: scopes it does not know (and nulls, repeats) are
 * dropped; an expiry before year 1 (-infinity) is expired, one past 9999
 * (infinity) reads as 9999-12-31T23:59:59.999Z; a quota window it does not
 * know is a month, a negative quota 0, one past 2^53 − 1 that. A row whose
 * kind or owner is inconsistent (a kind other than personal or service, a
 * personal key without its user or with another organisation's, a service
 * key with a user) or whose model list is absurdly long is `damaged`: the
 * key is refused, never guessed at.
 */
export function principalOfRow(r: KeyRow): { principal: Principal; problems: RowProblem[] } {
  const problems: RowProblem[] = [];
  const key = (problem: string) => problems.push({ table: "api_keys", id: r.keyId, problem });
  const org = (problem: string) => problems.push({ table: "organizations", id: r.orgId, problem });
  let damaged: string | undefined;

  const scopes = [...new Set(r.scopes.filter((s): s is Scope => typeof s === "string" && isScope(s)))];
  if (scopes.length !== r.scopes.length) key(`scopes ${JSON.stringify(r.scopes.slice(0, 20))}: unknown, null or repeated values dropped`);
  let models: string[] | null = null;
  if (r.models !== null) {
    models = [...new Set(r.models.filter((m): m is string => typeof m === "string"))];
    if (models.length !== r.models.length) key("models: null or repeated values dropped");
    if (models.length > MAX_KEY_MODELS) damaged = `its models list holds ${models.length} aliases (at most ${MAX_KEY_MODELS})`;
  }
  if (r.kind !== "personal" && r.kind !== "service") damaged = `its kind ${JSON.stringify(r.kind.slice(0, 40))} is neither personal nor service`;
  else if (r.kind === "personal" && r.userId === null) damaged = "it is a personal key without a user";
  else if (r.kind === "personal" && r.joinedUserId === null) damaged = `its user ${r.userId} does not exist`;
  else if (r.kind === "personal" && r.userOrgId !== r.orgId) damaged = `its user ${r.userId} belongs to another organisation`;
  else if (r.kind === "service" && r.userId !== null) damaged = "it is a service key with a user";
  if (damaged) key(`refused: ${damaged}`);

  // float8 arrives as a number (PGlite, postgres.js); Number() also reads the text a driver might give.
  const expiresMs = r.expiresMs === null ? Number.NEGATIVE_INFINITY : Number(r.expiresMs);
  const expiresAt = new Date(Number.isNaN(expiresMs) ? MIN_TIME : clampMs(expiresMs));
  if (!(expiresMs >= MIN_TIME && expiresMs <= MAX_TIME)) key(`expires_at ${expiresMs} ms is outside years 0001-9999: read as ${expiresAt.toISOString()}`);
  const revokedAt = r.revokedMs === null ? null : new Date(clampMs(Number(r.revokedMs) || 0));

  let quotaTokens = r.quotaTokens === null ? null : Number(r.quotaTokens);
  if (quotaTokens !== null && !(quotaTokens >= 0 && quotaTokens <= Number.MAX_SAFE_INTEGER)) {
    const read = quotaTokens > 0 ? Number.MAX_SAFE_INTEGER : 0;
    org(`quota_tokens ${r.quotaTokens} is outside 0 to 2^53 - 1: read as ${read}`);
    quotaTokens = read;
  }
  let quotaPeriod = r.quotaWindow as QuotaPeriod;
  if (!(QUOTA_PERIODS as readonly string[]).includes(r.quotaWindow)) {
    org(`quota_window ${JSON.stringify(r.quotaWindow.slice(0, 40))} is not one of ${QUOTA_PERIODS.join(", ")}: read as month`);
    quotaPeriod = "month";
  }

  const principal: Principal = {
    keyId: r.keyId,
    orgId: r.orgId,
    userId: r.userId,
    kind: r.kind === "personal" ? "personal" : "service",
    scopes,
    models,
    expiresAt,
    revokedAt,
    academyOnly: r.orgAcademyOnly || (r.userAcademyOnly ?? false),
    plan: r.plan,
    quotaTokens,
    quotaPeriod,
    actorName: r.userName ?? r.keyName,
    actorEmail: r.userEmail ?? "",
    keyRoot: r.keyId,
    ...(damaged ? { damaged } : {}),
  };
  return { principal, problems };
}

/** The key's row, and its lineage's root for a rotated key; ended by the server after ANSWER_TIMEOUT_MS (boundedCall). */
export function lookupKey(database: Database, hash: string, report?: (p: RowProblem) => void, timeoutMs?: number): Promise<Principal | null> {
  // Taken before the query: a lookup sent after another one's answer reads a row at least as new.
  const readAt = performance.now();
  return boundedCall(database, (q) => lookupRow(q, hash, readAt, report), timeoutMs);
}

async function lookupRow(q: Db, hash: string, readAt: number, report?: (p: RowProblem) => void): Promise<Principal | null> {
  const rows = await q
    .select({
      keyId: apiKeys.id,
      orgId: apiKeys.orgId,
      userId: apiKeys.userId,
      kind: apiKeys.kind,
      scopes: apiKeys.scopes,
      models: apiKeys.models,
      expiresMs: epochOf(apiKeys.expiresAt),
      revokedMs: epochOf(apiKeys.revokedAt),
      orgAcademyOnly: organizations.academyOnly,
      userAcademyOnly: users.academyOnly,
      plan: organizations.plan,
      quotaTokens: organizations.quotaTokens,
      quotaWindow: organizations.quotaWindow,
      keyName: apiKeys.name,
      joinedUserId: users.id,
      userOrgId: users.orgId,
      userName: users.name,
      userEmail: users.email,
      rotatedFrom: apiKeys.rotatedFrom,
    })
    .from(apiKeys)
    .innerJoin(organizations, eq(organizations.id, apiKeys.orgId))
    .leftJoin(users, eq(users.id, apiKeys.userId))
    .where(eq(apiKeys.hash, hash))
    .limit(1);
  const r = rows[0];
  if (!r) return null;
  const { principal, problems } = principalOfRow(r);
  principal.readAt = readAt;
  for (const p of problems) report?.(p);
  if (r.rotatedFrom !== null) principal.keyRoot = await lineageRoot(q, r.keyId);
  return principal;
}

/** Walks `rotated_from` back to the first key (bounded: a corrupt cycle cannot loop). Runs only on a cache miss of a rotated key. */
async function lineageRoot(q: Db, keyId: string): Promise<string> {
  const rows = rowsOf<{ id: string }>(
    await q.execute(sql`
    with recursive chain(id, rotated_from, depth) as (
      select id, rotated_from, 0 from api_keys where id = ${keyId}
      union all
      select k.id, k.rotated_from, c.depth + 1 from api_keys k join chain c on k.id = c.rotated_from where c.depth < 10000
    )
    select id from chain order by depth desc limit 1`),
  );
  return rows[0]?.id ?? keyId;
}
