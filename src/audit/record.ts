import type { Db } from "../db/client.ts";
import { type AuditTarget, auditEvents } from "../db/schema.ts";
import { networkPrefixProblem } from "../lib/cidr.ts";
import { VERSION } from "../lib/version.ts";

export const CATEGORIES = [
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
export type Category = (typeof CATEGORIES)[number];

/** A dotted action name (`api_key.revoked`): what `gateway audit import` stores and the audit query's `action` asks for. */
export const ACTION_PATTERN = "^[a-z][a-z0-9_]*\\.[a-z][a-z0-9_.]*$";
export const MAX_ACTION_CHARS = 200;
const ACTION = new RegExp(ACTION_PATTERN);

export function isAction(s: string): boolean {
  return s.length <= MAX_ACTION_CHARS && ACTION.test(s);
}

export interface AuditInput {
  orgId: string;
  id?: string;
  createdAt?: Date;
  action: string;
  category: Category;
  actor: { type: string; id: string; name: string; email: string; keyId: string | null };
  targets?: AuditTarget[];
  /** For each target, `details[target.key]` is set to the target's id unless the caller set it. */
  details?: Record<string, unknown>;
  /** Omitted: the event was made on the host (CLI, admin socket, demo), not by a request. */
  origin?: { ipPrefix: string; userAgentSummary: string };
}

/**
 * Origin of events made on the host rather than by a request (README
 * "Decisions"): spec 2.6 wants a CIDR prefix, and loopback is where the
 * operator's command came from.
 */
export const HOST_ORIGIN = { ipPrefix: "127.0.0.0/8", userAgentSummary: `gateway-cli/${VERSION}` } as const;

/**
 * The one folding of the stored search text and of `q` (docs/decisions.md, `q`),
 * done by the gateway rather than the database, whose lower() folds only A-Z
 * under LC_CTYPE C:
 * - NFKC, so that `e` + U+0301 (NFD, as macOS and some keyboards write it) is
 *   `é`, and compatibility forms are their plain letters (full-width `ａｄａ`,
 *   the ligature `ﬁ`, a no-break space). Before lower case, which leaves
 *   `ℌ` alone where NFKC makes it `H`; again after it, as lower case may
 *   decompose (`İ` becomes `i` + U+0307).
 * - Lower case, and the word-final `ς` made `σ`: JavaScript lowers a
 *   word-final `Σ` to `ς`, so `ΣΊΣΥΦΟΣ` (`σίσυφος`) and a `q` of `ΣΊΣ`
 *   (`σίς`) would each miss the other's spelling.
 * Migration 0010 applies the same folding to rows written before it.
 */
export function foldSearch(s: string): string {
  return s.normalize("NFKC").toLowerCase().normalize("NFKC").replaceAll("ς", "σ");
}

/**
 * What `q` searches: action, and the names and e-mails of the actor and
 * targets, one field per line, folded (foldSearch). `q` may not contain a line
 * break, so a substring match of q can never span two fields.
 */
export function searchTextOf(e: Pick<AuditInput, "action" | "actor" | "targets">): string {
  const parts = [e.action, e.actor.name, e.actor.email];
  for (const t of e.targets ?? []) parts.push(t.name, t.email);
  return foldSearch(parts.filter((p) => p).join("\n"));
}

/**
 * Spec 2.6: `targets[].key` names the details field that references the
 * target. Adds that field (the target's id) where it is missing; a field that
 * holds something else is a bug in the caller.
 */
export function detailsWithTargets(e: Pick<AuditInput, "action" | "targets" | "details">): Record<string, unknown> {
  const details: Record<string, unknown> = { ...(e.details ?? {}) };
  for (const t of e.targets ?? []) {
    if (!(t.key in details)) details[t.key] = t.id;
    else if (details[t.key] !== t.id) throw new Error(`${e.action}: details.${t.key} does not hold target ${t.id}`);
  }
  return details;
}

type Executor = Pick<Db, "insert">;

/**
 * Append audit events. Callers pass their transaction so a change and its
 * audit row commit together. Never pass chat content here (spec 2.6 rule 1).
 */
export async function recordAudit(tx: Executor, events: AuditInput | AuditInput[]): Promise<void> {
  const list = Array.isArray(events) ? events : [events];
  if (list.length === 0) return;
  for (const e of list) {
    const problem = e.origin && networkPrefixProblem(e.origin.ipPrefix);
    if (problem) throw new Error(`${e.action}: origin.ip_prefix ${JSON.stringify(e.origin?.ipPrefix)} ${problem}`);
  }
  await tx.insert(auditEvents).values(
    list.map((e) => ({
      ...(e.id ? { id: e.id } : {}),
      ...(e.createdAt ? { createdAt: e.createdAt } : {}),
      orgId: e.orgId,
      action: e.action,
      category: e.category,
      actorType: e.actor.type,
      actorId: e.actor.id,
      actorName: e.actor.name,
      actorEmail: e.actor.email,
      actorKeyId: e.actor.keyId,
      targets: e.targets ?? [],
      details: detailsWithTargets(e),
      originIpPrefix: (e.origin ?? HOST_ORIGIN).ipPrefix,
      originUserAgentSummary: (e.origin ?? HOST_ORIGIN).userAgentSummary,
      searchText: searchTextOf(e),
    })),
  );
}
