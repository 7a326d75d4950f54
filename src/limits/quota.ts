import { and, eq, sql } from "drizzle-orm";
import { recordAudit } from "../audit/record.ts";
import type { Principal } from "../auth/verify.ts";
import type { Database } from "../db/client.ts";
import { pgArray } from "../db/arrays.ts";
import { usageBatches, usageCounters } from "../db/schema.ts";
import { AppError } from "../http/errors.ts";
import { SYSTEM_ACTOR_ID } from "../lib/ids.ts";
import type { Logger } from "../lib/log.ts";
import type { Metering, RequestOutcome, Ticket, UsageReport } from "./metering.ts";
import { type UsageColumns, UsageLog } from "./usage-log.ts";

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
 * A request reserves min(estimate, available) and is refused only when
 * nothing is available and the database grants nothing more. When available
 * drops under half a lease, a refill runs in the background; only a request
 * that finds the lease empty waits for it. Usage is written every flushMs
 * (used += U, leased -= min(U, granted)); on shutdown the unused lease is
 * returned.
 *
 * Bound on overshoot: every admitted token was granted from the shared row, so
 * the quota can be exceeded only by what requests consume beyond their
 * reservation — at most the sum over requests in flight at exhaustion of
 * (actual − reserved). With `max_tokens` set, a chat request's reservation is
 * its prompt estimate plus max_tokens, so the excess is the prompt estimate's
 * error. (README "Quota" states this bound; test/integration/quota*.test.ts checks it.)
 *
 * A crashed instance strands at most one lease (leaseTokens) per organisation
 * until the window ends: the safe direction (admits less, never more).
 */

export type QuotaWindow = "hour" | "day" | "month";


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
  stats(): { orgs: number; bufferedEvents: number; pendingTokens: number; droppedEvents: number; flushFailures: number };
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

  function stateFor(p: Principal, t: number): OrgState {
    const window = p.quotaWindow;
    const start = windowStart(window, t);
    const k = key(p.orgId, start);
    let s = states.get(k);
    if (!s) {
      s = { orgId: p.orgId, window, start, quota: p.quotaTokens ?? 0, granted: 0, pending: 0, inflight: 0, exhausted: false, leaseError: false, checkedAt: 0, demand: 0, reservedSinceLease: 0, leasedAt: t, refill: undefined, lastUsed: t };
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
    const granted = await database.db.transaction(async (tx) => {
      await tx.insert(usageCounters).values({ orgId: s.orgId, windowStart: ws }).onConflictDoNothing();
      const [row] = await tx
        .select({ used: usageCounters.used, leased: usageCounters.leased })
        .from(usageCounters)
        .where(and(eq(usageCounters.orgId, s.orgId), eq(usageCounters.windowStart, ws)))
        .for("update");
      if (!row) throw new Error("usage counter row missing after insert");
      const free = s.quota - row.used - row.leased;
      const take = Math.max(0, Math.min(leaseSize(s), free));
      if (take > 0) {
        await tx
          .update(usageCounters)
          .set({ leased: sql`${usageCounters.leased} + ${take}` })
          .where(and(eq(usageCounters.orgId, s.orgId), eq(usageCounters.windowStart, ws)));
      }
      return take;
    });
    s.granted += granted;
    s.reservedSinceLease = 0;
    s.leasedAt = now();
    s.exhausted = granted === 0;
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

  function exceeded(s: OrgState, t: number): AppError {
    void recordExceeded(s).catch((e: Error) => log.warn("budget_exceeded audit write failed", { org_id: s.orgId, err: e.message }));
    const resetMs = windowEnd(s.window, t) - t;
    const headers: Record<string, string> = { "x-should-retry": "false" };
    // Only a reset within a minute is worth waiting for; SDKs otherwise should not retry at all.
    if (resetMs <= 60_000) headers["retry-after"] = String(Math.max(1, Math.ceil(resetMs / 1000)));
    return new AppError(
      "budget_exceeded",
      `budget_exceeded: the organisation's usage quota of ${s.quota} tokens per ${s.window} is exhausted; requests are refused until the window resets at ${new Date(windowEnd(s.window, t)).toISOString()}.`,
      null,
      headers,
    );
  }

  async function admit(p: Principal, estimate: number): Promise<Ticket> {
    const t = now();
    if (p.quotaTokens === null) return new TicketImpl(p, 0, undefined, t);
    const s = stateFor(p, t);
    const want = Math.max(1, Math.ceil(estimate));
    // An exhausted window is re-checked every few seconds: other instances may return leases, or the quota may grow.
    if (s.exhausted && t - s.checkedAt > 5_000) s.exhausted = false;
    // Not enough local lease: wait for a refill (the only path that touches the
    // database). Concurrent requests may drain a fresh lease before this one
    // resumes, so try a few times before giving up.
    // Demand of the requests waiting sizes the next lease, so a burst of
    // thousands of requests is served by a few refills, not thousands.
    s.demand += want;
    try {
      if (available(s) < want && !s.exhausted) await refill(s);
      for (let i = 0; available(s) <= 0 && !s.exhausted && !s.leaseError && i < 8; i++) await refill(s);
    } finally {
      s.demand -= want;
    }
    const avail = available(s);
    if (avail <= 0) {
      if (s.exhausted) throw exceeded(s, t);
      // Without a lease we cannot know the budget: refuse honestly, not as budget_exceeded.
      throw new AppError(
        "service_unavailable",
        s.leaseError ? "The usage quota store is temporarily unreachable; retry with backoff." : "The usage quota is being refilled under heavy load; retry shortly.",
      );
    }
    const reserve = Math.min(want, avail);
    s.inflight += reserve;
    s.reservedSinceLease += reserve;
    // Refill ahead of need so the next requests do not wait.
    if (available(s) < opts.leaseTokens / 2 && !s.exhausted) void refill(s);
    return new TicketImpl(p, reserve, s, t);
  }

  function settle(ticket: Ticket, usage: UsageReport, outcome: RequestOutcome): void {
    if (ticket.settled) return;
    ticket.settled = true;
    const t = ticket as TicketImpl;
    const tokens = Math.max(0, Math.round(usage.promptTokens) + Math.round(usage.completionTokens));
    opts.onSettle?.(outcome.alias, Math.max(0, Math.round(usage.promptTokens)), Math.max(0, Math.round(usage.completionTokens)));
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
    events.push(p.orgId, p.keyId, outcome.alias, outcome.target, usage.promptTokens, usage.completionTokens, outcome.status, outcome.latencyMs, outcome.streamed, now());
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
  }
  /** The batch being written; retried as it is until it lands, so its id makes the write idempotent. */
  let batch: Batch | undefined;
  let applied = 0;

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
      // Unused lease goes back on shutdown and when its window has ended.
      if ((final || ended) && s.inflight === 0) {
        give = s.granted;
        s.granted = 0;
      }
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

  async function apply(b: Batch): Promise<void> {
    await database.db.transaction(async (tx) => {
      const fresh = await tx.insert(usageBatches).values({ id: b.id }).onConflictDoNothing().returning({ id: usageBatches.id });
      // An earlier attempt committed although its connection died before we heard back.
      if (fresh.length === 0) return;
      for (const d of b.deltas) {
        await tx
          .insert(usageCounters)
          .values({ orgId: d.orgId, windowStart: new Date(d.start), used: d.used, leased: 0 })
          .onConflictDoUpdate({
            target: [usageCounters.orgId, usageCounters.windowStart],
            set: { used: sql`${usageCounters.used} + ${d.used}`, leased: sql`greatest(0, ${usageCounters.leased} + ${d.leased})` },
          });
      }
      if (b.events.length > 0) await insertEvents(tx, b.events);
    });
    // Batch ids only guard retries of the last few seconds; keep a day of them.
    if (++applied % 1000 === 1) {
      await database.db.execute(sql`delete from usage_batches where created_at < now() - interval '1 day'`).catch(() => {});
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

  async function flushOnce(final: boolean): Promise<void> {
    try {
      for (;;) {
        // A batch that failed before is written first, unchanged; new usage waits for the next one.
        batch ??= cut(final);
        if (!batch) return;
        await apply(batch);
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
      };
    },
  };
}
