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

/** What of Bun's server sets one request's connection timeout (Elysia's `server`; null when not served by Bun). */
export type ConnectionTimer = { timeout(req: Request, seconds: number): void } | null;

const restorers = new WeakMap<Request, () => void>();

/** While the body is read: the read's own timer answers 400 first, so Bun's (4 s steps) waits longer. */
export function timeBodyRead(request: Request, server: ConnectionTimer, idleTimeoutS: number): void {
  if (!server) return;
  server.timeout(request, Math.min(255, idleTimeoutS + 8));
  restorers.set(request, () => server.timeout(request, idleTimeoutS));
}

/** The body is read: no idle limit while the answer is worked out. */
export function liftIdleTimeout(request: Request, server: ConnectionTimer): void {
  server?.timeout(request, 0);
}

/** The answer is complete (or about to be sent whole): the connection waits under idleTimeoutS again. */
export function restoreIdleTimeout(request: Request): void {
  restorers.get(request)?.();
}

/**
 * Runs a route's answer and, unless it is a stream still to be sent (its
 * relay restores the timeout just before it closes), gives the connection its
 * idle timeout back before the answer or the error is written.
 */
export async function restoringIdle<T>(request: Request, work: () => Promise<T>): Promise<T> {
  let reply: T | undefined;
  try {
    reply = await work();
    return reply;
  } finally {
    if (!(reply instanceof Response && reply.status === 200 && reply.body !== null)) restoreIdleTimeout(request);
  }
}
