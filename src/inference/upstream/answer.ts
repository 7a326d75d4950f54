/**
 * Reading a 2xx answer within an attempt: a non-streamed body whole (bounded
 * in size, never silent for idleMs), or a stream up to its first bytes, then
 * handed to the caller.
 */

import { AnswerTooLarge, type Attempt, AttemptFailed, type Call } from "./attempt.ts";
import type { ByteReader, UpstreamResponse } from "./http1.ts";
import type { Target } from "./targets.ts";

export interface Completed {
  target: Target;
  body: string;
}

/** An upstream stream whose first bytes have arrived; from here on it belongs to the caller. */
export interface Opened {
  target: Target;
  reader: ByteReader;
  first: Uint8Array;
  /** Stops the upstream request (client left, idle timeout); idempotent. */
  abort(reason: string): void;
  /** Reports how the stream ended for the target's breaker; `null` = no verdict (client left). Also drops listeners. */
  finish(ok: boolean | null): void;
  /**
   * The upstream has finished the answer (every choice's finish_reason came):
   * the client leaving no longer aborts the call by itself; the relay decides
   * (stream.ts, `cancel`). Idempotent.
   */
  detach(): void;
}

/**
 * The whole body of a non-streamed answer: read before anything is sent, so
 * a cut-off body still fails over. At most `maxBytes` are read (a larger
 * answer closes the connection and fails over); the body may take as long as
 * it needs while it is never silent for `idleMs`.
 */
export async function readWhole(res: UpstreamResponse, a: Attempt, call: Call<string>): Promise<string> {
  a.clearTimer();
  const { maxBytes } = call;
  const declared = res.header("content-length");
  if (declared !== undefined && Number(declared) > maxBytes) {
    res.body.cancel().catch(() => {});
    throw new AnswerTooLarge(maxBytes);
  }
  // A body already complete (a small answer comes in the head's read) cannot go silent: no timer for it.
  if (!res.over) a.watchBody(call.timeouts.idleMs);
  try {
    const parts: Uint8Array[] = [];
    let n = 0;
    for (;;) {
      const r = await res.body.read();
      if (r.done) break;
      n += r.value.byteLength;
      if (n > maxBytes) {
        res.body.cancel().catch(() => {});
        throw new AnswerTooLarge(maxBytes);
      }
      parts.push(r.value);
      a.touch();
    }
    const only = parts.length === 1 ? parts[0] : undefined;
    // The connection's reads are Buffers (views of the socket's data): decoded as they are, without a
    // view of their ArrayBuffer (which Bun makes on first access) and a Buffer over it.
    if (only && Buffer.isBuffer(only)) return only.toString("utf8");
    return (only ? Buffer.from(only.buffer, only.byteOffset, only.byteLength) : Buffer.concat(parts, n)).toString("utf8");
  } finally {
    a.clearTimer();
  }
}

/**
 * A stream handed over once its first body bytes arrived (still under the
 * first-byte timer). `onFailure` is the router's breaker-and-log for a stream
 * that failed later.
 */
export async function openStream(res: UpstreamResponse, a: Attempt, onFailure: (t: Target, why: string) => void): Promise<Opened> {
  const reader: ByteReader = res.body;
  let first: Uint8Array | undefined;
  try {
    while (first === undefined) {
      const r = await reader.read();
      if (r.done) throw new AttemptFailed("stream ended before any data");
      if (r.value.byteLength > 0) first = r.value;
    }
  } catch (e) {
    reader.cancel().catch(() => {});
    throw e;
  }
  a.clearTimer();
  return new OpenStream(a, reader, first, onFailure);
}

/** Methods rather than closures: an open stream holds a few small objects. */
class OpenStream implements Opened {
  readonly target: Target;
  private finished = false;

  constructor(
    private readonly attempt: Attempt,
    readonly reader: ByteReader,
    readonly first: Uint8Array,
    private readonly onFailure: (t: Target, why: string) => void,
  ) {
    this.target = attempt.target;
  }

  abort(reason: string): void {
    this.attempt.abort(new AttemptFailed(reason));
    this.reader.cancel().catch(() => {});
  }

  detach(): void {
    this.attempt.unlink();
  }

  finish(ok: boolean | null): void {
    if (this.finished) return;
    this.finished = true;
    this.attempt.unlink();
    if (ok === true) this.target.breaker.success();
    else if (ok === false) this.onFailure(this.target, "stream failed");
    else this.target.breaker.release();
  }
}
