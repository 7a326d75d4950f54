/**
 * A raw HTTP/1.1 client on a Bun socket, for what fetch cannot do: declare a
 * Content-Length it never sends, stream a body while watching for an early
 * answer, and see whether and when the server closes the connection.
 */

export interface RawAnswer {
  /** 0 when no status line arrived. */
  status: number;
  headers: Record<string, string>;
  body: string;
  /** The server closed the connection (within `maxMs`). */
  closed: boolean;
  /** Milliseconds from connect to close, or to `maxMs` when it stayed open. */
  ms: number;
  /** Body bytes the client managed to write before the answer or the close. */
  sent: number;
}

export interface RawRequest {
  url: string;
  /** Request line and headers, without the blank line that ends them. */
  head: string;
  /** Body bytes to send after the head (sent in 64 KB pieces, paced by the socket). */
  bodyBytes?: number;
  /** Send the body with chunked framing (one chunk per piece; no final chunk unless `finish`). */
  chunked?: boolean;
  /** Send the terminating chunk (or nothing more for Content-Length) once `bodyBytes` are out. */
  finish?: boolean;
  /** Stop writing the body once a status line has arrived (a client watching for an early answer). */
  stopOnAnswer?: boolean;
  /** Give up waiting for the close after this long. */
  maxMs: number;
}

const PIECE = new Uint8Array(64 * 1024).fill(0x61);

function parse(raw: string): Pick<RawAnswer, "status" | "headers" | "body"> {
  const end = raw.indexOf("\r\n\r\n");
  if (end === -1) return { status: 0, headers: {}, body: "" };
  const [statusLine = "", ...lines] = raw.slice(0, end).split("\r\n");
  const headers: Record<string, string> = {};
  for (const line of lines) {
    const at = line.indexOf(":");
    if (at > 0) headers[line.slice(0, at).trim().toLowerCase()] = line.slice(at + 1).trim();
  }
  const length = Number(headers["content-length"] ?? Number.NaN);
  const rest = raw.slice(end + 4);
  return { status: Number(statusLine.split(" ")[1] ?? 0), headers, body: Number.isNaN(length) ? rest : rest.slice(0, length) };
}

export function rawRequest(req: RawRequest): Promise<RawAnswer> {
  const url = new URL(req.url);
  const started = performance.now();
  const total = req.bodyBytes ?? 0;
  const head = new TextEncoder().encode(`${req.head}\r\n\r\n`);
  const chunkHead = new TextEncoder().encode(`${PIECE.byteLength.toString(16)}\r\n`);
  const crlf = new TextEncoder().encode("\r\n");
  return new Promise((resolve, reject) => {
    let received = "";
    let sent = 0;
    let settled = false;
    let timer: ReturnType<typeof setTimeout> | undefined;
    const done = (closed: boolean) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      resolve({ ...parse(received), closed, ms: performance.now() - started, sent });
    };
    // Pending bytes of the current write (Bun's socket may take part of a buffer).
    let pending: Uint8Array[] = [];
    let finalQueued = false;
    const answered = () => req.stopOnAnswer === true && received.startsWith("HTTP/");
    const pump = (s: { write(b: Uint8Array): number; end(): void }) => {
      for (;;) {
        while (pending.length > 0) {
          const b = pending[0] as Uint8Array;
          const n = s.write(b);
          if (n < 0) return;
          if (n < b.byteLength) {
            pending[0] = b.subarray(n);
            return;
          }
          pending.shift();
        }
        if (settled || answered()) return;
        if (sent >= total) {
          if (!req.chunked || !req.finish || finalQueued) return;
          finalQueued = true;
          pending = [new TextEncoder().encode("0\r\n\r\n")];
          continue;
        }
        pending = req.chunked ? [chunkHead, PIECE, crlf] : [PIECE];
        sent += PIECE.byteLength;
      }
    };
    Bun.connect({
      hostname: url.hostname,
      port: Number(url.port),
      socket: {
        open(s) {
          pending = [head];
          pump(s);
        },
        drain(s) {
          pump(s);
        },
        data(_s, d) {
          received += d.toString("latin1");
        },
        close() {
          done(true);
        },
        end(s) {
          s.end();
          done(true);
        },
        error() {
          done(true);
        },
      },
    }).catch(reject);
    timer = setTimeout(() => done(false), req.maxMs);
  });
}
