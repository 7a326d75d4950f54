/** The response head of HTTP/1.x: status line and header fields. */

export interface Head {
  status: number;
  headers: Map<string, string>;
  keepAlive: boolean;
}

export function parseHead(text: string): Head | string {
  const lines = text.split("\r\n");
  const m = /^HTTP\/1\.([01]) ([1-5]\d\d)(?: .*)?$/.exec(lines[0] ?? "");
  if (!m) return `not an HTTP/1.x status line: ${JSON.stringify((lines[0] ?? "").slice(0, 80))}`;
  const headers = new Map<string, string>();
  for (let i = 1; i < lines.length; i++) {
    const line = lines[i] ?? "";
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
