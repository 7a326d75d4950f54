/** The response head of HTTP/1.x: status line and header fields. */

export interface Head {
  status: number;
  headers: Map<string, string>;
  keepAlive: boolean;
}

const STATUS_LINE = /^HTTP\/1\.([01]) ([1-5]\d\d)(?: .*)?$/;

/** Lines are taken by index rather than by split(): one array and one string fewer per line on every answer. */
export function parseHead(text: string): Head | string {
  let eol = text.indexOf("\r\n");
  const first = eol === -1 ? text : text.slice(0, eol);
  const m = STATUS_LINE.exec(first);
  if (!m) return `not an HTTP/1.x status line: ${JSON.stringify(first.slice(0, 80))}`;
  const headers = new Map<string, string>();
  let pos = eol + 2;
  while (eol !== -1) {
    eol = text.indexOf("\r\n", pos);
    const line = eol === -1 ? text.slice(pos) : text.slice(pos, eol);
    pos = eol + 2;
    const colon = line.indexOf(":");
    if (colon <= 0) return `malformed header line: ${JSON.stringify(line.slice(0, 80))}`;
    const name = line.slice(0, colon).trim().toLowerCase();
    const value = line.slice(colon + 1).trim();
    const prev = headers.get(name);
    headers.set(name, prev === undefined ? value : `${prev}, ${value}`);
  }
  const connection = headers.get("connection")?.toLowerCase() ?? "";
  const keepAlive = m[1] === "1" ? !/\bclose\b/.test(connection) : /\bkeep-alive\b/.test(connection);
  return { status: Number(m[2]), headers, keepAlive };
}
