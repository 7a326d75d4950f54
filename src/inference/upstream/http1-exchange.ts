import type { Head } from "./http1-head.ts";

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
  /** The response ended or failed: what is left of its body is already here, and no read of it waits. */
  readonly over: boolean;
}

/** The connection failed or closed before the response was complete. */
export class UpstreamConnectionError extends Error {}

/** No connection to the origin within the request's `connectMs`, and no sign of life from it meanwhile. */
export class ConnectTimeout extends UpstreamConnectionError {
  constructor(readonly ms: number) {
    super(`no connection within ${ms} ms`);
  }
}

/** What an exchange needs of the connection it is on. */
export interface ExchangeConn {
  destroy(why: Error | undefined): void;
  pauseReading(): void;
  resumeReading(): void;
}

/** An abort listener as an object (the exchange itself): no closure per exchange. */
export interface AbortListener {
  handleEvent(): void;
}

/**
 * What an exchange needs of an abort signal. An AbortSignal has it; so does
 * the router's Attempt, which spares the request path an AbortController
 * and its EventTarget per attempt. An exchange adds one listener and removes it.
 */
export interface AbortLike {
  readonly aborted: boolean;
  readonly reason: unknown;
  addEventListener(type: "abort", listener: AbortListener, options?: { once?: boolean }): void;
  removeEventListener(type: "abort", listener: AbortListener): void;
  /** Told when the request's bytes are written to a connection (the router's Attempt: the upstream has the prompt). */
  requestSent?(): void;
}

/** Sends an exchange again on a new connection (the pool it was sent from). */
export interface Resender {
  resend(ex: Exchange): void;
}

const ONCE = { once: true } as const;

/** `new Promise(takeHead)` leaves the promise's resolve and reject functions here: a promise made with no closure. */
let takenResolve: ((r: UpstreamResponse) => void) | undefined;
let takenReject: ((e: Error) => void) | undefined;
function takeHead(resolve: (r: UpstreamResponse) => void, reject: (e: Error) => void): void {
  takenResolve = resolve;
  takenReject = reject;
}

/**
 * One request and its response on one connection: the head promise, then the
 * body as a queue read by one reader. Methods rather than closures, so an
 * open stream holds a few small objects; the exchange is its own abort listener.
 */
export class Exchange implements UpstreamResponse, ByteReader, AbortListener {
  status = 0;
  ok = false;
  headers: Map<string, string> | undefined;
  readonly body: ByteReader = this;
  /** A response byte has arrived (a reused connection that fails before this is retried). */
  gotBytes = false;
  conn: ExchangeConn | undefined;
  /** Set while the request is on a reused connection for the first time: sends it again on a new one. */
  retry: Resender | undefined;
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
  handleEvent(): void {
    const r: unknown = this.signal.reason;
    const reason = r instanceof Error ? r : new UpstreamConnectionError("aborted");
    if (this.conn) this.conn.destroy(reason);
    else this.fail(reason);
  }

  constructor(
    readonly signal: AbortLike,
    payload: Uint8Array,
    private readonly highWaterMark: number,
    /** How long a connection for this request may take to open (see RequestOptions.connectMs). */
    readonly connectMs: number | undefined,
  ) {
    this.payload = payload;
    this.headPromise = new Promise<UpstreamResponse>(takeHead);
    this.headResolve = takenResolve;
    this.headReject = takenReject;
    takenResolve = takenReject = undefined;
    signal.addEventListener("abort", this, ONCE);
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
    this.signal.removeEventListener("abort", this);
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

  /** Gives up the exchange for `reason`, as an abort does: closes its connection, or fails it while it has none. */
  abandon(reason: Error): void {
    // Not worth sending again: the verdict is about the origin, not this connection.
    this.retry = undefined;
    if (this.conn) this.conn.destroy(reason);
    else this.fail(reason);
  }

  /** The response ended or failed: nothing more will happen to this exchange. */
  get over(): boolean {
    return this.ended || this.failure !== undefined;
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
