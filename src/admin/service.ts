import { type AnyColumn, desc, eq, sql } from "drizzle-orm";
import { type Scope, isScope, mintKey, parseDuration } from "../auth/keys.ts";
import { AUTH_CHANNEL } from "../auth/verify.ts";
import { type AuditInput, recordAudit } from "../audit/record.ts";
import type { Database, Db } from "../db/client.ts";
import { QUOTA_PERIODS, type QuotaPeriod, apiKeys, organizations, users } from "../db/schema.ts";
import { FieldError, InputError } from "../lib/errors.ts";
import { SYSTEM_ACTOR_ID, isUuid } from "../lib/ids.ts";
import { MAX_EMAIL_CHARS, MAX_NAME_CHARS, textProblem } from "../lib/text.ts";
import { MAX_TIME, MIN_TIME } from "../lib/time.ts";

/**
 * Organisation, user and key lifecycle. Every change writes its audit event
 * and its cache-invalidation NOTIFY in the same transaction, so either all of
 * it happened or none of it did.
 *
 * Bad input is a FieldError naming the input field it is about
 * (`quotaWindow`), worded in this module's terms; callers name the field
 * their own way (the CLI prints it as its flag, `--quota-window`).
 */

/** The quota period under the name operators see (--quota-window, column quota_window). */
type QuotaWindow = QuotaPeriod;
const WINDOWS: readonly QuotaWindow[] = QUOTA_PERIODS;

/** Events made through the CLI or the admin socket; recordAudit gives them HOST_ORIGIN. */
export const CLI_ACTOR: AuditInput["actor"] = { type: "system", id: SYSTEM_ACTOR_ID, name: "gateway-cli", email: "", keyId: null };

type Tx = Parameters<Parameters<Db["transaction"]>[0]>[0];

async function notify(tx: Tx, message: string) {
  await tx.execute(sql`select pg_notify(${AUTH_CHANNEL}, ${message})`);
}

export function requireUuid(field: string, id: string) {
  if (!isUuid(id)) throw new FieldError(field, (n) => `${n(field)} must be a UUID, got ${JSON.stringify(id)}`);
}

function requireWindow(w: string): QuotaWindow {
  if (!(WINDOWS as readonly string[]).includes(w)) throw new FieldError("quotaWindow", (n) => `${n("quotaWindow")} must be one of hour, day, month`);
  return w as QuotaWindow;
}

function requireQuota(n: number | null): number | null {
  if (n !== null && (!Number.isSafeInteger(n) || n < 0)) throw new FieldError("quotaTokens", (f) => `${f("quotaTokens")} must be a whole number ≥ 0 or none`);
  return n;
}

function requirePlan(plan: string, plans: readonly string[]) {
  if (!plans.includes(plan)) throw new FieldError("plan", () => `unknown plan ${JSON.stringify(plan)}; configured plans: ${plans.join(", ")}`);
}

/** A display text: one line of at most `max` characters (src/lib/text.ts). */
function requireText(field: string, value: string, max: number) {
  const problem = textProblem(value, max);
  if (problem) throw new FieldError(field, (n) => `${n(field)} ${problem}`);
}

function requireName(name: string) {
  if (!name.trim()) throw new FieldError("name", (n) => `${n("name")} must not be empty`);
  requireText("name", name, MAX_NAME_CHARS);
}

export interface OrgView {
  id: string;
  name: string;
  plan: string;
  academy_only: boolean;
  quota_tokens: number | null;
  quota_window: QuotaWindow;
  created_at: string;
}

/**
 * A timestamp column as epoch milliseconds (float8: ±Infinity for ±infinity), read in SQL as src/auth/key-row.ts
 * reads a key's: the driver's Date reads ±infinity and years past 275760 as an invalid date (toISOString threw,
 * and `keys list`, `keys revoke` and `orgs set` failed with "Invalid Date", exit 1) and years 0001–0099 as 19xx
 * (docs/decisions.md, Rows read from the database).
 */
const epochMs = (column: AnyColumn) => sql<number | string | null>`(extract(epoch from ${column}) * 1000)::float8`;

/** An instant read by epochMs, within years 0001–9999 as /v1/me shows a key's: -infinity is 0001, infinity 9999. */
function timeOf(ms: number | string | null): number {
  const n = Number(ms);
  return Number.isNaN(n) ? MIN_TIME : Math.min(MAX_TIME, Math.max(MIN_TIME, n));
}
const isoOf = (ms: number | string | null) => new Date(timeOf(ms)).toISOString();

/** The columns of an organisation the admin commands read, its time as epoch milliseconds. */
const ORG_ROW = {
  id: organizations.id,
  name: organizations.name,
  plan: organizations.plan,
  academyOnly: organizations.academyOnly,
  quotaTokens: organizations.quotaTokens,
  quotaWindow: organizations.quotaWindow,
  createdMs: epochMs(organizations.createdAt),
};
type OrgRow = Pick<typeof organizations.$inferSelect, "id" | "name" | "plan" | "academyOnly" | "quotaTokens" | "quotaWindow"> & { createdMs: number | string | null };

function orgView(o: OrgRow): OrgView {
  return {
    id: o.id,
    name: o.name,
    plan: o.plan,
    academy_only: o.academyOnly,
    quota_tokens: o.quotaTokens,
    quota_window: o.quotaWindow,
    created_at: isoOf(o.createdMs),
  };
}

function orgTarget(o: { id: string; name: string }) {
  return { key: "org_id", kind: "organization", id: o.id, name: o.name, email: "" };
}

export async function createOrg(
  database: Database,
  input: { name: string; plan: string; plans: readonly string[]; quotaTokens?: number | null; quotaWindow?: string; academyOnly?: boolean },
): Promise<OrgView> {
  requireName(input.name);
  requirePlan(input.plan, input.plans);
  const quotaTokens = requireQuota(input.quotaTokens ?? null);
  const quotaWindow = requireWindow(input.quotaWindow ?? "month");
  return database.db.transaction(async (tx) => {
    const [o] = await tx
      .insert(organizations)
      .values({ name: input.name, plan: input.plan, quotaTokens, quotaWindow, academyOnly: input.academyOnly ?? false })
      .returning(ORG_ROW);
    if (!o) throw new Error("insert returned no row");
    await recordAudit(tx, { orgId: o.id, action: "org.created", category: "org", actor: CLI_ACTOR, targets: [orgTarget(o)], details: { org_id: o.id, plan: o.plan } });
    return orgView(o);
  });
}

export async function setOrg(
  database: Database,
  input: { id: string; plans: readonly string[]; plan?: string; quotaTokens?: number | null; quotaWindow?: string; academyOnly?: boolean },
): Promise<OrgView> {
  requireUuid("id", input.id);
  if (input.plan !== undefined) requirePlan(input.plan, input.plans);
  if (input.quotaTokens !== undefined) requireQuota(input.quotaTokens);
  if (input.quotaWindow !== undefined) requireWindow(input.quotaWindow);
  return database.db.transaction(async (tx) => {
    const [before] = await tx.select(ORG_ROW).from(organizations).where(eq(organizations.id, input.id)).for("update");
    if (!before) throw new FieldError("id", () => `no organisation ${input.id}`);
    const patch: Partial<typeof organizations.$inferInsert> = {};
    if (input.plan !== undefined) patch.plan = input.plan;
    if (input.quotaTokens !== undefined) patch.quotaTokens = input.quotaTokens;
    if (input.quotaWindow !== undefined) patch.quotaWindow = input.quotaWindow as QuotaWindow;
    if (input.academyOnly !== undefined) patch.academyOnly = input.academyOnly;
    if (Object.keys(patch).length === 0) return orgView(before);
    const [after] = await tx.update(organizations).set(patch).where(eq(organizations.id, input.id)).returning(ORG_ROW);
    if (!after) throw new Error("update returned no row");
    const events: AuditInput[] = [];
    const base = { orgId: after.id, actor: CLI_ACTOR, targets: [orgTarget(after)] };
    // recordAudit adds org_id (the target's detail field) to each event's details.
    if (before.plan !== after.plan) {
      events.push({ ...base, action: "org.plan_changed", category: "org", details: { from: before.plan, to: after.plan } });
    }
    if (before.quotaTokens !== after.quotaTokens || before.quotaWindow !== after.quotaWindow) {
      events.push({
        ...base,
        action: "billing.quota_changed",
        category: "billing",
        details: {
          from: { tokens: before.quotaTokens, window: before.quotaWindow },
          to: { tokens: after.quotaTokens, window: after.quotaWindow },
        },
      });
    }
    if (before.academyOnly !== after.academyOnly) {
      events.push({ ...base, action: "org.access_changed", category: "org", details: { from: before.academyOnly ? "academy" : "platform", to: after.academyOnly ? "academy" : "platform" } });
    }
    await recordAudit(tx, events);
    await notify(tx, `org:${after.id}`);
    return orgView(after);
  });
}

export interface UserView {
  id: string;
  org_id: string;
  name: string;
  email: string;
  academy_only: boolean;
  created_at: string;
}

export async function createUser(
  database: Database,
  input: { orgId: string; name: string; email: string; academyOnly?: boolean },
): Promise<UserView> {
  requireUuid("orgId", input.orgId);
  requireName(input.name);
  requireText("email", input.email, MAX_EMAIL_CHARS);
  if (!/^[^\s@]+@[^\s@]+$/.test(input.email)) throw new FieldError("email", (n) => `${n("email")} is not an e-mail address: ${JSON.stringify(input.email)}`);
  return database.db.transaction(async (tx) => {
    // The organisation's row locked: users created at once in one organisation are checked one after another, so two
    // spellings of one address cannot both pass. The unique index is on the address as typed (case-only duplicates
    // stored before this check stay), so this check is what enforces it (docs/decisions.md: Command line).
    const [org] = await tx.select({ id: organizations.id }).from(organizations).where(eq(organizations.id, input.orgId)).for("no key update");
    if (!org) throw new FieldError("orgId", () => `no organisation ${input.orgId}`);
    const [dupe] = await tx
      .select({ id: users.id, email: users.email })
      .from(users)
      .where(sql`${users.orgId} = ${input.orgId} and lower(${users.email}) = lower(${input.email})`)
      .orderBy(users.createdAt, users.id)
      .limit(1);
    if (dupe) {
      const asTyped = dupe.email === input.email ? "" : "; addresses that differ only in case are the same address";
      throw new FieldError("email", () => `a user with e-mail ${dupe.email} already exists in this organisation (${dupe.id})${asTyped}`);
    }
    const [u] = await tx
      .insert(users)
      .values({ orgId: input.orgId, name: input.name, email: input.email, academyOnly: input.academyOnly ?? false })
      .returning();
    if (!u) throw new Error("insert returned no row");
    await recordAudit(tx, {
      orgId: u.orgId,
      action: "member.created",
      category: "member",
      actor: CLI_ACTOR,
      targets: [{ key: "user_id", kind: "user", id: u.id, name: u.name, email: u.email }],
      details: { user_id: u.id },
    });
    return { id: u.id, org_id: u.orgId, name: u.name, email: u.email, academy_only: u.academyOnly, created_at: u.createdAt.toISOString() };
  });
}

export interface KeyView {
  id: string;
  org_id: string;
  user_id: string | null;
  name: string;
  kind: "personal" | "service";
  prefix: string;
  scopes: string[];
  models: string[] | null;
  expires_at: string;
  revoked_at: string | null;
  rotated_from: string | null;
  last_used_at: string | null;
  created_at: string;
}

/** The columns of a key the admin commands read (never its hash), its times as epoch milliseconds. */
const KEY_ROW = {
  id: apiKeys.id,
  orgId: apiKeys.orgId,
  userId: apiKeys.userId,
  name: apiKeys.name,
  kind: apiKeys.kind,
  prefix: apiKeys.prefix,
  scopes: apiKeys.scopes,
  models: apiKeys.models,
  rotatedFrom: apiKeys.rotatedFrom,
  expiresMs: epochMs(apiKeys.expiresAt),
  revokedMs: epochMs(apiKeys.revokedAt),
  lastUsedMs: epochMs(apiKeys.lastUsedAt),
  createdMs: epochMs(apiKeys.createdAt),
};
type KeyRow = Pick<typeof apiKeys.$inferSelect, "id" | "orgId" | "userId" | "name" | "kind" | "prefix" | "scopes" | "models" | "rotatedFrom"> & {
  expiresMs: number | string | null;
  revokedMs: number | string | null;
  lastUsedMs: number | string | null;
  createdMs: number | string | null;
};

function keyView(k: KeyRow): KeyView {
  return {
    id: k.id,
    org_id: k.orgId,
    user_id: k.userId,
    name: k.name,
    kind: k.kind,
    prefix: k.prefix,
    scopes: k.scopes,
    models: k.models,
    expires_at: isoOf(k.expiresMs),
    revoked_at: k.revokedMs === null ? null : isoOf(k.revokedMs),
    rotated_from: k.rotatedFrom,
    last_used_at: k.lastUsedMs === null ? null : isoOf(k.lastUsedMs),
    created_at: isoOf(k.createdMs),
  };
}

function keyTarget(k: { id: string; name: string; prefix: string }) {
  return { key: "key_id", kind: "api_key", id: k.id, name: k.name || k.prefix, email: "" };
}

/**
 * Every key expires (README "Decisions"): without an explicit expiry a key
 * lives `defaultMs`; no key may be given more than `max` (when set).
 */
export interface KeyLifetime {
  defaultMs: number;
  max: { ms: number; label: string } | null;
}

const DAY_MS = 86_400_000;
export const DEFAULT_KEY_LIFETIME: KeyLifetime = { defaultMs: 365 * DAY_MS, max: null };

/** From the config's `keys` group (its durations are validated by the config schema). */
export function keyLifetime(keys: { defaultLifetime: string; maxLifetime?: string | undefined }): KeyLifetime {
  const defaultMs = parseDuration(keys.defaultLifetime);
  if (defaultMs === null) throw new InputError(`keys.defaultLifetime takes a duration such as 365d, got ${JSON.stringify(keys.defaultLifetime)}`);
  if (keys.maxLifetime === undefined) return { defaultMs, max: null };
  const maxMs = parseDuration(keys.maxLifetime);
  if (maxMs === null) throw new InputError(`keys.maxLifetime takes a duration such as 730d, got ${JSON.stringify(keys.maxLifetime)}`);
  return { defaultMs, max: { ms: maxMs, label: keys.maxLifetime } };
}

/** An expiry asked for explicitly: a time, or a duration from now. */
export type ExpiryRequest = { at: Date } | { inMs: number };

function explicitExpiry(req: ExpiryRequest, now: Date, lifetime: KeyLifetime): Date {
  const at = "at" in req ? req.at : new Date(now.getTime() + req.inMs);
  if (Number.isNaN(at.getTime())) throw new FieldError("expiresAt", (n) => `${n("expiresAt")} is not a valid ISO 8601 time`);
  const max = lifetime.max;
  if (max && at.getTime() - now.getTime() > max.ms) {
    throw new FieldError(
      "at" in req ? "expiresAt" : "expiresInMs",
      (n) => `the key would live longer than keys.maxLifetime (${max.label}); give an earlier ${n("expiresAt")} or a shorter ${n("expiresInMs")}`,
    );
  }
  return at;
}

/**
 * A lifetime that no explicit request asked for: the longest allowed is used, never refused; and never past
 * 9999-12-31, which is as far as a key's expiry is read (a rotated key whose row lived to `infinity`).
 */
function cappedExpiry(now: Date, ms: number, lifetime: KeyLifetime): Date {
  return new Date(Math.min(MAX_TIME, now.getTime() + Math.min(ms, lifetime.max?.ms ?? ms)));
}

export interface CreateKeyInput {
  orgId: string;
  userId?: string;
  kind: string;
  scopes: string[];
  models?: string[];
  knownModels: readonly string[];
  /** Explicit expiry; otherwise `lifetime.defaultMs` from now. */
  expiresAt?: Date;
  expiresInMs?: number;
  lifetime?: KeyLifetime;
  name?: string;
  tag: string;
  now?: Date;
}

export function validateKeyInput(input: CreateKeyInput): { kind: "personal" | "service"; scopes: Scope[] } {
  requireUuid("orgId", input.orgId);
  if (input.userId !== undefined) requireUuid("userId", input.userId);
  if (input.kind !== "personal" && input.kind !== "service") throw new FieldError("kind", (n) => `${n("kind")} must be personal or service`);
  if (input.kind === "personal" && !input.userId) throw new FieldError("userId", (n) => `a personal key needs ${n("userId")} (the person it belongs to)`);
  if (input.kind === "service" && input.userId) throw new FieldError("userId", (n) => `a service key belongs to the organisation; drop ${n("userId")}`);
  if (input.scopes.length === 0) throw new FieldError("scopes", (n) => `${n("scopes")} must name at least one scope`);
  for (const s of input.scopes) if (!isScope(s)) throw new FieldError("scopes", () => `unknown scope ${JSON.stringify(s)}`);
  if (input.kind === "personal" && input.scopes.includes("audit:read")) {
    throw new FieldError("scopes", () => "audit:read is for service keys only (spec 4.5); personal keys cannot hold it");
  }
  for (const m of input.models ?? []) {
    if (!input.knownModels.includes(m)) throw new FieldError("models", () => `unknown model alias ${JSON.stringify(m)}; known: ${input.knownModels.join(", ")}`);
  }
  if (input.name) requireText("name", input.name, MAX_NAME_CHARS);
  if (input.expiresAt && Number.isNaN(input.expiresAt.getTime())) throw new FieldError("expiresAt", (n) => `${n("expiresAt")} is not a valid ISO 8601 time`);
  if (input.expiresAt && input.expiresInMs !== undefined) throw new FieldError("expiresAt", (n) => `give ${n("expiresAt")} or ${n("expiresInMs")}, not both`);
  return { kind: input.kind, scopes: [...new Set(input.scopes)] as Scope[] };
}

export async function createKey(database: Database, input: CreateKeyInput): Promise<KeyView & { key: string }> {
  const { kind, scopes } = validateKeyInput(input);
  const lifetime = input.lifetime ?? DEFAULT_KEY_LIFETIME;
  // One clock for created_at and expires_at, so the lifetime is exact.
  const now = input.now ?? new Date();
  const request: ExpiryRequest | null = input.expiresAt ? { at: input.expiresAt } : input.expiresInMs !== undefined ? { inMs: input.expiresInMs } : null;
  const expiresAt = request ? explicitExpiry(request, now, lifetime) : cappedExpiry(now, lifetime.defaultMs, lifetime);
  const minted = mintKey(input.tag);
  return database.db.transaction(async (tx) => {
    const [org] = await tx.select({ id: organizations.id }).from(organizations).where(eq(organizations.id, input.orgId));
    if (!org) throw new FieldError("orgId", () => `no organisation ${input.orgId}`);
    if (input.userId) {
      const [u] = await tx.select({ orgId: users.orgId }).from(users).where(eq(users.id, input.userId));
      if (!u) throw new FieldError("userId", () => `no user ${input.userId}`);
      if (u.orgId !== input.orgId) throw new FieldError("userId", () => `user ${input.userId} belongs to another organisation`);
    }
    const [k] = await tx
      .insert(apiKeys)
      .values({
        orgId: input.orgId,
        userId: input.userId ?? null,
        name: input.name ?? "",
        kind,
        hash: minted.hash,
        prefix: minted.prefix,
        scopes,
        models: input.models && input.models.length > 0 ? [...new Set(input.models)] : null,
        expiresAt,
        createdAt: now,
      })
      .returning(KEY_ROW);
    if (!k) throw new Error("insert returned no row");
    await recordAudit(tx, {
      orgId: k.orgId,
      action: "api_key.created",
      category: "api_key",
      actor: CLI_ACTOR,
      targets: [keyTarget(k)],
      details: { key_id: k.id, kind: k.kind, scopes: k.scopes, expires_at: expiresAt.toISOString() },
    });
    await notify(tx, "new");
    return { ...keyView(k), key: minted.key };
  });
}

/** An id of no organisation (a typo, a key's or a person's id) is refused, not answered with an empty list. */
export async function requireOrg(database: Database, orgId: string) {
  requireUuid("orgId", orgId);
  const [org] = await database.db.select({ id: organizations.id }).from(organizations).where(eq(organizations.id, orgId));
  if (!org) throw new FieldError("orgId", () => `no organisation ${orgId}`);
}

export async function listKeys(database: Database, orgId: string): Promise<KeyView[]> {
  requireUuid("orgId", orgId);
  const rows = await database.db.select(KEY_ROW).from(apiKeys).where(eq(apiKeys.orgId, orgId)).orderBy(desc(apiKeys.createdAt), desc(apiKeys.id));
  if (rows.length === 0) await requireOrg(database, orgId);
  return rows.map(keyView);
}

export async function revokeKey(database: Database, id: string, now = new Date()): Promise<KeyView> {
  requireUuid("id", id);
  return database.db.transaction(async (tx) => {
    const [k] = await tx.select(KEY_ROW).from(apiKeys).where(eq(apiKeys.id, id)).for("update");
    if (!k) throw new FieldError("id", () => `no key ${id}`);
    // Any set revoked_at revokes (as a request reads it): revoking again changes nothing.
    if (k.revokedMs !== null) return keyView(k);
    const [after] = await tx.update(apiKeys).set({ revokedAt: now }).where(eq(apiKeys.id, id)).returning(KEY_ROW);
    if (!after) throw new Error("update returned no row");
    await recordAudit(tx, { orgId: k.orgId, action: "api_key.revoked", category: "api_key", actor: CLI_ACTOR, targets: [keyTarget(k)], details: { key_id: k.id } });
    await notify(tx, `key:${id}`);
    return keyView(after);
  });
}

/**
 * Rotation: a new secret with the same organisation, owner, scopes and models;
 * the old key keeps working until the grace period ends, then it expires.
 * The new key gets the old key's lifetime (expires_at − created_at) from now,
 * capped by keys.maxLifetime, unless an expiry is asked for explicitly.
 */
export async function rotateKey(
  database: Database,
  input: { id: string; graceMs: number; tag: string; now?: Date; expiry?: ExpiryRequest; lifetime?: KeyLifetime },
): Promise<KeyView & { key: string; old_key_expires_at: string }> {
  requireUuid("id", input.id);
  const now = input.now ?? new Date();
  const lifetime = input.lifetime ?? DEFAULT_KEY_LIFETIME;
  const explicit = input.expiry ? explicitExpiry(input.expiry, now, lifetime) : null;
  const minted = mintKey(input.tag);
  return database.db.transaction(async (tx) => {
    const [old] = await tx.select(KEY_ROW).from(apiKeys).where(eq(apiKeys.id, input.id)).for("update");
    if (!old) throw new FieldError("id", () => `no key ${input.id}`);
    if (old.revokedMs !== null) throw new FieldError("id", () => `key ${input.id} is revoked; create a new key instead`);
    // Read as a request reads it: an expiry before year 1 (-infinity) is expired, one past 9999 is 9999-12-31.
    const oldExpiresMs = timeOf(old.expiresMs);
    if (oldExpiresMs <= now.getTime()) throw new FieldError("id", () => `key ${input.id} has expired; create a new key instead`);
    const graceEnd = now.getTime() + input.graceMs;
    const oldExpiry = new Date(Math.min(oldExpiresMs, graceEnd));
    const expiresAt = explicit ?? cappedExpiry(now, oldExpiresMs - timeOf(old.createdMs), lifetime);
    await tx.update(apiKeys).set({ expiresAt: oldExpiry }).where(eq(apiKeys.id, old.id));
    const [k] = await tx
      .insert(apiKeys)
      .values({
        orgId: old.orgId,
        userId: old.userId,
        name: old.name,
        kind: old.kind,
        hash: minted.hash,
        prefix: minted.prefix,
        scopes: old.scopes,
        models: old.models,
        expiresAt,
        createdAt: now,
        rotatedFrom: old.id,
      })
      .returning(KEY_ROW);
    if (!k) throw new Error("insert returned no row");
    await recordAudit(tx, {
      orgId: k.orgId,
      action: "api_key.rotated",
      category: "api_key",
      actor: CLI_ACTOR,
      targets: [keyTarget(old), { ...keyTarget(k), key: "new_key_id" }],
      details: { key_id: old.id, old_key_expires_at: oldExpiry.toISOString(), new_key_id: k.id, new_key_expires_at: expiresAt.toISOString() },
    });
    await notify(tx, `key:${old.id}`);
    await notify(tx, "new");
    // When the old key stops working: the grace's end, or its own expiry if that comes first.
    return { ...keyView(k), key: minted.key, old_key_expires_at: oldExpiry.toISOString() };
  });
}
