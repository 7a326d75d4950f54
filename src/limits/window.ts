/**
 * Exact rolling-window request limiter (pure math, no I/O, no clocks).
 *
 * Guarantee: for any key, in no half-open interval [s, s + windowMs) are more
 * than `limit` requests admitted. A fixed-window or token-bucket limiter cannot
 * promise this (both allow ~2N across a window boundary), which is why we keep
 * the actual admission times: a ring buffer of at most `limit` timestamps.
 *
 * Why a ring of the last N admissions is enough: a new request at `now` is
 * admissible iff fewer than N admissions lie in (now - windowMs, now]. If we
 * hold the N most recent admissions, the oldest of them is the only one whose
 * expiry matters: anything older has expired no later than it has.
 *
 * Time is caller-supplied milliseconds (normally `Date.now()`), so tests drive
 * the clock and nothing here sleeps or reads a clock.
 */

export const DEFAULT_WINDOW_MS = 60_000;

/**
 * Admission times in ms, oldest first starting at `head`, wrapping around.
 * `times.length` is the capacity; it may be smaller than the limit (the store
 * grows rings lazily so an idle Ultra org does not cost 300 slots) or larger
 * (after a plan downgrade). `admit` copes with both.
 * Invariant: stored times are non-decreasing from oldest to newest.
 */
export interface Ring {
  times: Float64Array;
  head: number;
  count: number;
}

export interface Decision {
  allowed: boolean;
  limit: number;
  /** Slots left after this decision (0 when denied). */
  remaining: number;
  /**
   * Ms until the next request would be admitted: 0 while `remaining > 0`,
   * otherwise the time until one slot frees (the oldest admission in the
   * window expires). Integer. Sent as `x-ratelimit-reset-requests`: OpenAI
   * defines that as time until the limit is fully replenished, which for a
   * sliding log would be the *newest* admission's expiry; we report the
   * actionable value instead — when the next request can succeed — so a
   * client pacing on remaining/reset never waits longer than necessary and
   * never retries too early.
   */
  resetMs: number;
  /** When denied: exact ms to wait until a slot frees (>= 1). 0 when allowed. */
  retryAfterMs: number;
}

function assertLimit(limit: number): void {
  if (!Number.isInteger(limit) || limit < 1) {
    throw new RangeError(`rate limit must be an integer >= 1, got ${limit}`);
  }
}

/**
 * A ring for `limit` requests. `capacity` defaults to `limit` (the simple
 * fixed-size ring); pass something smaller to allocate lazily — `admit`
 * doubles the buffer, up to `limit`, when it fills.
 */
export function createRing(limit: number, capacity: number = limit): Ring {
  assertLimit(limit);
  if (!Number.isFinite(capacity)) throw new RangeError(`capacity must be finite, got ${capacity}`);
  const cap = Math.max(1, Math.min(Math.floor(capacity), limit));
  return { times: new Float64Array(cap), head: 0, count: 0 };
}

/** i-th oldest stored time (0 = oldest). Caller guarantees i < count. */
function timeAt(ring: Ring, i: number): number {
  // `?? 0` only satisfies noUncheckedIndexedAccess; the index is always in range.
  return ring.times[(ring.head + i) % ring.times.length] ?? 0;
}

/** Newest admission time, or -Infinity when the ring holds none. */
export function newestTime(ring: Ring): number {
  return ring.count === 0 ? Number.NEGATIVE_INFINITY : timeAt(ring, ring.count - 1);
}

/** True when no admission of this ring is still inside the window at `now`. */
export function isIdle(ring: Ring, now: number, windowMs: number = DEFAULT_WINDOW_MS): boolean {
  return newestTime(ring) + windowMs <= now;
}

/**
 * A new ring with the given capacity holding the newest `min(count, capacity)`
 * admissions of `ring` (oldest ones dropped).
 *
 * `admit` resizes by itself, so callers rarely need this. Trimming to a new,
 * lower limit (plan downgrade, e.g. 300 -> 60) stays exact for that limit: with
 * the newest `limit` kept, the ring reads "full" until the oldest kept one
 * expires, and by then every dropped (older) one has expired too. It forgets
 * history a later *higher* limit would need, which is why `admit` itself only
 * shrinks once fewer than `limit` admissions are live (nothing is dropped).
 */
export function resize(ring: Ring, capacity: number): Ring {
  if (!Number.isFinite(capacity)) throw new RangeError(`capacity must be finite, got ${capacity}`);
  const cap = Math.max(1, Math.floor(capacity));
  const keep = Math.min(ring.count, cap);
  const times = new Float64Array(cap);
  const skip = ring.count - keep;
  for (let i = 0; i < keep; i++) times[i] = timeAt(ring, skip + i);
  return { times, head: 0, count: keep };
}

/** In-place variant so callers holding the ring object (the store) keep it. */
function resizeInPlace(ring: Ring, capacity: number): void {
  const next = resize(ring, capacity);
  ring.times = next.times;
  ring.head = next.head;
  ring.count = next.count;
}

/**
 * Index (0 = oldest) of the first stored admission still inside the window at
 * `now`, i.e. the number of expired entries. Binary search: times are sorted.
 */
function firstLive(ring: Ring, now: number, windowMs: number): number {
  let lo = 0;
  let hi = ring.count;
  while (lo < hi) {
    const mid = (lo + hi) >>> 1;
    if (timeAt(ring, mid) + windowMs <= now) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/** Ms until the i-th oldest admission leaves the window; integer, >= 1. */
function waitFor(ring: Ring, i: number, now: number, windowMs: number): number {
  // Ceil so fractional clocks never produce a wait that is too short.
  return Math.max(1, Math.ceil(timeAt(ring, i) + windowMs - now));
}

/**
 * Decide whether a request at `now` may proceed; on admission record it.
 * The ring is mutated only when allowed (a denial leaves it untouched, so a
 * denied probe with some other limit can never lose history).
 *
 * The ring may have been created for another limit (plan change). Admission
 * is decided on the true count of admissions inside the window, whatever the
 * buffer size: with a lowered limit (300 -> 60) an org that holds 300 live
 * admissions waits until fewer than 60 remain, which is exact. On admission
 * the buffer is grown (lazily allocated or limit raised, doubling up to
 * `limit`) or shrunk back to `limit` (limit lowered).
 */
export function admit(ring: Ring, now: number, limit: number, windowMs: number = DEFAULT_WINDOW_MS): Decision {
  assertLimit(limit);
  if (!Number.isFinite(now)) throw new RangeError(`now must be a finite number, got ${now}`);
  if (!Number.isFinite(windowMs) || windowMs <= 0) throw new RangeError(`windowMs must be > 0, got ${windowMs}`);

  const expired = firstLive(ring, now, windowMs);
  const live = ring.count - expired;
  if (live >= limit) {
    // A slot frees once only limit - 1 live admissions remain, i.e. when the
    // admission at index count - limit (the oldest of the newest `limit`)
    // expires. It is live (live >= limit), so the wait is positive.
    const wait = waitFor(ring, ring.count - limit, now, windowMs);
    return { allowed: false, limit, remaining: 0, resetMs: wait, retryAfterMs: wait };
  }

  // Allowed: drop expired entries, then make room for one more (live < limit).
  ring.head = (ring.head + expired) % ring.times.length;
  ring.count = live;
  if (ring.times.length > limit) {
    resizeInPlace(ring, limit);
  } else if (ring.count === ring.times.length) {
    resizeInPlace(ring, Math.min(limit, Math.max(ring.times.length * 2, 8)));
  }
  // A clock that steps backwards must not break the sorted invariant (expiry
  // and the binary search rely on it). Recording the admission at the newest
  // time instead is conservative: the slot stays occupied slightly longer.
  const t = Math.max(now, newestTime(ring));
  ring.times[(ring.head + ring.count) % ring.times.length] = t;
  ring.count++;

  const remaining = limit - ring.count;
  // Full now: the next slot frees when the oldest (index 0) expires.
  const resetMs = remaining > 0 ? 0 : waitFor(ring, 0, now, windowMs);
  return { allowed: true, limit, remaining, resetMs, retryAfterMs: 0 };
}

/**
 * Go-style duration string as OpenAI sends in `x-ratelimit-reset-*`:
 * "0s", "20ms", "1s", "1.5s", "1m30.5s", "6m0s", "1h0m0s". Input is rounded up
 * to whole ms (never understate a wait).
 */
export function formatDuration(ms: number): string {
  const total = Math.max(0, Math.ceil(ms));
  if (total === 0) return "0s";
  if (total < 1000) return `${total}ms`;
  const h = Math.floor(total / 3_600_000);
  const m = Math.floor((total % 3_600_000) / 60_000);
  const s = Math.floor((total % 60_000) / 1000);
  const frac = total % 1000;
  const sec = frac === 0 ? `${s}s` : `${s}.${String(frac).padStart(3, "0").replace(/0+$/, "")}s`;
  if (h > 0) return `${h}h${m}m${sec}`;
  if (m > 0) return `${m}m${sec}`;
  return sec;
}

/**
 * Response headers for a decision. The official openai SDK (v7 `retryRequest`)
 * prefers `retry-after-ms` (parseFloat), then `retry-after` (seconds or HTTP
 * date), and ignores either if > 60 s; our waits never exceed the window.
 * `retry-after` is whole seconds rounded up (>= 1) so clients that only read it
 * never retry early.
 */
export function rateLimitHeaders(d: Decision): Record<string, string> {
  const headers: Record<string, string> = {
    "x-ratelimit-limit-requests": String(d.limit),
    "x-ratelimit-remaining-requests": String(d.remaining),
    "x-ratelimit-reset-requests": formatDuration(d.resetMs),
  };
  if (!d.allowed) {
    const ms = Math.max(1, Math.ceil(d.retryAfterMs));
    headers["retry-after"] = String(Math.max(1, Math.ceil(ms / 1000)));
    headers["retry-after-ms"] = String(ms);
  }
  return headers;
}
