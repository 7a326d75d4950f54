import type { Principal } from "../auth/types.ts";

/**
 * What the inference path needs from quota and usage accounting. In steady
 * state neither call touches the database: admission decides against this
 * instance's local lease of the organisation's quota (refilled in the
 * background ahead of need; only an empty lease waits for a refill), and
 * settlement queues the actual usage for the batched writer (src/limits/quota.ts
 * admits, src/limits/usage-writer.ts writes).
 */

export interface UsageReport {
  promptTokens: number;
  completionTokens: number;
}

export interface RequestOutcome {
  alias: string;
  /** Upstream target that served it (base URL + model), "" when none did. */
  target: string;
  status: number;
  latencyMs: number;
  streamed: boolean;
}

export interface Ticket {
  readonly principal: Principal;
  /** Tokens reserved at admission (the whole estimate for an organisation without a quota). */
  readonly reserved: number;
  settled: boolean;
}

export interface Metering {
  /**
   * The organisation's token quota (null: none) as this instance knows it:
   * the newest setting seen, by when each principal was read. A request whose
   * key was checked before a change carries the old setting; this, not its
   * principal, says whether it is metered (admission follows it too).
   */
  quotaOf(principal: Principal): number | null;
  /**
   * Admit a chat or embeddings request expected to use at most `estimate`
   * tokens, reserving all of them, or throw AppError("budget_exceeded") when
   * the quota has fewer left. With `minimum`, a request that can run with
   * less (its caller lowers max_tokens to fit) is given what is left, down to
   * `minimum`: `ticket.reserved` says how much.
   *
   * With `signal` (the request's: aborted when its client leaves), a request
   * whose client leaves while it waits for quota leaves the queue at once
   * (the next waiter's turn comes) and reserves nothing: the ticket has
   * `reserved` 0. The caller checks `signal.aborted` after the await and
   * settles the ticket as a client that left (499, nothing used); that check
   * also releases a reservation made just before the client left.
   */
  admit(principal: Principal, estimate: number, minimum?: number, signal?: AbortSignal): Promise<Ticket>;
  /**
   * `admit` when it can decide at once (no quota, or the local lease covers
   * the estimate: the steady state), without a promise; undefined when it
   * would wait for a lease. Throws as `admit` rejects.
   */
  admitNow(principal: Principal, estimate: number, minimum?: number): Ticket | undefined;
  /** Settle a ticket with what the request really used; idempotent (later calls are ignored). */
  settle(ticket: Ticket, usage: UsageReport, outcome: RequestOutcome): void;
}

/** Per-field bound on a usage figure at the metering boundary: anything larger is nonsense, not usage. */
export const MAX_TOKENS_PER_FIELD = 1_000_000_000;

/** A usage figure as metered: an integer in 0..MAX_TOKENS_PER_FIELD (NaN counts as 0). */
export function clampTokens(n: number): number {
  if (Number.isNaN(n) || n <= 0) return 0;
  return n >= MAX_TOKENS_PER_FIELD ? MAX_TOKENS_PER_FIELD : Math.round(n);
}
