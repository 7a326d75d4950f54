/** The response head of HTTP/1.x: status line and header fields. */

export interface Head {
  status: number;
  headers: Map<string, string>;
  keepAlive: boolean;
  /** An HTTP/1.0 answer (its Transfer-Encoding, if any, is faulty framing: RFC 9112 6.1). */
  http10: boolean;
}

const STATUS_LINE = /^HTTP\/1\.[01] [1-5]\d\d(?: .*)?$/;

/**
 * Parses a head without its closing empty line. Lines end with CRLF or a
 * bare LF (RFC 9112 2.2 lets a recipient take LF as a line end; nginx, curl
 * and Go's client do). A line that starts with a space or tab continues the
 * previous one (obs-fold): refused, as RFC 9112 5.2 lets a gateway do, since
 * read as a header of its own it would add one the server did not send.
 * Lines are taken by index rather than by split(), and a header's name and
 * value are sliced from the head's text, not from a string of its line: the
 * strings an answer's head leaves are its field names and values (the status
 * line is tested and its digits read where they are).
 */
export function parseHead(text: string): Head | string {
  let eol = text.indexOf("\n");
  const first = lineAt(text, 0, eol);
  if (!STATUS_LINE.test(first)) return `not an HTTP/1.x status line: ${JSON.stringify(first.slice(0, 80))}`;
  // "HTTP/1.x SSS": the minor version at 7, the status at 9 to 11.
  const http10 = first.charCodeAt(7) === 0x30;
  const status = (first.charCodeAt(9) - 0x30) * 100 + (first.charCodeAt(10) - 0x30) * 10 + (first.charCodeAt(11) - 0x30);
  const headers = new Map<string, string>();
  let pos = eol + 1;
  while (eol !== -1) {
    eol = text.indexOf("\n", pos);
    const end = lineEnd(text, pos, eol);
    const from = pos;
    pos = eol + 1;
    const c = text.charCodeAt(from);
    if (from < end && (c === 0x20 || c === 0x09)) return `obs-fold (a folded header line) in the response head: ${JSON.stringify(text.slice(from, end).slice(0, 80))}`;
    const colon = text.indexOf(":", from);
    if (colon <= from || colon >= end) return `malformed header line: ${JSON.stringify(text.slice(from, end).slice(0, 80))}`;
    const name = text.slice(from, colon).trim().toLowerCase();
    // The spaces after the colon skipped before slicing (trim would copy the value to drop them); trim still
    // takes any other whitespace, as it did.
    let v = colon + 1;
    while (v < end && (text.charCodeAt(v) === 0x20 || text.charCodeAt(v) === 0x09)) v++;
    const value = text.slice(v, end).trim();
    const prev = headers.get(name);
    headers.set(name, prev === undefined ? value : `${prev}, ${value}`);
  }
  const connection = headers.get("connection")?.toLowerCase() ?? "";
  const keepAlive = http10 ? /\bkeep-alive\b/.test(connection) : !/\bclose\b/.test(connection);
  return { status, headers, keepAlive, http10 };
}

/** Where the line from `from` to the LF at `eol` (-1: the end) ends without its CR. */
function lineEnd(text: string, from: number, eol: number): number {
  let end = eol === -1 ? text.length : eol;
  if (end > from && text.charCodeAt(end - 1) === 0x0d) end--;
  return end;
}

/** The line from `from` to the LF at `eol` (-1: the end), without its CR. */
function lineAt(text: string, from: number, eol: number): string {
  return text.slice(from, lineEnd(text, from, eol));
}
