import { describe, expect, test } from "bun:test";
import { parseHead } from "../../src/inference/upstream/http1-head.ts";

/** The parser as it was written first (split into lines), kept as the reference the faster one must agree with. */
function reference(text: string) {
  // Lines end with CRLF or a bare LF.
  const lines = text.split("\n").map((l) => (l.endsWith("\r") ? l.slice(0, -1) : l));
  const m = /^HTTP\/1\.([01]) ([1-5]\d\d)(?: .*)?$/.exec(lines[0] ?? "");
  if (!m) return `not an HTTP/1.x status line: ${JSON.stringify((lines[0] ?? "").slice(0, 80))}`;
  const headers = new Map<string, string>();
  for (let i = 1; i < lines.length; i++) {
    const line = lines[i] ?? "";
    if (line.startsWith(" ") || line.startsWith("\t")) return `obs-fold (a folded header line) in the response head: ${JSON.stringify(line.slice(0, 80))}`;
    const colon = line.indexOf(":");
    if (colon <= 0) return `malformed header line: ${JSON.stringify(line.slice(0, 80))}`;
    const name = line.slice(0, colon).trim().toLowerCase();
    const value = line.slice(colon + 1).trim();
    const prev = headers.get(name);
    headers.set(name, prev === undefined ? value : `${prev}, ${value}`);
  }
  const connection = headers.get("connection")?.toLowerCase() ?? "";
  const keepAlive = m[1] === "1" ? !/\bclose\b/.test(connection) : /\bkeep-alive\b/.test(connection);
  return { status: Number(m[2]), headers, keepAlive, http10: m[1] === "0" };
}

const PIECES = ["HTTP/1.1 200 OK", "HTTP/1.0 404 Not Found", "HTTP/1.1 204", "HTTP/2 200", "\r\n", "\r\n", "\r\n", ":", " ", "Content-Length: 12", "connection: close", "Connection: keep-alive", "X-A: 1", "x-a: 2", "\r", "\n", "bad line", "Transfer-Encoding: chunked", "\t", "\r\n x-fold: 1", "\nX-Lf: 2", ""];

describe("parseHead", () => {
  test("agrees with the split-based reference on 20,000 random heads", () => {
    let seed = 42;
    const rnd = (n: number) => {
      seed = (seed * 1103515245 + 12345) % 2 ** 31;
      return seed % n;
    };
    for (let i = 0; i < 20_000; i++) {
      const n = 1 + rnd(8);
      let text = i % 3 === 0 ? "" : (PIECES[rnd(3)] as string);
      for (let k = 0; k < n; k++) text += PIECES[rnd(PIECES.length)] as string;
      expect(parseHead(text)).toEqual(reference(text));
    }
  });

  test("a typical head", () => {
    const h = parseHead("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2");
    expect(h).toEqual({ status: 200, keepAlive: true, http10: false, headers: new Map([["content-type", "application/json"], ["content-length", "5"], ["x-a", "1, 2"]]) });
    expect(parseHead("HTTP/1.0 200 OK")).toEqual({ status: 200, keepAlive: false, http10: true, headers: new Map() });
    expect(parseHead("HTTP/1.1 200 OK\r\n")).toBe('malformed header line: ""');
  });

  test("bare LF line ends, alone or mixed with CRLF; no reason phrase", () => {
    const want = { status: 200, keepAlive: true, http10: false, headers: new Map([["a", "1"], ["b", "2"]]) };
    expect(parseHead("HTTP/1.1 200 OK\na: 1\nb: 2")).toEqual(want);
    expect(parseHead("HTTP/1.1 200\r\na: 1\nB: 2")).toEqual(want);
  });

  test("obs-fold (a line starting with a space or tab) is refused, never read as a header of its own", () => {
    expect(parseHead("HTTP/1.1 200 OK\r\nx-a: 1\r\n transfer-encoding: chunked")).toContain("obs-fold");
    expect(parseHead("HTTP/1.1 200 OK\r\n\tcontent-length: 5")).toContain("obs-fold");
  });
});
