import { and, inArray, sql } from "drizzle-orm";
import type { Principal } from "../auth/types.ts";
import type { Database } from "../db/client.ts";
import { type Bound, BoundFull, boundedCall, boundedTx, createBound, maxOutAtOnce } from "../db/bounded.ts";
import { isServerTimeout } from "../db/errors.ts";
import { epochMs, rowsOf } from "../db/raw.ts";
import { usageCounters } from "../db/schema.ts";
import { AppError } from "../lib/errors.ts";
import type { Logger } from "../lib/log.ts";
import { type Metering, type RequestOutcome, type Ticket, type UsageReport, clampTokens } from "./metering.ts";
import { budgetExceeded, createBudgetRecorder } from "./budget.ts";
import { type QuotaPeriod, periodEnd, periodStart } from "./period.ts";
import { type OrgQuota, createQuotaSettings } from "./quota-settings.ts";
import { type CounterDelta, type CounterSource, createUsageWriter } from "./usage-writer.ts";
import { firstSeen } from "../lib/once.ts";

/**
 * The organisation token quota, shared by all instances through Postgres,
 * with no database round trip on the request path in steady state.
 *
 * Each instance *leases* slices of an organisation's remaining quota for the
 * current period (one row per org and period in usage_counters: `used` is
 * settled usage, `leased` is what instances hold but have not yet used).
 * Locally, per org and period:
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
 * background; only a request that finds too little waits for it, and such
 * requests are served in the order they arrived (`reserve`). The usage
 * writer (src/limits/usage-writer.ts) writes usage every flushMs (used += U,
 * leased -= min(U, granted)); on shutdown the unused lease is returned.
 *
 * Sharing a small quota: a lease is at most a quarter of what remains on the
 * shared counter (but at least what waiting requests need), so two instances
 * split a small quota, or the end of a large one, instead of one taking it
 * all. Once an instance learns that the shared counter is empty, it returns
 * its unused lease at every flush; an instance that finds the counter empty
 * while others hold lease, or while its own requests in flight hold
 * reservations that could cover the rest, waits a few flush intervals before
 * refusing.
 *
 * Bound on overshoot: every admitted token was granted from the shared row, so
 * the quota can be exceeded only by what requests consume beyond their
 * reservation — at most the sum over requests in flight at exhaustion of
 * (actual − reserved). A chat request's reservation is the most its prompt
 * can be (src/inference/tokens.ts, promptTokenBound) plus max_tokens (as sent
 * upstream, lowered when needed) for each of its `n` choices, so there is no
 * excess unless a prompt breaks the bound's assumptions (an image above the
 * alias's imageTokens, a template beyond its allowances). (docs/decisions.md
 * "Quota" states this bound; test/integration/quota*.test.ts checks it.)
 *
 * A crashed instance strands at most one lease (leaseSize) per organisation,
 * plus what requests reserved and did not use since its last write, until the
 * period ends: the safe direction (admits less, never more). Each write gives
 * back the unused lease beyond one lease for that.
 */

/** A lease takes at most this share of what remains on the shared counter (more only when waiting requests need it). */
const LEASE_SHARE = 0.25;
/** Longest a request waits for other instances to return unused lease before it is refused. */
const MAX_SHARE_WAIT_MS = 5_000;

interface OrgState {
  orgId: string;
  period: QuotaPeriod;
  start: number;
  /** When the period ends (the next one's start). */
  end: number;
  quota: number;
  granted: number;
  pending: number;
  inflight: number;
  /** The database granted nothing on the last refill: the period's quota is spent. */
  exhausted: boolean;
  /** The last refill failed (database unreachable). */
  leaseError: boolean;
  /** Leases started (a sequence); and the number of the one whose look at the counter the figures below are from. */
  looks: number;
  lookSeen: number;
  checkedAt: number;
  /** Tokens wanted by requests waiting for a refill. */
  demand: number;
  /** Tokens reserved since the last lease and when it was taken: the consumption rate sizes the next lease. */
  reservedSinceLease: number;
  /** Size of the last lease taken (sizes the refill-ahead threshold). */
  lastTake: number;
  /** What the shared counter had left after our last lease or write (Infinity before the first). */
  sharedFree: number;
  /**
   * Lease on the shared row at our last lease that may come free for us:
   * other instances' (in use or not; they return the unused part when asked)
   * and our own return not yet written (`returning`), as the row showed them,
   * plus what our writes gave back since (`returned`).
   */
  othersHold: number;
  /**
   * Other instances' lease alone at our last lease, when it could be told
   * exactly: -1 when a write of ours that moves `leased` was out (it may
   * have committed before `landed` ran, so the row and `returning` can
   * disagree by it). A request waiting on other instances' lease tells a
   * live instance (its lease moves) from a dead one's stranded lease by it.
   */
  othersExact: number;
  /** Lease converted or returned in a batch not yet written (still counted in the shared `leased`). */
  returning: number;
  /** All lease ever moved to `returning` (a running sum): what a write gave back while a lease transaction was out. */
  returned: number;
  /** Lease taken back after the quota was lowered below it (changeQuota): no longer ours to admit against, returned at the next write. */
  revoked: number;
  leasedAt: number;
  refill: Promise<void> | undefined;
  /**
   * Requests waiting for quota (`reserve`), oldest first. Only the oldest looks at the lease and takes
   * tokens; a request that arrives while any waits queues behind them (admitNow admits none).
   */
  waitHead: Waiter | undefined;
  waitTail: Waiter | undefined;
  /** A lease given up on (no answer in time) has not settled: no other is sent for this state until it does. */
  leaseUnanswered: boolean;
  lastUsed: number;
}

/** Why a waiting request is refused: budget_exceeded, 503 held by requests in flight, 503 no lease. */
type Refusal = "spent" | "held" | "unavailable";

/** A request waiting for quota, in its organisation's queue (OrgState.waitHead). */
interface Waiter {
  prev: Waiter | undefined;
  next: Waiter | undefined;
  /** Still in the queue (not admitted, refused or gone). */
  queued: boolean;
  want: number;
  least: number;
  /** The first lease started after it began waiting: only that look, or a later one, may refuse it. */
  firstLook: number;
  /** When it began waiting (`now`). */
  since: number;
  /** Ends what it awaits now (its turn, a lease, a sleep): its turn came, it was refused with the oldest, or its client left. */
  resume: (() => void) | undefined;
  /** Ends the oldest waiter's sleep between looks, set only while it sleeps: a request settled and gave tokens back. */
  nap: (() => void) | undefined;
  /** Its client left: out of the queue, it takes nothing. */
  gone: boolean;
  /** Refused with the oldest waiter, on the same looks (refuseBehind). */
  answer: Refusal | undefined;
}

/** Usage of orgs without a quota: still counted per period, for reports and a later quota. */
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
  /** Usage records (requests) per batch (default 5,000), summed into rows per key, alias, target and status; a larger backlog goes out as several. */
  eventsPerBatch?: number;
  /** Called once per settled request (token metrics). */
  onSettle?: (alias: string, promptTokens: number, completionTokens: number) => void;
  /** Lease transactions out at once (default: maxOutAtOnce of the pool). */
  leaseBound?: Bound;
  /** budget_exceeded audit writes out at once (default: maxOutAtOnce of the pool). */
  budgetAuditBound?: Bound;
}

export interface QuotaManager extends Metering {
  start(): void;
  /** Write pending usage and records now; resolves when written (or re-buffered on failure). */
  flush(): Promise<void>;
  /** Flush and return unused leases. */
  stop(): Promise<void>;
  stats(): {
    orgs: number;
    /** Organisations whose newest quota setting this instance keeps. */
    settings: number;
    bufferedEvents: number;
    pendingTokens: number;
    droppedEvents: number;
    flushFailures: number;
    deadLettered: number;
    unansweredWrites: number;
    unansweredLeases: number;
    unansweredBudgetWrites: number;
  };
}

class TicketImpl implements Ticket {
  settled = false;
  constructor(
    readonly principal: Principal,
    readonly reserved: number,
    readonly state: OrgState | undefined,
    readonly start: number,
    /** The period its usage is counted in (the organisation's newest, not necessarily the principal's). */
    readonly period: QuotaPeriod,
  ) {}
}

export function createQuota(database: Database, log: Logger, opts: QuotaOptions): QuotaManager {
  const now = opts.now ?? Date.now;
  const states = new Map<string, OrgState>();
  const unmetered = new Map<string, Unmetered>();
  const leases = opts.leaseBound ?? createBound("quota lease", maxOutAtOnce(database.poolMax), log);
  const budgetAudit = createBudgetRecorder(database, log, now, opts.budgetAuditBound);

  const key = (orgId: string, start: number) => `${orgId}|${start}`;
  /** Each organisation's newest quota setting and its current period's state (quota-settings.ts). */
  const settings = createQuotaSettings<OrgState>(now);
  const orgOf = settings.of;
  /** How long a starved request waits for other instances' unused lease: they look for requests at every flush. */
  const shareWaitMs = Math.min(3 * opts.flushMs + 250, MAX_SHARE_WAIT_MS);
  /**
   * stop() has begun: no lease is taken from here on. Its final write returns what is held; a lease
   * taken after it (a request that waited for one through a drain cut short) was never returned.
   */
  let stopping = false;

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
    const rows = await boundedCall(database, (q) =>
      q
        .select({ orgId: usageCounters.orgId, windowStart: usageCounters.windowStart })
        .from(usageCounters)
        .where(and(inArray(usageCounters.orgId, ids), sql`${usageCounters.wantedAt} > now() - make_interval(secs => ${shareWaitMs / 1000})`)),
    );
    for (const r of rows) {
      const s = holding.get(key(r.orgId, r.windowStart.getTime()));
      if (s) s.sharedFree = 0;
    }
  }

  function stateFor(o: OrgQuota<OrgState>, tokens: number, t: number): OrgState {
    let s = o.current;
    if (!s || t >= s.end || t < s.start || s.period !== o.period) s = periodState(o, tokens, t);
    if (tokens !== s.quota) changeQuota(s, tokens);
    s.lastUsed = t;
    return s;
  }

  /**
   * The quota changed under a state that may hold lease. What the shared
   * counter has left moves by the change; when it falls below zero, lease
   * was granted beyond the new quota, and as much of ours as is unused (up
   * to that excess: other instances may hold the rest) is revoked: no longer
   * admitted against, and returned at the next write. Without this an
   * instance went on admitting its whole lease (up to a tenth of the old
   * quota) after the quota was lowered below it.
   */
  function changeQuota(s: OrgState, quota: number): void {
    const change = quota - s.quota;
    s.quota = quota;
    s.exhausted = false;
    if (!Number.isFinite(s.sharedFree)) return;
    s.sharedFree += change;
    if (s.sharedFree >= 0) return;
    const revoke = Math.min(Math.max(0, available(s)), -s.sharedFree);
    s.granted -= revoke;
    s.revoked += revoke;
  }

  /** The state of the period containing `t`, made when new (with the organisation's newest quota); it becomes the organisation's current one. */
  function periodState(o: OrgQuota<OrgState>, tokens: number, t: number): OrgState {
    const period = o.period;
    const start = periodStart(period, t);
    const k = key(o.orgId, start);
    let s = states.get(k);
    if (!s) {
      s = {
        orgId: o.orgId,
        period,
        start,
        end: periodEnd(period, t),
        quota: tokens,
        granted: 0,
        pending: 0,
        inflight: 0,
        exhausted: false,
        leaseError: false,
        looks: 0,
        lookSeen: 0,
        checkedAt: 0,
        demand: 0,
        reservedSinceLease: 0,
        lastTake: 0,
        sharedFree: Number.POSITIVE_INFINITY,
        othersHold: 0,
        othersExact: -1,
        returning: 0,
        returned: 0,
        revoked: 0,
        leasedAt: t,
        refill: undefined,
        waitHead: undefined,
        waitTail: undefined,
        leaseUnanswered: false,
        lastUsed: t,
      };
      states.set(k, s);
    }
    o.current = s;
    return s;
  }

  const available = (s: OrgState) => s.granted - s.pending - s.inflight;

  /** Counters already reported as negative: once per organisation, period and column. */
  const firstReport = firstSeen();
  /** A usage_counters figure as counted: a negative one (or one that is not a number) is 0, logged once. */
  function counted(s: OrgState, column: "used" | "leased", raw: unknown): number {
    const n = Number(raw);
    if (n >= 0) return n;
    if (firstReport(`${s.orgId}|${s.start}|${column}`)) {
      log.warn("a usage_counters row breaks the gateway's rules", {
        org_id: s.orgId,
        window_start: new Date(s.start).toISOString(),
        problem: `${column} ${String(raw)} is negative (or not a number): set to 0`,
      });
    }
    return 0;
  }

  /** Take up to one lease from the shared row: one short transaction. */
  async function lease(s: OrgState, timeoutMs?: number): Promise<void> {
    // What the requests waiting now lack: a lease smaller than that would refuse them while tokens remain.
    const need = Math.max(0, s.demand - available(s));
    const wanted = leaseSize(s);
    const look = ++s.looks;
    // Ended by the server after ANSWER_TIMEOUT_MS (a lock held elsewhere), as the request gives up on it then.
    const got = await boundedTx(database, async (tx) => {
      // Templates, not the query builder: leases are too rare for it to get warm (src/db/raw.ts).
      const ws = epochMs(s.start);
      await tx.execute(sql`insert into usage_counters (org_id, window_start) values (${s.orgId}, ${ws}) on conflict do nothing`);
      const [row] = rowsOf<{ used: unknown; leased: unknown }>(
        await tx.execute(sql`select used, leased from usage_counters where org_id = ${s.orgId} and window_start = ${ws} for update`),
      );
      if (!row) throw new Error("usage counter row missing after insert");
      // Our side as of this look, to compare with the row: a write of ours may land, a cut or a quota change run,
      // before the transaction ends (each await below, and the commit).
      const at = { quota: s.quota, granted: s.granted, returning: s.returning, revoked: s.revoked, returned: s.returned };
      // bigint columns arrive as numbers (PGlite) or strings (postgres.js). A negative figure (hand-edited:
      // the gateway only adds usage, and its returns stop leased at 0) is set to 0 in the row, under this
      // lock, so it never counts as quota; leases added to it from now on count in full.
      const used = counted(s, "used", row.used);
      const leased = counted(s, "leased", row.leased);
      if (used !== Number(row.used) || leased !== Number(row.leased)) {
        await tx.execute(sql`update usage_counters set used = ${used}, leased = ${leased} where org_id = ${s.orgId} and window_start = ${ws}`);
      }
      const free = at.quota - used - leased;
      // A share of what remains, so instances split a small quota (or the end of a large one); at least what is needed now.
      const take = Math.max(0, Math.min(free, Math.max(need, Math.min(wanted, Math.ceil(free * LEASE_SHARE)))));
      const others = leased - at.granted - at.returning - at.revoked;
      // Exact only with no write of ours out: between its commit and landed() the row has our return and `returning` still counts it.
      const exact = at.returning === 0;
      // Short while other instances hold lease: ask them for their unused part (they look at every flush).
      const asking = take < need && others > 0;
      if (take > 0 || asking) {
        await tx.execute(
          sql`update usage_counters set leased = leased + ${take}${asking ? sql`, wanted_at = now()` : sql``} where org_id = ${s.orgId} and window_start = ${ws}`,
        );
      }
      // notOurs: the row's lease that is not ours in hand (other instances' and our return not yet written there).
      return { take, left: free - take, others, exact, notOurs: leased - at.granted - at.revoked, at };
    }, timeoutMs);
    s.granted += got.take;
    s.lastTake = got.take;
    s.sharedFree = got.left;
    // The quota changed while the transaction was out: `left` is by the old one, and changeQuota saw none of
    // this lease. Before, all of it was admitted against, beyond a quota lowered below it.
    if (s.quota !== got.at.quota) {
      const quota = s.quota;
      s.quota = got.at.quota;
      changeQuota(s, quota);
    }
    // Other instances' lease and our own return not yet written there (what it frees is ours once it lands), and
    // what our writes have given back since the look. Before, `others` + `returning` as of now: a return that
    // landed during the transaction was counted against other instances' lease and by neither, a false 429.
    s.othersHold = Math.max(0, got.notOurs) + s.returned - got.at.returned;
    s.othersExact = got.exact ? Math.max(0, got.others) : -1;
    s.reservedSinceLease = 0;
    s.leasedAt = now();
    // Exhausted: the shared counter could not supply what was needed (or, for a refill ahead of need, anything).
    s.exhausted = got.take < need || (need === 0 && got.take === 0);
    s.leaseError = false;
    s.lookSeen = look;
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

  /**
   * At most maxOutAtOnce(dbPoolMax) lease transactions are out at once, given
   * up on or not (src/db/bounded.ts), and one per organisation and period: a
   * lease given up on (no answer within ANSWER_TIMEOUT_MS) keeps its
   * connection until the database answers it, and while it has not settled
   * no other is sent for that organisation; its requests are refused (503)
   * at once. A lease that commits after all is still counted when its answer
   * comes (lease() adds it to `granted`).
   */
  function refill(s: OrgState): Promise<void> {
    if (s.refill) return s.refill;
    // Stopping: a request that still wants lease is refused (503), never given one that nothing returns.
    if (s.leaseUnanswered || stopping) {
      s.leaseError = true;
      return Promise.resolve();
    }
    // One immediate retry: a pooled connection that the server dropped fails once, then postgres.js reconnects.
    s.refill = leases
      .run(
        (left) =>
          lease(s, left).catch((e: unknown) => {
            // Ended by the server after the request gave up on it (boundedTx): nobody waits for a retry.
            if (isServerTimeout(e)) throw e;
            return lease(s, left);
          }),
        (running) => {
          s.leaseUnanswered = true;
          const settled = () => {
            s.leaseUnanswered = false;
          };
          running.then(settled, settled);
        },
      )
      .catch((e: Error) => {
        s.leaseError = true;
        // Refused at once while earlier leases are unanswered: the bound logged that once.
        if (!(e instanceof BoundFull)) log.warn("quota lease failed", { org_id: s.orgId, err: e.message });
      })
      .finally(() => {
        s.refill = undefined;
      });
    return s.refill;
  }

  function exceeded(s: OrgState, t: number, want: number): AppError {
    const spent = { orgId: s.orgId, quota: s.quota, period: s.period, start: s.start };
    budgetAudit.record(spent);
    return budgetExceeded(spent, t, want);
  }

  /**
   * Admission decided at once, the steady state: a Ticket for an
   * organisation without a quota or when the local lease covers the whole
   * estimate; throws when more than the whole quota is asked; undefined when
   * it must wait for a lease (then `admit`). No promise, no await.
   */
  function admitNow(p: Principal, estimate: number, minimum?: number): Ticket | undefined {
    const t = now();
    const want = Math.max(1, Math.ceil(estimate));
    const o = orgOf(p);
    o.lastUsed = t;
    if (o.tokens === null) return new TicketImpl(p, want, undefined, t, o.period);
    const least = Math.min(want, Math.max(1, Math.ceil(minimum ?? want)));
    const s = stateFor(o, o.tokens, t);
    // More than the whole quota can never be granted: refused before any lease, so that no such
    // figure (up to Infinity: n × an unbounded max_tokens) reaches the lease arithmetic. Refused for its
    // own size: it takes the window's billing.budget_exceeded event (the quota running out, once a window)
    // only when this instance already knows the window has nothing left for it (the database granted
    // nothing, or the quota was lowered below what is used and held), with no database look of its own.
    // Before, any such request took the event while the quota had room, and none came when it ran out.
    if (!(least <= s.quota) || !Number.isFinite(want)) {
      const spent = { orgId: s.orgId, quota: s.quota, period: s.period, start: s.start };
      if ((s.exhausted || s.sharedFree < 0) && available(s) <= 0) budgetAudit.record(spent);
      throw budgetExceeded(spent, t, least);
    }
    // An exhausted period is re-checked every few seconds: other instances may return leases, or the quota may grow.
    if (s.exhausted && t - s.checkedAt > 5_000) s.exhausted = false;
    // Requests waiting for quota come first, even when what is free would cover this one (reserve).
    if (s.waitHead !== undefined || available(s) < want) return undefined;
    s.inflight += want;
    s.reservedSinceLease += want;
    refillAhead(s);
    return new TicketImpl(p, want, s, t, s.period);
  }

  async function admit(p: Principal, estimate: number, minimum?: number, signal?: AbortSignal): Promise<Ticket> {
    const ready = admitNow(p, estimate, minimum);
    if (ready) return ready;
    const t = now();
    const want = Math.max(1, Math.ceil(estimate));
    const least = Math.min(want, Math.max(1, Math.ceil(minimum ?? want)));
    const o = orgOf(p);
    // Set, or admitNow would have decided: no await between them.
    if (o.tokens === null) return new TicketImpl(p, want, undefined, t, o.period);
    const s = stateFor(o, o.tokens, t);
    // Demand of the requests waiting sizes the next lease, so a burst of
    // thousands of requests is served by a few refills, not thousands.
    s.demand += want;
    let got: number | Refusal | "gone";
    try {
      got = await reserve(s, want, least, signal);
    } finally {
      s.demand -= want;
    }
    // Its client left while it waited: nothing reserved; the caller settles the ticket (499, nothing charged).
    if (got === "gone") return new TicketImpl(p, 0, s, t, s.period);
    if (got === "spent") throw exceeded(s, t, least);
    if (got === "held") {
      throw new AppError(
        "service_unavailable",
        "The rest of the organisation's usage quota is reserved by requests in flight; retry shortly.",
        null,
        { "retry-after": "1" },
      );
    }
    if (got === "unavailable") {
      // Without a lease we cannot know the budget: refuse honestly, not as budget_exceeded.
      throw new AppError(
        "service_unavailable",
        stopping
          ? "The gateway is shutting down; retry the request."
          : s.leaseError
            ? "The usage quota store is temporarily unreachable; retry with backoff."
            : "The usage quota is being refilled under heavy load; retry shortly.",
      );
    }
    refillAhead(s);
    return new TicketImpl(p, got, s, t, s.period);
  }

  /** Refill ahead of need so the next requests do not wait (not once the shared counter is known to be empty). */
  function refillAhead(s: OrgState): void {
    if (!s.exhausted && s.sharedFree > 0 && available(s) < Math.min(opts.leaseTokens, s.lastTake) / 2) void refill(s);
  }

  /**
   * Reserves `want` tokens (or, when the shared counter has no more, what is
   * left down to `least`) from the local lease, leasing more while it holds
   * less: the only path that touches the database. The reservation is taken
   * in the same turn as the check, since concurrent requests may drain a
   * fresh lease before this one resumes; so it tries a few times. When the
   * counter is empty but other instances hold enough lease, it waits a few
   * flush intervals for them to return their unused part (they do at each
   * flush once the counter is empty); likewise while a write of this
   * instance's own return is under way (the row counts that lease until it lands).
   *
   * Waiters are served in arrival order: a request waits for its turn behind
   * those that arrived before it (the organisation's queue), and only the
   * oldest looks and takes tokens. Before, whoever looked first after tokens
   * came free took them, so a large request could wait out its whole wait
   * behind a stream of small ones and be refused while they were served.
   * The oldest's wait is its own, from when its turn came (`reserveInTurn`);
   * when it is refused, those behind it that the same looks refuse go with
   * it (`refuseBehind`), so a spent quota ends a queue at once.
   */
  async function reserve(s: OrgState, want: number, least: number, signal: AbortSignal | undefined): Promise<number | Refusal | "gone"> {
    if (signal?.aborted) return "gone";
    const me: Waiter = {
      prev: s.waitTail,
      next: undefined,
      queued: true,
      want,
      least,
      firstLook: s.looks + 1,
      since: now(),
      resume: undefined,
      nap: undefined,
      gone: false,
      answer: undefined,
    };
    if (me.prev) me.prev.next = me;
    else s.waitHead = me;
    s.waitTail = me;
    // A client that leaves takes its waiter out of the queue at once, whatever it awaits (its turn, a lease, a
    // sleep): the next one's turn comes now, not when this one's wait would have ended (up to shareWaitMs).
    const left = () => {
      me.gone = true;
      leave(s, me);
      me.resume?.();
    };
    signal?.addEventListener("abort", left);
    try {
      // Behind others: its turn comes when each before it is admitted or refused, unless it is refused with them.
      if (me.prev) await pause(me, undefined, undefined);
      if (me.gone) return "gone";
      return me.answer ?? (await reserveInTurn(s, me));
    } finally {
      signal?.removeEventListener("abort", left);
      leave(s, me);
    }
  }

  /** Takes a waiter out of its queue; when it was the oldest, the next one's turn comes. */
  function leave(s: OrgState, w: Waiter): void {
    if (!w.queued) return;
    w.queued = false;
    const { prev, next } = w;
    if (prev) prev.next = next;
    else s.waitHead = next;
    if (next) next.prev = prev;
    else s.waitTail = prev;
    w.prev = undefined;
    w.next = undefined;
    if (!prev) next?.resume?.();
  }

  /**
   * Waits until `p` settles (a lease), `ms` pass (a sleep between looks: a settle may end it early), or the
   * waiter is resumed (its turn came, it was refused with the oldest, or its client left). Only on the waiting path.
   */
  function pause(me: Waiter, p: Promise<void> | undefined, ms: number | undefined): Promise<void> {
    return new Promise<void>((resolve) => {
      let timer: ReturnType<typeof setTimeout> | undefined;
      const done = () => {
        if (timer !== undefined) clearTimeout(timer);
        // A lease that settles after the waiter went on (its client left) leaves a later pause alone.
        if (me.resume === done) me.resume = undefined;
        if (me.nap === done) me.nap = undefined;
        resolve();
      };
      me.resume = done;
      if (p) void p.then(done, done);
      if (ms !== undefined) {
        timer = setTimeout(done, ms);
        me.nap = done;
      }
    });
  }

  /**
   * `reserve` for the oldest waiter: the waiting loop. Its looks and its wait
   * for other instances' lease count from when its turn came, not from when
   * it arrived: a request that reached the front after a long wait behind
   * another is never refused on looks that were not its own (a first
   * attempt, reverted, counted its wait from when it queued: such a waiter
   * was refused at once, with no look of its own, while lease was still
   * coming back; quota-share, budget_exceeded with 905 of 20,000 tokens left).
   */
  async function reserveInTurn(s: OrgState, me: Waiter): Promise<number | Refusal | "gone"> {
    const { want, least } = me;
    let tries = 0;
    /** The first lease started in its turn: only its look, or a later one, may refuse it. */
    const firstLook = s.looks + 1;
    let waitUntil: number | undefined;
    /** Other instances' lease at the first exact look of the wait (-1: none yet): lease that moves is in use, not stranded. */
    let othersFirst = -1;
    let othersMoved = false;
    const refused = (answer: Refusal, waited: boolean): Refusal => {
      refuseBehind(s, me, answer, waited, othersMoved);
      return answer;
    };
    for (;;) {
      // Its client left during the await before: out of the queue already (the next has its turn), it takes nothing.
      if (me.gone) return "gone";
      const avail = available(s);
      const take = avail >= want ? want : s.exhausted && avail >= least ? avail : 0;
      if (take > 0) {
        s.inflight += take;
        s.reservedSinceLease += take;
        return take;
      }
      if (s.exhausted && s.sharedFree >= least - avail) {
        // "Exhausted" came from a lease that fell short of a larger request;
        // the counter had this much left at our last look (a write may have
        // given our lease back since): lease again rather than refuse.
        s.exhausted = false;
      } else if (s.exhausted) {
        // What may still come free: other instances' lease, and what this instance's own requests in
        // flight reserved beyond what they will use (a reservation is the prompt's bound, often several
        // times its count). Refusing before they settle would be a budget_exceeded while tokens remain.
        if (s.othersHold + s.inflight < least - avail) {
          // Refused only on a look at the counter taken in its turn. An earlier one (kept for admitNow, or
          // taken for the waiter before it) may predate lease given back since, this instance's own at a write
          // while another asked for lease (observed() then leaves sharedFree at 0): a false budget_exceeded
          // (quota.test.ts).
          if (s.lookSeen >= firstLook) return refused("spent", false);
          if (tries >= 8 || (tries > 0 && s.leaseError)) return refused("unavailable", false);
          tries++;
          await pause(me, refill(s), undefined);
          continue;
        }
        waitUntil ??= now() + shareWaitMs;
        // Only exact looks count: this instance's own return, written at every flush while the counter is
        // empty and taken again by this loop, is not another instance's lease moving (CI, quota-crash).
        if (s.othersExact >= 0) {
          if (othersFirst < 0) othersFirst = s.othersExact;
          else if (s.othersExact !== othersFirst) othersMoved = true;
        }
        // Still held after the wait by requests in flight (this instance's own, or another live instance's,
        // whose lease moved meanwhile as it wrote usage): the quota is not known to be spent, so not
        // budget_exceeded ("retrying does not help", spec 7 rule 1) but a 503 to retry. Lease that did not
        // move in all that time (an instance that died with it, or that keeps it idle) is not coming back:
        // budget_exceeded, as before.
        if (now() >= waitUntil) return refused(s.inflight >= least - avail || othersMoved ? "held" : "spent", true);
        // Until its next look; a request that settles wakes it (settle), and what it gave back is taken at
        // once when it is enough. Otherwise the oldest saw it only at its next look (up to flushMs / 4 later).
        // Real time, as the sleep is (`now` may be a test's clock).
        const lookAt = performance.now() + Math.max(20, Math.floor(opts.flushMs / 4));
        do await pause(me, undefined, Math.max(0, lookAt - performance.now()));
        while (!me.gone && available(s) < least && performance.now() < lookAt);
        s.exhausted = false;
        tries = 0;
        continue;
      } else if (tries >= 8 || (tries > 0 && s.leaseError)) {
        return refused("unavailable", false);
      }
      tries++;
      await pause(me, refill(s), undefined);
    }
  }

  /**
   * The oldest waiter was refused: each waiter behind it that the same looks
   * refuse is refused with it, now, so that a spent quota does not make a
   * queue of N waiters wait N times in series (each one's own look, or its
   * own whole wait for a stranded lease). Only a waiter that began waiting
   * before a look that has answered since (as its own refusal would need)
   * and that cannot take what is available:
   * - spent when what may still come free (other instances' lease,
   *   reservations in flight) cannot cover it: the database said so;
   * - after the oldest's whole wait (`waited`), spent when the rest is other
   *   instances' lease that did not move all that time (stranded); held
   *   (503, retry) when it is in use, for a waiter that wants no less than
   *   the oldest did or has waited a whole wait itself. A smaller one that
   *   came later may fit in what comes free next: it waits on;
   * - unavailable when a lease started since it began waiting failed.
   * Those that may still fit wait on, in order; the next gets its turn.
   */
  function refuseBehind(s: OrgState, head: Waiter, answer: Refusal, waited: boolean, othersMoved: boolean): void {
    const avail = available(s);
    const t = now();
    for (let w = head.next; w !== undefined; ) {
      const next = w.next;
      const lack = w.least - avail;
      let same: Refusal | undefined;
      if (avail >= w.want || (s.exhausted && lack <= 0)) {
        // It fits: its turn takes it.
      } else if (answer === "unavailable") {
        if (s.leaseError && s.looks >= w.firstLook) same = "unavailable";
      } else if (s.exhausted && s.lookSeen >= w.firstLook && s.sharedFree < lack) {
        if (s.othersHold + s.inflight < lack) same = "spent";
        else if (waited && !(s.inflight >= lack || othersMoved)) same = "spent";
        else if (waited && (w.least >= head.least || t - w.since >= shareWaitMs)) same = "held";
      }
      if (same !== undefined) {
        w.answer = same;
        leave(s, w);
        w.resume?.();
      }
      w = next;
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
      // What it reserved beyond its use is free now: the oldest waiter, if asleep between looks, looks at once.
      t.state.waitHead?.nap?.();
    } else if (tokens > 0) {
      const start = periodStart(t.period, t.start);
      const k = key(p.orgId, start);
      const u = unmetered.get(k) ?? { orgId: p.orgId, start, pending: 0 };
      u.pending += tokens;
      unmetered.set(k, u);
    }
    // Bounded: when full, the oldest per-request record gives way (token counters above are never dropped).
    writer.record(p.orgId, p.keyId, outcome.alias, outcome.target, prompt, completion, outcome.status, outcome.latencyMs, outcome.streamed, now());
  }


  /**
   * The lease side of each write: what usage settled and what lease goes back.
   * Unused lease goes back on shutdown and when its period has ended; at
   * every flush once the shared counter is empty, so that another instance's
   * requests can have it; and otherwise what exceeds one lease.
   */
  const counters: CounterSource = {
    cut(final) {
      const deltas: CounterDelta[] = [];
      const current = now();
      for (const [k, s] of states) {
        const u = s.pending;
        const convert = Math.min(u, s.granted);
        s.pending -= u;
        s.granted -= convert;
        const ended = s.start < periodStart(s.period, current);
        let give = 0;
        // The last write of the period or of the instance: all but what requests still in flight reserved
        // (what they use is written by no later write; kept as lease, it is never admitted twice). Before, the
        // final write kept a lease's worth more when a request was in flight, stranded until the period ended.
        if (final || ended) give = Math.max(0, s.granted - s.inflight);
        else if (s.sharedFree <= 0) give = Math.max(0, s.granted - s.inflight);
        // Unused lease beyond what the next lease would be goes back at every write (a lease taken ahead of
        // need on top of the last one, reservations settled far below their size), so a SIGKILL strands at
        // most one lease per organisation.
        else give = Math.max(0, s.granted - s.inflight - leaseSize(s));
        s.granted -= give;
        give += s.revoked;
        s.revoked = 0;
        s.returning += convert + give;
        s.returned += convert + give;
        if (u > 0 || convert + give > 0) deltas.push({ orgId: s.orgId, start: s.start, used: u, leased: -(convert + give) });
        if (ended && s.inflight === 0) {
          states.delete(k);
          const o = settings.get(s.orgId);
          if (o?.current === s) o.current = undefined;
        }
      }
      // Settings of organisations with no period state and no request for a while (an hour): at most one sweep a minute.
      settings.sweep(current);
      for (const [k, u] of unmetered) {
        if (u.pending > 0) deltas.push({ orgId: u.orgId, start: u.start, used: u.pending, leased: 0 });
        unmetered.delete(k);
      }
      return deltas;
    },
    observed(d, row) {
      const s = states.get(key(d.orgId, d.start));
      // Another instance asked for lease recently: the next flush returns our unused part.
      if (s) s.sharedFree = row.wanted ? 0 : s.quota - Math.max(0, row.used) - Math.max(0, row.leased);
    },
    landed(d) {
      const s = states.get(key(d.orgId, d.start));
      if (s) s.returning = Math.max(0, s.returning + d.leased);
    },
    pendingTokens() {
      let n = 0;
      for (const s of states.values()) n += s.pending;
      for (const u of unmetered.values()) n += u.pending;
      return n;
    },
    beforeFlush: answerWanted,
  };

  const writer = createUsageWriter(database, log, counters, {
    flushMs: opts.flushMs,
    maxBuffered: opts.maxBuffered,
    ...(opts.eventsPerBatch !== undefined ? { eventsPerBatch: opts.eventsPerBatch } : {}),
    wantedWithinMs: shareWaitMs,
  });

  return {
    quotaOf: (p) => orgOf(p).tokens,
    admitNow,
    admit,
    settle,
    start: writer.start,
    flush: writer.flush,
    async stop() {
      stopping = true;
      // A lease taken ahead of need may still be out: its tokens land on the row after the final write, and were
      // stranded there (counted as leased) until the period ended. Each is bounded (boundedTx), so this wait is.
      await Promise.all([...states.values()].map((s) => s.refill));
      await writer.stop();
    },
    stats: () => ({ orgs: states.size, settings: settings.size(), ...writer.stats(), unansweredLeases: leases.unanswered(), unansweredBudgetWrites: budgetAudit.unanswered() }),
  };
}
