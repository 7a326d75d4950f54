import { sql } from "drizzle-orm";
import {
  bigint,
  bigserial,
  boolean,
  index,
  integer,
  jsonb,
  pgTable,
  primaryKey,
  text,
  timestamp,
  uniqueIndex,
  uuid,
} from "drizzle-orm/pg-core";

/** Millisecond precision everywhere: audit `created_at` round-trips through ISO strings exactly. */
const ts = (name: string) => timestamp(name, { withTimezone: true, precision: 3, mode: "date" });
const createdAt = () => ts("created_at").notNull().default(sql`now()`);

/** The periods an organisation's token quota can run over (column quota_window; the CLI's --quota-window). */
export const QUOTA_PERIODS = ["hour", "day", "month"] as const;

export const organizations = pgTable("organizations", {
  id: uuid("id").primaryKey().defaultRandom(),
  name: text("name").notNull(),
  plan: text("plan").notNull(),
  academyOnly: boolean("academy_only").notNull().default(false),
  /** null = no quota. */
  quotaTokens: bigint("quota_tokens", { mode: "number" }),
  quotaWindow: text("quota_window", { enum: QUOTA_PERIODS }).notNull().default("month"),
  createdAt: createdAt(),
});
export type QuotaPeriod = (typeof organizations.$inferSelect)["quotaWindow"];

export const users = pgTable(
  "users",
  {
    id: uuid("id").primaryKey().defaultRandom(),
    orgId: uuid("org_id")
      .notNull()
      .references(() => organizations.id),
    name: text("name").notNull(),
    email: text("email").notNull(),
    academyOnly: boolean("academy_only").notNull().default(false),
    createdAt: createdAt(),
  },
  (t) => [uniqueIndex("users_org_email_idx").on(t.orgId, t.email)],
);

export const apiKeys = pgTable(
  "api_keys",
  {
    id: uuid("id").primaryKey().defaultRandom(),
    orgId: uuid("org_id")
      .notNull()
      .references(() => organizations.id),
    userId: uuid("user_id").references(() => users.id),
    name: text("name").notNull().default(""),
    kind: text("kind", { enum: ["personal", "service"] }).notNull(),
    /** SHA-256 (hex) of the whole presented key; the secret itself is never stored. */
    hash: text("hash").notNull(),
    /** Display prefix, e.g. `sk-gw-Ab3d…`, enough to recognise a key in a list. */
    prefix: text("prefix").notNull(),
    scopes: text("scopes").array().notNull(),
    /** Aliases this key may address; null = every alias. */
    models: text("models").array(),
    /** Every key expires (README "Decisions"); migration 0005 gave older keys created_at + 365 days. */
    expiresAt: ts("expires_at").notNull(),
    revokedAt: ts("revoked_at"),
    /** The key this one replaced by rotation. */
    rotatedFrom: uuid("rotated_from"),
    lastUsedAt: ts("last_used_at"),
    createdAt: createdAt(),
  },
  (t) => [uniqueIndex("api_keys_hash_idx").on(t.hash), index("api_keys_org_idx").on(t.orgId)],
);

/**
 * One row per organisation and quota window. `used` is what requests actually
 * consumed; `leased` is what instances have taken but not yet settled.
 */
export const usageCounters = pgTable(
  "usage_counters",
  {
    orgId: uuid("org_id")
      .notNull()
      .references(() => organizations.id),
    windowStart: ts("window_start").notNull(),
    used: bigint("used", { mode: "number" }).notNull().default(0),
    leased: bigint("leased", { mode: "number" }).notNull().default(0),
    exceededAt: ts("exceeded_at"),
    /** Last time an instance found the counter empty while others held lease: holders return their unused part. */
    wantedAt: ts("wanted_at"),
  },
  (t) => [primaryKey({ columns: [t.orgId, t.windowStart] })],
);

/**
 * Inference usage, never any content: one row per organisation, key, alias,
 * target, status and streamed-or-not per usage write (`quota.flushMs`), with
 * the number of requests it sums (`requests`), their tokens and their total
 * latency; `created_at` is the newest request's. Rows written before 0008 are
 * one request each.
 */
export const usageEvents = pgTable(
  "usage_events",
  {
    id: bigserial("id", { mode: "number" }).primaryKey(),
    orgId: uuid("org_id").notNull(),
    keyId: uuid("key_id").notNull(),
    alias: text("alias").notNull(),
    target: text("target").notNull(),
    promptTokens: integer("prompt_tokens").notNull(),
    completionTokens: integer("completion_tokens").notNull(),
    status: integer("status").notNull(),
    latencyMs: integer("latency_ms").notNull(),
    streamed: boolean("streamed").notNull(),
    createdAt: createdAt(),
    requests: integer("requests").notNull().default(1),
  },
  (t) => [index("usage_events_org_created_idx").on(t.orgId, t.createdAt)],
);

export interface AuditTarget {
  key: string;
  kind: string;
  id: string;
  name: string;
  email: string;
}

/** Spec 2.6, flattened for indexing; append-only (a trigger refuses UPDATE and DELETE). */
export const auditEvents = pgTable(
  "audit_events",
  {
    id: uuid("id").primaryKey().defaultRandom(),
    orgId: uuid("org_id").notNull(),
    createdAt: createdAt(),
    action: text("action").notNull(),
    category: text("category").notNull(),
    actorType: text("actor_type").notNull(),
    actorId: uuid("actor_id").notNull(),
    actorName: text("actor_name").notNull(),
    actorEmail: text("actor_email").notNull(),
    actorKeyId: uuid("actor_key_id"),
    targets: jsonb("targets").$type<AuditTarget[]>().notNull(),
    details: jsonb("details").$type<Record<string, unknown>>().notNull(),
    originIpPrefix: text("origin_ip_prefix").notNull(),
    originUserAgentSummary: text("origin_user_agent_summary").notNull(),
    /** Lower-cased action, actor and target names and e-mails, one per line: what `q` searches (trigram index). */
    searchText: text("search_text").notNull(),
  },
  (t) => [
    index("audit_org_created_idx").on(t.orgId, t.createdAt.desc(), t.id.desc()),
    index("audit_org_category_idx").on(t.orgId, t.category, t.createdAt.desc(), t.id.desc()),
    index("audit_org_actor_idx").on(t.orgId, t.actorId, t.createdAt.desc(), t.id.desc()),
    index("audit_org_action_idx").on(t.orgId, t.action, t.createdAt.desc(), t.id.desc()),
    // org_id inside the trigram GIN (btree_gin): `q` reads one organisation's postings, not everyone's.
    index("audit_org_search_trgm_idx").using("gin", t.orgId, sql`${t.searchText} gin_trgm_ops`),
  ],
);

/**
 * Usage batches already applied. A batch's counters and events commit in one
 * transaction with its id, so a retry after an ambiguous failure (the
 * connection died after COMMIT was sent) cannot count the usage twice.
 */
export const usageBatches = pgTable("usage_batches", {
  id: uuid("id").primaryKey(),
  appliedAt: createdAt(),
});

/**
 * Usage items the batched writer could not write (a value the database
 * refuses): set aside so that they never block the rest. `record` is the item
 * as JSON text (text, not jsonb, which refuses some strings a bad record may hold).
 */
export const usageDeadLetters = pgTable("usage_dead_letters", {
  id: bigserial("id", { mode: "number" }).primaryKey(),
  createdAt: createdAt(),
  record: text("record").notNull(),
  error: text("error").notNull(),
});

/** Small key/value store for generated secrets (the cursor HMAC key). */
export const settings = pgTable("settings", {
  key: text("key").primaryKey(),
  value: text("value").notNull(),
});

/**
 * Stored Responses API answers (src/responses/store.ts): conversation
 * content, kept `responses.retentionDays` and deleted by the sweeper. The
 * owner is the user of a personal key, or the root of a service key's
 * rotation lineage. JSON is kept as text: jsonb refuses strings holding
 * \u0000, which model output may contain.
 */
export const responses = pgTable(
  "responses",
  {
    id: text("id").primaryKey(),
    orgId: uuid("org_id")
      .notNull()
      .references(() => organizations.id),
    ownerUserId: uuid("owner_user_id"),
    ownerKeyId: uuid("owner_key_id"),
    previousResponseId: text("previous_response_id"),
    /** The request's own input items (not the replayed conversation), as a JSON array. */
    inputItems: text("input_items").notNull(),
    /** The whole Response object as answered. */
    response: text("response").notNull(),
    /**
     * The ids of the Response's output items, which later requests may name in
     * an `item_reference` (migration 0009; rows written before it hold none).
     */
    outputItemIds: text("output_item_ids").array().notNull().default(sql`'{}'::text[]`),
    createdAt: createdAt(),
    expiresAt: ts("expires_at").notNull(),
  },
  (t) => [index("responses_expires_idx").on(t.expiresAt), index("responses_output_item_ids_idx").using("gin", t.outputItemIds).with({ fastupdate: false })],
);
