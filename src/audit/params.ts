import { AppError } from "../lib/errors.ts";
import { isUuid } from "../lib/ids.ts";
import { type Instant, MAX_TIME, MIN_TIME, compareInstants, parseInstant } from "../lib/time.ts";
import { CATEGORIES, type Category, foldSearch, isAction } from "./record.ts";

/**
 * The query-string grammar of GET /v1/audit-events (spec 4.5): which
 * parameters exist, what each accepts, and the filter they make.
 */

export interface AuditFilter {
  from?: Date;
  to?: Date;
  actorId?: string;
  category?: Category;
  action?: string;
  /** Folded as the stored search text is (record.ts foldSearch), so equal searches are equal filters. */
  q?: string;
}

export interface AuditQuery {
  filter: AuditFilter;
  cursor: string | null;
  limit: number;
}

export const DEFAULT_LIMIT = 50;
export const MAX_LIMIT = 200;
export const MAX_Q_CHARS = 200;

const PARAMS = new Set(["from", "to", "actor_id", "category", "action", "q", "cursor", "limit"]);
// Rejected in q: NUL cannot be sent as Postgres text, and the others never occur in names.
// biome-ignore lint/suspicious/noControlCharactersInRegex: matching control characters is this pattern's job.
const CONTROL = /[\u0000-\u001f\u007f]/;

export function invalid(param: string | null, message: string): AppError {
  return new AppError("invalid_body", message, param);
}

/** `+02:00` sent unencoded in a query string arrives as ` 02:00`; a space can mean nothing else there. */
const SPACE_OFFSET = /(\d) (\d{2}(?::?\d{2})?)$/;

function parseTime(param: "from" | "to", value: string): Instant {
  const t = parseInstant(value.replace(SPACE_OFFSET, "$1+$2"));
  if (!t) {
    throw invalid(param, `${param} must be an ISO 8601 date and time with a zone, e.g. 2025-01-31T09:00:00Z or 2025-01-31T10:00:00.250+01:00.`);
  }
  return t;
}

const STRAY_PERCENT = /%(?![0-9A-Fa-f]{2})/g;

/** Whether the percent-escapes of a raw query value decode as UTF-8 (a `%` that starts no escape is itself, as URLSearchParams reads it). */
function isUtf8Escaped(raw: string): boolean {
  if (!raw.includes("%")) return true;
  try {
    decodeURIComponent(raw.replace(STRAY_PERCENT, "%25"));
    return true;
  } catch {
    return false;
  }
}

/**
 * Validate the query string by hand: TypeBox on Elysia's parsed `query` would
 * merge repeated parameters and could not name the offending one. Every
 * parameter may appear once; an empty value is invalid (omit it instead).
 */
export function parseAuditQuery(search: string): AuditQuery {
  const seen = new Map<string, string>();
  for (const pair of search.split("&")) {
    // URLSearchParams turns bytes that are not UTF-8 into U+FFFD without a word: q=caf%E9 searched for "caf\uFFFD".
    const at = pair.indexOf("=");
    if (at !== -1 && !isUtf8Escaped(pair.slice(at + 1))) {
      const name = (new URLSearchParams(pair).keys().next().value ?? "").slice(0, 64);
      throw invalid(name, `Parameter ${name} is not UTF-8 once percent-decoded; encode it as UTF-8.`);
    }
  }
  for (const [name, value] of new URLSearchParams(search)) {
    if (!PARAMS.has(name)) {
      const shown = name.slice(0, 64);
      throw invalid(shown, `Unknown parameter ${JSON.stringify(shown)}; allowed: ${[...PARAMS].join(", ")}.`);
    }
    if (seen.has(name)) throw invalid(name, `Parameter ${name} is given more than once.`);
    if (value === "") throw invalid(name, `Parameter ${name} is empty; omit it instead.`);
    seen.set(name, value);
  }

  const filter: AuditFilter = {};
  const fromRaw = seen.get("from");
  const toRaw = seen.get("to");
  const from = fromRaw === undefined ? undefined : parseTime("from", fromRaw);
  const to = toRaw === undefined ? undefined : parseTime("to", toRaw);
  if (from && to && compareInstants(from, to) > 0) throw invalid("from", "from must not be after to.");
  // Rows are stored to the millisecond: an inclusive lower bound rounds up, an
  // inclusive upper bound rounds down. Rows lie in years 0001–9999, the range
  // Postgres reads back: a lower bound before it or an upper bound after it is
  // clamped to it, which changes no result. A lower bound after it or an upper
  // bound before it leaves no row; clamped, it would take in the row stored at
  // the edge, so such a range is written as an empty one, from after to.
  const fromMs = from ? from.ms + (from.subNs > 0 ? 1 : 0) : undefined;
  if ((fromMs !== undefined && fromMs > MAX_TIME) || (to && to.ms < MIN_TIME)) {
    filter.from = new Date(MAX_TIME);
    filter.to = new Date(MIN_TIME);
  } else {
    if (fromMs !== undefined) filter.from = new Date(Math.max(fromMs, MIN_TIME));
    if (to) filter.to = new Date(Math.min(to.ms, MAX_TIME));
  }

  const actorId = seen.get("actor_id");
  if (actorId !== undefined) {
    if (!isUuid(actorId)) throw invalid("actor_id", "actor_id must be a UUID.");
    filter.actorId = actorId.toLowerCase();
  }
  const category = seen.get("category");
  if (category !== undefined) {
    if (!(CATEGORIES as readonly string[]).includes(category)) throw invalid("category", `category must be one of: ${CATEGORIES.join(", ")}.`);
    filter.category = category as Category;
  }
  const action = seen.get("action");
  if (action !== undefined) {
    // Same shape as `gateway audit import` accepts, so every stored action can be asked for.
    if (!isAction(action)) throw invalid("action", "action must be a dotted action name such as api_key.revoked.");
    filter.action = action;
  }
  const q = seen.get("q");
  if (q !== undefined) {
    if ([...q].length > MAX_Q_CHARS) throw invalid("q", `q must be at most ${MAX_Q_CHARS} characters.`);
    if (CONTROL.test(q)) throw invalid("q", "q must not contain control characters.");
    filter.q = foldSearch(q);
  }

  let limit = DEFAULT_LIMIT;
  const limitRaw = seen.get("limit");
  if (limitRaw !== undefined) {
    // Decimal digits only (no sign, point or exponent), leading zeros allowed: 050 and 0050 are both 50.
    limit = /^\d+$/.test(limitRaw) ? Number(limitRaw) : 0;
    if (limit < 1 || limit > MAX_LIMIT) throw invalid("limit", `limit must be a whole number from 1 to ${MAX_LIMIT}.`);
  }
  return { filter, cursor: seen.get("cursor") ?? null, limit };
}
