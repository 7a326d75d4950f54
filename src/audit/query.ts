import type { Database } from "../db/client.ts";
import { type Bound, BoundFull, boundedCall } from "../db/bounded.ts";
import { AppError } from "../lib/errors.ts";
import type { Logger } from "../lib/log.ts";
import { type CursorPosition, decodeCursor, encodeCursor } from "./cursor.ts";
import { type AuditFilter, invalid, parseAuditQuery } from "./params.ts";
import { type AuditEventView, listAuditEvents } from "./search.ts";
import { firstSeen } from "../lib/once.ts";

/**
 * Reading the audit log (spec 4.5): validate the parameters (params.ts), check
 * the cursor that binds a position to one organisation and one filter set
 * (cursor.ts), run the keyset query (search.ts), mint the next cursor.
 */

export interface AuditPage {
  data: AuditEventView[];
  /** `""` on the last page (README "Decisions"). */
  next_cursor: string;
}

/**
 * What a cursor is bound to: the organisation and every filter, in canonical
 * form (parsed times, lower-case uuid, folded q), so
 * `+01:00` and `Z` spellings of one instant, or `q=Ada` and `q=ada`, share
 * cursors but any other change of filter does not. `limit` is not bound: a
 * client may change its page size between pages.
 */
export function cursorBinding(orgId: string, f: AuditFilter): string {
  return JSON.stringify([
    "audit-events",
    orgId,
    f.from?.toISOString() ?? null,
    f.to?.toISOString() ?? null,
    f.actorId ?? null,
    f.category ?? null,
    f.action ?? null,
    f.q ?? null,
  ]);
}

export interface AuditReadDeps {
  database: Database;
  cursorSecret: string;
  /** Where a failed query is reported; the caller only sees 503. */
  log?: Logger;
  /**
   * Reads out at once, and how long one may wait for the database
   * (docs/decisions.md: audit-log reads while the database does not answer);
   * none: unbounded, as a tool reading the log on the host.
   */
  bound?: Bound;
}

/** Audit rows already reported as odd: each once per process and problem. */
const firstReport = firstSeen();
function reportRow(log: Logger | undefined, id: string, problem: string): void {
  if (!firstReport(`${id}|${problem}`)) return;
  log?.warn("an audit event row breaks the gateway's rules", { event_id: id, problem });
}

/** The whole read: validate, check the cursor, query, mint the next cursor. */
export async function readAuditEvents(deps: AuditReadDeps, orgId: string, search: string): Promise<AuditPage> {
  const { filter, cursor, limit } = parseAuditQuery(search);
  const binding = cursorBinding(orgId, filter);
  let position: CursorPosition | null = null;
  if (cursor !== null) {
    position = decodeCursor(cursor, binding, deps.cursorSecret);
    if (!position) {
      throw invalid("cursor", "cursor is not a next_cursor issued for this organisation and these filters; start again without cursor.");
    }
  }
  let result: Awaited<ReturnType<typeof listAuditEvents>>;
  try {
    // Ended by the server after ANSWER_TIMEOUT_MS, as the bound gives up on it then (boundedCall).
    const read = (left?: number) =>
      boundedCall(deps.database, (q) => listAuditEvents(q, orgId, filter, position, limit, (id, problem) => reportRow(deps.log, id, problem)), left);
    result = await (deps.bound ? deps.bound.run(read) : read());
  } catch (e) {
    // Input is fully validated above, so a failing query means the database is
    // unreachable or overloaded; the caller should retry with backoff.
    // drizzle wraps the driver's error (message = the SQL); the cause says what went wrong.
    // Refused at once while earlier reads are unanswered: the bound logged that once.
    if (!(e instanceof BoundFull)) {
      const cause = e instanceof Error && e.cause instanceof Error ? e.cause : e;
      deps.log?.error("audit query failed", { org_id: orgId, err: cause instanceof Error ? cause.message : String(cause) });
    }
    throw new AppError("service_unavailable", "The audit log is temporarily unavailable; retry with backoff.");
  }
  return {
    data: result.events,
    next_cursor: result.next ? encodeCursor(result.next, binding, deps.cursorSecret) : "",
  };
}
