/**
 * A rewrite of a relayed event stream, applied inside the relay itself (no
 * second stream layer): the Responses API turns the chat relay's events into
 * its own (src/responses/events.ts) on the same write that would have sent
 * them. Per open stream this saves a ReadableStream, its reader and a promise
 * per read (docs/benchmarks.md, phase r).
 */
export interface RelayTransform {
  /** What to send before the first upstream event ("" for nothing). */
  start(): string;
  /**
   * One read's complete SSE events, exactly as the relay would send them -> what to send instead,
   * as text or as bytes ("" for nothing; bytes are never empty).
   */
  events(events: readonly Uint8Array[]): string | Uint8Array;
  /**
   * Why the transform ended the answer itself (it failed it: a chunk it could
   * not read), or undefined. The relay then ends the stream as failed at once,
   * closing the upstream call: nothing more it reads would be sent.
   */
  failed(): string | undefined;
  /** The relay is about to close the response after its last event; the close waits for the promise. */
  finish(): Promise<void> | undefined;
  /**
   * The client went away; `usage`, when given, is what the request is charged, in chat's shape
   * (prompt_tokens, completion_tokens, total_tokens and the checked breakdowns).
   */
  cancel(usage?: Record<string, unknown>): void;
}
