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

import { stateOf } from "./context.ts";

/** What of Bun's server sets one request's connection timeout (Elysia's `server`; null when not served by Bun). */
export type ConnectionTimer = { timeout(req: Request, seconds: number): void } | null;

/** While the body is read: the read's own timer answers 400 first, so Bun's (4 s steps) waits longer. */
export function timeBodyRead(request: Request, server: ConnectionTimer, idleTimeoutS: number): void {
  if (!server) return;
  server.timeout(request, Math.min(255, idleTimeoutS + 8));
  // Kept on the request's state (no closure a request): what restoreIdleTimeout gives back.
  const state = stateOf(request);
  if (state) {
    state.timer = server;
    state.idleTimeoutS = idleTimeoutS;
  }
}

/** The body is read: no idle limit while the answer is worked out. */
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
