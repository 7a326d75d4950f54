import type { Db } from "../db/client.ts";
import { type AuditTarget, auditEvents } from "../db/schema.ts";

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

export interface AuditInput {
  orgId: string;
  id?: string;
  createdAt?: Date;
  action: string;
  category: Category;
  actor: { type: string; id: string; name: string; email: string; keyId: string | null };
  targets?: AuditTarget[];
  details?: Record<string, unknown>;
  origin?: { ipPrefix: string; userAgentSummary: string };
}

/** What `q` searches: action, and the names and e-mails of the actor and targets. */
export function searchTextOf(e: Pick<AuditInput, "action" | "actor" | "targets">): string {
  const parts = [e.action, e.actor.name, e.actor.email];
  for (const t of e.targets ?? []) parts.push(t.name, t.email);
  return parts
    .filter((p) => p)
    .join(" ")
    .toLowerCase();
}

type Executor = Pick<Db, "insert">;

/**
 * Append audit events. Callers pass their transaction so a change and its
 * audit row commit together. Never pass chat content here (spec 2.6 rule 1).
 */
export async function recordAudit(tx: Executor, events: AuditInput | AuditInput[]): Promise<void> {
  const list = Array.isArray(events) ? events : [events];
  if (list.length === 0) return;
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
      details: e.details ?? {},
      originIpPrefix: e.origin?.ipPrefix ?? "",
      originUserAgentSummary: e.origin?.userAgentSummary ?? "",
      searchText: searchTextOf(e),
    })),
  );
}
