/**
 * The targets of each alias, built once from the config, and the choice of
 * the next one to try: by weight, skipping targets already tried and those
 * whose circuit breaker is open.
 */

import type { AliasConfig, Config, TargetConfig, TimeoutsConfig } from "../../config/schema.ts";
import { Breaker } from "./breaker.ts";
import type { Endpoint, Http1Client } from "./http1.ts";

export interface Target {
  readonly alias: string;
  readonly cfg: TargetConfig;
  /** `<baseUrl>|<model>`, the label usage records and logs carry. */
  readonly label: string;
  /** The connection pool of the target's origin. */
  readonly endpoint: Endpoint;
  /** The base URL's path without a trailing slash (`/v1`); request paths are appended to it. */
  readonly basePath: string;
  readonly authorization: string | undefined;
  readonly breaker: Breaker;
  /** The upstream model id as it appears in response bytes: `"model":"<id>"`. */
  readonly modelField: Uint8Array;
}

const enc = new TextEncoder();

export function timeoutsFor(config: Config, alias: AliasConfig): TimeoutsConfig {
  return alias.timeouts ?? config.upstream.timeouts;
}

/** Every alias's targets, each with its connection pool, breaker and the bytes its model id has on the wire. */
export function buildTargets(config: Config, http: Http1Client): Map<string, Target[]> {
  const up = config.upstream;
  const targets = new Map<string, Target[]>();
  for (const [alias, a] of Object.entries(config.aliases)) {
    targets.set(
      alias,
      a.targets.map((cfg) => {
        const key = cfg.apiKeyEnv ? process.env[cfg.apiKeyEnv] : undefined;
        return {
          alias,
          cfg,
          label: `${cfg.baseUrl}|${cfg.model}`,
          endpoint: http.endpoint(cfg.baseUrl),
          basePath: new URL(cfg.baseUrl).pathname.replace(/\/+$/, ""),
          authorization: key ? `Bearer ${key}` : undefined,
          breaker: new Breaker({ failures: up.breakerFailures, cooldownMs: up.breakerCooldownMs }),
          modelField: enc.encode(`"model":${JSON.stringify(cfg.model)}`),
        };
      }),
    );
  }
  return targets;
}

/**
 * Weighted random choice among available targets not yet tried; weight-0
 * targets are standbys, used only when no weighted target is left. When every
 * target has been tried, the set starts over (a single-target alias retries itself).
 */
export function pickTarget(list: readonly Target[], tried: Set<Target>, t: number, random: () => number): Target | undefined {
  // One target (most aliases): the same choice as below, without its arrays and closures.
  if (list.length === 1) {
    const only = list[0] as Target;
    if (!only.breaker.available(t)) {
      tried.clear();
      return undefined;
    }
    if (tried.has(only)) tried.clear();
    return only;
  }
  let pool = list.filter((x) => !tried.has(x) && x.breaker.available(t));
  if (pool.length === 0) {
    tried.clear();
    pool = list.filter((x) => x.breaker.available(t));
  }
  const weighted = pool.filter((x) => x.cfg.weight > 0);
  const from = weighted.length > 0 ? weighted : pool;
  if (from.length <= 1) return from[0];
  const total = from.reduce((s, x) => s + x.cfg.weight, 0);
  if (total <= 0) return from[Math.floor(random() * from.length)];
  let r = random() * total;
  for (const x of from) {
    r -= x.cfg.weight;
    if (r < 0) return x;
  }
  return from[from.length - 1];
}
