import { afterAll, beforeAll } from "bun:test";
import { sql } from "drizzle-orm";
import postgres from "postgres";
import { type Database, migrate, openDatabase } from "../../src/db/client.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { testAliases, upstreamSettings } from "../integration/inference-fixtures.ts";
import { TEST_DATABASE_URL, bearer, errorOf, startTestGateway } from "./harness.ts";
import { createScratchDatabase, type ScratchPostgres } from "./process.ts";

/**
 * What the Postgres-only "the database does not answer" tests share
 * (pg-key-lookups, pg-pool-bounds, …): their scratch database and
 * simulator (useScene), a table locked by another session, a
 * count of the sessions waiting on a lock (and its most, sampled), a
 * request (a chat request) timed with its error code, those outcomes
 * tallied, and a gauge read off /metrics.
 */

/** Another session locks `table`: every statement that reads or writes it waits on the server; nothing else does. */
export async function lockTable(url: string, table: string): Promise<{ unlock(): Promise<void> }> {
  const locker = postgres(url, { max: 1, onnotice: () => {} });
  let release = () => {};
  const gate = new Promise<void>((r) => {
    release = r;
  });
  let onLocked = () => {};
  const isLocked = new Promise<void>((r) => {
    onLocked = r;
  });
  const locked = locker.begin(async (tx) => {
    await tx.unsafe(`lock table ${table} in access exclusive mode`);
    onLocked();
    await gate;
  });
  await Promise.race([isLocked, locked]);
  let done: Promise<void> | undefined;
  return {
    unlock() {
      release();
      done ??= locked.then(
        () => locker.end({ timeout: 1 }),
        () => locker.end({ timeout: 1 }),
      );
      return done;
    },
  };
}

/** Sessions of this database waiting on a lock whose statement matches `like` (ILIKE). */
export async function sessionsWaiting(db: Database, like: string): Promise<number> {
  const [r] = await db.rows<{ n: number }>(
    sql`select count(*)::int as n from pg_stat_activity
        where datname = current_database() and wait_event_type = 'Lock' and query ilike ${like}`,
  );
  return r?.n ?? -1;
}

/**
 * The max_tokens whose chat request ("hello", as the lock tests send it) reserves exactly `quota`: its
 * prompt's bound read from the 429 of one larger than the whole quota, which says what it needs (such a
 * refusal takes no audit row while the quota has room). A request of it fits the quota but not what any
 * usage left: refused for want of what is left, so it takes the period's billing.budget_exceeded event.
 */
export async function wholeQuotaMaxTokens(url: string, key: string, quota: number): Promise<number> {
  const big = quota * 5;
  const res = await fetch(`${url}/v1/chat/completions`, {
    method: "POST",
    headers: { ...bearer(key), "content-type": "application/json" },
    body: JSON.stringify({ model: "svc-fast", max_tokens: big, messages: [{ role: "user", content: "hello" }] }),
  });
  const needs = Number(/needs \((\d+)\)/.exec((await errorOf(res)).message)?.[1]);
  if (res.status !== 429 || !(needs > big)) throw new Error(`expected a 429 saying what the request needs, got ${res.status} (${needs})`);
  return quota - (needs - big);
}

export interface Outcome {
  status: number;
  /** The error body's code; null for a success; the exception's name when no answer came. */
  code: string | null;
  ms: number;
}

/** One request, its status, error code and time; an abort after `deadlineMs` is status 0. */
export async function timedCall(url: string, init: RequestInit, deadlineMs: number): Promise<Outcome> {
  const t = Date.now();
  try {
    const res = await fetch(url, { ...init, signal: AbortSignal.timeout(deadlineMs) });
    if (res.status >= 400) return { status: res.status, code: (await errorOf(res)).code, ms: Date.now() - t };
    await res.arrayBuffer();
    return { status: res.status, code: null, ms: Date.now() - t };
  } catch (e) {
    return { status: 0, code: (e as Error).name, ms: Date.now() - t };
  }
}

/** A chat request as the lock tests send it ("hello", `maxTokens`), timed: timedCall's outcome. */
export function timedChat(url: string, key: string, deadlineMs: number, maxTokens = 5): Promise<Outcome> {
  return timedCall(
    `${url}/v1/chat/completions`,
    {
      method: "POST",
      headers: { ...bearer(key), "content-type": "application/json" },
      body: JSON.stringify({ model: "svc-fast", max_tokens: maxTokens, messages: [{ role: "user", content: "hello" }] }),
    },
    deadlineMs,
  );
}

/** How many outcomes had each `status code` ("503 service_unavailable", "200 null", …). */
export function tally(rs: Outcome[]): Record<string, number> {
  const m: Record<string, number> = {};
  for (const r of rs) m[`${r.status} ${r.code}`] = (m[`${r.status} ${r.code}`] ?? 0) + 1;
  return m;
}

/** Samples sessionsWaiting(db, like) every 50 ms until stopped; stop() gives the most seen. */
export function waitingSampler(db: Database, like: string): { stop(): Promise<number> } {
  let most = 0;
  let on = true;
  const done = (async () => {
    while (on) {
      most = Math.max(most, await sessionsWaiting(db, like));
      await Bun.sleep(50);
    }
  })();
  return {
    async stop() {
      on = false;
      await done;
      return most;
    },
  };
}

/** A metric's value on a /metrics page (a line `name value`, no labels); NaN when absent. */
export async function gaugeOf(metricsUrl: string, name: string, deadlineMs: number): Promise<number> {
  const text = await (await fetch(metricsUrl, { signal: AbortSignal.timeout(deadlineMs) })).text();
  const line = text.split("\n").find((l) => l.startsWith(`${name} `));
  return line === undefined ? Number.NaN : Number(line.slice(name.length + 1));
}

/** A scratch Postgres database of a test file's own (migrated), a session into it for the test's queries, and a simulated upstream. */
export interface Scene {
  scratch: ScratchPostgres;
  held: Database;
  sim: Simulator;
  /**
   * A gateway on `db` (a pool of the test's size into the scratch database) and the simulator: cached keys
   * kept 10 minutes, unknown keys never throttled, no rate limit, usage written when the test flushes;
   * `over` replaces any of those settings.
   */
  gateway(db: Database, over?: Record<string, unknown>): Promise<Gateway>;
}

/**
 * Sets up a Scene for the enclosing describe (beforeAll) and tears it down
 * (afterAll); its fields are read inside tests, once set up.
 */
export function useScene(prefix: string): Scene {
  const scene = {
    gateway: (db: Database, over: Record<string, unknown> = {}) =>
      startTestGateway(
        {
          keyCache: { ttlMs: 600_000, max: 1_000, negativeTtlMs: 5_000, negativeMax: 10_000, unknownPerPrefixPerMin: 100_000, unknownPerMin: 100_000 },
          plans: { Standard: { requestsPerMinute: 1_000_000 } },
          upstream: upstreamSettings(),
          aliases: testAliases(scene.sim.url),
          quota: { flushMs: 600_000 },
          ...over,
        },
        db,
      ),
  } as Scene;
  beforeAll(async () => {
    scene.scratch = await createScratchDatabase(TEST_DATABASE_URL as string, prefix);
    scene.held = await openDatabase({ databaseUrl: scene.scratch.url, dataDir: "", poolMax: 2 });
    await migrate(scene.held);
    scene.sim = await startSimulator({ port: 0, ttftMs: 1, interTokenMs: 0, completionTokens: 5 });
  });
  afterAll(async () => {
    await scene.sim?.stop();
    await scene.held?.close();
    await scene.scratch?.drop();
  });
  return scene;
}
