/** The response head of HTTP/1.x: status line and header fields. */

export interface Head {
  status: number;
  headers: Map<string, string>;
  keepAlive: boolean;
  /** An HTTP/1.0 answer (its Transfer-Encoding, if any, is faulty framing: RFC 9112 6.1). */
  http10: boolean;
}

const STATUS_LINE = /^HTTP\/1\.([01]) ([1-5]\d\d)(?: .*)?$/;

/**
 * Parses a head without its closing empty line. Lines end with CRLF or a
 * bare LF (RFC 9112 2.2 lets a recipient take LF as a line end; nginx, curl
 * and Go's client do). A line that starts with a space or tab continues the
 * previous one (obs-fold): refused, as RFC 9112 5.2 lets a gateway do, since
 * read as a header of its own it would add one the server did not send.
 * Lines are taken by index rather than by split(): one array and one string
 * fewer per line on every answer.
 */
export function parseHead(text: string): Head | string {
  let eol = text.indexOf("\n");
  const first = lineAt(text, 0, eol);
  const m = STATUS_LINE.exec(first);
  if (!m) return `not an HTTP/1.x status line: ${JSON.stringify(first.slice(0, 80))}`;
  const headers = new Map<string, string>();
  let pos = eol + 1;
  while (eol !== -1) {
    eol = text.indexOf("\n", pos);
    const line = lineAt(text, pos, eol);
    pos = eol + 1;
    const c = line.charCodeAt(0);
    if (c === 0x20 || c === 0x09) return `obs-fold (a folded header line) in the response head: ${JSON.stringify(line.slice(0, 80))}`;
    const colon = line.indexOf(":");
    if (colon <= 0) return `malformed header line: ${JSON.stringify(line.slice(0, 80))}`;
    const name = line.slice(0, colon).trim().toLowerCase();
    const value = line.slice(colon + 1).trim();
    const prev = headers.get(name);
    headers.set(name, prev === undefined ? value : `${prev}, ${value}`);
  }
  const connection = headers.get("connection")?.toLowerCase() ?? "";
  const http10 = m[1] === "0";
  const keepAlive = http10 ? /\bkeep-alive\b/.test(connection) : !/\bclose\b/.test(connection);
  return { status: Number(m[2]), headers, keepAlive, http10 };
}

/** The line from `from` to the LF at `eol` (-1: the end), without its CR. */
function lineAt(text: string, from: number, eol: number): string {
  let end = eol === -1 ? text.length : eol;
  if (end > from && text.charCodeAt(end - 1) === 0x0d) end--;
  return text.slice(from, end);
}
