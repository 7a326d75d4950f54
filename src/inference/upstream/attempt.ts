/**
 * One upstream call (a complete() or an open()) and each attempt it makes
 * against a target. The call is built once and shared by its attempts; an
 * attempt is the abort signal of its request, aborted by the client's signal
 * and by the first-byte timer.
 */

import type { TimeoutsConfig } from "../../config/schema.ts";
import type { AppError } from "../../lib/errors.ts";
import type { AbortLike, AbortListener, UpstreamResponse } from "./http1.ts";
import type { Target } from "./targets.ts";

/**
 * Client went away while we were still trying; there is nobody to answer.
 * `sent`: the attempt in progress had written the request to the upstream
 * (which has the prompt and works on it) and had no refusal from it; false
 * when the client left before (waiting for quota, connecting, between
 * attempts) or after an error status.
 */
export class ClientGone extends Error {
  constructor(readonly sent = false) {
    super();
  }
}

/** Why an attempt was given up (a timeout, an empty stream): worth trying the next target. */
export class AttemptFailed extends Error {}

/** The answer is larger than we read; the message is fit for the client. */
export class AnswerTooLarge extends AttemptFailed {
  constructor(max: number) {
    super(`its answer was larger than ${max} bytes, the gateway's limit`);
  }
}

export interface CallContext {
  /** Aborted when the client disconnects. */
  signal: AbortSignal;
  requestId: string;
}

/** One call to an alias, as every attempt of it needs it. */
export interface Call<T> {
  readonly aliasName: string;
  /** Appended to the target's base path: `/chat/completions`. */
  readonly path: string;
  /** The request body for a target (its model id differs). */
  readonly payloadFor: (t: Target) => string;
  readonly ctx: CallContext;
  readonly stream: boolean;
  readonly timeouts: TimeoutsConfig;
  /** The largest answer read (a non-streamed call). */
  readonly maxBytes: number;
  /**
   * Turns a 2xx response into the call's value (the whole body, or the first
   * stream bytes) while the attempt's timers still apply. One function per
   * kind of call, not one per call.
   */
  readonly read: (res: UpstreamResponse, attempt: Attempt, call: Call<T>) => Promise<T>;
}

/** How one attempt ended. */
export type Outcome<T> =
  | { kind: "ok"; value: T }
  | { kind: "retry"; why: string; status?: number; retryAfter?: number; countsAsFailure: boolean; detail?: string }
  | { kind: "fail"; error: AppError };

/**
 * One attempt against one target, and the abort signal of its request (see
 * AbortLike): aborted by the client leaving and by the first-byte timer
 * (armed here); the client's connect timeout fails its request. A stream it
 * opens keeps it until the stream ends. It holds no reference to the call,
 * so an open stream does not keep the request body alive.
 */
export class Attempt implements AbortLike {
  aborted = false;
  /** The request was written to a connection (requestSent). */
  sent = false;
  reason: unknown = undefined;
  /** The router's list of attempts in flight (`InFlight`), through the attempts themselves. */
  prevInFlight: Attempt | undefined = undefined;
  nextInFlight: Attempt | undefined = undefined;
  /** The exchange's abort listener; an attempt has one exchange at a time. */
  private listener: AbortListener | undefined;
  private timer: ReturnType<typeof setTimeout> | undefined;

  constructor(
    readonly target: Target,
    private readonly client: AbortSignal,
    readonly firstByteMs: number,
  ) {
    // The attempt is its own listener (handleEvent) and the timer's argument: no closures per attempt.
    client.addEventListener("abort", this, ONCE);
    this.timer = setTimeout(firstByteTimeout, firstByteMs, this);
  }

  /** The exchange wrote the request to a connection. */
  requestSent(): void {
    this.sent = true;
  }

  /** The client's signal aborted: the client went away. */
  handleEvent(): void {
    this.abort(new ClientGone());
  }

  addEventListener(_type: "abort", listener: AbortListener): void {
    this.listener = listener;
  }

  removeEventListener(_type: "abort", listener: AbortListener): void {
    if (this.listener === listener) this.listener = undefined;
  }

  /** Gives up the attempt for `reason` (the first call wins), as AbortController.abort does. */
  abort(reason: Error): void {
    if (this.aborted) return;
    this.aborted = true;
    this.reason = reason;
    const l = this.listener;
    this.listener = undefined;
    l?.handleEvent();
  }

  /** Stops the attempt's timer (first byte, or body idle): the answer arrived, or the attempt is over. */
  clearTimer(): void {
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = undefined;
  }

  /** When the body last made progress (performance.now()), while watchBody's timer runs. */
  lastRead = 0;
  /** The body silence allowed, while watchBody's timer runs. */
  idleMs = 0;

  /**
   * The first byte came: from here the body may take as long as it needs
   * while it is never silent for `idleMs` (read() calls `touch`). One timer
   * that re-arms for the remainder when it fires early, not one per read.
   */
  watchBody(idleMs: number): void {
    this.clearTimer();
    this.idleMs = idleMs;
    this.lastRead = performance.now();
    this.timer = setTimeout(bodyIdleCheck, idleMs, this);
  }

  /** The body made progress. */
  touch(): void {
    this.lastRead = performance.now();
  }

  /** watchBody's timer fired: abort if the body has been silent long enough, else wait for the rest. */
  checkBodyIdle(): void {
    const quiet = performance.now() - this.lastRead;
    if (quiet >= this.idleMs) {
      this.timer = undefined;
      this.abort(new AttemptFailed(`response body stalled for ${this.idleMs} ms`));
    } else this.timer = setTimeout(bodyIdleCheck, this.idleMs - quiet, this);
  }

  /** Stops listening to the client's signal: when the attempt ends, or the stream it opened does. */
  unlink(): void {
    this.client.removeEventListener("abort", this);
  }
}

const ONCE = { once: true } as const;

function bodyIdleCheck(a: Attempt): void {
  a.checkBodyIdle();
}

function firstByteTimeout(a: Attempt): void {
  a.abort(new AttemptFailed(`no response within ${a.firstByteMs} ms`));
}

/**
 * The attempts in flight (waiting for an upstream's answer), for the shutdown
 * to end them (router.ts, endCalls): a doubly linked list through the
 * attempts' own fields. A Set's insert and delete per attempt cost ~7 % of a
 * non-streamed request's CPU in `bun run bench:wrk` (paired rounds, this list
 * against the Set: 0.87–1.00, median 0.93; docs/benchmarks.md); linking is a
 * few stores each way.
 */
export class InFlight {
  private head: Attempt | undefined = undefined;
  size = 0;

  add(a: Attempt): void {
    a.prevInFlight = undefined;
    a.nextInFlight = this.head;
    if (this.head) this.head.prevInFlight = a;
    this.head = a;
    this.size++;
  }

  delete(a: Attempt): void {
    if (a.prevInFlight) a.prevInFlight.nextInFlight = a.nextInFlight;
    else if (this.head === a) this.head = a.nextInFlight;
    else return; // not in the list
    if (a.nextInFlight) a.nextInFlight.prevInFlight = a.prevInFlight;
    a.prevInFlight = a.nextInFlight = undefined;
    this.size--;
  }

  /** The attempts now in flight, as a list (ending one unlinks it). */
  toArray(): Attempt[] {
    const out: Attempt[] = [];
    for (let a = this.head; a; a = a.nextInFlight) out.push(a);
    return out;
  }
}
