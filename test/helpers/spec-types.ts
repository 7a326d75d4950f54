import { expect } from "bun:test";
import { isIPv4, isIPv6 } from "node:net";

/**
 * What a strict generated client checks: every field of `/v1/me` (spec 2.5)
 * and of an audit event (spec 2.6) has exactly the spec's type, and the
 * event follows the spec's rules. Written from the spec, not from src/, so a
 * change in the service cannot quietly change what is checked.
 *
 * Each `*Problems` function lists every deviation as `path: what is wrong`
 * (empty = conformant); the `expect*` wrappers fail the test with that list.
 */

/** Spec 2.6, `category`. */
export const SPEC_CATEGORIES = [
  "auth",
  "security",
  "sso",
  "domain",
  "scim",
  "member",
  "group",
  "share",
  "api_key",
  "billing",
  "automation",
  "governance",
  "learning",
  "org",
  "studio",
  "connection",
  "export",
  "audit",
] as const;

/** Spec 5, the scope table. */
export const SPEC_SCOPES = [
  "inference",
  "audit:read",
  "agents:run",
  "knowledge:read",
  "knowledge:write",
  "agents:manage",
  "prompts",
  "usage:export",
  "members:invite",
] as const;

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
/** ISO 8601, UTC (`Z`), exactly three fraction digits. */
const ISO_UTC_MS = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$/;
/** `<area>.<verb>`: two dotted parts. */
const ACTION = /^[a-z][a-z0-9_]*\.[a-z][a-z0-9_]*$/;

type Json = Record<string, unknown>;

function isObject(v: unknown): v is Json {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function exactKeys(v: Json, path: string, keys: readonly string[], out: string[]): void {
  for (const k of keys) if (!(k in v)) out.push(`${path}.${k}: missing`);
  for (const k of Object.keys(v)) if (!keys.includes(k)) out.push(`${path}.${k}: not a spec field`);
}

function str(v: unknown, path: string, out: string[]): v is string {
  if (typeof v === "string") return true;
  out.push(`${path}: expected string, got ${v === null ? "null" : typeof v}`);
  return false;
}

function uuid(v: unknown, path: string, out: string[]): void {
  if (str(v, path, out) && !UUID.test(v)) out.push(`${path}: not a UUID: ${JSON.stringify(v)}`);
}

function timestamp(v: unknown, path: string, out: string[]): void {
  if (!str(v, path, out)) return;
  const t = Date.parse(v);
  if (!ISO_UTC_MS.test(v) || Number.isNaN(t) || new Date(t).toISOString() !== v) {
    out.push(`${path}: not an ISO 8601 UTC timestamp with milliseconds: ${JSON.stringify(v)}`);
  }
}

/** IPv6 text to its 8 groups (handles `::` and a dotted IPv4 tail); assumes isIPv6 passed. */
function ipv6Groups(addr: string): number[] {
  let text = addr;
  const dotted = /(\d+\.\d+\.\d+\.\d+)$/.exec(text);
  if (dotted?.[1]) {
    const [a = 0, b = 0, c = 0, d = 0] = dotted[1].split(".").map(Number);
    text = `${text.slice(0, -dotted[1].length)}${((a << 8) | b).toString(16)}:${((c << 8) | d).toString(16)}`;
  }
  const [head = "", tail] = text.split("::");
  const h = head ? head.split(":") : [];
  const t = tail ? tail.split(":") : [];
  const zeros = tail === undefined ? [] : Array(8 - h.length - t.length).fill("0");
  return [...h, ...zeros, ...t].map((g) => Number.parseInt(g, 16));
}

/**
 * A network prefix in CIDR notation, not a full address (spec 2.6): an IPv4 or
 * IPv6 address, a prefix length shorter than the address, and no host bits set.
 */
export function cidrProblem(v: string): string | null {
  const m = /^([^/]+)\/(\d{1,3})$/.exec(v);
  if (!m?.[1] || !m[2]) return "not in CIDR notation (address/length)";
  const len = Number(m[2]);
  let bits: boolean[];
  if (isIPv4(m[1])) {
    bits = m[1].split(".").flatMap((o) => [...Number(o).toString(2).padStart(8, "0")].map((b) => b === "1"));
  } else if (isIPv6(m[1])) {
    bits = ipv6Groups(m[1]).flatMap((g) => [...g.toString(2).padStart(16, "0")].map((b) => b === "1"));
  } else {
    return "the address is neither IPv4 nor IPv6";
  }
  if (len >= bits.length) return `/${len} is a full address, not a network prefix`;
  if (bits.slice(len).some(Boolean)) return "host bits are set beyond the prefix length";
  return null;
}

/** Spec 2.5. */
export function keyInfoProblems(body: unknown): string[] {
  const out: string[] = [];
  if (!isObject(body)) return ["body: expected an object"];
  exactKeys(body, "body", ["key", "organization"], out);
  const { key, organization } = body;
  if (isObject(key)) {
    exactKeys(key, "key", ["id", "kind", "scopes", "expires_at"], out);
    uuid(key.id, "key.id", out);
    if (key.kind !== "personal" && key.kind !== "service") out.push(`key.kind: expected personal or service, got ${JSON.stringify(key.kind)}`);
    if (!Array.isArray(key.scopes)) out.push("key.scopes: expected an array");
    else
      for (const [i, s] of key.scopes.entries()) {
        if (str(s, `key.scopes[${i}]`, out) && !(SPEC_SCOPES as readonly string[]).includes(s)) out.push(`key.scopes[${i}]: unknown scope ${JSON.stringify(s)}`);
      }
    timestamp(key.expires_at, "key.expires_at", out);
  } else {
    out.push("key: expected an object");
  }
  if (isObject(organization)) {
    exactKeys(organization, "organization", ["id", "plan"], out);
    uuid(organization.id, "organization.id", out);
    if (str(organization.plan, "organization.plan", out) && organization.plan === "") out.push("organization.plan: empty");
  } else {
    out.push("organization: expected an object");
  }
  return out;
}

/** Spec 2.6: types, and `targets[].key` names a details field holding that target's id. */
export function auditEventProblems(e: unknown, path = "event"): string[] {
  const out: string[] = [];
  if (!isObject(e)) return [`${path}: expected an object`];
  exactKeys(e, path, ["id", "created_at", "action", "category", "actor", "targets", "details", "origin"], out);
  uuid(e.id, `${path}.id`, out);
  timestamp(e.created_at, `${path}.created_at`, out);
  if (str(e.action, `${path}.action`, out) && !ACTION.test(e.action)) out.push(`${path}.action: not <area>.<verb>: ${JSON.stringify(e.action)}`);
  if (!(SPEC_CATEGORIES as readonly unknown[]).includes(e.category)) out.push(`${path}.category: not a spec category: ${JSON.stringify(e.category)}`);

  const actor = e.actor;
  if (isObject(actor)) {
    exactKeys(actor, `${path}.actor`, ["type", "id", "name", "email", "key_id"], out);
    if (str(actor.type, `${path}.actor.type`, out) && actor.type === "") out.push(`${path}.actor.type: empty`);
    uuid(actor.id, `${path}.actor.id`, out);
    str(actor.name, `${path}.actor.name`, out);
    str(actor.email, `${path}.actor.email`, out);
    if (actor.key_id !== null) uuid(actor.key_id, `${path}.actor.key_id`, out);
  } else {
    out.push(`${path}.actor: expected an object`);
  }

  const details = e.details;
  if (!isObject(details)) out.push(`${path}.details: expected an object`);
  if (Array.isArray(e.targets)) {
    for (const [i, t] of e.targets.entries()) {
      const tp = `${path}.targets[${i}]`;
      if (!isObject(t)) {
        out.push(`${tp}: expected an object`);
        continue;
      }
      exactKeys(t, tp, ["key", "kind", "id", "name", "email"], out);
      str(t.kind, `${tp}.kind`, out);
      uuid(t.id, `${tp}.id`, out);
      str(t.name, `${tp}.name`, out);
      str(t.email, `${tp}.email`, out);
      if (str(t.key, `${tp}.key`, out) && isObject(details)) {
        if (!(t.key in details)) out.push(`${tp}.key: details has no field ${JSON.stringify(t.key)}`);
        else if (details[t.key] !== t.id) out.push(`${tp}.key: details.${t.key} is ${JSON.stringify(details[t.key])}, not the target's id ${JSON.stringify(t.id)}`);
      }
    }
  } else {
    out.push(`${path}.targets: expected an array`);
  }

  const origin = e.origin;
  if (isObject(origin)) {
    exactKeys(origin, `${path}.origin`, ["ip_prefix", "user_agent_summary"], out);
    if (str(origin.ip_prefix, `${path}.origin.ip_prefix`, out)) {
      const problem = cidrProblem(origin.ip_prefix);
      if (problem) out.push(`${path}.origin.ip_prefix: ${JSON.stringify(origin.ip_prefix)} ${problem}`);
    }
    str(origin.user_agent_summary, `${path}.origin.user_agent_summary`, out);
  } else {
    out.push(`${path}.origin: expected an object`);
  }
  return out;
}

/** Spec 2.6 envelope: `data` (audit events) and `next_cursor` (string). */
export function auditPageProblems(body: unknown): string[] {
  if (!isObject(body)) return ["body: expected an object"];
  const out: string[] = [];
  exactKeys(body, "body", ["data", "next_cursor"], out);
  str(body.next_cursor, "body.next_cursor", out);
  if (!Array.isArray(body.data)) out.push("body.data: expected an array");
  else for (const [i, e] of body.data.entries()) out.push(...auditEventProblems(e, `body.data[${i}]`));
  return out;
}

export interface SpecKeyInfo {
  key: { id: string; kind: "personal" | "service"; scopes: string[]; expires_at: string };
  organization: { id: string; plan: string };
}

export interface SpecAuditEvent {
  id: string;
  created_at: string;
  action: string;
  category: string;
  actor: { type: string; id: string; name: string; email: string; key_id: string | null };
  targets: { key: string; kind: string; id: string; name: string; email: string }[];
  details: Record<string, unknown>;
  origin: { ip_prefix: string; user_agent_summary: string };
}

export interface SpecAuditPage {
  data: SpecAuditEvent[];
  next_cursor: string;
}

/** Fails the test (listing every deviation) unless `body` is a spec 2.5 key information. */
export function expectKeyInfo(body: unknown): SpecKeyInfo {
  expect(keyInfoProblems(body)).toEqual([]);
  return body as SpecKeyInfo;
}

export function expectAuditEvent(e: unknown): SpecAuditEvent {
  expect(auditEventProblems(e)).toEqual([]);
  return e as SpecAuditEvent;
}

export function expectAuditPage(body: unknown): SpecAuditPage {
  expect(auditPageProblems(body)).toEqual([]);
  return body as SpecAuditPage;
}
