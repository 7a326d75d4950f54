import type { Principal } from "../auth/types.ts";
import type { QuotaPeriod } from "./period.ts";

/**
 * Each organisation's newest quota setting, as this instance has seen it on
 * the principals of its requests (quota.ts admits against it). A setting
 * arrives on every principal; which one is newest is told by when the
 * principal was read (Principal.readAt), so a request whose key was checked
 * before a change is held to the newer setting. Bounded: a setting is kept
 * while its organisation has a period state, and for SETTING_IDLE_MS after
 * its last request.
 */

/** An organisation's newest quota setting is forgotten once it has had no request for this long and holds no period state. */
const SETTING_IDLE_MS = 3_600_000;

/**
 * What this instance knows of one organisation's quota: the newest setting
 * seen, by the time its principal was read (Principal.readAt), and the state
 * of its current period (`S`: quota.ts's). Admission and the period's state
 * follow this setting, never an older principal's: a request whose key was
 * checked before a change (its body read after) carries the old setting.
 */
export interface OrgQuota<S> {
  orgId: string;
  /** null: no quota. */
  tokens: number | null;
  period: QuotaPeriod;
  /** When the principal that carried this setting was read; -Infinity when it did not say. */
  readAt: number;
  current: S | undefined;
  lastUsed: number;
}

export interface QuotaSettings<S> {
  /**
   * The organisation's entry, with the principal's setting applied when it is
   * the newest seen. A quota change reaches us through the key cache (org:<id>
   * invalidation); a principal read before the one whose setting the entry
   * has (a request whose key was checked before the change, its body read
   * after) is held to the newer setting, whether the change set a first quota,
   * lowered or raised it, or changed its period. Before, such a request was
   * admitted as its principal said: unlimited, against the old period's
   * quota, or (the first of its organisation in a new period) against the old
   * quota, far beyond the new one. A principal without readAt counts as newest.
   */
  of(p: Principal): OrgQuota<S>;
  /** The organisation's entry when one is kept, as it is (no setting applied). */
  get(orgId: string): OrgQuota<S> | undefined;
  /** Settings of organisations with no period state and no request for a while (an hour) are forgotten: at most one sweep a minute. */
  sweep(t: number): void;
  /** Organisations whose newest setting is kept. */
  size(): number;
}

export function createQuotaSettings<S>(now: () => number): QuotaSettings<S> {
  /**
   * Each organisation's newest quota setting and its current period's state, for the request path: one
   * lookup, no key string or date math per request. Pruned with the states (quota.ts's cut): a setting is
   * kept while its organisation has a period state, and for SETTING_IDLE_MS after its last request.
   */
  const orgs = new Map<string, OrgQuota<S>>();
  /** The last principal applied and its organisation's entry: the inference path asks quotaOf, then admits, in one turn. */
  let lastPrincipal: Principal | undefined;
  let lastOrg: OrgQuota<S> | undefined;
  let lastSweep = 0;

  function of(p: Principal): OrgQuota<S> {
    if (p === lastPrincipal && lastOrg !== undefined) return lastOrg;
    let o = orgs.get(p.orgId);
    if (o === undefined) {
      o = { orgId: p.orgId, tokens: p.quotaTokens, period: p.quotaPeriod, readAt: p.readAt ?? Number.NEGATIVE_INFINITY, current: undefined, lastUsed: now() };
      orgs.set(p.orgId, o);
    } else if (p.readAt === undefined || p.readAt >= o.readAt) {
      o.tokens = p.quotaTokens;
      o.period = p.quotaPeriod;
      if (p.readAt !== undefined) o.readAt = p.readAt;
    }
    lastPrincipal = p;
    lastOrg = o;
    return o;
  }

  function sweep(current: number): void {
    if (current - lastSweep < 60_000) return;
    lastSweep = current;
    for (const [id, o] of orgs) {
      if (o.current !== undefined || current - o.lastUsed < SETTING_IDLE_MS) continue;
      orgs.delete(id);
      if (lastOrg === o) lastPrincipal = lastOrg = undefined;
    }
  }

  return { of, get: (orgId) => orgs.get(orgId), sweep, size: () => orgs.size };
}
