import { and, eq, sql } from "drizzle-orm";
import { recordAudit } from "../audit/record.ts";
import { type Bound, BoundFull, boundedCall, boundedTx, createBound, maxOutAtOnce } from "../db/bounded.ts";
import type { Database } from "../db/client.ts";
import { usageCounters } from "../db/schema.ts";
import { AppError } from "../lib/errors.ts";
import type { Logger } from "../lib/log.ts";
import { SYSTEM_ACTOR_ID } from "../lib/ids.ts";
import { type QuotaPeriod, periodEnd } from "./period.ts";

/** A refusal for want of quota: the error the caller sees and the audit row operators see. */

/** One organisation's quota period that cannot supply a request. */
export interface SpentPeriod {
  orgId: string;
  quota: number;
  period: QuotaPeriod;
  /** Start of the period, epoch ms. */
  start: number;
}

/** The period's counter row was not marked by this transaction: its audit row is rolled back. */
class NotMarked extends Error {}

/**
 * budget_exceeded, once per org and period in the audit log
 * (usage_counters.exceeded_at decides across instances). The audit row is
 * inserted before the counter row is marked, so a write that waits on
 * audit_events (locked by another session, say) holds no lock on the counter
 * row, which leases and usage writes need; a transaction that finds the row
 * marked already (another instance, another attempt) rolls its audit row back.
 * True when the row is marked now (by this call or before): nothing more is
 * to be done for the period; false when it has no counter row yet.
 */
export async function recordBudgetExceeded(database: Database, s: SpentPeriod, now: number): Promise<boolean> {
  const ws = new Date(s.start);
  const row = and(eq(usageCounters.orgId, s.orgId), eq(usageCounters.windowStart, ws));
  try {
    // Ended by the server after ANSWER_TIMEOUT_MS (audit_events locked elsewhere), as the bound gives up on it then.
    await boundedTx(database, async (tx) => {
      await recordAudit(tx, {
        orgId: s.orgId,
        action: "billing.budget_exceeded",
        category: "billing",
        actor: { type: "system", id: SYSTEM_ACTOR_ID, name: "gateway", email: "", keyId: null },
        targets: [{ key: "org_id", kind: "organization", id: s.orgId, name: "", email: "" }],
        // Field names as operators know them (the column and CLI flag say quota window).
        details: { quota_tokens: s.quota, window: s.period, window_start: ws.toISOString() },
      });
      const marked = await tx
        .update(usageCounters)
        .set({ exceededAt: new Date(now) })
        .where(and(row, sql`${usageCounters.exceededAt} is null`))
        .returning({ orgId: usageCounters.orgId });
      if (marked.length === 0) throw new NotMarked();
    });
    return true;
  } catch (e) {
    if (!(e instanceof NotMarked)) throw e;
  }
  const [counter] = await boundedCall(database, (q) => q.select({ at: usageCounters.exceededAt }).from(usageCounters).where(row));
  return counter?.at != null;
}

/** The refusal of a request needing `want` tokens at `t`: retry hints only when the period resets within a minute. */
export function budgetExceeded(s: SpentPeriod, t: number, want: number): AppError {
  const resetMs = periodEnd(s.period, t) - t;
  const headers: Record<string, string> = { "x-should-retry": "false" };
  // Only a reset within a minute is worth waiting for; SDKs otherwise should not retry at all.
  if (resetMs <= 60_000) headers["retry-after"] = String(Math.max(1, Math.ceil(resetMs / 1000)));
  return new AppError(
    "budget_exceeded",
    `budget_exceeded: the organisation's usage quota of ${s.quota} tokens per ${s.period} has fewer tokens left than this request needs (${want}); requests are refused until the window resets at ${new Date(periodEnd(s.period, t)).toISOString()}.`,
    null,
    headers,
  );
}

/** The budget_exceeded audit writes of one quota manager (quota.ts refuses, this records). */
export interface BudgetRecorder {
  /** Records the period's budget_exceeded in the background (at most once); returns at once. */
  record(spent: SpentPeriod): void;
  /** Writes given up on that have not settled (db/bounded.ts). */
  unanswered(): number;
}

/**
 * The period's budget_exceeded audit row, written in the background: at
 * most one write at a time per organisation and period, none once one has
 * been written or found written (recordBudgetExceeded marks the counter
 * row), and at most maxOutAtOnce(dbPoolMax) at once in all. A write given up
 * on stays out, and keeps its place, until the database answers it.
 */
export function createBudgetRecorder(database: Database, log: Logger, now: () => number, bound?: Bound): BudgetRecorder {
  const budgetWrites = bound ?? createBound("budget_exceeded audit write", maxOutAtOnce(database.poolMax), log);
  /** Organisation periods whose budget_exceeded write is out, or done (the row says so): no other is sent. Bounded. */
  const budgetOut = new Set<string>();
  const budgetDone = new Set<string>();

  function record(spent: SpentPeriod): void {
    const k = `${spent.orgId}|${spent.start}`;
    if (budgetOut.has(k) || budgetDone.has(k)) return;
    if (budgetOut.size >= 10_000) return;
    budgetOut.add(k);
    const done = (marked: boolean) => {
      budgetOut.delete(k);
      if (!marked) return; // no counter row yet: a later refusal (after a lease made one) tries again
      if (budgetDone.size >= 10_000) budgetDone.clear();
      budgetDone.add(k);
    };
    /** Given up on: the write runs on and keeps its place until the database answers it. */
    let stillOut = false;
    budgetWrites
      .run(
        () => recordBudgetExceeded(database, spent, now()),
        (running) => {
          stillOut = true;
          running.then(done, () => budgetOut.delete(k));
        },
      )
      .then(done, (e: Error) => {
        // Refused at once while earlier writes are unanswered: the bound logged that once.
        if (!(e instanceof BoundFull)) log.warn("budget_exceeded audit write failed", { org_id: spent.orgId, err: e.message });
        // Refused or failed: the next refusal tries again.
        if (!stillOut) budgetOut.delete(k);
      });
  }

  return { record, unanswered: () => budgetWrites.unanswered() };
}
