/**
 * One upstream connection: opens the socket (TCP or TLS), writes a request,
 * and parses the response (head, then the body by its framing: length,
 * chunked, or until close) into the exchange it carries.
 */

import type { Socket, TCPSocketConnectOptions } from "bun";
import { type Exchange, UpstreamConnectionError } from "./http1-exchange.ts";
import { parseHead } from "./http1-head.ts";

/** What a connection needs of the pool it belongs to. */
export interface ConnPool {
  readonly hostname: string;
  readonly port: number;
  readonly tls: boolean;
  readonly maxHeaderBytes: number;
  /** The keep-alive race window: a request whose kept-alive connection closes this soon after the write, before any answer byte, is resent. */
  readonly staleRetryMs: number;
  /** Takes the connection back once its response is complete (or closes it). */
  release(conn: Conn): void;
  /** Drops a closed connection from the idle list. */
  forget(conn: Conn): void;
  /** A sign of life from the origin: a connection opened, or a response head arrived. */
  alive(): void;
  /** Opens the socket: `Bun.connect`, or a test's stand-in. */
  readonly connect: SocketOpener;
}

/** `Bun.connect` for a connection's socket. */
export type SocketOpener = (options: TCPSocketConnectOptions<Conn>) => Promise<Socket<Conn>>;

const LFCRLF = Buffer.from("\n\r\n");
const LFLF = Buffer.from("\n\n");

/**
 * Where the body after the head at the start of `b` starts (searching from
 * `from`), or -1 when the head's empty line has not arrived. Lines end with
 * CRLF or a bare LF (see parseHead); the first empty line of either kind ends
 * the head.
 */
export function bodyStart(b: Buffer, from: number): number {
  // "\r\n\r\n" holds "\n\r\n": one search finds the usual end; a bare "\n\n" can only end the head before it.
  const crlf = b.indexOf(LFCRLF, from);
  const lf = (crlf === -1 ? b : b.subarray(0, crlf + 1)).indexOf(LFLF, from);
  return lf !== -1 ? lf + 2 : crlf === -1 ? -1 : crlf + 3;
}

/** Where the text of a head whose body starts at `start` ends: before its last line's end and its empty line. */
export function headTextEnd(b: Buffer, start: number): number {
  const lf = b[start - 2] === 0x0d ? start - 3 : start - 2;
  return lf > 0 && b[lf - 1] === 0x0d ? lf - 1 : lf;
}
/**
 * A pooled connection that fails within this long after the request was
 * written, before any answer byte, was closed by the server before it read
 * the request (the keep-alive race): the request is sent once more. A later
 * failure may follow work the server did, and is reported instead.
 */
/** The keep-alive race window's default (Http1ClientOptions.staleRetryMs). */
export const STALE_RETRY_MS = 100;
/** Interim (1xx) answers skipped before the real one; more is a server that never answers. */
const MAX_INTERIM = 8;
/**
 * The longest chunk-size line (size and extensions) accepted, however it
 * arrives; extensions are ignored, so this is only a bound on what a server
 * may make us hold.
 */
const MAX_CHUNK_LINE = 4096;
/** Hex digits of a chunk size after its leading zeros: 8 is up to 4 GiB, more is a size no answer has. */
const MAX_CHUNK_DIGITS = 8;

/** The value of a hex digit byte, or -1. */
function hexDigit(c: number | undefined): number {
  if (c === undefined) return -1;
  if (c >= 0x30 && c <= 0x39) return c - 0x30;
  const l = c | 0x20;
  return l >= 0x61 && l <= 0x66 ? l - 0x61 + 10 : -1;
}

/**
 * Where a chunk size line of 1-8 hex digits starting at `at` ends (its CR,
 * with the LF after it in `b`), or -1 for anything else (an extension,
 * spaces, more digits, a line split across reads), which the general parser
 * then reads.
 */
export function hexLineEnd(b: Buffer, at: number): number {
  let i = at;
  while (i < b.length && i - at <= 8 && hexDigit(b[i]) !== -1) i++;
  const digits = i - at;
  return digits >= 1 && digits <= 8 && b[i] === 0x0d && b[i + 1] === 0x0a ? i : -1;
}

export function hexValue(b: Buffer, from: number, to: number): number {
  let n = 0;
  for (let i = from; i < to; i++) n = n * 16 + hexDigit(b[i]);
  return n;
}

/**
 * A Content-Length value: one decimal number, or the same number repeated as
 * a list (`42, 42`: a field sent twice, or joined by a proxy), which RFC 9110
 * 8.6 lets a recipient read as that number. Different values, anything not a
 * number, or a length past 2^53 (not a length any answer has) are undefined.
 */
export function contentLength(v: string): number | undefined {
  // The usual value, one number of at most 15 digits (below 2^53): read as it is, no list or strings made.
  if (ONE_LENGTH.test(v)) return Number(v);
  let n: number | undefined;
  for (const part of v.split(",")) {
    const d = part.trim().replace(/^0+(?=.)/, "");
    if (!/^\d{1,16}$/.test(d)) return undefined;
    const x = Number(d);
    if (!Number.isSafeInteger(x) || (n !== undefined && x !== n)) return undefined;
    n = x;
  }
  return n;
}

const ONE_LENGTH = /^\d{1,15}$/;

enum Framing {
  None,
  Length,
  Chunked,
  UntilClose,
}

enum Chunk {
  Size,
  Data,
  DataEnd,
  Trailers,
}

type UpSocket = Socket<Conn>;

/** One connection: writes the request, parses the response head and body framing, feeds the exchange. */
export class Conn {
  socket: UpSocket | undefined;
  ex: Exchange | undefined;
  dead = false;
  /** When the connection last went back to the pool. */
  idleSince = 0;
  /** When the current request was written. */
  sentAt = 0;
  private opened: { resolve: () => void; reject: (e: Error) => void } | undefined;
  /**
   * A head still arriving: its bytes so far are the first `headLen` of this
   * buffer, whose capacity doubles as it fills, so a head sent in many small
   * reads is copied O(n) times in all, not once per read.
   */
  private headBuf: Buffer | undefined;
  private headLen = 0;
  private framing = Framing.None;
  private remaining = 0;
  private chunk = Chunk.Size;
  private line = "";
  private pendingWrite: Uint8Array | undefined;
  private keepAlive = false;
  private paused = false;
  private interim = 0;
  /** Bytes of trailer lines so far (bounded like a head). */
  private trailerBytes = 0;

  constructor(
    readonly pool: ConnPool,
    readonly ready: Promise<void>,
  ) {}

  static open(pool: ConnPool): Conn {
    let settle: Conn["opened"];
    const ready = new Promise<void>((resolve, reject) => {
      settle = { resolve, reject };
    });
    const conn = new Conn(pool, ready);
    conn.opened = settle;
    pool.connect({
      hostname: pool.hostname,
      port: pool.port,
      ...(pool.tls ? { tls: { serverName: pool.hostname } } : {}),
      data: conn,
      socket: HANDLERS,
    }).catch((e: unknown) => conn.closed(e instanceof Error ? e : new Error(String(e))));
    return conn;
  }

  onOpen(s: UpSocket): void {
    this.socket = s;
    this.pool.alive();
    const o = this.opened;
    this.opened = undefined;
    o?.resolve();
  }

  /** Sends an exchange's request on this (open, idle) connection. */
  send(ex: Exchange): void {
    const s = this.socket;
    if (!s || this.dead) {
      ex.fail(new UpstreamConnectionError("connection closed"));
      return;
    }
    this.ex = ex;
    ex.conn = this;
    this.headBuf = undefined;
    this.headLen = 0;
    this.framing = Framing.None;
    this.keepAlive = false;
    this.interim = 0;
    s.ref();
    const payload = ex.payload;
    if (!payload) {
      this.destroy(new UpstreamConnectionError("request already answered"));
      return;
    }
    this.sentAt = performance.now();
    ex.signal.requestSent?.();
    const n = s.write(payload);
    if (n < payload.byteLength) this.pendingWrite = payload.subarray(Math.max(0, n));
  }

  onDrain(): void {
    const p = this.pendingWrite;
    const s = this.socket;
    if (!p || !s) return;
    const n = s.write(p);
    this.pendingWrite = n < p.byteLength ? p.subarray(Math.max(0, n)) : undefined;
  }

  pauseReading(): void {
    if (this.paused || !this.socket) return;
    this.paused = true;
    this.socket.pause();
  }

  resumeReading(): void {
    if (!this.paused || !this.socket) return;
    this.paused = false;
    this.socket.resume();
  }

  onData(buf: Buffer): void {
    const ex = this.ex;
    if (!ex) {
      // Bytes on an idle connection: the server is confused; never reuse it.
      this.destroy(new UpstreamConnectionError("unexpected data on an idle connection"));
      return;
    }
    ex.gotBytes = true;
    let b: Buffer = buf;
    while (ex.headPending) {
      let from = 0;
      if (this.headBuf) {
        // Only the new bytes are searched, and the 3 before them (where a "\n\r\n" ending in them may start).
        from = Math.max(0, this.headLen - 3);
        b = this.holdHead(b);
      }
      const start = bodyStart(b, from);
      if (start === -1) {
        // The bound on the head's text (below), however it arrives: up to 3 bytes here may be the start of its "\r\n\r\n".
        if (b.byteLength > this.pool.maxHeaderBytes + 3) {
          this.destroy(new UpstreamConnectionError("response head too large"));
          return;
        }
        if (!this.headBuf) this.holdHead(b);
        return;
      }
      // The held bytes now belong to the head and body read from `b`; the next head, if any, is held anew.
      this.headBuf = undefined;
      this.headLen = 0;
      const end = headTextEnd(b, start);
      if (end > this.pool.maxHeaderBytes) {
        this.destroy(new UpstreamConnectionError("response head too large"));
        return;
      }
      const head = parseHead(b.toString("latin1", 0, end));
      b = b.subarray(start);
      if (typeof head === "string") {
        this.destroy(new UpstreamConnectionError(head));
        return;
      }
      if (head.status < 200) {
        // 100 Continue, 103 Early Hints: the real answer follows.
        if (++this.interim > MAX_INTERIM) {
          this.destroy(new UpstreamConnectionError("too many interim (1xx) responses"));
          return;
        }
        continue;
      }
      // We ask for no encoding (accept-encoding: identity), so a compressed body is a server we cannot read.
      const ce = head.headers.get("content-encoding");
      if (ce !== undefined && !/^(identity)?$/i.test(ce)) {
        this.destroy(new UpstreamConnectionError(`unsupported content-encoding: ${ce}`));
        return;
      }
      const te = head.headers.get("transfer-encoding");
      const cl = head.headers.get("content-length");
      this.keepAlive = head.keepAlive;
      // Transfer-Encoding with Content-Length (a proxy on the way may have framed it by the other one), or in an
      // HTTP/1.0 answer (RFC 9112 6.1): the body is read by Transfer-Encoding (RFC 9112 6.3), and the connection
      // is closed after it, so no byte left in doubt is read as the next answer.
      if (te !== undefined && (cl !== undefined || head.http10)) this.keepAlive = false;
      if (head.status === 204 || head.status === 304) {
        this.framing = Framing.None;
        // A 204 has no body whatever its head says (RFC 9112 6.3), but one that announces a body (a server must not:
        // RFC 9112 6.1, RFC 9110 8.6) may still send it: bytes in doubt, never read as the next answer.
        if (head.status === 204 && (te !== undefined || (cl !== undefined && contentLength(cl) !== 0))) this.keepAlive = false;
      } else if (te !== undefined) {
        if (te.trim().toLowerCase() !== "chunked") {
          this.destroy(new UpstreamConnectionError(`unsupported transfer-encoding: ${te}`));
          return;
        }
        this.framing = Framing.Chunked;
        this.chunk = Chunk.Size;
        this.line = "";
        if (cl !== undefined) head.headers.delete("content-length");
      } else if (cl !== undefined) {
        const n = contentLength(cl);
        if (n === undefined) {
          this.destroy(new UpstreamConnectionError(`invalid content-length: ${cl.slice(0, 80)}`));
          return;
        }
        // The one value, for readers of the header (`10, 10` is 10).
        head.headers.set("content-length", String(n));
        this.framing = Framing.Length;
        this.remaining = n;
      } else {
        this.framing = Framing.UntilClose;
        this.keepAlive = false;
      }
      this.pool.alive();
      ex.onHead(head);
      if (this.framing === Framing.None || (this.framing === Framing.Length && this.remaining === 0)) {
        this.complete(b);
        return;
      }
    }
    if (this.ex !== ex) return; // the head's receiver cancelled the body
    this.body(ex, b);
  }

  /** Appends `b` to the head held so far (growing its buffer by doubling), and returns all of it. */
  private holdHead(b: Buffer): Buffer {
    const len = this.headLen + b.byteLength;
    let held = this.headBuf;
    if (!held || held.byteLength < len) {
      // Never more room than a head may take (and a byte for the check that refuses it), unless one read brings more.
      const room = Math.min(Math.max(2 * (held?.byteLength ?? 0), 1024), this.pool.maxHeaderBytes + 4);
      const grown = Buffer.allocUnsafe(Math.max(len, room));
      if (held) held.copy(grown, 0, 0, this.headLen);
      held = this.headBuf = grown;
    }
    b.copy(held, this.headLen);
    this.headLen = len;
    return held.subarray(0, len);
  }

  private body(ex: Exchange, b: Buffer): void {
    switch (this.framing) {
      case Framing.UntilClose:
        ex.push(b);
        return;
      case Framing.Length: {
        if (b.byteLength < this.remaining) {
          this.remaining -= b.byteLength;
          ex.push(b);
          return;
        }
        ex.push(b.subarray(0, this.remaining));
        const rest = b.subarray(this.remaining);
        this.remaining = 0;
        this.complete(rest);
        return;
      }
      case Framing.Chunked:
        this.chunked(ex, b);
        return;
      default:
        if (b.byteLength > 0) this.destroy(new UpstreamConnectionError("data after the response"));
    }
  }

  /** A chunk size line was read: its data follows, or (0) the trailers. */
  private sized(n: number): void {
    this.remaining = n;
    this.chunk = n === 0 ? Chunk.Trailers : Chunk.Data;
    this.trailerBytes = 0;
  }

  /** Decodes chunked transfer coding; body slices go to the exchange as they arrive (none waits for a whole chunk). */
  private chunked(ex: Exchange, b: Buffer): void {
    let at = 0;
    while (at < b.byteLength) {
      switch (this.chunk) {
        case Chunk.Size:
        case Chunk.Trailers: {
          if (this.chunk === Chunk.Size && this.line === "") {
            // The common case: the whole size line (hex digits, then CRLF) in this read, read as bytes.
            const end = hexLineEnd(b, at);
            if (end !== -1) {
              this.sized(hexValue(b, at, end));
              at = end + 2;
              break;
            }
          }
          // Lines end with CRLF or a bare LF (as in the head); a CR that ended the previous read is dropped with its LF here.
          const nl = b.indexOf(0x0a, at);
          if (nl === -1) {
            this.line += b.toString("latin1", at);
            // The bound of the whole line (below), so a line is refused however it arrives: a chunk-size line's,
            // or what is left of the trailers' (a trailer field may be longer than a size line; the empty line
            // that ends them is not counted), and one byte for a CR whose LF is still to come.
            const max = this.chunk === Chunk.Size ? MAX_CHUNK_LINE : Math.max(0, this.pool.maxHeaderBytes - this.trailerBytes - 2);
            if (this.line.length > max + 1) {
              this.destroy(new UpstreamConnectionError(this.chunk === Chunk.Size ? "chunk header too long" : "response trailers too large"));
            }
            return;
          }
          let line = this.line + b.toString("latin1", at, nl);
          at = nl + 1;
          if (line.charCodeAt(line.length - 1) === 0x0d) line = line.slice(0, -1);
          this.line = "";
          if (this.chunk === Chunk.Trailers) {
            if (line === "") {
              this.complete(b.subarray(at));
              return;
            }
            this.trailerBytes += line.length + 2;
            if (this.trailerBytes > this.pool.maxHeaderBytes) {
              this.destroy(new UpstreamConnectionError("response trailers too large"));
              return;
            }
            continue;
          }
          if (line.length > MAX_CHUNK_LINE) {
            this.destroy(new UpstreamConnectionError("chunk header too long"));
            return;
          }
          // Extensions (after ";") are ignored; leading zeros are legal (chunk-size = 1*HEXDIG).
          const hex = (line.split(";", 1)[0] ?? "").trim().replace(/^0+(?=.)/, "");
          if (!/^[0-9a-fA-F]+$/.test(hex) || hex.length > MAX_CHUNK_DIGITS) {
            this.destroy(new UpstreamConnectionError(`invalid chunk size: ${JSON.stringify(hex.slice(0, 20))}`));
            return;
          }
          this.sized(Number.parseInt(hex, 16));
          break;
        }
        case Chunk.Data: {
          const n = Math.min(this.remaining, b.byteLength - at);
          ex.push(b.subarray(at, at + n));
          at += n;
          this.remaining -= n;
          if (this.remaining === 0) {
            this.chunk = Chunk.DataEnd;
            this.remaining = 2;
          }
          break;
        }
        case Chunk.DataEnd: {
          // The CRLF (or bare LF) after a chunk's data, possibly split across reads.
          if (this.remaining === 2 && b[at] === 0x0a) {
            at++;
            this.remaining = 0;
            this.chunk = Chunk.Size;
            break;
          }
          const want = this.remaining === 2 ? 0x0d : 0x0a;
          if (b[at] !== want) {
            this.destroy(new UpstreamConnectionError("missing CRLF after chunk data"));
            return;
          }
          at++;
          if (--this.remaining === 0) this.chunk = Chunk.Size;
          break;
        }
      }
    }
  }

  /** The response is complete: hand the body's end to the reader, and the connection back to the pool if it may be reused. */
  private complete(rest: Buffer): void {
    const ex = this.ex;
    this.ex = undefined;
    if (ex) ex.conn = undefined;
    const reusable = this.keepAlive && rest.byteLength === 0 && this.pendingWrite === undefined && !this.dead;
    this.resumeReading();
    if (reusable) this.pool.release(this);
    else this.destroy(undefined);
    ex?.end();
  }

  /** Closes the connection; a response in progress fails with `why` (undefined: it already completed). */
  destroy(why: Error | undefined): void {
    const wasDead = this.dead;
    // First the exchange learns why (closing the socket reports a plain close).
    this.closed(why);
    if (wasDead) return;
    // A failure or an abort resets the connection (the server stops at once); a finished one closes politely.
    if (why) this.socket?.terminate();
    else this.socket?.end();
  }

  /** The socket is gone (or never opened): whatever was waiting on it fails. */
  closed(why: Error | undefined): void {
    this.dead = true;
    this.pool.forget(this);
    const o = this.opened;
    this.opened = undefined;
    o?.reject(why ?? new UpstreamConnectionError("connection closed"));
    const ex = this.ex;
    this.ex = undefined;
    if (!ex) return;
    ex.conn = undefined;
    if (ex.retry && !ex.gotBytes && !ex.signal.aborted && performance.now() - this.sentAt < this.pool.staleRetryMs) {
      // A kept-alive connection the server had closed as we sent: it processed nothing; send it again.
      // Later than that, the server may have been working on it (a crash mid-prefill): not resent here.
      ex.retry.resend(ex);
      return;
    }
    if (this.framing === Framing.UntilClose && !ex.headPending && !why) {
      ex.end();
      return;
    }
    ex.fail(why ?? new UpstreamConnectionError(ex.headPending ? "connection closed before the response" : "connection closed mid-response"));
  }
}

const HANDLERS: import("bun").SocketHandler<Conn> = {
  open(s) {
    // A TLS connection is ready only once its handshake is done and the certificate verified.
    if (!s.data.pool.tls) s.data.onOpen(s);
  },
  handshake(s, ok, authorizationError) {
    if (ok && !authorizationError) s.data.onOpen(s);
    else {
      s.data.destroy(new UpstreamConnectionError(`TLS handshake failed: ${authorizationError?.message ?? "unknown reason"}`));
      s.terminate();
    }
  },
  data(s, d) {
    s.data.onData(d);
  },
  drain(s) {
    s.data.onDrain();
  },
  end(s) {
    // The server closed its side: a read-until-close body ends here; anything else was cut short.
    s.data.closed(undefined);
    s.end();
  },
  close(s, err) {
    s.data.closed(err ? new UpstreamConnectionError(err.message) : undefined);
  },
  error(s, err) {
    s.data.destroy(new UpstreamConnectionError(err.message));
    s.terminate();
  },
  connectError(s, err) {
    s.data.closed(new UpstreamConnectionError(err.message));
  },
};
