import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { sql } from "drizzle-orm";
import { type Database, migrate, openDatabase } from "../../src/db/client.ts";
import { TEST_DATABASE_URL, bearer, startTestGateway } from "../helpers/harness.ts";
import { type FreezeProxy, startFreezeProxy } from "../helpers/freeze-proxy.ts";
import { type Outcome, lockTable, timedCall, waitingSampler } from "../helpers/pg-locks.ts";
import { createScratchDatabase, type ScratchPostgres } from "../helpers/process.ts";
import { until } from "../helpers/poll.ts";

setDefaultTimeout(90_000);

/**
 * GET /readyz while the database does not answer (docs/operations.md, Health;
 * docs/decisions.md, /readyz is bounded). A load balancer polls it every
 * second or two with a short timeout of its own: each poll must be answered
 * (503) within READY_TIMEOUT_MS (2 s) plus what a busy machine adds, and the
 * polls must not pile up database connections or queries: one readiness
 * check is out at a time (a second only once the first has gone unanswered
 * for 5 s), and concurrent polls share it. Before, each poll ran its own
 * `select 1` and migrations check, each waiting up to 5 s (503 after 5 to
 * 10 s), and a check given up on stayed on its connection: behind a locked
 * `gateway_migrations` every poll left one more session waiting on the lock.
 * The embedded database cannot stop answering this way (it runs in a worker
 * thread of the process), so these cases are Postgres only.
 */

/** A poll must be answered within this: READY_TIMEOUT_MS (2 s) and room for a busy 2-core machine, well below the old 5 s. */
const ANSWER_MS = 3_500;

describe.skipIf(!TEST_DATABASE_URL)("/readyz while the database does not answer", () => {
  let scratch: ScratchPostgres;
  let held: Database;

  beforeAll(async () => {
    scratch = await createScratchDatabase(TEST_DATABASE_URL as string, "s1_readyz");
    held = await openDatabase({ databaseUrl: scratch.url, dataDir: "", poolMax: 2 });
    await migrate(held);
  });
  afterAll(async () => {
    await held?.close();
    await scratch?.drop();
  });

  const poll = (url: string) => timedCall(`${url}/readyz`, {}, 15_000);

  /** A balancer's polls: `burst` at once, then one every `everyMs` for `n` more, each with its own deadline. */
  async function balancer(url: string, burst: number, n: number, everyMs: number): Promise<Outcome[]> {
    const all: Promise<Outcome>[] = [];
    for (let i = 0; i < burst; i++) all.push(poll(url));
    for (let i = 0; i < n; i++) {
      await Bun.sleep(everyMs);
      all.push(poll(url));
    }
    return Promise.all(all);
  }

  const summary = (rs: Outcome[]) => ({
    statuses: [...new Set(rs.map((r) => r.status))],
    slow: rs.filter((r) => r.ms >= ANSWER_MS).map((r) => r.ms),
  });

  test("a database that stops answering (partition): every poll is 503 within the bound; ready again once it answers", async () => {
    const proxy: FreezeProxy = await startFreezeProxy(scratch.url, 0);
    const db = await openDatabase({ databaseUrl: proxy.url, dataDir: "", poolMax: 4 });
    const gw = await startTestGateway({}, db);
    try {
      expect((await poll(gw.url)).status).toBe(200);
      proxy.freeze();
      // 10 at once, then one every 500 ms for 10 s.
      const rs = await balancer(gw.url, 10, 20, 500);
      expect(summary(rs)).toEqual({ statuses: [503], slow: [] });
      proxy.thaw();
      await until(async () => (await poll(gw.url)).status === 200, "/readyz 200 once the database answers again", 20_000, 200);
    } finally {
      proxy.thaw();
      await gw.stop();
      await db.close();
      proxy.stop();
    }
  });

  // docs/operations.md, Health: "polls share one check, which holds one pool connection (two once a check has gone
  // unanswered for 5 s)". Counted at the proxy: the connections that were sent a readiness check's `begin` and never
  // got an answer.
  test("a database that stops answering: 12 s of polls (a burst, then three a second) leave readiness work on two connections, no more; /healthz still answers 200 at once", async () => {
    const proxy: FreezeProxy = await startFreezeProxy(scratch.url, 0);
    const db = await openDatabase({ databaseUrl: proxy.url, dataDir: "", poolMax: 10 });
    const gw = await startTestGateway({}, db);
    try {
      // Six connections open and idle, so every check finds one (a new one would time out and reconnect while frozen).
      await Promise.all(Array.from({ length: 6 }, () => db.rows(sql`select pg_sleep(0.2)`)));
      expect((await poll(gw.url)).status).toBe(200);
      proxy.freeze();
      const rs = await balancer(gw.url, 10, 36, 333);
      expect(summary(rs).statuses).toEqual([503]);
      const checks = proxy.sentWhileFrozen().filter((t) => /\bbegin\b/i.test(t));
      // Before the shared check, each poll began its own: 46 here.
      expect(checks.length).toBe(2);
      // "GET /healthz (alive)": no database work, so 200 at once while /readyz is 503 (a liveness probe must not restart it).
      const alive = await timedCall(`${gw.url}/healthz`, {}, 10_000);
      expect({ status: alive.status, fast: alive.ms < ANSWER_MS }).toEqual({ status: 200, fast: true });
    } finally {
      proxy.thaw();
      await gw.stop();
      await db.close();
      proxy.stop();
    }
  });

  test("a lock on gateway_migrations: every poll is 503 within the bound, at most one check waits on the lock, the pool keeps serving", async () => {
    const db = await openDatabase({ databaseUrl: scratch.url, dataDir: "", poolMax: 10 });
    const gw = await startTestGateway({}, db);
    const lock = await lockTable(scratch.url, "gateway_migrations");
    try {
      const sampler = waitingSampler(held, "%gateway_migrations%");
      const rs = await balancer(gw.url, 10, 20, 500);
      const most = await sampler.stop();
      // Before: every poll 503 after 5 s, and ten sessions (the whole pool) waiting on the lock.
      expect({ ...summary(rs), waitingOnLock: most }).toEqual({ statuses: [503], slow: [], waitingOnLock: 1 });
      // The pool serves other work: a key lookup (another table) is answered at once.
      const lookup = await timedCall(`${gw.url}/v1/me`, { headers: bearer(`sk-gw-${"A".repeat(10)}${crypto.randomUUID().replaceAll("-", "").slice(0, 33)}`) }, 10_000);
      expect({ status: lookup.status, fast: lookup.ms < ANSWER_MS }).toEqual({ status: 401, fast: true });
      await lock.unlock();
      await until(async () => (await poll(gw.url)).status === 200, "/readyz 200 once the lock is gone", 20_000, 200);
    } finally {
      await lock.unlock();
      await gw.stop();
      await db.close();
    }
  });
});
