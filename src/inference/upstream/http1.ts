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
 * flight, which only an environment variable set at start lifts.
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

import { Conn, STALE_RETRY_MS, type SocketOpener } from "./http1-conn.ts";
import { type AbortLike, ConnectTimeout, Exchange, type Resender, type UpstreamResponse, UpstreamConnectionError } from "./http1-exchange.ts";
import { type Origin, originOf } from "./origin.ts";
import { type ConnectProbe, createConnectProbe } from "./probe.ts";

export type { SocketOpener } from "./http1-conn.ts";
export { type AbortLike, type AbortListener, type ByteReader, ConnectTimeout, type UpstreamResponse, UpstreamConnectionError } from "./http1-exchange.ts";

export interface RequestOptions {
  method: "POST" | "GET";
  /** Absolute path with query, e.g. `/v1/chat/completions`. */
  path: string;
  /** Lower-case names; `host` and `content-length` are added here. */
  headers: Record<string, string>;
  /**
   * Headers many requests send the same (lower-case names; written before
   * `headers`), as one object the caller keeps: when it is frozen, the
   * request line, host and these are checked and written once per object (and
   * method and path), so a request writes only its own part of the head. An
   * object that is not frozen could change after its head was written: it is
   * checked and written for each request.
   */
  fixedHeaders?: Readonly<Record<string, string>>;
  body?: string;
  /** Aborting closes the connection; the request rejects (or the body read fails) with the signal's reason. */
  signal: AbortLike;
  /**
   * The request fails with ConnectTimeout when the origin shows no sign of
   * life for this long: a new connection that does not open (dropped SYNs),
   * or a kept-alive one to an origin that went silent (see Pool.watchReused).
   * Unset: no connect deadline.
   */
  connectMs?: number;
}

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
  /** The keep-alive race window (default STALE_RETRY_MS); tests widen it so a busy machine's pauses cannot close it. */
  staleRetryMs?: number;
  /** Checks an origin that went silent, for requests sent on kept-alive connections; one per client by default. */
  probe?: ConnectProbe;
  /** Opens sockets; `Bun.connect` by default (tests stand in one that never completes, for dropped SYNs). */
  connect?: SocketOpener;
}

/** A head's start: the request line, host and fixed headers, as written and as checked for one method and path. */
interface HeadStart {
  method: string;
  path: string;
  text: string;
  bytes: number;
}

/** Why a header cannot be sent (a CR or LF would split it into another header), or undefined. */
function badHeader(k: string, v: string): Error | undefined {
  return /[\r\n]/.test(v) || /[\r\n:]/.test(k) ? new Error(`invalid upstream request header ${JSON.stringify(k)}`) : undefined;
}

/** The connections of one origin. */
class Pool implements Endpoint, Resender {
  /** Host (IPv6 without brackets) and port, as the connect probe reads them from the same URL. */
  readonly hostname: string;
  readonly port: number;
  readonly tls: boolean;
  private readonly hostHeader: string;
  private readonly idle: Conn[] = [];
  /** Sweeps idle connections older than idleMs (Bun's socket timeouts tick in 4 s steps, too coarse here). */
  private sweeper: ReturnType<typeof setInterval> | undefined;
  private readonly origin: Origin;
  /** Counts signs of life (connections opened, response heads): a connect deadline checks whether it moved. */
  private lifeSigns = 0;

  private readonly idleMs: number;
  /** The head's start written for each caller's fixedHeaders object. */
  private readonly starts = new WeakMap<object, HeadStart>();

  constructor(
    url: URL,
    readonly maxIdle: number,
    idleMs: number,
    readonly maxHeaderBytes: number,
    private readonly highWaterMark: number,
    readonly staleRetryMs: number,
    private readonly probe: ConnectProbe,
    readonly connect: SocketOpener,
  ) {
    this.tls = url.protocol === "https:";
    this.origin = originOf(url.href);
    ({ hostname: this.hostname, port: this.port } = this.origin);
    this.hostHeader = url.host;
    this.idleMs = idleMs;
  }

  alive(): void {
    this.lifeSigns++;
    this.probe.alive(this.origin);
  }

  request(opts: RequestOptions): Promise<UpstreamResponse> {
    if (opts.signal.aborted) {
      const r: unknown = opts.signal.reason;
      return Promise.reject(r instanceof Error ? r : new UpstreamConnectionError("aborted"));
    }
    const start = this.headStart(opts);
    if (start instanceof Error) return Promise.reject(start);
    // The request's bytes written into one buffer, piece by piece: no string is built for the head, and
    // the body (a prompt of megabytes) is not copied into a joined string before it is encoded.
    const body = opts.body ?? "";
    const bodyBytes = Buffer.byteLength(body);
    let size = start.bytes + bodyBytes + 2;
    for (const k in opts.headers) {
      const v = opts.headers[k] as string;
      const bad = badHeader(k, v);
      if (bad) return Promise.reject(bad);
      size += Buffer.byteLength(k) + Buffer.byteLength(v) + 4;
    }
    const length = opts.method === "POST" || body !== "" ? String(bodyBytes) : undefined;
    if (length !== undefined) size += CONTENT_LENGTH.length + length.length + 2;
    const payload = Buffer.allocUnsafe(size);
    let at = payload.write(start.text);
    for (const k in opts.headers) {
      at += payload.write(k, at);
      at += payload.write(": ", at);
      at += payload.write(opts.headers[k] as string, at);
      at += payload.write("\r\n", at);
    }
    if (length !== undefined) {
      at += payload.write(CONTENT_LENGTH, at);
      at += payload.write(length, at);
      at += payload.write("\r\n", at);
    }
    at += payload.write("\r\n", at);
    payload.write(body, at);
    const ex = new Exchange(opts.signal, payload, this.highWaterMark, opts.connectMs);
    this.dispatch(ex, false);
    return ex.headPromise;
  }

  /**
   * The request line, host and fixed headers: checked and written once per frozen fixedHeaders object,
   * method and path. Only a frozen object's head is kept: one changed after its head was written would be
   * sent as it was (its new headers missing, a CR/LF put in it never checked).
   */
  private headStart(opts: RequestOptions): HeadStart | Error {
    const fixed = opts.fixedHeaders;
    const keep = fixed !== undefined && Object.isFrozen(fixed);
    const kept = keep && this.starts.get(fixed);
    if (kept && kept.method === opts.method && kept.path === opts.path) return kept;
    if (/[\s]/.test(opts.path)) return new Error(`invalid upstream request path ${JSON.stringify(opts.path)}`);
    let text = `${opts.method} ${opts.path} HTTP/1.1\r\nhost: ${this.hostHeader}\r\n`;
    if (fixed) {
      for (const k in fixed) {
        const v = fixed[k] as string;
        const bad = badHeader(k, v);
        if (bad) return bad;
        text += `${k}: ${v}\r\n`;
      }
    }
    const start = { method: opts.method, path: opts.path, text, bytes: Buffer.byteLength(text) };
    if (keep) this.starts.set(fixed, start);
    return start;
  }

  /** A request on a reused connection that the server had closed: sent again on a new one (Conn.closed). */
  resend(ex: Exchange): void {
    ex.retry = undefined;
    this.dispatch(ex, true);
  }

  /** Sends on the most recently used idle connection, or on a new one (always new for a retry). */
  private dispatch(ex: Exchange, retried: boolean): void {
    let conn: Conn | undefined;
    while (!retried) {
      conn = this.idle.pop();
      if (!conn?.dead) break;
    }
    if (conn) {
      ex.retry = this;
      conn.send(ex);
      this.watchReused(ex);
      return;
    }
    const fresh = Conn.open(this);
    const deadline = this.connectDeadline(ex);
    fresh.ready.then(
      () => {
        clearTimeout(deadline);
        // Failed while connecting (aborted, or the deadline): the connection is kept for the next request.
        if (ex.signal.aborted || ex.over) this.release(fresh);
        else fresh.send(ex);
      },
      (e: unknown) => {
        clearTimeout(deadline);
        ex.fail(e instanceof Error ? e : new UpstreamConnectionError(String(e)));
      },
    );
  }

  /**
   * The connect timeout of a new connection. Under a burst of new connections
   * the origin's accept queue overflows and SYNs are retried, so a slow
   * connect alone proves little: if the origin showed any sign of life
   * meanwhile (another connection opened, a response arrived), the request
   * keeps waiting, bounded by the caller's first-byte timeout.
   */
  private connectDeadline(ex: Exchange): ReturnType<typeof setTimeout> | undefined {
    const ms = ex.connectMs;
    if (ms === undefined) return undefined;
    const signs = this.lifeSigns;
    return setTimeout(() => {
      if (this.lifeSigns === signs) ex.fail(new ConnectTimeout(ms));
    }, ms);
  }

  /**
   * A request on a kept-alive connection has no connect phase to time, yet
   * the server behind it may have died without a word (a host gone, a
   * dropped route): writes succeed and nothing comes back, for as long as the
   * first-byte timeout (minutes for slow models). So when the origin has not
   * been heard from lately, the probe opens a connection of its own, raced
   * against connectMs; one probe per origin at a time, none while the origin
   * keeps answering, which is the steady-state hot path.
   */
  private watchReused(ex: Exchange): void {
    const ms = ex.connectMs;
    if (ms === undefined) return;
    this.probe.check(this.origin, ms)?.then((r) => {
      if (r === "timeout" && ex.headPending) ex.abandon(new ConnectTimeout(ms));
    });
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

const CONTENT_LENGTH = "content-length: ";

export interface Http1Client {
  /** The pool for a base URL's origin (created on first use); the URL's path is not part of it. */
  endpoint(baseUrl: string): Endpoint;
  /** Closes idle connections (connections in use close when their exchange ends). */
  close(): void;
}

export function createHttp1Client(opts: Http1ClientOptions = {}): Http1Client {
  const pools = new Map<string, Pool>();
  const probe = opts.probe ?? createConnectProbe();
  const connect: SocketOpener = opts.connect ?? Bun.connect;
  return {
    endpoint(baseUrl) {
      const url = new URL(baseUrl);
      if (url.protocol !== "http:" && url.protocol !== "https:") throw new Error(`unsupported upstream protocol ${url.protocol}`);
      const key = `${url.protocol}//${url.host}`;
      let p = pools.get(key);
      if (!p) {
        p = new Pool(url, opts.maxIdle ?? 512, opts.idleMs ?? 3_000, opts.maxHeaderBytes ?? 64 * 1024, opts.highWaterMark ?? 16 * 1024, opts.staleRetryMs ?? STALE_RETRY_MS, probe, connect);
        pools.set(key, p);
      }
      return p;
    },
    close() {
      for (const p of pools.values()) p.close();
    },
  };
}
