import { and, eq, inArray, sql } from "drizzle-orm";
import { recordAudit } from "../audit/record.ts";
import type { Principal } from "../auth/verify.ts";
import type { Database } from "../db/client.ts";
import { pgArray } from "../db/arrays.ts";
import { usageBatches, usageCounters, usageDeadLetters } from "../db/schema.ts";
import { AppError } from "../http/errors.ts";
import { SYSTEM_ACTOR_ID } from "../lib/ids.ts";
import type { Logger } from "../lib/log.ts";
import type { Metering, RequestOutcome, Ticket, UsageReport } from "./metering.ts";
import { columnsAt, eventRecord, type UsageColumns, UsageLog } from "./usage-log.ts";

/**
 * The organisation token quota, shared by all instances through Postgres,
 * with no database round trip on the request path in steady state.
 *
 * Each instance *leases* slices of an organisation's remaining quota for the
 * current window (one row per org and window in usage_counters: `used` is
 * settled usage, `leased` is what instances hold but have not yet used).
 * Locally, per org and window:
 *   granted  - tokens this instance holds as lease (counted in `leased`)
 *   pending  - usage settled here but not yet written
 *   inflight - reservations of requests under way
 *   available = granted - pending - inflight
 * A request reserves its whole estimate from the local lease, leasing more
 * when the lease holds less; a request that can run with less (a chat request
 * without max_tokens: the caller lowers max_tokens) may be given less, down to
 * its minimum. When the shared counter cannot supply the rest the request is
 * refused with budget_exceeded, never admitted on a part of its reservation.
 * When available drops under half of the last lease, a refill runs in the
 * background; only a request that finds too little waits for it. Usage is
 * written every flushMs (used += U, leased -= min(U, granted)); on shutdown
 * the unused lease is returned.
 *
 * Sharing a small quota: a lease is at most a quarter of what remains on the
 * shared counter (but at least what waiting requests need), so two instances
 * split a small quota, or the end of a large one, instead of one taking it
 * all. Once an instance learns that the shared counter is empty, it returns
 * its unused lease at every flush; an instance that finds the counter empty
 * while others hold lease waits a few flush intervals for it before refusing.
 *
 * Bound on overshoot: every admitted token was granted from the shared row, so
 * the quota can be exceeded only by what requests consume beyond their
 * reservation — at most the sum over requests in flight at exhaustion of
 * (actual − reserved). A chat request's reservation is its prompt estimate plus
 * max_tokens (as sent upstream, lowered when needed), so the excess is the
 * prompt estimate's error; without max_tokens a request admitted with the full
 * default reserve may run past it. (README "Quota" states this bound;
 * test/integration/quota*.test.ts checks it.)
 *
 * A crashed instance strands at most one lease (leaseTokens) per organisation
 * until the window ends: the safe direction (admits less, never more).
 */

export type QuotaWindow = "hour" | "day" | "month";

/** A lease takes at most this share of what remains on the shared counter (more only when waiting requests need it). */
const LEASE_SHARE = 0.25;
/** Longest a request waits for other instances to return unused lease before it is refused. */
const MAX_SHARE_WAIT_MS = 5_000;
/** Per-field bound on a usage figure at the metering boundary: anything larger is nonsense, not usage. */
export const MAX_TOKENS_PER_FIELD = 1_000_000_000;

/** A usage figure as metered: an integer in 0..MAX_TOKENS_PER_FIELD (NaN counts as 0). */
export function clampTokens(n: number): number {
  if (Number.isNaN(n) || n <= 0) return 0;
  return n >= MAX_TOKENS_PER_FIELD ? MAX_TOKENS_PER_FIELD : Math.round(n);
}


/** Start of the UTC window containing `t`. */
export function windowStart(window: QuotaWindow, t: number): number {
  const d = new Date(t);
  if (window === "hour") return Date.UTC(d.getUTCFullYear(), d.getUTCMonth(), d.getUTCDate(), d.getUTCHours());
  if (window === "day") return Date.UTC(d.getUTCFullYear(), d.getUTCMonth(), d.getUTCDate());
  return Date.UTC(d.getUTCFullYear(), d.getUTCMonth(), 1);
}

/** Start of the next window after the one containing `t`. */
export function windowEnd(window: QuotaWindow, t: number): number {
  const d = new Date(windowStart(window, t));
  if (window === "hour") return d.getTime() + 3_600_000;
  if (window === "day") return d.getTime() + 86_400_000;
  return Date.UTC(d.getUTCFullYear(), d.getUTCMonth() + 1, 1);
}

interface OrgState {
  orgId: string;
  window: QuotaWindow;
  start: number;
  quota: number;
  granted: number;
  pending: number;
  inflight: number;
  /** The database granted nothing on the last refill: the window is spent. */
  exhausted: boolean;
  /** The last refill failed (database unreachable). */
  leaseError: boolean;
  checkedAt: number;
  /** Tokens wanted by requests waiting for a refill. */
  demand: number;
  /** Tokens reserved since the last lease and when it was taken: the consumption rate sizes the next lease. */
  reservedSinceLease: number;
  /** Size of the last lease taken (sizes the refill-ahead threshold). */
  lastTake: number;
  /** What the shared counter had left after our last lease or write (Infinity before the first). */
  sharedFree: number;
  /** Lease held by other instances at our last lease (in use or not). */
  othersHold: number;
  /** Lease converted or returned in a batch not yet written (still counted in the shared `leased`). */
  returning: number;
  leasedAt: number;
  refill: Promise<void> | undefined;
  lastUsed: number;
}

/** Usage of orgs without a quota: still counted per window, for reports and a later quota. */
interface Unmetered {
  orgId: string;
  start: number;
  pending: number;
}

export interface QuotaOptions {
  leaseTokens: number;
  flushMs: number;
  maxBuffered: number;
  now?: () => number;
  /** Usage records per transaction (default 5,000); a larger backlog goes out as several. */
  eventsPerBatch?: number;
  /** Called once per settled request (token metrics). */
  onSettle?: (alias: string, promptTokens: number, completionTokens: number) => void;
}

export interface QuotaManager extends Metering {
  start(): void;
  /** Write pending usage and events now; resolves when written (or re-buffered on failure). */
  flush(): Promise<void>;
  /** Flush and return unused leases. */
  stop(): Promise<void>;
  stats(): { orgs: number; bufferedEvents: number; pendingTokens: number; droppedEvents: number; flushFailures: number; deadLettered: number };
}

class TicketImpl implements Ticket {
  settled = false;
  constructor(
    readonly principal: Principal,
    readonly reserved: number,
    readonly state: OrgState | undefined,
    readonly start: number,
  ) {}
}

export function createQuota(database: Database, log: Logger, opts: QuotaOptions): QuotaManager {
  const now = opts.now ?? Date.now;
  const states = new Map<string, OrgState>();
  const unmetered = new Map<string, Unmetered>();
  const events = new UsageLog(opts.maxBuffered);
  let flushFailures = 0;
  let timer: ReturnType<typeof setInterval> | undefined;
  let flushing: Promise<void> | undefined;

  const key = (orgId: string, start: number) => `${orgId}|${start}`;
  /** How long a starved request waits for other instances' unused lease: they look for requests at every flush. */
  const shareWaitMs = Math.min(3 * opts.flushMs + 250, MAX_SHARE_WAIT_MS);

  /**
   * Another instance found the shared counter empty while we hold unused
   * lease (usage_counters.wanted_at, recent): mark those organisations so
   * that this flush returns what we hold beyond our requests in flight. An
   * organisation with usage to write learns it from its counter update; this
   * small query is for those that hold unused lease and had no requests
   * since the last flush (one query per flush interval while there are any).
   */
  async function answerWanted(): Promise<void> {
    const holding = new Map<string, OrgState>();
    for (const s of states.values()) {
      if (s.sharedFree > 0 && s.pending === 0 && s.inflight === 0 && available(s) > 0) holding.set(key(s.orgId, s.start), s);
      if (holding.size >= 10_000) break;
    }
    if (holding.size === 0) return;
    const ids = [...new Set([...holding.values()].map((s) => s.orgId))];
    const rows = await database.db
      .select({ orgId: usageCounters.orgId, windowStart: usageCounters.windowStart })
      .from(usageCounters)
      .where(and(inArray(usageCounters.orgId, ids), sql`${usageCounters.wantedAt} > now() - make_interval(secs => ${shareWaitMs / 1000})`));
    for (const r of rows) {
      const s = holding.get(key(r.orgId, r.windowStart.getTime()));
      if (s) s.sharedFree = 0;
    }
  }

  function stateFor(p: Principal, t: number): OrgState {
    const window = p.quotaWindow;
    const start = windowStart(window, t);
    const k = key(p.orgId, start);
    let s = states.get(k);
    if (!s) {
      s = {
        orgId: p.orgId,
        window,
        start,
        quota: p.quotaTokens ?? 0,
        granted: 0,
        pending: 0,
        inflight: 0,
        exhausted: false,
        leaseError: false,
        checkedAt: 0,
        demand: 0,
        reservedSinceLease: 0,
        lastTake: 0,
        sharedFree: Number.POSITIVE_INFINITY,
        othersHold: 0,
        returning: 0,
        leasedAt: t,
        refill: undefined,
        lastUsed: t,
      };
      states.set(k, s);
    }
    // A quota change reaches us through the key cache (org:<id> invalidation).
    if (p.quotaTokens !== null && p.quotaTokens !== s.quota) {
      s.quota = p.quotaTokens;
      s.exhausted = false;
    }
    s.lastUsed = t;
    return s;
  }

  const available = (s: OrgState) => s.granted - s.pending - s.inflight;

  /** Take up to one lease from the shared row: one short transaction. */
  async function lease(s: OrgState): Promise<void> {
    const ws = new Date(s.start);
    // What the requests waiting now lack: a lease smaller than that would refuse them while tokens remain.
    const need = Math.max(0, s.demand - available(s));
    const wanted = leaseSize(s);
    const got = await database.db.transaction(async (tx) => {
      await tx.insert(usageCounters).values({ orgId: s.orgId, windowStart: ws }).onConflictDoNothing();
      const [row] = await tx
        .select({ used: usageCounters.used, leased: usageCounters.leased })
        .from(usageCounters)
        .where(and(eq(usageCounters.orgId, s.orgId), eq(usageCounters.windowStart, ws)))
        .for("update");
      if (!row) throw new Error("usage counter row missing after insert");
      const free = s.quota - row.used - row.leased;
      // A share of what remains, so instances split a small quota (or the end of a large one); at least what is needed now.
      const take = Math.max(0, Math.min(free, Math.max(need, Math.min(wanted, Math.ceil(free * LEASE_SHARE)))));
      const others = row.leased - s.granted - s.returning;
      // Short while other instances hold lease: ask them for their unused part (they look at every flush).
      const asking = take < need && others > 0;
      if (take > 0 || asking) {
        await tx
          .update(usageCounters)
          .set({ leased: sql`${usageCounters.leased} + ${take}`, ...(asking ? { wantedAt: sql`now()` } : {}) })
          .where(and(eq(usageCounters.orgId, s.orgId), eq(usageCounters.windowStart, ws)));
      }
      return { take, left: free - take, others };
    });
    s.granted += got.take;
    s.lastTake = got.take;
    s.sharedFree = got.left;
    s.othersHold = Math.max(0, got.others);
    s.reservedSinceLease = 0;
    s.leasedAt = now();
    // Exhausted: the shared counter could not supply what was needed (or, for a refill ahead of need, anything).
    s.exhausted = got.take < need || (need === 0 && got.take === 0);
    s.leaseError = false;
    s.checkedAt = now();
  }

  /**
   * At least leaseTokens; twice what waiting requests want (a burst); and
   * about 5 s of this organisation's recent consumption, so a busy one takes
   * a lease every few seconds, not every few hundred requests. Capped at a
   * tenth of the quota, so one instance never holds most of it.
   */
  function leaseSize(s: OrgState): number {
    const elapsed = Math.max(1, now() - s.leasedAt);
    const fiveSeconds = (s.reservedSinceLease / elapsed) * 5_000;
    const cap = Math.max(opts.leaseTokens, Math.floor(s.quota / 10));
    return Math.ceil(Math.max(opts.leaseTokens, 2 * s.demand, Math.min(fiveSeconds, cap)));
  }

  function refill(s: OrgState): Promise<void> {
    // One immediate retry: a pooled connection that the server dropped fails once, then postgres.js reconnects.
    s.refill ??= lease(s)
      .catch(() => lease(s))
      .catch((e: Error) => {
        s.leaseError = true;
        log.warn("quota lease failed", { org_id: s.orgId, err: e.message });
      })
      .finally(() => {
        s.refill = undefined;
      });
    return s.refill;
  }

  /** budget_exceeded, once per org and window in the audit log (usage_counters.exceeded_at decides across instances). */
  async function recordExceeded(s: OrgState): Promise<void> {
    const ws = new Date(s.start);
    await database.db.transaction(async (tx) => {
      const marked = await tx
        .update(usageCounters)
        .set({ exceededAt: new Date(now()) })
        .where(and(eq(usageCounters.orgId, s.orgId), eq(usageCounters.windowStart, ws), sql`${usageCounters.exceededAt} is null`))
        .returning({ orgId: usageCounters.orgId });
      if (marked.length === 0) return;
      await recordAudit(tx, {
        orgId: s.orgId,
        action: "billing.budget_exceeded",
        category: "billing",
        actor: { type: "system", id: SYSTEM_ACTOR_ID, name: "gateway", email: "", keyId: null },
        targets: [{ key: "org_id", kind: "organization", id: s.orgId, name: "", email: "" }],
        details: { quota_tokens: s.quota, window: s.window, window_start: ws.toISOString() },
      });
    });
  }

  function exceeded(s: OrgState, t: number, want: number): AppError {
    void recordExceeded(s).catch((e: Error) => log.warn("budget_exceeded audit write failed", { org_id: s.orgId, err: e.message }));
    const resetMs = windowEnd(s.window, t) - t;
    const headers: Record<string, string> = { "x-should-retry": "false" };
    // Only a reset within a minute is worth waiting for; SDKs otherwise should not retry at all.
    if (resetMs <= 60_000) headers["retry-after"] = String(Math.max(1, Math.ceil(resetMs / 1000)));
    return new AppError(
      "budget_exceeded",
      `budget_exceeded: the organisation's usage quota of ${s.quota} tokens per ${s.window} has fewer tokens left than this request needs (${want}); requests are refused until the window resets at ${new Date(windowEnd(s.window, t)).toISOString()}.`,
      null,
      headers,
    );
  }

  async function admit(p: Principal, estimate: number, minimum?: number): Promise<Ticket> {
    const t = now();
    const want = Math.max(1, Math.ceil(estimate));
    if (p.quotaTokens === null) return new TicketImpl(p, want, undefined, t);
    const least = Math.min(want, Math.max(1, Math.ceil(minimum ?? want)));
    const s = stateFor(p, t);
    // An exhausted window is re-checked every few seconds: other instances may return leases, or the quota may grow.
    if (s.exhausted && t - s.checkedAt > 5_000) s.exhausted = false;
    // Demand of the requests waiting sizes the next lease, so a burst of
    // thousands of requests is served by a few refills, not thousands.
    s.demand += want;
    let got: number | "spent" | "unavailable";
    try {
      got = await reserve(s, want, least);
    } finally {
      s.demand -= want;
    }
    if (got === "spent") throw exceeded(s, t, least);
    if (got === "unavailable") {
      // Without a lease we cannot know the budget: refuse honestly, not as budget_exceeded.
      throw new AppError(
        "service_unavailable",
        s.leaseError ? "The usage quota store is temporarily unreachable; retry with backoff." : "The usage quota is being refilled under heavy load; retry shortly.",
      );
    }
    // Refill ahead of need so the next requests do not wait (not once the shared counter is known to be empty).
    if (!s.exhausted && s.sharedFree > 0 && available(s) < Math.min(opts.leaseTokens, s.lastTake) / 2) void refill(s);
    return new TicketImpl(p, got, s, t);
  }

  /**
   * Reserves `want` tokens (or, when the shared counter has no more, what is
   * left down to `least`) from the local lease, leasing more while it holds
   * less: the only path that touches the database. The reservation is taken
   * in the same turn as the check, since concurrent requests may drain a
   * fresh lease before this one resumes; so it tries a few times. When the
   * counter is empty but other instances hold enough lease, it waits a few
   * flush intervals for them to return their unused part (they do at each
   * flush once the counter is empty).
   */
  async function reserve(s: OrgState, want: number, least: number): Promise<number | "spent" | "unavailable"> {
    let tries = 0;
    let waitUntil: number | undefined;
    for (;;) {
      const avail = available(s);
      const take = avail >= want ? want : s.exhausted && avail >= least ? avail : 0;
      if (take > 0) {
        s.inflight += take;
        s.reservedSinceLease += take;
        return take;
      }
      if (s.exhausted) {
        if (s.othersHold < least - avail) return "spent";
        waitUntil ??= now() + shareWaitMs;
        if (now() >= waitUntil) return "spent";
        await Bun.sleep(Math.max(20, Math.floor(opts.flushMs / 4)));
        s.exhausted = false;
        tries = 0;
      } else if (tries >= 8 || (tries > 0 && s.leaseError)) {
        return "unavailable";
      }
      tries++;
      await refill(s);
    }
  }

  function settle(ticket: Ticket, usage: UsageReport, outcome: RequestOutcome): void {
    if (ticket.settled) return;
    ticket.settled = true;
    const t = ticket as TicketImpl;
    // Second line of defence after the parsers' own checks: no negative, fractional or absurd figure reaches the counters.
    const prompt = clampTokens(usage.promptTokens);
    const completion = clampTokens(usage.completionTokens);
    const tokens = prompt + completion;
    opts.onSettle?.(outcome.alias, prompt, completion);
    const p = t.principal;
    if (t.state) {
      t.state.inflight -= t.reserved;
      t.state.pending += tokens;
    } else if (tokens > 0) {
      const start = windowStart(p.quotaWindow, t.start);
      const k = key(p.orgId, start);
      const u = unmetered.get(k) ?? { orgId: p.orgId, start, pending: 0 };
      u.pending += tokens;
      unmetered.set(k, u);
    }
    // Bounded: when full, the oldest per-request record gives way (token counters above are never dropped).
    events.push(p.orgId, p.keyId, outcome.alias, outcome.target, prompt, completion, outcome.status, outcome.latencyMs, outcome.streamed, now());
  }

  interface CounterDelta {
    orgId: string;
    start: number;
    used: number;
    /** Change of the shared `leased` column: converted to usage, or returned. */
    leased: number;
  }
  interface Batch {
    id: string;
    deltas: CounterDelta[];
    events: UsageColumns;
    /** Records were already waiting beyond this batch when it was cut (a backlog larger than one batch). */
    more: boolean;
    /** Once the batch failed with the database reachable: written item by item, each with its own id, from `next` on. */
    items?: { ids: string[]; next: number };
  }
  /** The batch being written; retried as it is until it lands, so its id makes the write idempotent. */
  let batch: Batch | undefined;
  let applied = 0;
  let deadLettered = 0;

  /** Move everything pending into a new batch (synchronous: no settle interleaves). */
  function cut(final: boolean): Batch | undefined {
    const deltas: CounterDelta[] = [];
    const current = now();
    for (const [k, s] of states) {
      const u = s.pending;
      const convert = Math.min(u, s.granted);
      s.pending -= u;
      s.granted -= convert;
      const ended = s.start < windowStart(s.window, current);
      let give = 0;
      // Unused lease goes back on shutdown and when its window has ended; and
      // at every flush once the shared counter is empty, so that another
      // instance's requests can have it.
      if ((final || ended) && s.inflight === 0) give = s.granted;
      else if (s.sharedFree <= 0) give = Math.max(0, s.granted - s.inflight);
      s.granted -= give;
      s.returning += convert + give;
      if (u > 0 || convert + give > 0) deltas.push({ orgId: s.orgId, start: s.start, used: u, leased: -(convert + give) });
      if (ended && s.inflight === 0) states.delete(k);
    }
    for (const [k, u] of unmetered) {
      if (u.pending > 0) deltas.push({ orgId: u.orgId, start: u.start, used: u.pending, leased: 0 });
      unmetered.delete(k);
    }
    // A batch carries at most eventsPerBatch usage records; larger backlogs go out as several batches.
    const taken = events.take(opts.eventsPerBatch ?? 5_000);
    if (deltas.length === 0 && taken.length === 0) return undefined;
    return { id: crypto.randomUUID(), deltas, events: taken, more: events.length > 0 };
  }

  type Tx = Parameters<Parameters<Database["db"]["transaction"]>[0]>[0];

  /** Adds one delta to the shared counter and learns what the counter has left. */
  async function applyDelta(tx: Tx, d: CounterDelta): Promise<void> {
    const [row] = await tx
      .insert(usageCounters)
      .values({ orgId: d.orgId, windowStart: new Date(d.start), used: d.used, leased: 0 })
      .onConflictDoUpdate({
        target: [usageCounters.orgId, usageCounters.windowStart],
        set: { used: sql`${usageCounters.used} + ${d.used}`, leased: sql`greatest(0, ${usageCounters.leased} + ${d.leased})` },
      })
      .returning({
        used: usageCounters.used,
        leased: usageCounters.leased,
        wanted: sql<boolean>`coalesce(${usageCounters.wantedAt} > now() - make_interval(secs => ${shareWaitMs / 1000}), false)`,
      });
    const s = states.get(key(d.orgId, d.start));
    // Another instance asked for lease recently: the next flush returns our unused part.
    if (row && s) s.sharedFree = row.wanted ? 0 : s.quota - row.used - row.leased;
  }

  /** The delta's lease change has reached the shared counter. */
  function landed(d: CounterDelta): void {
    const s = states.get(key(d.orgId, d.start));
    if (s) s.returning = Math.max(0, s.returning + d.leased);
  }

  /** Runs `write` in a transaction unless `id` was applied before (an earlier attempt committed although we never heard back). */
  async function once(id: string, write: (tx: Tx) => Promise<void>): Promise<void> {
    await database.db.transaction(async (tx) => {
      const fresh = await tx.insert(usageBatches).values({ id }).onConflictDoNothing().returning({ id: usageBatches.id });
      if (fresh.length > 0) await write(tx);
    });
  }

  async function apply(b: Batch): Promise<void> {
    await once(b.id, async (tx) => {
      for (const d of b.deltas) await applyDelta(tx, d);
      if (b.events.length > 0) await insertEvents(tx, b.events);
    });
    for (const d of b.deltas) landed(d);
    // Batch ids only guard retries of the last few seconds; keep a day of them.
    if (++applied % 1000 === 1) {
      await database.db.execute(sql`delete from usage_batches where created_at < now() - interval '1 day'`).catch(() => {});
    }
  }

  /** Whether the database takes transactions now (the path every write uses), so a failed write was the data's fault. */
  async function reachable(): Promise<boolean> {
    try {
      await database.db.transaction(async (tx) => {
        await tx.execute(sql`select 1`);
      });
      return true;
    } catch {
      return false;
    }
  }

  async function batchLanded(id: string): Promise<boolean> {
    const rows = await database.db.select({ id: usageBatches.id }).from(usageBatches).where(eq(usageBatches.id, id));
    return rows.length > 0;
  }

  /**
   * A batch that failed twice while the database answers holds something
   * that cannot be written (a value out of range, a broken constraint): write
   * it item by item — each counter delta, then each usage record, in its own
   * idempotent transaction — and set aside only the item that fails, so one
   * bad record never blocks the rest. If the database stops answering midway,
   * the batch keeps its position and the next flush continues from there.
   */
  async function applyIsolated(b: Batch, cause: Error): Promise<void> {
    if (!b.items) {
      // The failed attempts may have committed all the same (an ambiguous commit).
      if (await batchLanded(b.id)) {
        for (const d of b.deltas) landed(d);
        return;
      }
      log.warn("usage batch failed with the database reachable; writing it record by record", { err: cause.message, deltas: b.deltas.length, events: b.events.length });
      b.items = { ids: Array.from({ length: b.deltas.length + b.events.length }, () => crypto.randomUUID()), next: 0 };
    }
    const items = b.items;
    for (; items.next < items.ids.length; items.next++) {
      const i = items.next;
      const id = items.ids[i] as string;
      const delta = i < b.deltas.length ? b.deltas[i] : undefined;
      try {
        if (delta) await once(id, (tx) => applyDelta(tx, delta));
        else await once(id, (tx) => insertEvents(tx, columnsAt(b.events, i - b.deltas.length)));
      } catch (e) {
        if (!(await reachable())) throw e;
        const record = delta ? { kind: "counter", org_id: delta.orgId, window_start: new Date(delta.start).toISOString(), used: delta.used, leased: delta.leased } : eventRecord(b.events, i - b.deltas.length);
        await deadLetter(record, e as Error);
      }
      if (delta) landed(delta);
    }
  }

  /** Sets one unwritable item aside: in usage_dead_letters, and always in the log with the full record. */
  async function deadLetter(record: Record<string, unknown>, err: Error): Promise<void> {
    deadLettered++;
    log.error("usage record could not be written; set aside", { err: err.message, record });
    try {
      await database.db.insert(usageDeadLetters).values({ record: JSON.stringify(record), error: err.message });
    } catch (e) {
      log.error("usage dead letter could not be stored; the log line above is its only copy", { err: (e as Error).message });
    }
  }

  /** One statement per batch: each column is one array parameter, unnested into rows. */
  async function insertEvents(tx: Pick<Database["db"], "execute">, c: UsageColumns): Promise<void> {
    // Times travel as epoch milliseconds (exact), turned into timestamptz by the database.
    await tx.execute(sql`
      insert into usage_events (org_id, key_id, alias, target, prompt_tokens, completion_tokens, status, latency_ms, streamed, created_at)
      select o, k, a, t, p, c, s, l, st, timestamptz 'epoch' + ms * interval '1 millisecond' from unnest(
        ${pgArray(c.orgId)}::uuid[], ${pgArray(c.keyId)}::uuid[], ${pgArray(c.alias)}::text[], ${pgArray(c.target)}::text[],
        ${pgArray(c.promptTokens)}::int[], ${pgArray(c.completionTokens)}::int[], ${pgArray(c.status)}::int[],
        ${pgArray(c.latencyMs)}::int[], ${pgArray(Array.from(c.streamed, (x) => x === 1))}::bool[], ${pgArray(c.createdAt)}::float8[])
        as u(o, k, a, t, p, c, s, l, st, ms)`);
  }

  function bufferedTokens(): number {
    let n = 0;
    for (const s of states.values()) n += s.pending;
    for (const u of unmetered.values()) n += u.pending;
    for (const d of batch?.deltas ?? []) n += d.used;
    return n;
  }

  /** One transaction for the batch; a batch that fails twice while the database answers is written item by item. */
  async function write(b: Batch): Promise<void> {
    if (b.items) return applyIsolated(b, new Error("continuing"));
    try {
      await apply(b);
    } catch (first) {
      if (!(await reachable())) throw first;
      try {
        await apply(b);
      } catch (second) {
        if (!(await reachable())) throw second;
        await applyIsolated(b, second as Error);
      }
    }
  }

  async function flushOnce(final: boolean): Promise<void> {
    // Best effort: a failure here only delays handing lease over, never the usage write.
    await answerWanted().catch((e: Error) => log.debug("lease request check failed", { err: e.message }));
    try {
      for (;;) {
        // A batch that failed before is written first, unchanged; new usage waits for the next one.
        batch ??= cut(final);
        if (!batch) return;
        await write(batch);
        const more = batch.more;
        batch = undefined;
        // Only a backlog that was already there continues at once; what
        // requests settled during the write waits for the next interval, or a
        // busy instance would write back to back instead of once per flushMs.
        if (!more) return;
        // Let requests run between batches of a backlog.
        await new Promise((r) => setImmediate(r));
      }
    } catch (e) {
      flushFailures++;
      // Nothing is lost: the batch stays buffered and the next flush retries it.
      log.warn("usage flush failed; buffered for retry", {
        err: (e as Error).message,
        buffered_events: events.length + (batch?.events.length ?? 0),
        pending_tokens: bufferedTokens(),
      });
      throw e;
    }
  }

  function flush(final = false): Promise<void> {
    // One flush at a time.
    flushing ??= flushOnce(final).finally(() => {
      flushing = undefined;
    });
    return flushing;
  }

  return {
    admit,
    settle,
    start() {
      timer = setInterval(() => {
        void flush(false).catch(() => {});
      }, opts.flushMs);
      timer.unref?.();
    },
    flush: () => flush(false),
    async stop() {
      if (timer) clearInterval(timer);
      if (flushing) await flushing.catch(() => {});
      // Write everything and return unused leases; retry a few times, since a
      // shutdown during a database blip should still land the usage.
      for (let attempt = 0; attempt < 5; attempt++) {
        try {
          await flush(true);
          if (!batch && bufferedTokens() === 0 && events.length === 0) break;
        } catch {
          await Bun.sleep(200 * (attempt + 1));
        }
      }
    },
    stats() {
      return {
        orgs: states.size,
        bufferedEvents: events.length + (batch?.events.length ?? 0),
        pendingTokens: bufferedTokens(),
        droppedEvents: events.dropped,
        flushFailures,
        deadLettered,
      };
    },
  };
}
