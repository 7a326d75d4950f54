import { createKey, createOrg, createUser } from "../../src/admin/service.ts";
import type { Principal } from "../../src/auth/types.ts";
import { loadConfig, upstreamAliases } from "../../src/config/load.ts";
import type { Config } from "../../src/config/schema.ts";
import { type Database, migrate, openDatabase } from "../../src/db/client.ts";
import type { QuotaPeriod } from "../../src/db/schema.ts";
import { createLogger } from "../../src/lib/log.ts";
import { type Gateway, type StartOptions, startGateway } from "../../src/server.ts";

/**
 * Test harness. One database per test process: embedded PGlite in memory by
 * default, a real Postgres when TEST_DATABASE_URL is set (CI runs the suite
 * both ways). Tests isolate themselves by creating their own organisations.
 */

export const TEST_DATABASE_URL = process.env.TEST_DATABASE_URL;

let shared: Promise<Database> | undefined;
export function sharedDatabase(): Promise<Database> {
  shared ??= (async () => {
    const db = await openDatabase({ databaseUrl: TEST_DATABASE_URL, dataDir: "memory://", poolMax: 10 });
    await migrate(db);
    return db;
  })();
  return shared;
}

/** A fresh, separate database (for migration and multi-instance tests). */
export async function freshDatabase(): Promise<Database> {
  const db = await openDatabase({ databaseUrl: TEST_DATABASE_URL, dataDir: "memory://", poolMax: 10 });
  await migrate(db);
  return db;
}

export async function testConfig(overrides: Record<string, unknown> = {}): Promise<Config> {
  const base = await loadConfig({ env: {}, overrides: { host: "127.0.0.1", port: 0 } });
  // Aliases point at a closed port unless a test brings its own upstream (a simulator).
  const aliases = upstreamAliases("http://127.0.0.1:9/v1");
  // Metrics on their own loopback listener as by default, but on any free port (never the default 9464).
  const metrics = { enabled: true, listen: "127.0.0.1:0" };
  const merged: Record<string, unknown> = { ...base, aliases, metrics, logLevel: "error", accessLog: false, drainMs: 2_000 };
  // A group a test overrides keeps the defaults of the options it does not name
  // (as a config file's would); aliases and plans are replaced whole.
  for (const [k, v] of Object.entries(overrides)) {
    const was = merged[k];
    merged[k] = isPlainObject(v) && isPlainObject(was) && k !== "aliases" && k !== "plans" ? { ...was, ...v } : v;
  }
  return merged as Config;
}

function isPlainObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

/** A gateway on a real socket (port 0), sharing the process's test database. */
export async function startTestGateway(overrides: Record<string, unknown> = {}, database?: Database, opts: Pick<StartOptions, "now"> = {}): Promise<Gateway> {
  const config = await testConfig(overrides);
  return startGateway({ ...opts, config, database: database ?? (await sharedDatabase()), log: createLogger("error") });
}

export interface SeededOrg {
  orgId: string;
  userId: string;
  personalKey: string;
  personalKeyId: string;
  serviceKey: string;
  serviceKeyId: string;
}

export async function seedOrg(
  database: Database,
  opts: { plan?: string; quotaTokens?: number | null; quotaWindow?: "hour" | "day" | "month"; academyOnly?: boolean; plans?: string[]; models?: string[] } = {},
): Promise<SeededOrg> {
  const plans = opts.plans ?? ["Standard", "Ultra"];
  const org = await createOrg(database, {
    name: `org-${crypto.randomUUID().slice(0, 8)}`,
    plan: opts.plan ?? "Standard",
    plans,
    quotaTokens: opts.quotaTokens ?? null,
    quotaWindow: opts.quotaWindow ?? "month",
    academyOnly: opts.academyOnly ?? false,
  });
  const user = await createUser(database, { orgId: org.id, name: "Test User", email: `u-${crypto.randomUUID().slice(0, 8)}@example.com` });
  const knownModels = ["svc-fast", "svc-smart", "svc-bigthink", "svc-embed"];
  const personal = await createKey(database, {
    orgId: org.id,
    userId: user.id,
    kind: "personal",
    scopes: ["inference"],
    knownModels,
    ...(opts.models ? { models: opts.models } : {}),
    tag: "gw",
  });
  const service = await createKey(database, { orgId: org.id, kind: "service", scopes: ["inference", "audit:read"], knownModels, tag: "gw" });
  return { orgId: org.id, userId: user.id, personalKey: personal.key, personalKeyId: personal.id, serviceKey: service.key, serviceKeyId: service.id };
}

/**
 * A new organisation on the Standard plan with `quotaTokens` a `quotaWindow`, and the principal of a
 * service key of it (no key row: for tests that call the quota directly, as the guard would).
 */
export async function quotaPrincipal(database: Database, quotaTokens: number | null, quotaWindow: QuotaPeriod = "day", name = "q"): Promise<Principal> {
  const o = await createOrg(database, { name, plan: "Standard", plans: ["Standard"], quotaTokens, quotaWindow });
  return {
    keyId: crypto.randomUUID(),
    orgId: o.id,
    userId: null,
    kind: "service",
    scopes: ["inference"],
    models: null,
    expiresAt: null,
    revokedAt: null,
    academyOnly: false,
    plan: "Standard",
    quotaTokens,
    quotaPeriod: quotaWindow,
    actorName: "",
    actorEmail: "",
    keyRoot: crypto.randomUUID(),
  };
}

export function bearer(key: string, extra: Record<string, string> = {}): Record<string, string> {
  return { authorization: `Bearer ${key}`, ...extra };
}

/** Assert helper: the wire error shape with a given code. */
export async function errorOf(res: Response): Promise<{ message: string; type: string; param: string | null; code: string }> {
  const body = (await res.json()) as { error: { message: string; type: string; param: string | null; code: string } };
  return body.error;
}

/**
 * What a promise rejects with (or a failure if it resolves). Used instead of
 * `expect(p).rejects`: in Bun 1.4.5 that waits without delivering worker
 * messages, so a promise that needs the embedded database's worker to settle
 * never does.
 */
export async function rejectionOf(p: Promise<unknown>): Promise<unknown> {
  try {
    await p;
  } catch (e) {
    return e;
  }
  throw new Error("expected a rejection, but the promise resolved");
}

/**
 * Reads a streamed answer until its text holds `marker`, then leaves (aborts
 * `ac`, the request's controller): a client that disconnects at a chosen
 * point of the stream. The text read so far.
 */
export async function readUntilThenLeave(res: Response, marker: string, ac: AbortController): Promise<string> {
  const reader = res.body?.getReader();
  if (!reader) throw new Error("no body");
  const decoder = new TextDecoder();
  let text = "";
  while (!text.includes(marker)) {
    const r = await reader.read();
    if (r.done) throw new Error("stream ended early");
    text += decoder.decode(r.value, { stream: true });
  }
  ac.abort();
  return text;
}
