import { recordAudit } from "../audit/record.ts";
import type { Database } from "../db/client.ts";
import { networkPrefixProblem } from "../lib/cidr.ts";
import type { Logger } from "../lib/log.ts";
import type { RequestMeta } from "./guard.ts";
import type { Principal } from "./verify.ts";

/** Peer address unknown (socket already gone): the prefix that says nothing, still CIDR (spec 2.6). */
export const UNKNOWN_PREFIX = "0.0.0.0/0";

/** /24 for IPv4, /48 for IPv6: the audit log never holds a full address. */
export function ipPrefix(ip: string | null): string {
  const p = prefixOf(ip);
  return p && networkPrefixProblem(p) === null ? p : UNKNOWN_PREFIX;
}

function prefixOf(ip: string | null): string {
  if (!ip) return "";
  const v4 = /^(?:::ffff:)?(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.\d{1,3}$/i.exec(ip);
  if (v4) return `${v4[1]}.${v4[2]}.${v4[3]}.0/24`;
  if (ip.includes(":")) {
    // Expand `::` so the first three groups are the real ones.
    const [head = "", tail = ""] = ip.split("::");
    const h = head ? head.split(":") : [];
    const t = tail ? tail.split(":") : [];
    const groups = ip.includes("::") ? [...h, ...Array(Math.max(0, 8 - h.length - t.length)).fill("0"), ...t] : h;
    const first = groups.slice(0, 3).map((g) => (g || "0").toLowerCase().replace(/^0+(?=.)/, ""));
    while (first.length < 3) first.push("0");
    return `${first.join(":")}::/48`;
  }
  return "";
}

/** A short client summary such as `openai-node/6.1` or `curl/8.5`, never the full string. */
export function userAgentSummary(ua: string | null): string {
  if (!ua) return "";
  const first = ua.trim().split(/\s+/)[0] ?? "";
  const m = /^([A-Za-z][\w.-]{0,40})\/(\d+(?:\.\d+)?)/.exec(first);
  if (m) return `${m[1]}/${m[2]}`;
  return first.slice(0, 40);
}

/**
 * Security events for keys that are presented after expiry or revocation and
 * for browser-looking requests with a valid key: at most one per key and action
 * a minute, written off the request path (a failed write is logged, never
 * surfaced to the caller).
 */
export interface SecurityAuditor {
  keyRejected(p: Principal, action: string, meta: RequestMeta): void;
  /** Wait for pending writes (shutdown, tests). */
  drain(): Promise<void>;
}

export function createSecurityAuditor(database: Database, log: Logger, now: () => number = Date.now): SecurityAuditor {
  const last = new Map<string, number>();
  const pending = new Set<Promise<void>>();
  const MAX = 10_000;
  return {
    keyRejected(p, action, meta) {
      const k = `${p.keyId}|${action}`;
      const t = now();
      const prev = last.get(k);
      if (prev !== undefined && t - prev < 60_000) return;
      if (last.size >= MAX) {
        for (const [key, at] of last) if (t - at >= 60_000) last.delete(key);
        if (last.size >= MAX) last.clear();
      }
      last.set(k, t);
      const write = recordAudit(database.db, {
        orgId: p.orgId,
        action,
        category: "security",
        actor: { type: p.kind === "service" ? "service_key" : "user", id: p.userId ?? p.keyId, name: p.actorName, email: p.actorEmail, keyId: p.keyId },
        targets: [{ key: "key_id", kind: "api_key", id: p.keyId, name: "", email: "" }],
        details: {},
        origin: { ipPrefix: ipPrefix(meta.ip), userAgentSummary: userAgentSummary(meta.userAgent) },
      })
        .catch((e: Error) => log.warn("security audit write failed", { action, err: e.message }))
        .finally(() => pending.delete(write));
      pending.add(write);
    },
    async drain() {
      await Promise.all([...pending]);
    },
  };
}
