/**
 * The one rule for a display text that the gateway stores and shows (the name
 * of an organisation, person or key, an e-mail address): one line of bounded
 * length. The admin commands (src/admin/service.ts) and `gateway audit
 * import` (src/audit/import.ts, an event's actor and targets) apply it alike.
 */

/** Longest name of an organisation, person or key; past it a name is a mistake, not a label. */
export const MAX_NAME_CHARS = 200;
/** RFC 5321's limit for an address in a path. */
export const MAX_EMAIL_CHARS = 254;

// Control characters (Unicode's Cc: C0, DEL and C1) and the Unicode line and paragraph separators: a line break
// would split one field into two lines of the audit search text and of the CLI's output. C1 holds NEL (a line
// break) and CSI, which a terminal reading UTF-8 may take for ESC [: both passed when only C0 and DEL were refused.
// biome-ignore lint/suspicious/noControlCharactersInRegex: matching them is the point.
const CONTROL = /[\u0000-\u001f\u007f-\u009f\u2028\u2029]/;

/** What is wrong with a display text of at most `max` characters (JavaScript's count: UTF-16 code units), as the end of a sentence naming it; undefined when nothing is. */
export function textProblem(value: string, max: number): string | undefined {
  if (value.length > max) return `is longer than ${max} characters (got ${value.length})`;
  if (CONTROL.test(value)) return "must not contain control characters or line separators";
  return undefined;
}
