import { AppError } from "../lib/errors.ts";
import type { Limiter } from "../limits/store.ts";
import { rateLimitHeaders } from "../limits/window.ts";
import { bearerToken, createKeyMatcher } from "./keys.ts";
import type { SecurityAuditor } from "./security.ts";
import type { Caller, Principal } from "./types.ts";
import { AuthStoreUnavailable, type KeyVerifier, LookupThrottled, type Verdict } from "./verify.ts";

/**
 * The order of checks, the same on every endpoint (README "Decisions"):
 *   browser-looking request (in the app's onRequest, before routing)
 *   → key present and well-formed → a key not in the cache within the budget of
 *   lookups for the client's network (429 rate_limit_error)
 *   → key known and not revoked (401 unauthorized)
 *   → not expired (401 key_expired) → scope and key kind (403 scope_missing)
 *   → academy-only account (403 academy_only) → rate limit (429 rate_limit_error).
 * Authentication precedes body parsing, so an anonymous caller learns nothing
 * about validation.
 */

export interface Requirement {
  scope: string;
  /** Key kinds allowed; the audit log takes service keys only. */
  kinds?: readonly ("personal" | "service")[];
  /** Whether academy-only accounts are refused (default yes; the audit log no, spec 4.5). */
  platformOnly?: boolean;
}

export interface GuardDeps {
  verifier: KeyVerifier;
  limiter: Limiter;
  keyTag: string;
  /** Requests per minute for an organisation's plan name (the organisation named for a log line when the plan is unknown). */
  planLimit: (plan: string, orgId: string) => number;
  security: SecurityAuditor;
  now?: () => number;
}

export interface Guarded {
  principal: Principal;
  /** x-ratelimit-* headers for the response. */
  headers: Record<string, string>;
}

/**
 * The organisation's rate limit refused the request. Other refusals answer
 * 429 rate_limit_error too (the unknown-key lookup budget, an upstream
 * overloaded on every attempt, image hosts being resolved), but only this one
 * is the limiter's: `gateway_rate_limited_total` counts it alone.
 */
export class RateLimited extends AppError {}

/** A rate limit's window in a refusal's words: the spec's minute, else the configured `rateLimit.windowMs` in seconds. */
function windowText(ms: number): string {
  return ms === 60_000 ? "minute" : `${Math.round(ms / 100) / 10} s`;
}

export function createGuard(deps: GuardDeps) {
  const isWellFormed = createKeyMatcher(deps.keyTag);
  const now = deps.now ?? Date.now;

  /** The key in the header, well-formed, or 401. */
  function tokenOf(authorization: string | null): string {
    const token = bearerToken(authorization);
    if (!token) {
      // Present but not one Bearer key: another scheme, a bare key, or the header sent twice (joined as "Bearer a, Bearer b").
      throw new AppError(
        "unauthorized",
        authorization
          ? "Malformed Authorization header: send exactly one, as Authorization: Bearer <key>."
          : "Missing API key: send the header Authorization: Bearer <key>.",
      );
    }
    if (!isWellFormed(token)) throw new AppError("unauthorized", "Invalid API key.");
    return token;
  }

  /**
   * The checks when the key cache already has the key's verdict, the steady
   * state: no promise, no await. Throws as `guard` rejects; undefined when
   * the key must be looked up (then `guard`).
   */
  function cached(authorization: string | null, req: Requirement, meta: Caller): Guarded | undefined {
    const verdict = deps.verifier.cached(tokenOf(authorization));
    return verdict ? decide(verdict, req, meta) : undefined;
  }

  async function guard(authorization: string | null, req: Requirement, meta: Caller): Promise<Guarded> {
    const token = tokenOf(authorization);
    let verdict: Verdict;
    try {
      verdict = await deps.verifier.verify(token, meta);
    } catch (e) {
      if (e instanceof LookupThrottled) {
        const retryAfter = String(Math.max(1, Math.ceil(e.retryAfterMs / 1000)));
        throw new AppError(
          "rate_limit_error",
          `Too many requests with unknown API keys. Retry after ${retryAfter} s.`,
          null,
          { "retry-after": retryAfter },
        );
      }
      if (e instanceof AuthStoreUnavailable) {
        // Never fail open: a key we cannot verify is not accepted.
        throw new AppError("service_unavailable", "The key store is temporarily unreachable; retry with backoff.");
      }
      throw e;
    }
    return decide(verdict, req, meta);
  }

  /** Everything after the key's verdict, in the order above. */
  function decide(verdict: Verdict, req: Requirement, meta: Caller): Guarded {
    if (verdict.status === "unknown") throw new AppError("unauthorized", "Invalid API key.");
    if (verdict.status === "damaged") {
      // Logged with the key's id when it was loaded (key-row.ts principalOfRow); no audit row: the row's fields are not to be trusted.
      throw new AppError("unauthorized", "This API key's record is damaged and it cannot be used; ask an administrator to check it or create a new key.");
    }
    if (verdict.status === "revoked") {
      deps.security.keyRejected(verdict.principal, "security.revoked_key_used", meta);
      throw new AppError("unauthorized", "This API key has been revoked; create a new key.");
    }
    if (verdict.status === "expired") {
      deps.security.keyRejected(verdict.principal, "security.expired_key_used", meta);
      throw new AppError("key_expired", "This API key has expired; create a new key.");
    }
    const p = verdict.principal;
    if (!p.scopes.includes(req.scope)) {
      throw new AppError("scope_missing", `This key lacks the scope ${req.scope} required by this endpoint.`);
    }
    if (req.kinds && !req.kinds.includes(p.kind)) {
      throw new AppError("scope_missing", `This endpoint takes ${req.kinds.join(" or ")} keys only; this is a ${p.kind} key.`);
    }
    if ((req.platformOnly ?? true) && p.academyOnly) {
      throw new AppError("academy_only", "This account has access to the academy only, not to the platform API.");
    }
    const decision = deps.limiter.check(p.orgId, deps.planLimit(p.plan, p.orgId), now());
    const headers = rateLimitHeaders(decision);
    if (!decision.allowed) {
      throw new RateLimited(
        "rate_limit_error",
        `Rate limit reached: ${decision.limit} requests per ${windowText(deps.limiter.windowMs)} for this organisation. Retry after ${headers["retry-after"]} s.`,
        null,
        headers,
      );
    }
    deps.verifier.markUsed(p.keyId);
    return { principal: p, headers };
  }

  /** The principal of a currently valid key, without any check or side effect; null otherwise. */
  async function peek(authorization: string | null, meta: Caller) {
    const token = bearerToken(authorization);
    if (!token || !isWellFormed(token)) return null;
    try {
      // Charged to the client's lookup budget like any other request: browser-looking floods are no way around it.
      const v = await deps.verifier.verify(token, meta);
      return v.status === "valid" ? v.principal : null;
    } catch {
      return null;
    }
  }

  return Object.assign(guard, { peek, cached });
}

export type Guard = ReturnType<typeof createGuard>;
