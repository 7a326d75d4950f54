/**
 * Calls to the upstream model servers. The parts, in call order:
 *
 *   router.ts         createUpstream: complete()/open(), attempts with failover and backoff
 *   targets.ts        an alias's targets, and the weighted pick among those not tried and not broken
 *   breaker.ts        the per-target circuit breaker (pure, clock passed in)
 *   attempt.ts        one call and one attempt of it: abort controller, first-byte timer, client link
 *   answer.ts         reading a 2xx answer: a whole body, or a stream's first bytes
 *   error-body.ts     reading an upstream error answer and the message in it
 *   probe.ts          the connect timeout for origins not seen alive lately
 *   origin.ts         host and port of a base URL
 *   http1.ts          the HTTP/1.1 client: a keep-alive pool per origin
 *   http1-conn.ts     one connection: request bytes out, response framing in
 *   http1-exchange.ts one request/response: the head promise and the body queue
 *   http1-head.ts     parsing a response head
 */

export type { Completed, Opened } from "./answer.ts";
export { type CallContext, ClientGone } from "./attempt.ts";
export type { ByteReader } from "./http1.ts";
export { createUpstream, type Upstream, type UpstreamDeps, type UpstreamObserver } from "./router.ts";
export { type Target, timeoutsFor } from "./targets.ts";
