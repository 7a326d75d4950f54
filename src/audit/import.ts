import { type Static, Type as T } from "@sinclair/typebox";
import { inArray } from "drizzle-orm";
import { TypeCompiler } from "@sinclair/typebox/compiler";
import type { Database } from "../db/client.ts";
import { auditEvents, organizations } from "../db/schema.ts";
import { networkPrefixProblem } from "../lib/cidr.ts";
import { InputError } from "../lib/errors.ts";
import { UUID_PATTERN } from "../lib/ids.ts";
import { MAX_EMAIL_CHARS, MAX_NAME_CHARS, textProblem } from "../lib/text.ts";
import { inStorableRange, parseInstant } from "../lib/time.ts";
import { ACTION_PATTERN, type AuditInput, CATEGORIES, MAX_ACTION_CHARS, recordAudit } from "./record.ts";

const Uuid = T.String({ format: "uuid", pattern: UUID_PATTERN });

/** One line of `gateway audit import`: org_id plus the spec 2.6 fields. */
const Line = T.Object(
  {
    org_id: Uuid,
    id: T.Optional(Uuid),
    // The time grammar is checked below (src/lib/time.ts); the bound only keeps junk short.
    created_at: T.Optional(T.String({ maxLength: 64 })),
    action: T.String({ pattern: ACTION_PATTERN, maxLength: MAX_ACTION_CHARS }),
    category: T.Union(CATEGORIES.map((c) => T.Literal(c))),
    actor: T.Object({
      type: T.String({ minLength: 1 }),
      id: Uuid,
      name: T.String(),
      email: T.String(),
      key_id: T.Optional(T.Union([Uuid, T.Null()])),
    }),
    targets: T.Optional(
      T.Array(T.Object({ key: T.String(), kind: T.String(), id: Uuid, name: T.String(), email: T.String() })),
    ),
    details: T.Optional(T.Record(T.String(), T.Unknown())),
    origin: T.Object({ ip_prefix: T.String({ maxLength: 64 }), user_agent_summary: T.String() }, { additionalProperties: false }),
  },
  { additionalProperties: false },
);
const check = TypeCompiler.Compile(Line);

/** The first name or e-mail of the actor and targets that breaks the display-text rule, as `/path problem`. */
function peopleTextProblem(v: Static<typeof Line>): string | undefined {
  const people: [string, { name: string; email: string }][] = [["/actor", v.actor]];
  for (const [n, t] of (v.targets ?? []).entries()) people.push([`/targets/${n}`, t]);
  for (const [path, who] of people) {
    const name = textProblem(who.name, MAX_NAME_CHARS);
    if (name) return `${path}/name ${name}`;
    const email = textProblem(who.email, MAX_EMAIL_CHARS);
    if (email) return `${path}/email ${email}`;
  }
  return undefined;
}

/** Parse and validate every line first; insert all of them in one transaction or none. */
export async function importAudit(database: Database, text: string): Promise<number> {
  const events: AuditInput[] = [];
  /** Line number of each event (for the checks against the database) and of each id given. */
  const lineOf: number[] = [];
  const idLine = new Map<string, number>();
  const lines = text.split("\n");
  for (const [i, raw] of lines.entries()) {
    const line = raw.trim();
    if (!line) continue;
    let v: unknown;
    try {
      v = JSON.parse(line);
    } catch (e) {
      throw new InputError(`line ${i + 1}: invalid JSON (${(e as Error).message})`);
    }
    if (!check.Check(v)) {
      const err = check.Errors(v).First();
      throw new InputError(`line ${i + 1}: ${err?.path || "/"} ${err?.message ?? "invalid"}`);
    }
    // Names and e-mails are the display texts the admin commands store (src/lib/text.ts): one line, bounded.
    // Before, an imported name could hold a line break, which splits one field of the audit search text in two.
    const textError = peopleTextProblem(v);
    if (textError) throw new InputError(`line ${i + 1}: ${textError}`);
    // Spec 2.6 rules a schema cannot state: a network prefix, and each target's details field.
    const prefixProblem = networkPrefixProblem(v.origin.ip_prefix);
    if (prefixProblem) throw new InputError(`line ${i + 1}: /origin/ip_prefix ${JSON.stringify(v.origin.ip_prefix)} ${prefixProblem}`);
    for (const [n, t] of (v.targets ?? []).entries()) {
      const held = v.details?.[t.key];
      if (held !== t.id) {
        throw new InputError(
          `line ${i + 1}: /targets/${n}/key: details.${t.key} must hold the target's id ${t.id}, but ${held === undefined ? "is missing" : `is ${JSON.stringify(held)}`}`,
        );
      }
    }
    let createdAt: Date | undefined;
    if (v.created_at !== undefined) {
      const t = parseInstant(v.created_at);
      if (!t || !inStorableRange(t)) {
        throw new InputError(`line ${i + 1}: /created_at is not a valid time: an ISO 8601 date and time with a zone, e.g. 2025-01-31T09:00:00Z or 2025-01-31T10:00:00.250+01:00`);
      }
      createdAt = new Date(t.ms);
    }
    if (v.id) {
      const first = idLine.get(v.id.toLowerCase());
      if (first !== undefined) throw new InputError(`line ${i + 1}: /id ${v.id} is also the id of line ${first}`);
      idLine.set(v.id.toLowerCase(), i + 1);
    }
    lineOf.push(i + 1);
    events.push({
      orgId: v.org_id,
      ...(v.id ? { id: v.id } : {}),
      ...(createdAt ? { createdAt } : {}),
      action: v.action,
      category: v.category,
      actor: { type: v.actor.type, id: v.actor.id, name: v.actor.name, email: v.actor.email, keyId: v.actor.key_id ?? null },
      targets: v.targets ?? [],
      details: v.details ?? {},
      origin: { ipPrefix: v.origin.ip_prefix, userAgentSummary: v.origin.user_agent_summary },
    });
  }
  // A line the database would refuse (an id already stored) or keep where no one can read it (an
  // organisation that does not exist) is a bad line too: named, and nothing imported.
  await database.db.transaction(async (tx) => {
    const ids = [...idLine.keys()];
    for (let i = 0; i < ids.length; i += 500) {
      const [taken] = await tx.select({ id: auditEvents.id }).from(auditEvents).where(inArray(auditEvents.id, ids.slice(i, i + 500))).limit(1);
      if (taken) throw new InputError(`line ${idLine.get(taken.id)}: /id ${taken.id} is already in the audit log`);
    }
    const orgs = [...new Set(events.map((e) => e.orgId.toLowerCase()))];
    const known = new Set<string>();
    for (let i = 0; i < orgs.length; i += 500) {
      for (const o of await tx.select({ id: organizations.id }).from(organizations).where(inArray(organizations.id, orgs.slice(i, i + 500)))) known.add(o.id);
    }
    const unknown = events.findIndex((e) => !known.has(e.orgId.toLowerCase()));
    if (unknown !== -1) throw new InputError(`line ${lineOf[unknown]}: /org_id: no organisation ${events[unknown]?.orgId}`);
    for (let i = 0; i < events.length; i += 500) await recordAudit(tx, events.slice(i, i + 500));
  });
  return events.length;
}
