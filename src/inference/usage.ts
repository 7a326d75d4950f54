/**
 * Token counts read from an upstream's `usage`. They are hostile input like
 * any other: an upstream answering `"prompt_tokens": 1e20` must not reach the
 * client, the quota or the usage table. A count is accepted when it is an
 * integer from 0 to MAX_TOKEN_COUNT and within the request's bounds (the
 * completion within what the upstream was told to generate, the prompt
 * within the context window); anything else (absent, negative, fractional, a
 * string, absurdly large) is replaced by the gateway's own estimate (a count
 * over its bound: by the bound), and a count that was present but
 * implausible is reported so the caller can name the upstream in a warning.
 * Zero where the estimate is not (a prompt was sent, text was delivered) is
 * implausible too: some servers send zeros as placeholders, and every
 * generated piece of text is at least one token.
 */

/** Far above any real request (context windows are ~10^6), far below where sums lose precision or overflow. */
export const MAX_TOKEN_COUNT = 1_000_000_000;

export interface Counted {
  promptTokens: number;
  completionTokens: number;
  /** The upstream's figures that were replaced (clipped for logging); undefined when all were plausible or absent. */
  rejected: { prompt_tokens?: string; completion_tokens?: string } | undefined;
  /** The upstream's prompt count when it was a count but above its bound (so capped): for the caller's own word on it. */
  promptOver?: number;
}

const plausible = (v: unknown): v is number => typeof v === "number" && Number.isInteger(v) && v >= 0 && v <= MAX_TOKEN_COUNT;
const clip = (v: unknown): string => {
  const s = typeof v === "string" ? JSON.stringify(v) : String(v);
  return s.length > 40 ? `${s.slice(0, 40)}…` : s;
};

/** The most each count can be: what the upstream was allowed to generate, the model's context window. */
export interface UsageBounds {
  promptTokens: number;
  completionTokens: number;
}
const UNBOUNDED: UsageBounds = { promptTokens: Number.POSITIVE_INFINITY, completionTokens: Number.POSITIVE_INFINITY };

/**
 * The counts of a `usage` object (or undefined when there was none), each falling back to its estimate.
 *
 * `bounds`: a completion count above n × max_tokens as sent (Infinity when
 * the upstream was sent no bound), or a prompt count above the alias's
 * context window (or, under a quota on an alias without one, above what was
 * reserved for the prompt), is no model's: it is capped at the bound and reported like
 * any implausible figure. The completion is never charged past its bound,
 * the estimate neither: an upstream that ran past its max_tokens delivered
 * text nobody reserved, and charging it would overshoot the quota (the
 * reservation is the bound). A prompt count is capped at the window or at
 * the prompt estimate, when that is more. Without the caps one request could
 * charge up to 10^9 tokens against a quota it was admitted to spend a few
 * hundred of.
 */
export function countUsage(usage: Record<string, unknown> | undefined, estimate: { promptTokens: number; completionTokens: number }, bounds = UNBOUNDED): Counted {
  // The counts are written into the result as they are picked: no closure a call.
  const counted: Counted = { promptTokens: 0, completionTokens: 0, rejected: undefined };
  counted.promptTokens = pick(counted, usage, "prompt_tokens", estimate.promptTokens, bounds.promptTokens);
  // The estimate capped first: past the bound it is no fallback either, and a count above the bound then comes to the bound.
  counted.completionTokens = pick(counted, usage, "completion_tokens", Math.min(estimate.completionTokens, bounds.completionTokens), bounds.completionTokens);
  return counted;
}

/** One count of `usage`, or its fallback; a figure rejected or over its bound is noted in `counted`. */
function pick(counted: Counted, usage: Record<string, unknown> | undefined, key: "prompt_tokens" | "completion_tokens", fallback: number, bound: number): number {
  const v = usage?.[key];
  if (plausible(v) && v > bound) {
    counted.rejected ??= {};
    counted.rejected[key] = clip(v);
    if (key === "prompt_tokens") counted.promptOver = v;
    return Math.min(v, Math.max(bound, fallback));
  }
  // Zero for work the gateway saw done (a prompt sent, text delivered) is a placeholder, not a count.
  if (plausible(v) && (v > 0 || fallback === 0)) return v;
  if (v !== undefined) {
    counted.rejected ??= {};
    counted.rejected[key] = clip(v);
  }
  return fallback;
}

/** The counts the openai SDK's CompletionUsage names in each breakdown (7.x); each is part of the count it details. */
const PROMPT_DETAILS = ["cached_tokens", "cache_write_tokens", "audio_tokens", "image_tokens", "text_tokens"] as const;
const COMPLETION_DETAILS = ["reasoning_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens", "audio_tokens", "text_tokens"] as const;

export interface UsageDetails {
  prompt_tokens_details?: Record<string, number>;
  completion_tokens_details?: Record<string, number>;
}

/** The known counts of one breakdown that are integers from 0 to `part` (the count charged that they are part of); undefined when none is. */
function detailsOf(v: unknown, fields: readonly string[], part: number): Record<string, number> | undefined {
  if (typeof v !== "object" || v === null || Array.isArray(v)) return undefined;
  const from = v as Record<string, unknown>;
  const out: Record<string, number> = {};
  let kept = 0;
  for (const k of fields) {
    const n = from[k];
    if (typeof n !== "number" || !Number.isInteger(n) || n < 0 || n > part) continue;
    out[k] = n;
    kept++;
  }
  return kept > 0 ? out : undefined;
}

/**
 * The upstream's `prompt_tokens_details` and `completion_tokens_details`
 * (cached, reasoning, audio… tokens: what LangChain's usage metadata, the
 * openai SDK's CompletionUsage and the Vercel AI SDK's cachedInputTokens and
 * reasoningTokens read), checked as any upstream figure: only the fields the
 * SDK names, each an integer from 0 to the count charged it is part of (a
 * cached count above the prompt charged is no breakdown of it); anything else
 * is dropped, and a breakdown left empty (or not an object: vLLM sends
 * `null`) is left out. They change nothing that is charged.
 */
export function usageDetails(usage: Record<string, unknown> | undefined, promptTokens: number, completionTokens: number): UsageDetails {
  const prompt = detailsOf(usage?.prompt_tokens_details, PROMPT_DETAILS, promptTokens);
  const completion = detailsOf(usage?.completion_tokens_details, COMPLETION_DETAILS, completionTokens);
  // No breakdown (vLLM sends null): one shared empty object, not three made to be spread.
  if (!prompt && !completion) return NO_DETAILS;
  const out: UsageDetails = {};
  if (prompt) out.prompt_tokens_details = prompt;
  if (completion) out.completion_tokens_details = completion;
  return out;
}

const NO_DETAILS: UsageDetails = Object.freeze({});

/**
 * The breakdowns were sent as checked (each absent, null, or an object of
 * known valid counts only), so a streamed usage chunk carrying them need not
 * be rewritten. `checked` is usageDetails of the same usage.
 */
export function detailsAsSent(usage: Record<string, unknown>, checked: UsageDetails): boolean {
  for (const k of ["prompt_tokens_details", "completion_tokens_details"] as const) {
    const sent = usage[k];
    if (sent === undefined || sent === null) continue;
    const kept = checked[k];
    // Each kept count is one sent as it is: as many as were sent means all of them.
    if (kept === undefined || Object.keys(sent as object).length !== Object.keys(kept).length) return false;
  }
  return true;
}
