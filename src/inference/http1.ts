import type { Socket } from "bun";
import { originOf } from "./probe.ts";

/**
 * The gateway's HTTP/1.1 client for upstream model servers, on Bun's TCP/TLS
 * sockets (`Bun.connect`) with a keep-alive pool per origin.
 *
 * Why not `fetch`: memory per open stream. A stream relayed through the
 * gateway must be read in JavaScript (the model id is swapped, usage is
 * metered), and a `fetch` body read from JavaScript costs about 28 KB of
 * resident memory per open stream in Bun 1.4 (a native pull buffer of 64 KB
 * per body, its stream objects, and the client's own buffers); the same relay
 * over a socket costs about 8 KB (measured with 5,000 held streams, README
 * "Benchmarks"). At 10,000 streams that is the difference between meeting
 * the memory target and not. It also drops Bun's cap of 256 fetches in
 * flight, which needed a re-executed process to lift.
 *
 * The client speaks just what an OpenAI-compatible server needs: one request
 * at a time per connection (no pipelining), a request body of known length,
 * responses framed by Content-Length, chunked transfer coding (with
 * extensions and trailers) or the connection's close, and interim 1xx
 * responses skipped. Nothing here knows JSON or SSE.
 *
 * Connections: idle ones are kept per origin (at most `maxIdle`, closed after
 * `idleMs`, never keeping the process alive) and reused most recent first. A
 * reused connection that the server had already closed (its keep-alive
 * timeout raced our request) fails before any response byte arrives; such a
 * request is sent once more on a new connection (only when the failure
 * comes within STALE_RETRY_MS of the write), as browsers do, instead of
 * being reported as an upstream failure.
 */

/** The part of a stream reader the relay uses (also what a `fetch` body's reader offers). */
export interface ByteReader {
  read(): Promise<{ done: true; value?: undefined } | { done: false; value: Uint8Array }>;
  cancel(reason?: unknown): Promise<void>;
}

export interface UpstreamResponse {
  readonly status: number;
  readonly ok: boolean;
  /** A response header by lower-case name; repeated headers are joined with ", ". */
  header(name: string): string | undefined;
  /** The whole body as UTF-8 text. */
  text(): Promise<string>;
  /** The body as it arrives; `cancel()` closes the connection. */
  readonly body: ByteReader;
}

export interface RequestOptions {
  method: "POST" | "GET";
  /** Absolute path with query, e.g. `/v1/chat/completions`. */
  path: string;
  /** Lower-case names; `host` and `content-length` are added here. */
  headers: Record<string, string>;
  body?: string;
  /** Aborting closes the connection; the request rejects (or the body read fails) with the signal's reason. */
  signal: AbortSignal;
}

/** The connection failed or closed before the response was complete. */
export class UpstreamConnectionError extends Error {}

export interface Endpoint {
  request(opts: RequestOptions): Promise<UpstreamResponse>;
}

export interface Http1ClientOptions {
  /** Idle connections kept per origin. */
  maxIdle?: number;
  /** An idle connection is closed after this long (below common server keep-alive timeouts: uvicorn's is 5 s); default 3 s. */
  idleMs?: number;
  /** Largest response head accepted. */
  maxHeaderBytes?: number;
  /** Body bytes queued for a reader that is not reading before the socket stops reading (default 16 KB: 10,000 slow readers hold at most ~160 MB). */
  highWaterMark?: number;
  /** The keep-alive race window (`STALE_RETRY_MS`); tests widen it so a busy machine's pauses cannot close it. */
  staleRetryMs?: number;
}

const CRLF2 = Buffer.from("\r\n\r\n");
/**
 * A pooled connection that fails within this long after the request was
 * written, before any answer byte, was closed by the server before it read
 * the request (the keep-alive race): the request is sent once more. A later
 * failure may follow work the server did, and is reported instead.
 */
const STALE_RETRY_MS = 100;
/** Interim (1xx) answers skipped before the real one; more is a server that never answers. */
const MAX_INTERIM = 8;
const CRLF = Buffer.from("\r\n");
const enc = new TextEncoder();

const enum Framing {
  None,
  Length,
  Chunked,
  UntilClose,
}

const enum Chunk {
  Size,
  Data,
  DataEnd,
  Trailers,
}

interface Head {
  status: number;
  headers: Map<string, string>;
  keepAlive: boolean;
}

function parseHead(text: string): Head | string {
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

/**
 * One request and its response on one connection: the head promise, then the
 * body as a queue read by one reader. Methods rather than closures, so an
 * open stream holds a few small objects.
 */
class Exchange implements UpstreamResponse, ByteReader {
  status = 0;
  ok = false;
  headers: Map<string, string> | undefined;
  readonly body: ByteReader = this;
  /** A response byte has arrived (a reused connection that fails before this is retried). */
  gotBytes = false;
  conn: Conn | undefined;
  /** Set while the request is on a reused connection for the first time: sends it again on a new one. */
  retry: (() => void) | undefined;
  /**
   * The request's bytes, until an answer starts (a retry needs them): a
   * stream must not keep its request body (large prompts, base64 images)
   * alive for its whole life.
   */
  payload: Uint8Array | undefined;
  private queue: Uint8Array[] = [];
  private queued = 0;
  private ended = false;
  private failure: Error | undefined;
  private waiter: { resolve: (r: { done: true } | { done: false; value: Uint8Array }) => void; reject: (e: Error) => void } | undefined;
  private headResolve: ((r: UpstreamResponse) => void) | undefined;
  private headReject: ((e: Error) => void) | undefined;
  readonly headPromise: Promise<UpstreamResponse>;

  /** The abort listener: closes the connection, or fails the exchange while it has none. */
  private readonly onAbort = () => {
    const r: unknown = this.signal.reason;
    const reason = r instanceof Error ? r : new UpstreamConnectionError("aborted");
    if (this.conn) this.conn.destroy(reason);
    else this.fail(reason);
  };

  constructor(
    readonly signal: AbortSignal,
    payload: Uint8Array,
    private readonly highWaterMark: number,
  ) {
    this.payload = payload;
    this.headPromise = new Promise<UpstreamResponse>((resolve, reject) => {
      this.headResolve = resolve;
      this.headReject = reject;
    });
    signal.addEventListener("abort", this.onAbort, { once: true });
  }

  header(name: string): string | undefined {
    return this.headers?.get(name);
  }

  onHead(head: Head): void {
    this.payload = undefined;
    this.retry = undefined;
    this.status = head.status;
    this.ok = head.status >= 200 && head.status <= 299;
    this.headers = head.headers;
    const resolve = this.headResolve;
    this.headResolve = undefined;
    this.headReject = undefined;
    resolve?.(this);
  }

  push(chunk: Uint8Array): void {
    if (chunk.byteLength === 0 || this.ended) return;
    const w = this.waiter;
    if (w && this.queue.length === 0) {
      this.waiter = undefined;
      w.resolve({ done: false, value: chunk });
      return;
    }
    this.queue.push(chunk);
    this.queued += chunk.byteLength;
    if (this.queued > this.highWaterMark) this.conn?.pauseReading();
  }

  /** The exchange is over: nothing more to retry or abort. */
  private settled(): void {
    this.retry = undefined;
    this.payload = undefined;
    this.signal.removeEventListener("abort", this.onAbort);
  }

  /** The body is complete. */
  end(): void {
    if (this.ended) return;
    this.ended = true;
    this.settled();
    const w = this.waiter;
    if (w && this.queue.length === 0) {
      this.waiter = undefined;
      w.resolve({ done: true });
    }
  }

  /** The exchange failed: before the head, the request rejects; after it, the next read does. */
  fail(e: Error): void {
    if (this.ended || this.failure) return;
    this.failure = e;
    this.settled();
    const reject = this.headReject;
    this.headResolve = undefined;
    this.headReject = undefined;
    reject?.(e);
    const w = this.waiter;
    this.waiter = undefined;
    w?.reject(e);
  }

  get headPending(): boolean {
    return this.headResolve !== undefined;
  }

  read(): Promise<{ done: true; value?: undefined } | { done: false; value: Uint8Array }> {
    if (this.queue.length > 0) {
      const value = this.queue.length === 1 ? (this.queue[0] as Uint8Array) : Buffer.concat(this.queue, this.queued);
      this.queue.length = 0;
      this.queued = 0;
      this.conn?.resumeReading();
      return Promise.resolve({ done: false, value });
    }
    if (this.failure) return Promise.reject(this.failure);
    if (this.ended) return Promise.resolve({ done: true });
    if (this.waiter) return Promise.reject(new Error("concurrent reads on one upstream body"));
    return new Promise((resolve, reject) => {
      this.waiter = { resolve, reject };
    });
  }

  async cancel(): Promise<void> {
    if (this.ended && this.queue.length === 0) return;
    this.queue.length = 0;
    this.queued = 0;
    this.conn?.destroy(new UpstreamConnectionError("response body cancelled"));
    this.end();
  }

  async text(): Promise<string> {
    const parts: Uint8Array[] = [];
    let n = 0;
    for (;;) {
      const r = await this.read();
      if (r.done) break;
      parts.push(r.value);
      n += r.value.byteLength;
    }
    return Buffer.concat(parts, n).toString("utf8");
  }
}

type UpSocket = Socket<Conn>;

/** One connection: writes the request, parses the response head and body framing, feeds the exchange. */
class Conn {
  socket: UpSocket | undefined;
  ex: Exchange | undefined;
  dead = false;
  /** When the connection last went back to the pool. */
  idleSince = 0;
  /** When the current request was written. */
  sentAt = 0;
  private opened: { resolve: () => void; reject: (e: Error) => void } | undefined;
  private headBuf: Buffer | undefined;
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
    readonly pool: Pool,
    readonly ready: Promise<void>,
  ) {}

  static open(pool: Pool): Conn {
    let settle: Conn["opened"];
    const ready = new Promise<void>((resolve, reject) => {
      settle = { resolve, reject };
    });
    const conn = new Conn(pool, ready);
    conn.opened = settle;
    Bun.connect<Conn>({
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
        from = Math.max(0, this.headBuf.byteLength - 3);
        b = Buffer.concat([this.headBuf, b]);
      }
      this.headBuf = undefined;
      const end = b.indexOf(CRLF2, from);
      if (end === -1) {
        if (b.byteLength > this.pool.maxHeaderBytes) return this.destroy(new UpstreamConnectionError("response head too large"));
        this.headBuf = b;
        return;
      }
      if (end > this.pool.maxHeaderBytes) return this.destroy(new UpstreamConnectionError("response head too large"));
      const head = parseHead(b.toString("latin1", 0, end));
      b = b.subarray(end + 4);
      if (typeof head === "string") return this.destroy(new UpstreamConnectionError(head));
      if (head.status < 200) {
        // 100 Continue, 103 Early Hints: the real answer follows.
        if (++this.interim > MAX_INTERIM) return this.destroy(new UpstreamConnectionError("too many interim (1xx) responses"));
        continue;
      }
      // We ask for no encoding (no accept-encoding), so a compressed body is a server we cannot read.
      const ce = head.headers.get("content-encoding");
      if (ce !== undefined && ce.toLowerCase() !== "identity") return this.destroy(new UpstreamConnectionError(`unsupported content-encoding: ${ce}`));
      const te = head.headers.get("transfer-encoding");
      const cl = head.headers.get("content-length");
      // Two framings: a proxy on the way may pick the other one (request smuggling); never guess.
      if (te !== undefined && cl !== undefined) return this.destroy(new UpstreamConnectionError("ambiguous framing: both transfer-encoding and content-length"));
      this.keepAlive = head.keepAlive;
      if (head.status === 204 || head.status === 304) this.framing = Framing.None;
      else if (te !== undefined) {
        if (te.trim().toLowerCase() !== "chunked") return this.destroy(new UpstreamConnectionError(`unsupported transfer-encoding: ${te}`));
        this.framing = Framing.Chunked;
        this.chunk = Chunk.Size;
        this.line = "";
      } else if (cl !== undefined) {
        if (!/^\d+$/.test(cl)) return this.destroy(new UpstreamConnectionError(`invalid content-length: ${cl}`));
        this.framing = Framing.Length;
        this.remaining = Number(cl);
      } else {
        this.framing = Framing.UntilClose;
        this.keepAlive = false;
      }
      ex.onHead(head);
      if (this.framing === Framing.None || (this.framing === Framing.Length && this.remaining === 0)) return this.complete(b);
    }
    if (this.ex !== ex) return; // the head's receiver cancelled the body
    this.body(ex, b);
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
        return this.complete(rest);
      }
      case Framing.Chunked:
        return this.chunked(ex, b);
      default:
        if (b.byteLength > 0) this.destroy(new UpstreamConnectionError("data after the response"));
    }
  }

  /** Decodes chunked transfer coding; body slices go to the exchange as they arrive (none waits for a whole chunk). */
  private chunked(ex: Exchange, b: Buffer): void {
    let at = 0;
    while (at < b.byteLength) {
      switch (this.chunk) {
        case Chunk.Size:
        case Chunk.Trailers: {
          let line: string;
          if (this.line.endsWith("\r") && b[at] === 0x0a) {
            // The CR ended the previous read, its LF starts this one.
            line = this.line.slice(0, -1);
            at += 1;
          } else {
            const nl = b.indexOf(CRLF, at);
            if (nl === -1) {
              this.line += b.toString("latin1", at);
              if (this.line.length > 4096) return this.destroy(new UpstreamConnectionError("chunk header too long"));
              return;
            }
            line = this.line + b.toString("latin1", at, nl);
            at = nl + 2;
          }
          this.line = "";
          if (this.chunk === Chunk.Trailers) {
            if (line === "") return this.complete(b.subarray(at));
            this.trailerBytes += line.length + 2;
            if (this.trailerBytes > this.pool.maxHeaderBytes) return this.destroy(new UpstreamConnectionError("response trailers too large"));
            continue;
          }
          const hex = (line.split(";", 1)[0] ?? "").trim();
          if (!/^[0-9a-fA-F]{1,8}$/.test(hex)) return this.destroy(new UpstreamConnectionError(`invalid chunk size: ${JSON.stringify(hex.slice(0, 20))}`));
          this.remaining = Number.parseInt(hex, 16);
          this.chunk = this.remaining === 0 ? Chunk.Trailers : Chunk.Data;
          this.trailerBytes = 0;
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
          // The CRLF after a chunk's data, possibly split across reads.
          const want = this.remaining === 2 ? 0x0d : 0x0a;
          if (b[at] !== want) return this.destroy(new UpstreamConnectionError("missing CRLF after chunk data"));
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
    if (ex.retry && !ex.gotBytes && !ex.signal.aborted && performance.now() - this.sentAt < STALE_RETRY_MS) {
      // A kept-alive connection the server had closed as we sent: it processed nothing; send it again.
      // Later than that, the server may have been working on it (a crash mid-prefill): not resent here.
      ex.retry();
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

/** The connections of one origin. */
class Pool implements Endpoint {
  /** Host (IPv6 without brackets) and port, as the connect probe reads them from the same URL. */
  readonly hostname: string;
  readonly port: number;
  readonly tls: boolean;
  private readonly hostHeader: string;
  private readonly idle: Conn[] = [];
  /** Sweeps idle connections older than idleMs (Bun's socket timeouts tick in 4 s steps, too coarse here). */
  private sweeper: ReturnType<typeof setInterval> | undefined;

  private readonly idleMs: number;

  constructor(
    url: URL,
    readonly maxIdle: number,
    idleMs: number,
    readonly maxHeaderBytes: number,
    private readonly highWaterMark: number,
    readonly staleRetryMs: number,
  ) {
    this.tls = url.protocol === "https:";
    ({ hostname: this.hostname, port: this.port } = originOf(url.href));
    this.hostHeader = url.host;
    this.idleMs = idleMs;
  }

  request(opts: RequestOptions): Promise<UpstreamResponse> {
    if (opts.signal.aborted) {
      const r: unknown = opts.signal.reason;
      return Promise.reject(r instanceof Error ? r : new UpstreamConnectionError("aborted"));
    }
    if (/[\s]/.test(opts.path)) return Promise.reject(new Error(`invalid upstream request path ${JSON.stringify(opts.path)}`));
    const body = opts.body ?? "";
    let head = `${opts.method} ${opts.path} HTTP/1.1\r\nhost: ${this.hostHeader}\r\n`;
    for (const k in opts.headers) {
      const v = opts.headers[k] as string;
      if (/[\r\n]/.test(v) || /[\r\n:]/.test(k)) return Promise.reject(new Error(`invalid upstream request header ${JSON.stringify(k)}`));
      head += `${k}: ${v}\r\n`;
    }
    if (opts.method === "POST" || body !== "") head += `content-length: ${Buffer.byteLength(body)}\r\n`;
    const ex = new Exchange(opts.signal, enc.encode(`${head}\r\n${body}`), this.highWaterMark);
    this.dispatch(ex, false);
    return ex.headPromise;
  }

  /** Sends on the most recently used idle connection, or on a new one (always new for a retry). */
  private dispatch(ex: Exchange, retried: boolean): void {
    let conn: Conn | undefined;
    while (!retried) {
      conn = this.idle.pop();
      if (!conn || !conn.dead) break;
    }
    if (conn) {
      ex.retry = () => {
        ex.retry = undefined;
        this.dispatch(ex, true);
      };
      conn.send(ex);
      return;
    }
    const fresh = Conn.open(this);
    fresh.ready.then(
      () => {
        // Aborted while connecting: the exchange has failed already; the connection is kept for the next request.
        if (ex.signal.aborted) this.release(fresh);
        else fresh.send(ex);
      },
      (e: unknown) => ex.fail(e instanceof Error ? e : new UpstreamConnectionError(String(e))),
    );
  }

  release(conn: Conn): void {
    const s = conn.socket;
    if (conn.dead || !s || this.idle.length >= this.maxIdle) {
      conn.destroy(undefined);
      return;
    }
    s.unref();
    conn.idleSince = performance.now();
    this.idle.push(conn);
    if (!this.sweeper) {
      this.sweeper = setInterval(() => this.sweep(), Math.max(100, Math.min(1_000, this.idleMs / 4)));
      this.sweeper.unref?.();
    }
  }

  /** Closes connections idle for idleMs; the stack's oldest are at its bottom. */
  private sweep(): void {
    const before = performance.now() - this.idleMs;
    let n = 0;
    while (n < this.idle.length && (this.idle[n] as Conn).idleSince <= before) n++;
    for (const c of this.idle.splice(0, n)) c.destroy(undefined);
    if (this.idle.length === 0) {
      clearInterval(this.sweeper);
      this.sweeper = undefined;
    }
  }

  forget(conn: Conn): void {
    const i = this.idle.indexOf(conn);
    if (i !== -1) this.idle.splice(i, 1);
  }

  close(): void {
    for (const c of this.idle.splice(0)) c.destroy(undefined);
    clearInterval(this.sweeper);
    this.sweeper = undefined;
  }
}

export interface Http1Client {
  /** The pool for a base URL's origin (created on first use); the URL's path is not part of it. */
  endpoint(baseUrl: string): Endpoint;
  /** Closes idle connections (connections in use close when their exchange ends). */
  close(): void;
}

export function createHttp1Client(opts: Http1ClientOptions = {}): Http1Client {
  const pools = new Map<string, Pool>();
  return {
    endpoint(baseUrl) {
      const url = new URL(baseUrl);
      if (url.protocol !== "http:" && url.protocol !== "https:") throw new Error(`unsupported upstream protocol ${url.protocol}`);
      const key = `${url.protocol}//${url.host}`;
      let p = pools.get(key);
      if (!p) {
        p = new Pool(url, opts.maxIdle ?? 512, opts.idleMs ?? 3_000, opts.maxHeaderBytes ?? 64 * 1024, opts.highWaterMark ?? 16 * 1024, opts.staleRetryMs ?? STALE_RETRY_MS);
        pools.set(key, p);
      }
      return p;
    },
    close() {
      for (const p of pools.values()) p.close();
    },
  };
}
