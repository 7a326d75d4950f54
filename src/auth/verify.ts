import { sql } from "drizzle-orm";
import { ANSWER_TIMEOUT_MS, type Database, DatabaseTimeout, answeredWithin } from "../db/client.ts";
import { boundedCall, createBound } from "../db/bounded.ts";
import { isServerTimeout } from "../db/errors.ts";
import type { Logger } from "../lib/log.ts";
import { firstSeen } from "../lib/once.ts";
import { type RowProblem, lookupKey } from "./key-row.ts";
import { hashKey } from "./keys.ts";
import { ipPrefix } from "./security.ts";
import type { Principal } from "./types.ts";

/**
 * Key verification with an in-memory cache, so a request touches no database
 * in steady state:
 * - positive entries (by key hash) live `ttlMs`; past that they are refreshed,
 *   and while the database is unreachable a stale entry keeps serving for up to
 *   10 × ttlMs (a known key keeps working through a short outage);
 * - unknown hashes are remembered `negativeTtlMs` in a bounded map, and
 *   lookups of keys not in the cache are budgeted per client network and in
 *   total, so a flood of random keys costs a bounded number of lookups and
 *   cannot grow memory;
 * - concurrent misses for one hash share one lookup;
 * - changes arrive on the `gateway_auth` NOTIFY channel (sent in the same
 *   transaction as the change), so revocation reaches every instance at once;
 *   a lookup that was out while a message arrived is not cached (see sharedLookup).
 *
 * Expiry and revocation are judged on every request from the cached fields.
 */

export const AUTH_CHANNEL = "gateway_auth";

export type Verdict =
  | { status: "valid"; principal: Principal }
  | { status: "expired"; principal: Principal }
  | { status: "revoked"; principal: Principal }
  | { status: "damaged"; principal: Principal }
  | { status: "unknown" };

export class AuthStoreUnavailable extends Error {}

/** Too many lookups of keys not in the cache, from this client's network or from everyone. */
export class LookupThrottled extends Error {
  constructor(readonly retryAfterMs: number) {
    super("too many lookups of unknown keys");
  }
}

/** Who presents a key; only read when a lookup would be charged. */
export interface KeyClient {
  readonly ip: string | null;
}

/** Up to `rate` lookups at once, refilled at `rate` a minute. */
interface Bucket {
  tokens: number;
  at: number;
}

function refill(b: Bucket, rate: number, t: number): void {
  b.tokens = Math.min(rate, b.tokens + (Math.max(0, t - b.at) * rate) / 60_000);
  b.at = t;
}

/** Client networks whose lookup budget is remembered; beyond this the least recently used is forgotten. */
const MAX_PREFIXES = 10_000;

interface Entry {
  principal: Principal;
  fetchedAt: number;
  /** A refresh of this entry failed (the store unreachable) and none succeeded since; 0 otherwise. */
  failedAt: number;
}

export interface VerifierOptions {
  ttlMs: number;
  max: number;
  negativeTtlMs: number;
  negativeMax: number;
  /** How often batched `last_used_at` updates are written. */
  lastUsedFlushMs?: number;
  now?: () => number;
  /**
   * Lookups of keys not in the cache, a minute, per client network (/24,
   * /48) and for all clients together; beyond either the request is refused
   * without a lookup. A lookup that finds a key is given back, so the budgets
   * bound lookups of unknown keys. Unset: unbounded.
   */
  unknownPerPrefixPerMin?: number;
  unknownPerMin?: number;
  /** How long a lookup (with its one retry) may wait for the database; ANSWER_TIMEOUT_MS by default. */
  lookupTimeoutMs?: number;
  /** Where rows read past the gateway's rules are reported (once per row and problem). */
  log?: Logger;
  /** Reads a key's row; `lookupKey` unless a test substitutes one it can pause. */
  lookup?: (hash: string, timeoutMs?: number) => Promise<Principal | null>;
}

export interface KeyVerifier {
  /** Throws AuthStoreUnavailable (database down, key not cached) or LookupThrottled. */
  verify(key: string, client?: KeyClient): Promise<Verdict>;
  /** The verdict when the cache holds one (a fresh entry, or a fresh negative one), without a promise; else undefined. */
  cached(key: string): Verdict | undefined;
  /** Apply an invalidation message (`key:<id>`, `org:<id>`, `user:<id>`, `new`, `*`). */
  invalidate(message: string): void;
  /** Record a use; written to `last_used_at` in batches. */
  markUsed(keyId: string): void;
  flushLastUsed(): Promise<void>;
  start(): Promise<void>;
  stop(): Promise<void>;
  stats(): { entries: number; negative: number; hits: number; misses: number; lookups: number; throttled: number; unansweredLookups: number };
}

/**
 * Key lookups that may be out at once, each holding (or queued for) a pool
 * connection: half the pool, at least one. A lookup the caller gave up on
 * (no answer within lookupTimeoutMs) cannot be taken back and keeps its
 * connection until the database answers it, so without a bound a flood of
 * distinct keys not in the cache, while lookups hang (a lock on api_keys, an
 * overloaded or partitioned server), took every connection: the usage
 * writer (at most maxUnanswered() + 1 = 3 of the default 10), quota leases,
 * audit and /readyz then got none. Half the pool leaves the other half to
 * them; a healthy database answers a lookup in about a millisecond, so five
 * at a time still verify thousands of new keys a second. The embedded
 * database (no pool) is not bounded.
 */
export function maxKeyLookups(poolMax: number | undefined): number {
  if (poolMax === undefined) return Number.POSITIVE_INFINITY;
  return Math.max(1, Math.floor(poolMax / 2));
}

const UNKNOWN: Verdict = { status: "unknown" };

/**
 * Revocation is never scheduled: a set `revoked_at` is a revocation, whatever
 * it says. It is stamped with the revoking host's clock (`gateway keys
 * revoke` may run elsewhere), and comparing it with ours kept a key revoked
 * by a host whose clock ran ahead working until our clock caught up.
 */
export function judge(p: Principal, now: number): Verdict {
  if (p.damaged) return { status: "damaged", principal: p };
  if (p.revokedAt) return { status: "revoked", principal: p };
  if (p.expiresAt && p.expiresAt.getTime() <= now) return { status: "expired", principal: p };
  return { status: "valid", principal: p };
}

export function createKeyVerifier(database: Database, opts: VerifierOptions): KeyVerifier {
  const now = opts.now ?? Date.now;
  /** Row problems are logged once per process each. */
  const firstReport = firstSeen();
  const report = (p: RowProblem) => {
    if (!firstReport(`${p.table}|${p.id}|${p.problem}`)) return;
    opts.log?.warn(`${p.table === "api_keys" ? "an API key row" : "an organization row"} breaks the gateway's rules`, {
      [p.table === "api_keys" ? "key_id" : "org_id"]: p.id,
      problem: p.problem,
    });
  };
  const lookup = opts.lookup ?? ((hash: string, timeoutMs?: number) => lookupKey(database, hash, report, timeoutMs));
  const cache = new Map<string, Entry>();
  const negative = new Map<string, number>();
  const inflight = new Map<string, Promise<Principal | null>>();
  const used = new Map<string, number>();
  let hits = 0;
  let misses = 0;
  let lookups = 0;
  let throttled = 0;
  const perPrefix = opts.unknownPerPrefixPerMin;
  const perAll = opts.unknownPerMin;
  const prefixBuckets = new Map<string, Bucket>();
  const allBucket: Bucket = { tokens: perAll ?? 0, at: now() };
  /** Bumped by every message that can make a row in hand stale (a key, organisation or user changed, or all); see sharedLookup. */
  let generation = 0;
  /** Bumped by "new" (a key was created): only a "no such key" in hand can be stale then. */
  let created = 0;
  let unlisten: (() => Promise<void>) | undefined;
  let flushTimer: ReturnType<typeof setInterval> | undefined;
  /** Key lookups out at once, each holding (or queued for) a pool connection. */
  const lookupBound = createBound("key lookup", maxKeyLookups(database.poolMax), undefined, opts.lookupTimeoutMs ?? ANSWER_TIMEOUT_MS);
  /** A last_used_at update given up on has not settled yet: the next flush waits for it. */
  let lastUsedUnanswered = false;

  function remember(hash: string, principal: Principal | null, t: number) {
    if (principal) {
      if (cache.size >= opts.max && !cache.has(hash)) {
        // Map iteration is insertion order: the first key is the oldest entry.
        const oldest = cache.keys().next().value;
        if (oldest !== undefined) cache.delete(oldest);
      }
      cache.delete(hash);
      cache.set(hash, { principal, fetchedAt: t, failedAt: 0 });
      negative.delete(hash);
    } else {
      if (negative.size >= opts.negativeMax && !negative.has(hash)) {
        const oldest = negative.keys().next().value;
        if (oldest !== undefined) negative.delete(oldest);
      }
      negative.set(hash, t + opts.negativeTtlMs);
    }
  }

  /**
   * Reads a key's row (with one immediate retry: a pooled connection the
   * server dropped fails once, then the driver reconnects), waiting at most
   * lookupTimeoutMs in all, a wait for a turn included: a database that stops
   * answering must not hold the request. At most maxKeyLookups are out at
   * once (src/db/bounded.ts); a lookup given up on stays out until the
   * database answers it, and while that many are out so, a new one is refused
   * at once rather than made to wait for nothing.
   */
  function boundedLookup(hash: string): Promise<Principal | null> {
    // The server ends it when we give up on it (what the wait for a turn left of the bound's time: boundedCall).
    return lookupBound.run((left) =>
      lookup(hash, left).catch((e: unknown) => {
        // Ended by the server after we gave up on it (boundedCall): nobody waits for a retry.
        if (isServerTimeout(e)) throw e;
        return lookup(hash, left);
      }),
    );
  }

  /**
   * One lookup per hash at a time. Its result is cached only if no
   * invalidation arrived while it was out: a row read before a revocation (or
   * a "no such key" read before a creation) committed must not outlive the
   * NOTIFY that announced the change. Any change message counts, because a
   * lookup does not know which key, organisation or user its row belongs to
   * until it returns; such messages are rare, so the cost is an occasional
   * extra lookup. A key creation ("new", which comes with every key minted)
   * only discards a "no such key": it cannot make a row in hand stale, and
   * counting it would leave keys uncached whenever keys are being created.
   */
  function sharedLookup(hash: string): Promise<Principal | null> {
    let p = inflight.get(hash);
    if (!p) {
      lookups++;
      const startedAt = generation;
      const createdAt = created;
      const running: Promise<Principal | null> = boundedLookup(hash)
        .then((principal) => {
          if (generation === startedAt && (principal !== null || created === createdAt)) remember(hash, principal, now());
          return principal;
        })
        .finally(() => {
          if (inflight.get(hash) === running) inflight.delete(hash);
        });
      p = running;
      inflight.set(hash, p);
    }
    return p;
  }

  function prefixBucket(client: KeyClient | undefined, rate: number, t: number): Bucket {
    const prefix = ipPrefix(client?.ip ?? null) || "unknown";
    let b = prefixBuckets.get(prefix);
    if (b) {
      prefixBuckets.delete(prefix); // re-inserted below: the map's order is least recently used first
    } else {
      b = { tokens: rate, at: t };
      if (prefixBuckets.size >= MAX_PREFIXES) {
        const oldest = prefixBuckets.keys().next().value;
        if (oldest !== undefined) prefixBuckets.delete(oldest);
      }
    }
    prefixBuckets.set(prefix, b);
    return b;
  }

  /**
   * Takes one lookup from the client's network and from the global budget,
   * or throws LookupThrottled (taking nothing) when either is spent. Returns
   * the refund for a lookup that found a key.
   */
  function charge(client: KeyClient | undefined, t: number): () => void {
    const charged: [Bucket, number][] = [];
    if (perPrefix !== undefined) charged.push([prefixBucket(client, perPrefix, t), perPrefix]);
    if (perAll !== undefined) charged.push([allBucket, perAll]);
    let waitMs = 0;
    for (const [b, rate] of charged) {
      refill(b, rate, t);
      if (b.tokens < 1) waitMs = Math.max(waitMs, ((1 - b.tokens) * 60_000) / rate);
    }
    if (waitMs > 0) {
      throttled++;
      throw new LookupThrottled(waitMs);
    }
    for (const [b] of charged) b.tokens -= 1;
    return () => {
      for (const [b, rate] of charged) b.tokens = Math.min(rate, b.tokens + 1);
    };
  }

  /** What the cache says of a key's hash at `t`, counted as a hit; undefined when it must be looked up. */
  function fromCache(hash: string, t: number): Verdict | undefined {
    const entry = cache.get(hash);
    if (entry && t - entry.fetchedAt < opts.ttlMs) {
      hits++;
      return judge(entry.principal, t);
    }
    const neg = negative.get(hash);
    if (neg !== undefined && neg > t) {
      hits++;
      return UNKNOWN;
    }
    return undefined;
  }

  return {
    cached(key) {
      return fromCache(hashKey(key), now());
    },

    async verify(key, client) {
      const hash = hashKey(key);
      const t = now();
      const known = fromCache(hash, t);
      if (known) return known;
      const entry = cache.get(hash);
      if (entry && entry.failedAt > 0 && t - entry.fetchedAt < opts.ttlMs * 10) {
        // Its last refresh failed: the store is unreachable. Serve the entry at once and try again in the
        // background, rather than make every request with this key wait for the database to time out.
        if (!inflight.has(hash)) void sharedLookup(hash).catch(() => {});
        return judge(entry.principal, t);
      }
      // A key seen before (entry kept past its TTL) or a lookup already out costs no new lookup of an unknown key.
      const refund = entry || inflight.has(hash) ? undefined : charge(client, t);
      misses++;
      let principal: Principal | null;
      try {
        principal = await sharedLookup(hash);
        if (principal) refund?.();
      } catch (e) {
        if (entry && cache.get(hash) === entry) entry.failedAt = now();
        if (entry && t - entry.fetchedAt < opts.ttlMs * 10) return judge(entry.principal, t);
        throw new AuthStoreUnavailable((e as Error).message);
      }
      return principal ? judge(principal, t) : UNKNOWN;
    },

    invalidate(message) {
      created++;
      if (message !== "new") generation++;
      // Requests from now on start their own lookup rather than share one that may have read the old row.
      inflight.clear();
      if (message === "*") {
        cache.clear();
        negative.clear();
        return;
      }
      if (message === "stale") {
        // After a lost LISTEN connection we may have missed invalidations: every
        // entry is re-checked with the database at its next use, but stays
        // available as a fallback while the database is unreachable.
        const expired = now() - opts.ttlMs;
        // A failed refresh no longer lets an entry serve without waiting for a lookup: the database is back.
        for (const e of cache.values()) {
          e.fetchedAt = Math.min(e.fetchedAt, expired);
          e.failedAt = 0;
        }
        negative.clear();
        return;
      }
      if (message === "new") {
        negative.clear();
        return;
      }
      const [kind, id] = message.split(":");
      const field = kind === "key" ? "keyId" : kind === "org" ? "orgId" : kind === "user" ? "userId" : null;
      if (!field || !id) {
        cache.clear();
        return;
      }
      for (const [hash, e] of cache) if (e.principal[field] === id) cache.delete(hash);
    },

    markUsed(keyId) {
      used.set(keyId, now());
    },

    async flushLastUsed() {
      // One update left unanswered may hold a connection until it settles; a second would hold another.
      if (used.size === 0 || lastUsedUnanswered) return;
      const batch = [...used];
      used.clear();
      const values = sql.join(
        batch.map(([id, t]) => sql`(${id}::uuid, ${new Date(t).toISOString()}::timestamptz)`),
        sql`, `,
      );
      // Ended by the server after ANSWER_TIMEOUT_MS too, so one given up on frees its connection (boundedCall).
      const update = boundedCall(database, (q) =>
        q.execute(sql`update api_keys as k set last_used_at = greatest(k.last_used_at, v.t) from (values ${values}) as v(id, t) where k.id = v.id`),
      );
      try {
        await answeredWithin(update, ANSWER_TIMEOUT_MS, "last_used_at update");
      } catch (e) {
        if (e instanceof DatabaseTimeout) {
          lastUsedUnanswered = true;
          const settled = () => {
            lastUsedUnanswered = false;
          };
          update.then(settled, settled);
        }
        // Best effort: keep the newest times for the next attempt.
        for (const [id, t] of batch) if ((used.get(id) ?? 0) < t) used.set(id, t);
      }
    },

    async start() {
      unlisten = await database.listen(
        AUTH_CHANNEL,
        (payload) => this.invalidate(payload),
        () => this.invalidate("stale"),
      );
      flushTimer = setInterval(() => void this.flushLastUsed(), opts.lastUsedFlushMs ?? 5_000);
      flushTimer.unref?.();
    },

    async stop() {
      if (flushTimer) clearInterval(flushTimer);
      await this.flushLastUsed();
      // Bounded: UNLISTEN goes to the database, which may not answer; closing the database drops the channel anyway.
      if (unlisten) await answeredWithin(unlisten(), ANSWER_TIMEOUT_MS, "unlisten").catch(() => {});
    },

    stats() {
      return { entries: cache.size, negative: negative.size, hits, misses, lookups, throttled, unansweredLookups: lookupBound.unanswered() };
    },
  };
}
