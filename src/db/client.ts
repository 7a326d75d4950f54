import { existsSync, mkdirSync, readFileSync, renameSync, unlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { type SQL, sql } from "drizzle-orm";
import type { PgDatabase, PgQueryResultHKT } from "drizzle-orm/pg-core";
// The drivers are imported by the kind of database opened (openDatabase): a process on the embedded database
// never loads postgres.js, one on Postgres never loads drizzle's pglite driver. Code a process holds costs it
// at every collection (docs/benchmarks.md, "What a young collection's pause is made of").
import type postgres from "postgres";
// Embedded in the executable by `bun build --compile` (type: "file"): PGlite's
// wasm, its file-system bundle and the pg_trgm and btree_gin extensions travel inside the binary.
import initdbWasmPath from "@electric-sql/pglite/initdb.wasm" with { type: "file" };
import pgliteDataPath from "@electric-sql/pglite/pglite.data" with { type: "file" };
import pgliteWasmPath from "@electric-sql/pglite/pglite.wasm" with { type: "file" };
import btreeGinPath from "../../node_modules/@electric-sql/pglite/dist/btree_gin.tar.gz" with { type: "file" };
import pgTrgmPath from "../../node_modules/@electric-sql/pglite/dist/pg_trgm.tar.gz" with { type: "file" };
import { MIGRATIONS } from "./migrations.ts";
import { PGliteRemote } from "./pglite-remote.ts";
import * as schema from "./schema.ts";

export type Db = PgDatabase<PgQueryResultHKT, typeof schema>;

export interface Database {
  kind: "pglite" | "postgres";
  db: Db;
  /** Connections of the pool (Postgres); the embedded database has none to run out of. */
  poolMax?: number;
  /** Raw query returning rows, the same shape on both drivers. */
  rows<T = Record<string, unknown>>(query: SQL): Promise<T[]>;
  /**
   * Subscribe to a NOTIFY channel. `onReconnect` runs after the listening
   * connection was lost and re-established (messages may have been missed).
   */
  listen(channel: string, onMessage: (payload: string) => void, onReconnect: () => void): Promise<() => Promise<void>>;
  ping(): Promise<boolean>;
  close(): Promise<void>;
  /** Transactions this process started on the embedded database (Postgres counts its own: pg_stat_database). */
  transactions?(): number;
}

export interface DbOptions {
  databaseUrl?: string;
  /** Directory for the embedded database, or `memory://`. */
  dataDir: string;
  poolMax?: number;
}

// Compiling PGlite's wasm costs seconds; do it once per process (tests open many databases).
let pgliteModules: Promise<{ pgliteWasmModule: WebAssembly.Module; initdbWasmModule: WebAssembly.Module; fsBundle: Blob }> | undefined;
function loadPgliteModules() {
  pgliteModules ??= (async () => {
    const [pgliteWasmModule, initdbWasmModule, data] = await Promise.all([
      Bun.file(pgliteWasmPath).arrayBuffer().then((b) => WebAssembly.compile(b)),
      Bun.file(initdbWasmPath).arrayBuffer().then((b) => WebAssembly.compile(b)),
      Bun.file(pgliteDataPath).arrayBuffer(),
    ]);
    return { pgliteWasmModule, initdbWasmModule, fsBundle: new Blob([data]) };
  })();
  return pgliteModules;
}

/**
 * PGlite reads extension bundles with fs streams, which cannot open files
 * inside a compiled executable; copy the embedded bundle to a real file once.
 */
async function extensionBundleUrl(name: string, path: string): Promise<URL> {
  if (!path.startsWith("/$bunfs")) return new URL(`file://${resolve(path)}`);
  const bytes = new Uint8Array(await Bun.file(path).arrayBuffer());
  const target = join(tmpdir(), `gateway-${name}-${Bun.hash(bytes).toString(16)}.tar.gz`);
  if (!existsSync(target)) {
    const partial = `${target}.${process.pid}`;
    writeFileSync(partial, bytes);
    renameSync(partial, target);
  }
  return new URL(`file://${target}`);
}

/**
 * How long the request path (a key lookup, a quota lease, the readiness
 * check) waits for the database before it acts as if the database were
 * unreachable. A database that stops answering without closing its
 * connections (a network partition, a paused host) would otherwise hold a
 * query sent on an open connection until TCP gives up, many minutes later;
 * only a new connection is bounded, by connect_timeout.
 */
export const ANSWER_TIMEOUT_MS = 5_000;

export class DatabaseTimeout extends Error {}

/** The server ends a session of ours left idle inside a transaction this long (its locks released). */
export const IDLE_IN_TRANSACTION_MS = 10_000;

/** A LISTEN connection that heard nothing for this long is checked with a NOTIFY to itself (openPostgres). */
export const LISTEN_CHECK_MS = 10_000;
/** Where each instance's listening connection sends itself that NOTIFY (a random payload of its own). */
const LISTEN_PROBE_CHANNEL = "gateway_listen_probe";

interface Subscription {
  channel: string;
  onMessage(payload: string): void;
  onReconnect(): void;
  /** UNLISTEN on the listening connection of the moment (set again when it is replaced). */
  unlisten?: () => Promise<void>;
}

/** `p`, or a DatabaseTimeout after `ms`; the query itself is left to finish or fail on its own. */
export function answeredWithin<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new DatabaseTimeout(`${what}: no answer from the database within ${ms} ms`)), ms);
  });
  return Promise.race([p, late]).finally(() => clearTimeout(timer));
}

export class DataDirLockedError extends Error {}

/** Data directories this process has open: the pid file cannot tell us apart from ourselves. */
const openDirs = new Set<string>();

function pidAlive(pid: number): boolean {
  if (!Number.isInteger(pid) || pid <= 0) return false;
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    // EPERM: the process exists but belongs to another user; still alive.
    return (e as NodeJS.ErrnoException).code === "EPERM";
  }
}

/**
 * The embedded database is single-process: two processes on one data
 * directory would corrupt it. A pid file, created exclusively (O_EXCL) so two
 * processes starting at once cannot both win, refuses the second one clearly.
 * A lock left by a dead process (crash, SIGKILL) is taken over; so is one
 * holding our own pid (a container restarted with the same pid 1).
 */
function lockDataDir(dir: string): () => void {
  if (openDirs.has(dir)) throw new DataDirLockedError(`the data directory ${dir} is already open in this process`);
  mkdirSync(dir, { recursive: true });
  const lock = join(dir, "gateway.pid");
  for (let attempt = 0; ; attempt++) {
    try {
      writeFileSync(lock, String(process.pid), { flag: "wx" });
      break;
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== "EEXIST" || attempt >= 3) throw e;
    }
    let holder = "";
    try {
      holder = readFileSync(lock, "utf8").trim();
    } catch {
      continue; // removed meanwhile: try again
    }
    const pid = Number(holder);
    if (pid !== process.pid && pidAlive(pid)) {
      throw new DataDirLockedError(
        `the data directory ${dir} is in use by process ${pid}: stop it first, or use DATABASE_URL (a Postgres server) to share one database between processes (a running \`gateway serve\` takes orgs, users, keys, audit and usage commands itself); if no gateway is running, delete ${lock}`,
      );
    }
    try {
      unlinkSync(lock); // stale
    } catch {
      // another process removed it first; the exclusive create decides
    }
  }
  openDirs.add(dir);
  return () => {
    openDirs.delete(dir);
    try {
      if (readFileSync(lock, "utf8").trim() === String(process.pid)) unlinkSync(lock);
    } catch {
      // already gone
    }
  };
}

async function openPglite(dataDir: string): Promise<Database> {
  const memory = dataDir.startsWith("memory://");
  const unlock = memory ? () => {} : lockDataDir(resolve(dataDir));
  let pg: PGliteRemote;
  try {
    const modules = await loadPgliteModules();
    const [trgm, btreeGin] = await Promise.all([extensionBundleUrl("pg_trgm", pgTrgmPath), extensionBundleUrl("btree_gin", btreeGinPath)]);
    // The database runs in its own worker thread: its statements never pause request handling.
    pg = await PGliteRemote.open({
      dataDir: memory ? dataDir : resolve(dataDir, "pg"),
      ...modules,
      extensions: { pg_trgm: trgm.href, btree_gin: btreeGin.href },
    });
  } catch (e) {
    unlock();
    throw e;
  }
  const { drizzle: drizzlePglite } = await import("drizzle-orm/pglite");
  const db = drizzlePglite({ client: pg as never, schema }) as unknown as Db;
  return {
    kind: "pglite",
    db,
    transactions: () => pg.transactions,
    async rows<T>(query: SQL) {
      const r = (await db.execute(query)) as unknown as { rows: T[] };
      return r.rows;
    },
    async listen(channel, onMessage) {
      // One process owns the embedded database, so NOTIFY is delivered in-process and never lost.
      const unsub = await pg.listen(channel, onMessage);
      return unsub;
    },
    async ping() {
      try {
        await pg.query("select 1");
        return true;
      } catch {
        return false;
      }
    },
    async close() {
      try {
        await pg.close();
      } finally {
        unlock();
      }
    },
  };
}

/**
 * Seconds before postgres.js opens a connection again after one ended with an
 * error, given the errors counted since the pool last connected (shared by
 * every connection of a client). The driver's default grows as 3^n / 100 up
 * to 20 s: a few rounds of sessions ended by the server (a failover, a
 * pooler recycling backends, pg_terminate_backend) left a request that needs
 * the database waiting up to 20 s after it answered again. Ours doubles from
 * 50 ms to at most 1 s, with the same jitter (half to all of it): a database
 * that refuses sees a connection attempt a second per pooled connection.
 */
export function reconnectBackoff(errors: number): number {
  return (0.5 + Math.random() / 2) * Math.min(0.05 * 2 ** Math.max(0, errors), 1);
}

async function openPostgres(url: string, poolMax: number): Promise<Database> {
  const [{ default: postgres }, { drizzle: drizzlePostgres }] = await Promise.all([import("postgres"), import("drizzle-orm/postgres-js")]);
  const client = postgres(url, {
    max: poolMax,
    idle_timeout: 30,
    connect_timeout: 5,
    backoff: reconnectBackoff,
    onnotice: () => {},
    // A session whose client stopped mid-transaction (SIGSTOP, a paused VM, a partition) would otherwise
    // hold its row locks until the server notices the silent client, hours later: the organisation's quota
    // counter locked for every instance. Our transactions never wait on anything but the database.
    connection: { idle_in_transaction_session_timeout: IDLE_IN_TRANSACTION_MS },
    // Our timestamps are timestamptz(3) Date objects; bigint columns are read as numbers by drizzle.
  });
  const db = drizzlePostgres(client, { schema }) as unknown as Db;

  /**
   * Every listen() shares one listening connection, as postgres.js's own
   * listen does, so subscribers hear messages in the order the server sent
   * them. It is a client of its own, so that one found dead can be dropped
   * and replaced, with its subscriptions, without waiting on it. postgres.js
   * re-subscribes by itself after a dropped connection and calls onlisten
   * again; every call after the first means messages may have been missed.
   */
  const subs = new Set<Subscription>();
  const probe = crypto.randomUUID();
  let heardAt = Date.now();
  let listener: postgres.Sql | undefined;
  let opening: Promise<postgres.Sql> | undefined;
  let checker: ReturnType<typeof setInterval> | undefined;
  let checking = false;

  async function openListener(): Promise<postgres.Sql> {
    const sql = postgres(url, { max: 1, idle_timeout: 0, connect_timeout: 5, backoff: reconnectBackoff, onnotice: () => {} });
    try {
      await sql.listen(LISTEN_PROBE_CHANNEL, (p) => {
        if (p === probe) heardAt = Date.now();
      });
    } catch (e) {
      opening = undefined;
      void sql.end({ timeout: 0 }).catch(() => {});
      throw e;
    }
    heardAt = Date.now();
    listener = sql;
    return sql;
  }

  async function attach(sql: postgres.Sql, sub: Subscription): Promise<void> {
    let first = true;
    const r = await sql.listen(
      sub.channel,
      (p) => {
        heardAt = Date.now();
        sub.onMessage(p);
      },
      () => {
        heardAt = Date.now();
        if (first) first = false;
        else sub.onReconnect();
      },
    );
    sub.unlisten = () => r.unlisten();
  }

  async function endListener(timeout: number): Promise<void> {
    if (checker) clearInterval(checker);
    checker = undefined;
    const l = listener;
    listener = undefined;
    opening = undefined;
    await l?.end({ timeout }).catch(() => {});
  }

  /**
   * A LISTEN connection can die without a word (a NAT or firewall drops the
   * idle flow, a partition): nothing arrives, nothing fails, and revocations
   * wait for the cache TTL. Every LISTEN_CHECK_MS without a message, a NOTIFY
   * to ourselves on the probe channel must come back within
   * ANSWER_TIMEOUT_MS; when the NOTIFY was sent (the database answers) and
   * did not come back, the connection is replaced, every subscription made
   * again on the new one, and each told, as after a reconnect (the key cache
   * re-verifies every entry).
   */
  async function checkListener(): Promise<void> {
    if (checking || !listener || subs.size === 0 || Date.now() - heardAt < LISTEN_CHECK_MS) return;
    checking = true;
    try {
      const sent = Date.now();
      try {
        await answeredWithin(client`select pg_notify(${LISTEN_PROBE_CHANNEL}, ${probe})`.execute(), ANSWER_TIMEOUT_MS, "listen probe");
      } catch {
        return; // the database does not answer at all: postgres.js and the readiness check deal with that
      }
      while (heardAt < sent && Date.now() - sent < ANSWER_TIMEOUT_MS) await Bun.sleep(50);
      if (heardAt >= sent || !listener) return;
      const dead = listener;
      listener = undefined;
      void dead.end({ timeout: 0 }).catch(() => {});
      opening = openListener();
      const sql = await opening;
      for (const sub of subs) await attach(sql, sub);
      for (const sub of subs) sub.onReconnect();
    } catch {
      // the new listener failed: the next check tries again
    } finally {
      checking = false;
    }
  }

  return {
    kind: "postgres",
    db,
    poolMax,
    async rows<T>(query: SQL) {
      return (await db.execute(query)) as unknown as T[];
    },
    async listen(channel, onMessage, onReconnect) {
      opening ??= openListener();
      const sql = await opening;
      const sub: Subscription = { channel, onMessage, onReconnect };
      subs.add(sub);
      await attach(sql, sub);
      checker ??= setInterval(() => void checkListener(), 1_000);
      checker.unref?.();
      return async () => {
        subs.delete(sub);
        await sub.unlisten?.().catch(() => {});
        if (subs.size === 0) await endListener(1);
      };
    },
    async ping() {
      try {
        await answeredWithin(client`select 1`.execute(), ANSWER_TIMEOUT_MS, "ping");
        return true;
      } catch {
        return false;
      }
    },
    async close() {
      // Everything worth writing was flushed before close; do not wait on a connection the server already dropped.
      await endListener(0);
      await client.end({ timeout: 1 });
    },
  };
}

export async function openDatabase(opts: DbOptions): Promise<Database> {
  if (opts.databaseUrl) return openPostgres(opts.databaseUrl, opts.poolMax ?? 10);
  return openPglite(opts.dataDir);
}

/** Arbitrary constant: the advisory lock that serialises migrations across instances. */
const MIGRATION_LOCK = 72_530_017;

/**
 * Apply the embedded migrations in one transaction under an advisory lock, so
 * several instances starting at once apply each migration exactly once.
 * Returns the tags it applied.
 */
export async function migrate(database: Database): Promise<string[]> {
  return database.db.transaction(async (tx) => {
    await tx.execute(sql`select pg_advisory_xact_lock(${MIGRATION_LOCK})`);
    await tx.execute(
      sql`create table if not exists gateway_migrations (tag text primary key, applied_at timestamptz not null default now())`,
    );
    const done = (await tx.execute(sql`select tag from gateway_migrations`)) as unknown;
    const doneRows = (Array.isArray(done) ? done : (done as { rows: { tag: string }[] }).rows) as { tag: string }[];
    const applied = new Set(doneRows.map((r) => r.tag));
    const ran: string[] = [];
    for (const m of MIGRATIONS) {
      if (applied.has(m.tag)) continue;
      for (const stmt of m.statements) await tx.execute(sql.raw(stmt));
      await tx.execute(sql`insert into gateway_migrations (tag) values (${m.tag})`);
      ran.push(m.tag);
    }
    return ran;
  });
}

/** A database holding applied migrations this binary does not carry: a newer release (or another build) migrated it. */
export interface UnknownMigrations {
  /** The tags this binary does not know, in order. */
  unknown: string[];
  /** The newest migration the database has applied, and the newest this binary knows. */
  databaseNewest: string;
  gatewayNewest: string;
  /** One line for the operator, naming both. */
  message: string;
}

/**
 * Undefined when every migration the database has applied is one of ours.
 * Nothing is undone: a rollback to an older release keeps the newer schema
 * (docs/decisions.md: Command line).
 */
export async function unknownMigrations(database: Database): Promise<UnknownMigrations | undefined> {
  const rows = await database.rows<{ tag: string }>(sql`select tag from gateway_migrations order by tag`);
  const known = new Set(MIGRATIONS.map((m) => m.tag));
  const unknown = rows.map((r) => r.tag).filter((t) => !known.has(t));
  if (unknown.length === 0) return undefined;
  // Tags start with a zero-padded number, so their order is the order they were made in.
  const databaseNewest = rows.at(-1)?.tag ?? "";
  const gatewayNewest = MIGRATIONS.at(-1)?.tag ?? "";
  const who = databaseNewest > gatewayNewest ? "a newer release" : "another build";
  const message =
    `the database has ${unknown.length} migration${unknown.length === 1 ? "" : "s"} this gateway does not know (${unknown.join(", ")}): ` +
    `the newest it has is ${databaseNewest}, the newest this gateway knows is ${gatewayNewest}; ${who} migrated it, and this one may fail on that schema`;
  return { unknown, databaseNewest, gatewayNewest, message };
}

/**
 * True when every embedded migration has been applied (readiness), matched by
 * tag: a newer release's migrations the database also holds neither count
 * for nor against it.
 */
export function migrationsApplied(tags: string[]): boolean {
  const applied = new Set(tags);
  return MIGRATIONS.every((m) => applied.has(m.tag));
}

/** migrationsApplied, read from the database (each query bounded by ANSWER_TIMEOUT_MS); GET /readyz uses src/db/ready.ts. */
export async function migrationsCurrent(database: Database): Promise<boolean> {
  try {
    const rows = await answeredWithin(database.rows<{ tag: string }>(sql`select tag from gateway_migrations`), ANSWER_TIMEOUT_MS, "migrations check");
    return migrationsApplied(rows.map((r) => r.tag));
  } catch {
    return false;
  }
}
