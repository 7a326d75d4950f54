/**
 * A Postgres array literal (`{"a","b"}`) for one text parameter. Bulk inserts
 * send each column as one array and `unnest` them, so a batch of thousands of
 * rows is ten parameters, not tens of thousands (which both drivers would have
 * to build and parse on the main thread). Every element is quoted and escaped,
 * so commas, quotes and backslashes in values are safe; null is SQL NULL
 * (unquoted), the string "NULL" stays a string.
 */
export function pgArray(values: ArrayLike<string | number | boolean | null>): string {
  let out = "{";
  for (let i = 0; i < values.length; i++) {
    if (i > 0) out += ",";
    const v = values[i];
    out += typeof v === "string" ? `"${v.replace(/["\\]/g, "\\$&")}"` : v === null ? "NULL" : String(v);
  }
  return `${out}}`;
}
