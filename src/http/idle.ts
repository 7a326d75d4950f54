/**
 * One connection's idle timeout around an inference answer. Bun's idle timer
 * (`idleTimeoutS`) bounds a request body that stops arriving and a kept-alive
 * connection waiting for its next request. While a model thinks, the
 * connection may rightly sit silent for minutes, so the inference routes lift
 * the timer once the body is read (the upstream timeouts bound the answer
 * instead) and give it back once the answer is complete: a JSON answer or an
 * error before it is sent, a stream just before its last bytes. Bun keeps a
 * connection's timeout across its requests and ignores a change made after
 * the response is written, so a timer never given back left a kept-alive
 * connection open for good.
 */

import { readJsonBody } from "./body.ts";
import { stateOf } from "./context.ts";

/** What of Bun's server sets one request's connection timeout (Elysia's `server`; null when not served by Bun). */
export type ConnectionTimer = { timeout(req: Request, seconds: number): void } | null;

/**
 * An inference request's JSON body, read under the connection's idle timeout
 * (a slow-loris body is cut off: the reader's own timer answers 400 first, so
 * Bun's, in 4 s steps, waits longer). Every route that reads one (chat,
 * embeddings, Responses, input_tokens) then lifts it (`liftIdleTimeout`)
 * until the answer is complete (`answered`; a stream's relay calls
 * `restoreIdleTimeout`): not lifted, a model thinking past it has its
 * connection cut. The lifted timer is kept on the request's state: no closure
 * a request, and no async frame of its own (the route awaits the read).
 */
export function readInferenceBody(request: Request, server: ConnectionTimer, limits: { bodyLimitBytes: number; idleTimeoutS: number }): Promise<unknown> {
  const { idleTimeoutS } = limits;
  if (server) {
    server.timeout(request, Math.min(255, idleTimeoutS + 8));
    const state = stateOf(request);
    if (state) {
      state.timer = server;
      state.idleTimeoutS = idleTimeoutS;
    }
  }
  return readJsonBody(request, limits.bodyLimitBytes, "invalid_request_error", idleTimeoutS * 1000);
}

/** The body was read: the connection's idle timer is lifted until the answer is complete. */
export function liftIdleTimeout(request: Request, server: ConnectionTimer): void {
  server?.timeout(request, 0);
}

/** The answer is complete (or about to be sent whole): the connection waits under idleTimeoutS again. Once. */
export function restoreIdleTimeout(request: Request): void {
  const state = stateOf(request);
  if (!state?.timer) return;
  state.timer.timeout(request, state.idleTimeoutS ?? 0);
  state.timer = undefined;
}

/**
 * A route's answer is about to be written: unless it is a stream still to be
 * sent (its relay restores the timeout just before it closes), the
 * connection gets its idle timeout back now. Called from the route's
 * `finally`, so an error answer gets it back too.
 */
export function answered(request: Request, reply: unknown): void {
  if (!(reply instanceof Response && reply.status === 200 && reply.body !== null)) restoreIdleTimeout(request);
}
