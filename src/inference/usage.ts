/**
 * Token counts read from an upstream's `usage`. They are hostile input like
 * any other: an upstream answering `"prompt_tokens": 1e20` must not reach the
 * client, the quota or the usage table. A count is accepted when it is an
 * integer from 0 to MAX_TOKEN_COUNT; anything else (absent, negative,
 * fractional, a string, absurdly large) is replaced by the gateway's own
 * estimate, and a count that was present but implausible is reported so the
 * caller can name the upstream in a warning.
 */

/** Far above any real request (context windows are ~10^6), far below where sums lose precision or overflow. */
export const MAX_TOKEN_COUNT = 1_000_000_000;

export interface Counted {
  promptTokens: number;
  completionTokens: number;
  /** The upstream's figures that were replaced (clipped for logging); undefined when all were plausible or absent. */
  rejected: { prompt_tokens?: string; completion_tokens?: string } | undefined;
}

const plausible = (v: unknown): v is number => typeof v === "number" && Number.isInteger(v) && v >= 0 && v <= MAX_TOKEN_COUNT;
const clip = (v: unknown): string => {
  const s = typeof v === "string" ? JSON.stringify(v) : String(v);
  return s.length > 40 ? `${s.slice(0, 40)}…` : s;
};

/** The counts of a `usage` object (or undefined when there was none), each falling back to its estimate. */
export function countUsage(usage: Record<string, unknown> | undefined, estimate: { promptTokens: number; completionTokens: number }): Counted {
  let rejected: Counted["rejected"];
  const pick = (key: "prompt_tokens" | "completion_tokens", fallback: number): number => {
    const v = usage?.[key];
    if (plausible(v)) return v;
    if (v !== undefined) {
      rejected ??= {};
      rejected[key] = clip(v);
    }
    return fallback;
  };
  const promptTokens = pick("prompt_tokens", estimate.promptTokens);
  const completionTokens = pick("completion_tokens", estimate.completionTokens);
  return { promptTokens, completionTokens, rejected };
}
