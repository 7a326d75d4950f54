import { type AuditInput, recordAudit } from "../audit/record.ts";
import { boundedCall, maxOutAtOnce } from "../db/bounded.ts";
import { ANSWER_TIMEOUT_MS, type Database, answeredWithin } from "../db/client.ts";
import { isServerTimeout } from "../db/errors.ts";
import { networkPrefixProblem } from "../lib/cidr.ts";
import type { Logger } from "../lib/log.ts";
import type { Caller, Principal } from "./types.ts";

const IPV4 = /^(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})$/;

function ipv4Octets(s: string): number[] | null {
  const m = IPV4.exec(s);
  if (!m) return null;
  const octets = m.slice(1).map(Number);
  return octets.every((o) => o <= 255) ? octets : null;
}

/** The eight 16-bit groups of an IPv6 address (a dotted IPv4 tail counts as two), or null. */
function ipv6Groups(ip: string): number[] | null {
  const halves = ip.split("::");
  if (halves.length > 2) return null;
  const parse = (part: string, last: boolean): number[] | null => {
    if (part === "") return [];
    const out: number[] = [];
    const pieces = part.split(":");
    for (let i = 0; i < pieces.length; i++) {
      const piece = pieces[i] as string;
      if (last && i === pieces.length - 1 && piece.includes(".")) {
        const v4 = ipv4Octets(piece);
        if (!v4) return null;
        out.push(((v4[0] as number) << 8) | (v4[1] as number), ((v4[2] as number) << 8) | (v4[3] as number));
      } else if (/^[0-9a-f]{1,4}$/i.test(piece)) out.push(Number.parseInt(piece, 16));
      else return null;
    }
    return out;
  };
  const head = parse(halves[0] as string, halves.length === 1);
  const tail = halves.length === 2 ? parse(halves[1] as string, true) : [];
  if (!head || !tail) return null;
  if (halves.length === 1) return head.length === 8 ? head : null;
  const missing = 8 - head.length - tail.length;
  return missing >= 1 ? [...head, ...Array<number>(missing).fill(0), ...tail] : null;
}

/** Peer address unknown (socket already gone) or unreadable: the prefix that says nothing, still CIDR (spec 2.6). */
export const UNKNOWN_PREFIX = "0.0.0.0/0";

/**
 * /24 for IPv4, /48 for IPv6 (zero-compressed, RFC 5952): the audit log never
 * holds a full address. An IPv4 address carried in IPv6 (IPv4-mapped, as a
 * dual-stack listener reports IPv4 clients, or NAT64's well-known
 * 64:ff9b::/96) is the IPv4 client's /24. Anything else: UNKNOWN_PREFIX.
 */
export function ipPrefix(ip: string | null): string {
  const p = prefixOf(ip);
  return p && networkPrefixProblem(p) === null ? p : UNKNOWN_PREFIX;
}

function prefixOf(ip: string | null): string {
  if (!ip) return "";
  const v4 = ipv4Octets(ip);
  if (v4) return `${v4[0]}.${v4[1]}.${v4[2]}.0/24`;
  const g = ipv6Groups(ip.replace(/%[\w.-]+$/, ""));
  if (!g) return "";
  const mapped = g.slice(0, 5).every((x) => x === 0) && g[5] === 0xffff;
  const nat64 = g[0] === 0x64 && g[1] === 0xff9b && g.slice(2, 6).every((x) => x === 0);
  if (mapped || nat64) return `${(g[6] as number) >> 8}.${(g[6] as number) & 0xff}.${(g[7] as number) >> 8}.0/24`;
  // The groups after the third are zero, so the longest zero run always ends the prefix: drop trailing zeros, then "::".
  const first = g.slice(0, 3);
  while (first.length > 0 && first[first.length - 1] === 0) first.pop();
  return `${first.map((x) => x.toString(16)).join(":")}::/48`;
}

/**
 * A short client summary such as `openai-node/6.1` or `curl/8.5`, never the
 * full string. The official SDKs write their version as a word of its own
 * (`OpenAI/JS 7.57.0`, `OpenAI/Python 1.54.3`): that is `OpenAI/JS 7.57`.
 */
export function userAgentSummary(ua: string | null): string {
  if (!ua) return "";
  const [first = "", second = ""] = ua.trim().split(/\s+/, 2);
  const m = /^([A-Za-z][\w.-]{0,40})\/(\d+(?:\.\d+)?)/.exec(first);
  if (m) return `${m[1]}/${m[2]}`;
  const version = /^\d+(?:\.\d+)?/.exec(second)?.[0];
  if (version && /^[A-Za-z][\w.-]{0,40}\/[A-Za-z][\w.-]{0,20}$/.test(first)) return `${first} ${version}`;
  return first.slice(0, 40);
}

/**
 * Security audit writes out at once, each holding (or queued for) a pool
 * connection: a quarter of the pool, as each other kind of background
 * database work (maxOutAtOnce: 2 of the default 10); one on the embedded
 * database, which runs one statement at a time anyway.
 */
export function maxSecurityWrites(poolMax: number | undefined): number {
  return poolMax === undefined ? 1 : maxOutAtOnce(poolMax);
}

/** Events waiting for a write; beyond this an event is dropped (counted, logged). */
export const MAX_QUEUED_SECURITY_EVENTS = 1_000;
/** Events in one write (one multi-row insert). */
const MAX_BATCH = 100;

/**
 * Security events for keys that are presented after expiry or revocation and
 * for browser-looking requests with a valid key: at most one per key and action
 * a minute, written off the request path (a failed write is logged, never
 * surfaced to the caller). At most maxSecurityWrites are being written at
 * once; events that arrive meanwhile wait (at most MAX_QUEUED_SECURITY_EVENTS,
 * each at most ANSWER_TIMEOUT_MS) and go out together, up to 100 in one
 * insert, when a write ends; beyond that they are dropped, counted (`gateway_security_events_dropped_total`) and
 * logged once until the queue empties (docs/decisions.md, Security audit
 * writes are bounded). Before, every event had a write of its own, with no
 * bound: a flood of expired or revoked keys while `audit_events` was locked
 * or the database slow took every pool connection from key lookups and the
 * usage writer, for 5 s (statement_timeout) per ten events.
 */
export interface SecurityAuditor {
  keyRejected(p: Principal, action: string, meta: Caller): void;
  /** Wait for pending writes (shutdown, tests). */
  drain(): Promise<void>;
  /** Writes out now, events waiting for one, events dropped since start. */
  stats(): { writing: number; queued: number; dropped: number };
}

export interface SecurityAuditorOptions {
  /** Events that may wait for a write; MAX_QUEUED_SECURITY_EVENTS by default. */
  maxQueued?: number;
}

export function createSecurityAuditor(database: Database, log: Logger, now: () => number = Date.now, opts: SecurityAuditorOptions = {}): SecurityAuditor {
  const last = new Map<string, number>();
  const MAX = 10_000;
  const limit = maxSecurityWrites(database.poolMax);
  const maxQueued = opts.maxQueued ?? MAX_QUEUED_SECURITY_EVENTS;
  /** Events waiting for a write: the event, its key in `last`, when it began waiting (performance.now()). */
  const queue: { event: AuditInput; k: string; at: number }[] = [];
  let writing = 0;
  let dropped = 0;
  /** The drops of this episode (the queue full) were logged. */
  let dropLogged = false;
  const idle: (() => void)[] = [];

  function drop(k: string, why: string, action: string) {
    // Not remembered as written: the key's next use tries again.
    last.delete(k);
    dropped++;
    if (!dropLogged) {
      dropLogged = true;
      log.warn("security audit events dropped: too many waiting for the database", { why, writing, queued: queue.length, action });
    }
  }

  function pump() {
    while (writing < limit && queue.length > 0) {
      // Each event waits at most ANSWER_TIMEOUT_MS for its turn, as other bounded work does (src/db/bounded.ts):
      // older ones are dropped rather than sent to wait on the database as long again.
      const stale = performance.now() - ANSWER_TIMEOUT_MS;
      while (queue.length > 0 && (queue[0]?.at ?? 0) <= stale) {
        const old = queue.shift();
        if (old) drop(old.k, `waited ${ANSWER_TIMEOUT_MS} ms for a write`, old.event.action);
      }
      const batch = queue.splice(0, MAX_BATCH).map((q) => q.event);
      if (batch.length === 0) break;
      writing++;
      // Nothing waits for the write, but Postgres ends it after ANSWER_TIMEOUT_MS (a locked audit_events):
      // before, each held its pool connection for as long as the lock was held.
      void boundedCall(database, (q) => recordAudit(q, batch))
        .catch((e: Error) => {
          log.warn("security audit write failed", { events: batch.length, action: batch[0]?.action, err: e.message });
          // Ended by the server after ANSWER_TIMEOUT_MS (a locked audit_events, an overloaded server): the events
          // that waited behind it would wait as long again on another write; dropped instead.
          if (isServerTimeout(e)) for (const q of queue.splice(0)) drop(q.k, "a write before them was ended by the database", q.event.action);
        })
        .finally(() => {
          writing--;
          pump();
          if (writing === 0 && queue.length === 0) {
            dropLogged = false;
            for (const done of idle.splice(0)) done();
          }
        });
    }
  }

  return {
    keyRejected(p, action, meta) {
      const k = `${p.keyId}|${action}`;
      const t = now();
      const prev = last.get(k);
      if (prev !== undefined && t - prev < 60_000) return;
      if (writing >= limit && queue.length >= maxQueued) {
        drop(k, `${maxQueued} waiting`, action);
        return;
      }
      if (last.size >= MAX) {
        for (const [key, at] of last) if (t - at >= 60_000) last.delete(key);
        if (last.size >= MAX) last.clear();
      }
      last.set(k, t);
      // Read now: the caller's address may be gone once the request has been answered.
      const event: AuditInput = {
        orgId: p.orgId,
        action,
        category: "security",
        actor: { type: p.kind === "service" ? "service_key" : "user", id: p.userId ?? p.keyId, name: p.actorName, email: p.actorEmail, keyId: p.keyId },
        targets: [{ key: "key_id", kind: "api_key", id: p.keyId, name: "", email: "" }],
        details: {},
        origin: { ipPrefix: ipPrefix(meta.ip), userAgentSummary: userAgentSummary(meta.userAgent) },
      };
      queue.push({ event, k, at: performance.now() });
      pump();
    },
    async drain() {
      if (writing === 0 && queue.length === 0) return;
      const done = new Promise<void>((r) => idle.push(r));
      // Bounded: a database that stops answering must not hold the shutdown (these rows are best effort).
      await answeredWithin(done, ANSWER_TIMEOUT_MS, "security events").catch(() => {});
    },
    stats: () => ({ writing, queued: queue.length, dropped }),
  };
}
