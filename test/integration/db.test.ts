import { afterAll, describe, expect, test, setDefaultTimeout } from "bun:test";
import { existsSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { sql } from "drizzle-orm";
import { createOrg } from "../../src/admin/service.ts";
import { searchTextOf } from "../../src/audit/record.ts";
import { type Database, DataDirLockedError, migrate, migrationsCurrent, openDatabase } from "../../src/db/client.ts";
import { MIGRATIONS } from "../../src/db/migrations.ts";
import { createScratchDatabase, removeScratch, type ScratchPostgres, scratchDir } from "../helpers/process.ts";
import { rejectionOf } from "../helpers/harness.ts";
import { until } from "../helpers/poll.ts";

// Bun 1.4.5 applies a preload's setDefaultTimeout only to the first test file it
// runs (test/helpers/setup.ts), so files that spawn processes or open PGlite set
// their own: a cold PGlite start on a busy 2-core machine takes several seconds.
setDefaultTimeout(60_000);

/**
 * One database suite, two drivers: embedded PGlite always, postgres.js when
 * TEST_DATABASE_URL is set (CI sets it). Each Postgres case gets a scratch
 * database of its own so it sees migrations run from nothing.
 */

const TEST_DATABASE_URL = process.env.TEST_DATABASE_URL;
const ALL_TAGS = MIGRATIONS.map((m) => m.tag);

const cleanups: (() => Promise<void>)[] = [];
afterAll(async () => {
  for (const c of cleanups.splice(0).reverse()) await c().catch(() => {});
  removeScratch();
});

type Kind = "pglite" | "postgres";

/** A fresh, empty (unmigrated) database of the given kind, closed after the file. */
async function fresh(kind: Kind, poolMax = 4): Promise<Database> {
  let url: string | undefined;
  if (kind === "postgres") {
    const pg: ScratchPostgres = await createScratchDatabase(TEST_DATABASE_URL ?? "", "gw_dbtest");
    cleanups.push(() => pg.drop());
    url = pg.url;
  }
  const db = await openDatabase({ databaseUrl: url, dataDir: "memory://", poolMax });
  cleanups.push(() => db.close());
  return db;
}

/** Driver errors are wrapped by drizzle ("Failed query: …"); the server's words are in the cause. */
async function failure(p: Promise<unknown>): Promise<string> {
  try {
    await p;
  } catch (e) {
    const parts: string[] = [];
    for (let c: unknown = e; c instanceof Error; c = c.cause) parts.push(c.message);
    return parts.join(" | ");
  }
  throw new Error("expected the statement to fail");
}

async function insertAuditEvent(db: Database): Promise<string> {
  const [row] = await db.rows<{ id: string }>(sql`
    insert into audit_events (org_id, action, category, actor_type, actor_id, actor_name, actor_email,
                              targets, details, origin_ip_prefix, origin_user_agent_summary, search_text)
    values (gen_random_uuid(), 'member.invited', 'member', 'user', gen_random_uuid(), 'Ada', 'ada@example.com',
            '[]'::jsonb, '{}'::jsonb, '203.0.113.0/24', 'Firefox/131.0', 'member.invited ada ada@example.com')
    returning id`);
  if (!row) throw new Error("no row");
  return row.id;
}

/** Bring a fresh database to where a gateway before `tag` left it. */
/** An audit event as the tests before 0005 wrote it (no targets). */
function oldEvent(name: string, email: string) {
  return { action: "member.invited", actor: { type: "user" as const, id: crypto.randomUUID(), name, email, keyId: null }, targets: [] };
}

/** A row as the gateway wrote it before 0005: its fields joined by spaces, lower-cased by JavaScript. */
async function insertOldEvent(db: Database, name: string, email: string): Promise<string> {
  const old = `member.invited ${name} ${email}`.toLowerCase();
  const [row] = await db.rows<{ id: string }>(sql`
    insert into audit_events (org_id, action, category, actor_type, actor_id, actor_name, actor_email,
                              targets, details, origin_ip_prefix, origin_user_agent_summary, search_text)
    values (gen_random_uuid(), 'member.invited', 'member', 'user', gen_random_uuid(), ${name}, ${email},
            '[]'::jsonb, '{}'::jsonb, '', '', ${old})
    returning id::text as id`);
  return row?.id ?? "";
}

async function migrateUpTo(db: Database, tag: string): Promise<number> {
  const upTo = MIGRATIONS.findIndex((m) => m.tag === tag);
  expect(upTo).toBeGreaterThan(0);
  await db.db.transaction(async (tx) => {
    await tx.execute(sql`create table gateway_migrations (tag text primary key, applied_at timestamptz not null default now())`);
    for (const m of MIGRATIONS.slice(0, upTo)) {
      for (const stmt of m.statements) await tx.execute(sql.raw(stmt));
      await tx.execute(sql`insert into gateway_migrations (tag) values (${m.tag})`);
    }
  });
  return upTo;
}

function suite(kind: Kind) {
  test("0005: keys without expiry get created_at + 365 days (at least 30 days from the upgrade) and expires_at becomes NOT NULL; search_text gets one field per line", async () => {
    const db = await fresh(kind);
    // The database as a gateway before 0005 left it.
    const upTo = await migrateUpTo(db, "0005_keys_expire_search_fields");
    const [org] = await db.rows<{ id: string }>(sql`insert into organizations (name, plan) values ('Old', 'Standard') returning id::text as id`);
    const key = (expires: string | null, created = "2024-02-28T10:00:00.123Z") => sql`
      insert into api_keys (org_id, kind, hash, prefix, scopes, expires_at, created_at)
      values (${org?.id}, 'service', ${crypto.randomUUID()}, 'sk-gw-old', '{inference}', ${expires}, ${created}) returning id::text as id`;
    const [never] = await db.rows<{ id: string }>(key(null));
    const recentlyCreated = new Date(Date.now() - 10 * 86_400_000);
    const [recent] = await db.rows<{ id: string }>(key(null, recentlyCreated.toISOString()));
    const [dated] = await db.rows<{ id: string }>(key("2030-01-01T00:00:00.000Z"));
    const [event] = await db.rows<{ id: string }>(sql`
      insert into audit_events (org_id, action, category, actor_type, actor_id, actor_name, actor_email,
                                targets, details, origin_ip_prefix, origin_user_agent_summary, search_text)
      values (${org?.id}, 'member.invited', 'member', 'user', gen_random_uuid(), 'Ada Lovelace', 'Ada@Example.com',
              ${JSON.stringify([
                { key: "target_user_id", kind: "user", id: crypto.randomUUID(), name: "Grace Hopper", email: "" },
                { key: "group_id", kind: "group", id: crypto.randomUUID(), name: "", email: "" },
                { key: "x_id", kind: "user", id: crypto.randomUUID(), name: "Zed", email: "zed@example.com" },
              ])}::jsonb, '{}'::jsonb, '', '', 'member.invited ada lovelace ada@example.com grace hopper zed zed@example.com')
      returning id::text as id`);

    const upgradedAt = Date.now();
    expect(await migrate(db)).toEqual(MIGRATIONS.slice(upTo).map((m) => m.tag));
    const expiry = async (id: string | undefined) =>
      new Date((await db.rows<{ e: string | Date }>(sql`select expires_at as e from api_keys where id = ${id}`))[0]?.e ?? 0).toISOString();
    // Past created_at + 365 days already: 30 days from the upgrade instead.
    const graced = new Date(await expiry(never?.id)).getTime();
    expect(graced).toBeGreaterThanOrEqual(upgradedAt + 30 * 86_400_000 - 1_000);
    expect(graced).toBeLessThanOrEqual(Date.now() + 30 * 86_400_000 + 1_000);
    expect(await expiry(recent?.id)).toBe(new Date(recentlyCreated.getTime() + 365 * 86_400_000).toISOString());
    expect(await expiry(dated?.id)).toBe("2030-01-01T00:00:00.000Z");
    const [col] = await db.rows<{ n: string }>(sql`select is_nullable as n from information_schema.columns where table_name = 'api_keys' and column_name = 'expires_at'`);
    expect(col?.n).toBe("NO");
    expect(await failure(db.rows(key(null)))).toContain("expires_at");
    const [row] = await db.rows<{ s: string }>(sql`select search_text as s from audit_events where id = ${event?.id}`);
    expect(row?.s).toBe("member.invited\nada lovelace\nada@example.com\ngrace hopper\nzed\nzed@example.com");
    // The log is append-only again.
    expect(await failure(db.rows(sql`update audit_events set action = 'member.removed' where id = ${event?.id}`))).toContain("append-only");
  });

  test("0010: search_text is refolded as the gateway now writes it (NFKC, final sigma as σ); rows that do not change are not rewritten", async () => {
    const db = await fresh(kind);
    const upTo = await migrateUpTo(db, "0010_audit_search_fold");
    const people: [string, string, { name: string; email: string }[]][] = [
      ["ΣΊΣΥΦΟΣ", "", [{ name: "Οδυσσέας", email: "" }]],
      ["Σίσυφος Παπαδόπουλος", "sisyphos@example.com", []],
      ["Zoe\u0301 Martin", "zoe\u0301@example.com", [{ name: "Chlo\u00e9", email: "" }]],
      ["Ａｃｍｅ™ \ufb01nance\u00a0bot", "", [{ name: "ℌilbert ½", email: "ＨＩ@example.com" }]],
      ["Ada Lovelace", "Ada@Example.com", [{ name: "Grace Hopper", email: "grace@example.com" }]],
    ];
    const written: { id: string; want: string }[] = [];
    for (const [name, email, targets] of people) {
      const event = {
        action: "member.invited",
        actor: { type: "user", id: crypto.randomUUID(), name, email, keyId: null },
        targets: targets.map((t) => ({ key: "target_user_id", kind: "user", id: crypto.randomUUID(), ...t })),
      };
      // What the gateway wrote before 0010: the fields, one per line, lower-cased by JavaScript.
      const old = [event.action, name, email, ...targets.flatMap((t) => [t.name, t.email])].filter((p) => p).join("\n").toLowerCase();
      const [row] = await db.rows<{ id: string }>(sql`
        insert into audit_events (org_id, action, category, actor_type, actor_id, actor_name, actor_email,
                                  targets, details, origin_ip_prefix, origin_user_agent_summary, search_text)
        values (gen_random_uuid(), ${event.action}, 'member', 'user', ${event.actor.id}, ${name}, ${email},
                ${JSON.stringify(event.targets)}::jsonb, '{}'::jsonb, '', '', ${old})
        returning id::text as id`);
      written.push({ id: row?.id ?? "", want: searchTextOf(event) });
    }
    expect(written[0]?.want).toBe("member.invited\nσίσυφοσ\nοδυσσέασ");
    expect(written[2]?.want).toBe("member.invited\nzo\u00e9 martin\nzo\u00e9@example.com\nchlo\u00e9");
    expect(written[3]?.want).toBe("member.invited\nacmetm finance bot\nhilbert 1\u20442\nhi@example.com");
    const versions = async () =>
      new Map((await db.rows<{ id: string; x: string }>(sql`select id::text as id, xmin::text as x from audit_events`)).map((r) => [r.id, r.x]));
    const before = await versions();

    expect(await migrate(db)).toEqual(MIGRATIONS.slice(upTo).map((m) => m.tag));
    for (const { id, want } of written) {
      const [row] = await db.rows<{ s: string }>(sql`select search_text as s from audit_events where id = ${id}`);
      expect(row?.s).toBe(want);
    }
    // Ada's row was already folded: left alone (same row version).
    const after = await versions();
    expect(after.get(written[4]?.id ?? "")).toBe(before.get(written[4]?.id ?? ""));
    expect(after.get(written[0]?.id ?? "")).not.toBe(before.get(written[0]?.id ?? ""));
    // The log is append-only again.
    expect(await failure(db.rows(sql`update audit_events set action = 'member.removed' where id = ${written[0]?.id}`))).toContain("append-only");
  });

  test("0010: rows 0005 lower-cased in the database (its lower(), not JavaScript's) are refolded from their fields as the gateway writes them", async () => {
    const db = await fresh(kind);
    const upTo = await migrateUpTo(db, "0005_keys_expire_search_fields");
    // A row written before 0005 (fields joined by spaces); 0005 rewrote it with Postgres's lower(), which
    // lowers İ to a plain i where JavaScript (the writer and q) writes i + U+0307: q=İlkay found nothing.
    const id = await insertOldEvent(db, "İLKAY Gündoğan", "ilkay@example.com");
    expect(await migrate(db)).toEqual(MIGRATIONS.slice(upTo).map((m) => m.tag));
    const [row] = await db.rows<{ s: string }>(sql`select search_text as s from audit_events where id = ${id}`);
    expect(row?.s).toBe(searchTextOf(oldEvent("İLKAY Gündoğan", "ilkay@example.com")));
    expect(row?.s).toBe("member.invited\ni\u0307lkay gündoğan\nilkay@example.com");
  });

  test("migrations apply once: a second run applies nothing and changes nothing", async () => {
    const db = await fresh(kind);
    expect(await migrationsCurrent(db)).toBe(false);
    expect(await migrate(db)).toEqual(ALL_TAGS);
    expect(await migrationsCurrent(db)).toBe(true);
    const tables = async () =>
      (await db.rows<{ t: string }>(sql`select table_name as t from information_schema.tables where table_schema = 'public' order by 1`)).map((r) => r.t);
    const before = await tables();
    expect(before).toEqual(
      expect.arrayContaining(["api_keys", "audit_events", "gateway_migrations", "organizations", "settings", "usage_counters", "usage_events", "users"]),
    );
    expect(await migrate(db)).toEqual([]);
    expect(await migrate(db)).toEqual([]);
    expect(await tables()).toEqual(before);
    const applied = await db.rows<{ tag: string }>(sql`select tag from gateway_migrations order by tag`);
    expect(applied.map((r) => r.tag)).toEqual([...ALL_TAGS].sort());
  });

  test("readiness needs every migration of ours by its tag: an unknown newer one does not make up for one missing", async () => {
    const db = await fresh(kind);
    await migrate(db);
    expect(await migrationsCurrent(db)).toBe(true);
    // As many rows as this binary has migrations, but not the same set.
    const missing = ALL_TAGS[3] as string;
    await db.rows(sql`delete from gateway_migrations where tag = ${missing}`);
    await db.rows(sql`insert into gateway_migrations (tag) values ('9999_from_a_newer_release')`);
    // Before: true (the rows were counted, not matched).
    expect(await migrationsCurrent(db)).toBe(false);
    // With it back it is current, the unknown one (a newer release's) notwithstanding.
    await db.rows(sql`insert into gateway_migrations (tag) values (${missing})`);
    expect(await migrationsCurrent(db)).toBe(true);
  });

  test("migrations started concurrently apply each migration exactly once (advisory lock)", async () => {
    // Postgres: several instances (pools) on one fresh database, as when several
    // gateways start at once. PGlite: one process, several concurrent callers.
    const first = await fresh(kind, 1);
    let dbs: Database[] = [first, first, first, first];
    if (kind === "postgres") {
      const url = await urlOf(first);
      const others = await Promise.all([1, 2, 3].map(() => openDatabase({ databaseUrl: url, dataDir: "memory://", poolMax: 1 })));
      for (const o of others) cleanups.push(() => o.close());
      dbs = [first, ...others];
    }
    const results = await Promise.all(dbs.map((d) => migrate(d)));
    expect(results.flat().sort()).toEqual([...ALL_TAGS].sort());
    expect(results.filter((r) => r.length > 0).length).toBe(1);
    const counts = await first.rows<{ n: number }>(sql`select count(*)::int as n from gateway_migrations`);
    expect(Number(counts[0]?.n)).toBe(ALL_TAGS.length);
    for (const d of dbs) expect(await migrationsCurrent(d)).toBe(true);
  });

  test("pg_trgm (and every extension the migrations create) is installed and usable", async () => {
    const db = await fresh(kind);
    await migrate(db);
    const wanted = [...MIGRATIONS.flatMap((m) => m.statements).join("\n").matchAll(/create extension if not exists "?(\w+)"?/gi)].map((m) => m[1]);
    expect(wanted).toContain("pg_trgm");
    const ext = await db.rows<{ extname: string }>(sql`select extname from pg_extension`);
    expect(ext.map((r) => r.extname)).toEqual(expect.arrayContaining(wanted));
    const [sim] = await db.rows<{ s: number }>(sql`select similarity('grace hopper', 'grace hoper')::float8 as s`);
    expect(Number(sim?.s)).toBeGreaterThan(0.5);
    const idx = await db.rows<{ indexdef: string }>(sql`select indexdef from pg_indexes where tablename = 'audit_events' and indexdef like '%gin_trgm_ops%'`);
    expect(idx.length).toBeGreaterThan(0);
    await insertAuditEvent(db);
    const hits = await db.rows<{ n: number }>(sql`select count(*)::int as n from audit_events where search_text % 'ada@exampl.com'`);
    expect(Number(hits[0]?.n)).toBe(1);
  });

  // docs/decisions.md, Responses API: "The index has no pending list (`fastupdate = off`, migration 0011)":
  // with one, every item_reference probe read it whole on the embedded database (no autovacuum merges it).
  test("0011: the GIN index on responses.output_item_ids has no pending list (fastupdate = off)", async () => {
    const db = await fresh(kind);
    await migrate(db);
    const rows = await db.rows<{ opts: string | null }>(
      sql`select array_to_string(reloptions, ',') as opts from pg_class where relname = 'responses_output_item_ids_idx'`,
    );
    expect(rows).toEqual([{ opts: "fastupdate=off" }]);
  });

  test("the audit log is append-only: UPDATE, DELETE and TRUNCATE are refused", async () => {
    const db = await fresh(kind);
    await migrate(db);
    const id = await insertAuditEvent(db);
    expect(await failure(db.rows(sql`update audit_events set action = 'member.removed' where id = ${id}`))).toContain("append-only");
    expect(await failure(db.rows(sql`delete from audit_events where id = ${id}`))).toContain("append-only");
    expect(await failure(db.rows(sql`truncate audit_events`))).toContain("append-only");
    const rows = await db.rows<{ action: string }>(sql`select action from audit_events where id = ${id}`);
    expect(rows).toEqual([{ action: "member.invited" }]);
    // Inserting stays allowed.
    await insertAuditEvent(db);
  });

  test("rows() has the same shape on both drivers; ping; LISTEN/NOTIFY", async () => {
    const db = await fresh(kind);
    await migrate(db);
    expect(await db.rows<{ a: number; b: string }>(sql`select 1::int as a, 'x' as b`)).toEqual([{ a: 1, b: "x" }]);
    expect(await db.ping()).toBe(true);
    const got: string[] = [];
    const unlisten = await db.listen("gw_test_channel", (p) => got.push(p), () => {});
    await db.rows(sql`select pg_notify('gw_test_channel', 'hello')`);
    await until(() => got.length > 0, "the NOTIFY to arrive");
    expect(got).toEqual(["hello"]);
    await unlisten();
  });

  test("a failed transaction leaves nothing behind", async () => {
    const db = await fresh(kind);
    await migrate(db);
    const err = await rejectionOf(
      db.db.transaction(async (tx) => {
        await tx.execute(sql`insert into settings (key, value) values ('k1', 'v')`);
        throw new Error("abort");
      }),
    );
    expect((err as Error).message).toBe("abort");
    expect(await db.rows(sql`select * from settings where key = 'k1'`)).toEqual([]);
  });
}

/** The URL of the scratch database a postgres Database is connected to. */
async function urlOf(db: Database): Promise<string> {
  const [row] = await db.rows<{ d: string }>(sql`select current_database() as d`);
  const u = new URL(TEST_DATABASE_URL ?? "");
  u.pathname = `/${row?.d}`;
  return u.toString();
}

describe("PGlite (embedded)", () => {
  suite("pglite");

  test("on disk: data survives a reopen; the data directory is locked while open", async () => {
    const dir = join(scratchDir("gw-db-"), "data");
    const a = await openDatabase({ dataDir: dir });
    let org: { id: string };
    try {
      await migrate(a);
      org = await createOrg(a, { name: "Persisted", plan: "Standard", plans: ["Standard"] });
      expect(readFileSync(join(dir, "gateway.pid"), "utf8")).toBe(String(process.pid));
      // A second open of the same directory in this process is refused, not allowed to corrupt it.
      expect(await rejectionOf(openDatabase({ dataDir: dir }))).toBeInstanceOf(DataDirLockedError);
    } finally {
      await a.close();
    }
    expect(existsSync(join(dir, "gateway.pid"))).toBe(false);

    const b = await openDatabase({ dataDir: dir });
    try {
      expect(await migrate(b)).toEqual([]);
      const rows = await b.rows<{ name: string }>(sql`select name from organizations where id = ${org.id}`);
      expect(rows).toEqual([{ name: "Persisted" }]);
    } finally {
      await b.close();
    }
  });

  test("the worker thread: errors keep their fields, transactions hold other statements back, savepoints, priority", async () => {
    const db = await fresh("pglite");
    await migrate(db);
    // A database error crosses the thread with its SQLSTATE and its words.
    await db.rows(sql`insert into settings (key, value) values ('dup', '1')`);
    const dup = (await rejectionOf(db.rows(sql`insert into settings (key, value) values ('dup', '2')`))) as Error & { cause?: { code?: string } };
    expect(dup.cause?.code ?? (dup as { code?: string }).code).toBe("23505");
    expect(String(dup.cause ?? dup)).toContain("duplicate key");

    // A statement from outside waits for an open transaction and never sees its uncommitted rows.
    let release!: () => void;
    const held = new Promise<void>((r) => {
      release = r;
    });
    let inserted!: () => void;
    const insertedP = new Promise<void>((r) => {
      inserted = r;
    });
    const tx = db.db.transaction(async (t) => {
      await t.execute(sql`insert into settings (key, value) values ('tx', 'pending')`);
      inserted();
      await held;
    });
    await insertedP;
    let outsideSaw: unknown;
    const outside = db.rows<{ value: string }>(sql`select value from settings where key = 'tx'`).then((r) => {
      outsideSaw = r;
    });
    await Bun.sleep(50);
    expect(outsideSaw).toBeUndefined(); // still waiting behind the transaction
    release();
    await tx;
    await outside;
    expect(outsideSaw).toEqual([{ value: "pending" }]); // ran after the commit

    // A nested transaction is a savepoint: its failure rolls back only its own work.
    await db.db.transaction(async (t) => {
      await t.execute(sql`insert into settings (key, value) values ('outer', '1')`);
      await rejectionOf(
        t.transaction(async (inner) => {
          await inner.execute(sql`insert into settings (key, value) values ('inner', '1')`);
          throw new Error("inner fails");
        }),
      );
    });
    const keys = (await db.rows<{ key: string }>(sql`select key from settings where key in ('outer', 'inner') order by key`)).map((r) => r.key);
    expect(keys).toEqual(["outer"]);

    // Shared buffers are kept small (most of the embedded database's memory otherwise).
    expect(await db.rows(sql`show shared_buffers`)).toEqual([{ shared_buffers: "16MB" }]);

    // On Linux the database thread runs at nice 10, below the request thread.
    if (process.platform === "linux") {
      const { readdirSync } = await import("node:fs");
      const niceOf = (tid: string) => Number(readFileSync(`/proc/self/task/${tid}/stat`, "utf8").split(") ")[1]?.split(" ")[16]);
      const nices = readdirSync("/proc/self/task").map(niceOf);
      expect(nices).toContain(10);
      expect(niceOf(String(process.pid))).toBe(0);
    }
  });

  test("a lock held by a live process is refused with a clear message; a stale one is taken over", async () => {
    const dir = join(scratchDir("gw-lock-"), "data");
    mkdirSync(dir, { recursive: true });
    // The test runner's parent (a shell or CI) is alive for the whole run.
    writeFileSync(join(dir, "gateway.pid"), String(process.ppid));
    const message = await failure(openDatabase({ dataDir: dir }));
    expect(message).toContain(`in use by process ${process.ppid}`);
    expect(message).toContain("DATABASE_URL");
    expect(readFileSync(join(dir, "gateway.pid"), "utf8")).toBe(String(process.ppid));

    // No process has pid 2^22 + 1 (above Linux's pid_max default and maximum).
    writeFileSync(join(dir, "gateway.pid"), String(4_194_305));
    const db = await openDatabase({ dataDir: dir });
    try {
      expect(readFileSync(join(dir, "gateway.pid"), "utf8")).toBe(String(process.pid));
      expect(await db.ping()).toBe(true);
    } finally {
      await db.close();
    }
  });
});

describe.skipIf(!TEST_DATABASE_URL)("Postgres (TEST_DATABASE_URL)", () => {
  suite("postgres");

  test("0010 on a database not in UTF8 (SQL_ASCII) applies and leaves search_text as it was (normalize() needs UTF8)", async () => {
    const pg = await createScratchDatabase(TEST_DATABASE_URL ?? "", "gw_dbtest", "template template0 encoding 'SQL_ASCII' lc_collate 'C' lc_ctype 'C'");
    cleanups.push(() => pg.drop());
    const db = await openDatabase({ databaseUrl: pg.url, dataDir: "memory://", poolMax: 2 });
    cleanups.push(() => db.close());
    const upTo = await migrateUpTo(db, "0010_audit_search_fold");
    const old = "member.invited\nzoe\u0301 ｍａｒｔｉｎ\nσίσυφος";
    const [event] = await db.rows<{ id: string }>(sql`
      insert into audit_events (org_id, action, category, actor_type, actor_id, actor_name, actor_email,
                                targets, details, origin_ip_prefix, origin_user_agent_summary, search_text)
      values (gen_random_uuid(), 'member.invited', 'member', 'user', gen_random_uuid(), 'Zoe\u0301 ＭＡＲＴＩＮ', '',
              '[]'::jsonb, '{}'::jsonb, '', '', ${old})
      returning id::text as id`);
    const id = event?.id;
    expect(await migrate(db)).toEqual(MIGRATIONS.slice(upTo).map((m) => m.tag));
    const [row] = await db.rows<{ s: string }>(sql`select search_text as s from audit_events where id = ${id}`);
    expect(row?.s).toBe(old);
  });
});

describe.skipIf(!TEST_DATABASE_URL)("Postgres whose LC_CTYPE is C (TEST_DATABASE_URL)", () => {
  test("0010: rows 0005 lower-cased there (A to Z only) are refolded as the gateway writes them, so q=Émile finds Émile", async () => {
    const pg = await createScratchDatabase(TEST_DATABASE_URL ?? "", "gw_dbtest", "template template0 encoding 'UTF8' lc_collate 'C' lc_ctype 'C'");
    cleanups.push(() => pg.drop());
    const db = await openDatabase({ databaseUrl: pg.url, dataDir: "memory://", poolMax: 2 });
    cleanups.push(() => db.close());
    const upTo = await migrateUpTo(db, "0005_keys_expire_search_fields");
    const id = await insertOldEvent(db, "ÉMILE Ölund", "emile@example.com");
    expect(await migrate(db)).toEqual(MIGRATIONS.slice(upTo).map((m) => m.tag));
    const [row] = await db.rows<{ s: string }>(sql`select search_text as s from audit_events where id = ${id}`);
    // Before: 0005 left "Émile Ölund" (lower() there folds A to Z only), and 0010 kept it: already NFKC.
    expect(row?.s).toBe("member.invited\némile ölund\nemile@example.com");
    expect(row?.s).toBe(searchTextOf(oldEvent("ÉMILE Ölund", "emile@example.com")));
  });
});

describe("postgres.js without a server", () => {
  test("ping and readiness are false, not an exception", async () => {
    const db = await openDatabase({ databaseUrl: "postgres://postgres@127.0.0.1:1/none", dataDir: "memory://", poolMax: 1 });
    try {
      expect(await db.ping()).toBe(false);
      expect(await migrationsCurrent(db)).toBe(false);
    } finally {
      await db.close();
    }
  });
});
