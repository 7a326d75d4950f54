/**
 * Per-request facts for the access log, kept beside the Request (not in
 * Elysia's context, which error paths do not always carry).
 */
export interface RequestState {
  id: string;
  start: number;
  orgId?: string;
  keyId?: string;
  alias?: string;
  promptTokens?: number;
  completionTokens?: number;
  streamed?: boolean;
  errorCode?: string;
  /**
   * The status a request came to when its handler returned no answer for the
   * client: 499, the client left before one (an unread Response whose status
   * the framework does not copy into `set.status`).
   */
  status?: number;
  /** Refused by the organisation's rate limit (not every rate_limit_error is: auth/guard.ts RateLimited). */
  rateLimited?: boolean;
  /**
   * Set while a streamed answer is still being sent: settles with the status
   * the request came to (200, 499 the client left, 503 the upstream failed),
   * and the access line waits for it.
   */
  ended?: Promise<number>;
  /** The server whose idle timer an inference route lifted, until restoreIdleTimeout gives it back (idle.ts). */
  timer?: { timeout(req: Request, seconds: number): void };
  idleTimeoutS?: number;
}

const states = new WeakMap<Request, RequestState>();

export function beginRequest(request: Request, id: string, start: number): RequestState {
  const s: RequestState = { id, start };
  states.set(request, s);
  return s;
}

export function stateOf(request: Request): RequestState | undefined {
  return states.get(request);
}

const REQUEST_ID = /^[\w.:-]{1,128}$/;
/**
 * What a key or token looks like within a plain id (as loggablePath in app.ts
 * finds them in a URL path): a key `sk-<tag>-…` (ours or another service's),
 * `Bearer:` and its token (a space is no id character already), a JWT.
 */
const KEY_LIKE = /(?<![A-Za-z0-9])sk-|bearer:|eyJ[\w-]*\.[\w-]+/i;

/**
 * Honour a caller's x-request-id when it is short and plain, and not a key or
 * token: the id is written on every log line of the request and sent
 * upstream, and a log never holds a key (operations.md). Otherwise make one.
 */
export function requestIdOf(header: string | null): string {
  return header && REQUEST_ID.test(header) && !KEY_LIKE.test(header) ? header : `req_${crypto.randomUUID().replaceAll("-", "")}`;
}
