/**
 * Calls to the upstream model servers: target choice, timeouts, failover and
 * circuit breaking. Nothing here knows the request or response format beyond
 * "JSON in, JSON or SSE out"; the service layer owns that.
 *
 * Failover happens only before anything reached the client: on a connection
 * error, a connect or first-byte timeout, a 429/500/502/503/504, or a
 * misconfigured target (401/403/404: wrong key or model id), the next target
 * is tried after a jittered backoff, up to `upstream.attempts` in all. A
 * stream counts as delivered once its first body bytes arrive, so a stream
 * that dies before its first token also fails over.
 */

import type { AliasConfig, Config } from "../../config/schema.ts";
import { AppError } from "../../lib/errors.ts";
import type { Logger } from "../../lib/log.ts";
import { type Completed, type Opened, openStream, readWhole } from "./answer.ts";
import { AnswerTooLarge, Attempt, AttemptFailed, type Call, type CallContext, ClientGone, InFlight, type Outcome } from "./attempt.ts";
import { ERROR_BODY_MS, readErrorBody, retryAfterSeconds, upstreamMessage } from "./error-body.ts";
import { ConnectTimeout, createHttp1Client, type Http1Client, type UpstreamResponse } from "./http1.ts";
import type { ConnectProbe } from "./probe.ts";
import { buildTargets, pickTarget, type Target, timeoutsFor } from "./targets.ts";

/** Observation hooks (metrics); called on the request path, so they must be cheap. */
export interface UpstreamObserver {
  /** One attempt's outcome: ok, http_<status>, timeout, connect_error; `seconds` to response headers when there were any. */
  attempt(alias: string, target: string, outcome: string, seconds: number | undefined): void;
}

export interface UpstreamDeps {
  config: Config;
  log: Logger;
  observe?: UpstreamObserver;
  /** For the client the upstream makes (see Http1ClientOptions.probe); a caller's `http` has its own. */
  probe?: ConnectProbe;
  random?: () => number;
  now?: () => number;
  /** An HTTP client of the caller's (other pool settings); by default the upstream makes its own and closes its idle connections on stop. */
  http?: Http1Client;
}

/**
 * Worth another target. 500 is included: from vLLM it mostly means a dead or
 * wedged engine (a bad request is a 4xx), which another replica does not share.
 */
const RETRY_STATUS = new Set([429, 500, 502, 503, 504]);
/** The target is misconfigured (key, model id, path): another target may work; never the caller's fault. */
const MISCONFIGURED = new Set([401, 403, 404, 405]);
const MAX_BACKOFF_MS = 2_000;
/** No target tried yet: a call's set of tried targets is made at its second attempt (most calls make one). */
const NOTHING_TRIED = new Set<Target>();

/**
 * What every request to one target sends the same, made once: its headers
 * for an answer as JSON and as a stream (the pool writes each object's part
 * of the head once: http1.ts, fixedHeaders), and its paths.
 */
class TargetRequests {
  readonly json: Readonly<Record<string, string>>;
  readonly sse: Readonly<Record<string, string>>;
  private readonly paths = new Map<string, string>();

  constructor(private readonly target: Target) {
    this.json = TargetRequests.headers(target, "application/json");
    this.sse = TargetRequests.headers(target, "text/event-stream");
  }

  /** Allow-list: nothing of the client's request (its key above all) goes upstream; its id goes with each request. */
  private static headers(target: Target, accept: string): Readonly<Record<string, string>> {
    const h: Record<string, string> = {
      "content-type": "application/json",
      accept,
      // No content coding: the client reads bodies as they come (see http1-conn); without this a server may pick one.
      "accept-encoding": "identity",
    };
    if (target.authorization) h.authorization = target.authorization;
    // Frozen: the pool keeps the head it wrote for these only for an object that cannot change (http1.ts, headStart).
    return Object.freeze(h);
  }

  /** The target's base path and a call's path (`/v1` and `/chat/completions`). */
  path(callPath: string): string {
    let full = this.paths.get(callPath);
    if (full === undefined) {
      full = `${this.target.basePath}${callPath}`;
      this.paths.set(callPath, full);
    }
    return full;
  }
}

/**
 * Waits `ms`, or less when the client leaves or the gateway's shutdown ends the calls in flight
 * (`wakers`: endCalls wakes every call between attempts, which then ends with its 503).
 */
function sleep(ms: number, signal: AbortSignal, wakers: Set<() => void>): Promise<void> {
  if (ms <= 0) return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      signal.removeEventListener("abort", done);
      wakers.delete(done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal.addEventListener("abort", done, { once: true });
    wakers.add(done);
  });
}

export function createUpstream(deps: UpstreamDeps) {
  const { config, log } = deps;
  /** Attempts waiting for an upstream's answer (until it is read, or a stream's first bytes are handed over). */
  const live = new InFlight();
  /** Calls waiting between attempts (the backoff): endCalls wakes them, and they end with its error. */
  const between = new Set<() => void>();
  /** Set by endCalls (shutdown): the error every call still in flight ends with. */
  let closing: AppError | undefined;
  const random = deps.random ?? Math.random;
  const now = deps.now ?? Date.now;
  const up = config.upstream;
  const http = deps.http ?? createHttp1Client(deps.probe ? { probe: deps.probe } : {});
  const targets = buildTargets(config, http);
  const requests = new Map<Target, TargetRequests>();
  for (const list of targets.values()) for (const t of list) requests.set(t, new TargetRequests(t));

  function failed(target: Target, why: string): void {
    if (target.breaker.failure(now())) {
      log.warn("upstream target circuit opened", { alias: target.alias, target: target.label, reason: why, cooldown_ms: up.breakerCooldownMs });
    }
  }

  /** Reads a non-2xx answer and decides: retry elsewhere, or a final error for the client. */
  async function judge<T>(res: UpstreamResponse, target: Target, call: Call<T>): Promise<Outcome<T>> {
    const { aliasName } = call;
    const { text, cut } = await readErrorBody(res, up.maxResponseBytes, Math.min(ERROR_BODY_MS, call.timeouts.firstByteMs));
    const status = res.status;
    if (RETRY_STATUS.has(status)) {
      const retryAfter = status === 429 ? retryAfterSeconds(res.header("retry-after") ?? null, now()) : undefined;
      // A 429 is back-pressure from a healthy server, not a fault: it does not trip the breaker.
      return { kind: "retry", why: `status ${status}`, status, ...(retryAfter !== undefined ? { retryAfter } : {}), countsAsFailure: status !== 429 };
    }
    if (MISCONFIGURED.has(status)) {
      log.error("upstream target refused the gateway (check its apiKeyEnv, model id and baseUrl)", {
        alias: aliasName,
        target: target.label,
        status,
        message: upstreamMessage(text, cut).message,
      });
      return { kind: "retry", why: `status ${status}`, status, countsAsFailure: true };
    }
    if (status >= 400 && status < 500) {
      // The request itself is at fault (context length, bad parameter value): the caller's 400, with the upstream's words.
      target.breaker.success();
      const { message, param } = upstreamMessage(text, cut);
      return { kind: "fail", error: new AppError("invalid_request_error", message, param) };
    }
    // Anything else (501, 505, a 3xx): a failure of this target, not one a retry elsewhere is known to fix.
    failed(target, `status ${status}`);
    log.warn("upstream error", { alias: aliasName, target: target.label, status, message: upstreamMessage(text, cut).message });
    return { kind: "fail", error: unavailable(aliasName) };
  }

  function unavailable(aliasName: string, detail?: string): AppError {
    return new AppError("service_unavailable", `The model '${aliasName}' is temporarily unreachable${detail ? ` (${detail})` : ""}; retry with backoff.`);
  }

  /** What a call comes to, made once rather than a `.then` and its closure per request. */
  const completed = (target: Target, body: string): Completed => ({ target, body });
  const opened = (_target: Target, stream: Opened): Opened => stream;

  /** Reads the first bytes of a 2xx stream; one function for every open(), made once. */
  const readFirst = (res: UpstreamResponse, a: Attempt): Promise<Opened> => openStream(res, a, failed);

  /**
   * One attempt of a call against one target: the request, under the
   * attempt's timers, then `call.read` for a 2xx answer or `judge` for any
   * other.
   */
  async function attempt<T>(call: Call<T>, target: Target): Promise<Outcome<T>> {
    const payload = call.payloadFor(target);
    const { ctx, timeouts, aliasName } = call;
    const a = new Attempt(target, ctx.signal, timeouts.firstByteMs);
    live.add(a);
    target.breaker.acquire(now());
    let headed = false;
    /** The upstream answered with an error status: it did no work for this request. */
    let refused = false;
    let handedOver = false;
    const sentAt = performance.now();
    const fixed = requests.get(target) as TargetRequests;
    try {
      // The connect timeout is the client's: it owns the connection.
      const res = await target.endpoint.request({
        method: "POST",
        path: fixed.path(call.path),
        body: payload,
        fixedHeaders: call.stream ? fixed.sse : fixed.json,
        headers: { "x-request-id": ctx.requestId },
        signal: a,
        connectMs: timeouts.connectMs,
      });
      headed = true;
      deps.observe?.attempt(aliasName, target.label, res.ok ? "ok" : `http_${res.status}`, (performance.now() - sentAt) / 1000);
      if (res.status < 200 || res.status > 299) {
        refused = true;
        a.clearTimer();
        return await judge<T>(res, target, call);
      }
      const value = await call.read(res, a, call);
      handedOver = true;
      return { kind: "ok", value };
    } catch (e) {
      const reason: unknown = a.aborted ? a.reason : e;
      if (reason instanceof ClientGone || ctx.signal.aborted) {
        target.breaker.release();
        throw new ClientGone(a.sent && !refused);
      }
      // Ended by the gateway's shutdown (endCalls): no verdict on the target.
      if (reason === closing) {
        target.breaker.release();
        throw closing;
      }
      const timedOut = reason instanceof AttemptFailed || reason instanceof ConnectTimeout;
      const why = timedOut ? reason.message : `connection error: ${reason instanceof Error ? reason.message : String(reason)}`;
      if (!headed) deps.observe?.attempt(aliasName, target.label, timedOut ? "timeout" : "connect_error", undefined);
      return { kind: "retry", why, countsAsFailure: true, ...(reason instanceof AnswerTooLarge ? { detail: reason.message } : {}) };
    } finally {
      live.delete(a);
      a.clearTimer();
      if (!handedOver) a.unlink();
    }
  }

  /**
   * Runs attempts until one succeeds, a final error comes back, or attempts
   * run out: then 429 when every failure was upstream back-pressure, else 503.
   */
  async function run<T, R>(call: Call<T>, result: (target: Target, value: T) => R): Promise<R> {
    const { aliasName, ctx } = call;
    const list = targets.get(aliasName) ?? [];
    let tried: Set<Target> | undefined;
    let previous: Target | undefined;
    let only429 = true;
    let made = 0;
    let retryAfter: number | undefined;
    /** What the client may be told about the last attempt's failure. */
    let detail: string | undefined;
    for (let i = 0; i < up.attempts; i++) {
      if (i > 0) {
        const delay = Math.min(MAX_BACKOFF_MS, up.backoffMs * 2 ** (i - 1)) * (0.5 + random());
        if (!closing) await sleep(delay, ctx.signal, between);
      }
      if (ctx.signal.aborted) throw new ClientGone();
      if (closing) throw closing;
      if (previous) {
        tried ??= new Set();
        tried.add(previous);
      }
      const target = pickTarget(list, tried ?? NOTHING_TRIED, now(), random);
      if (!target) break;
      previous = target;
      made++;
      const r = await attempt(call, target);
      if (r.kind === "ok") {
        target.breaker.success();
        return result(target, r.value);
      }
      if (r.kind === "fail") throw r.error;
      detail = r.detail;
      if (r.countsAsFailure) failed(target, r.why);
      else target.breaker.release();
      if (r.status === 429) {
        if (r.retryAfter !== undefined) retryAfter = Math.min(retryAfter ?? r.retryAfter, r.retryAfter);
      } else only429 = false;
      log.debug("upstream attempt failed", { alias: aliasName, target: target.label, attempt: i + 1, reason: r.why, request_id: ctx.requestId });
    }
    if (only429 && made > 0) {
      const wait = Math.max(1, retryAfter ?? 1);
      throw new AppError(
        "rate_limit_error",
        `The model '${aliasName}' is overloaded at the moment; retry after ${wait} s.`,
        null,
        { "retry-after": String(wait) },
      );
    }
    throw unavailable(aliasName, detail);
  }

  /** A non-streamed call: the whole body, at most `maxBytes` of it (see readWhole). */
  function complete(
    aliasName: string,
    alias: AliasConfig,
    path: string,
    payloadFor: (t: Target) => string,
    ctx: CallContext,
    maxBytes = up.maxResponseBytes,
  ) {
    const call: Call<string> = { aliasName, path, payloadFor, ctx, stream: false, timeouts: timeoutsFor(config, alias), maxBytes, read: readWhole };
    return run(call, completed);
  }

  /** A streamed call, handed over once the first body bytes arrived (still under the first-byte timer). */
  function open(aliasName: string, alias: AliasConfig, path: string, payloadFor: (t: Target) => string, ctx: CallContext) {
    const call: Call<Opened> = {
      aliasName,
      path,
      payloadFor,
      ctx,
      stream: true,
      timeouts: timeoutsFor(config, alias),
      maxBytes: up.maxResponseBytes,
      read: readFirst,
    };
    return run(call, opened);
  }

  /** Each target's breaker, for the metrics scrape (not the request path). */
  function breakers(): { target: string; open: boolean }[] {
    const t = now();
    const out: { target: string; open: boolean }[] = [];
    for (const list of targets.values()) for (const x of list) out.push({ target: x.label, open: x.breaker.state(t) === "open" });
    return out;
  }

  /**
   * Shutdown past the drain limit: every call still waiting for an upstream's answer (a JSON answer,
   * or a stream's first bytes, or the backoff before its next attempt) ends now with `message` as a 503
   * service_unavailable, as an open stream ends with its error event, and none starts another attempt.
   * Returns how many were ended.
   */
  function endCalls(message: string): number {
    closing ??= new AppError("service_unavailable", message);
    const n = live.size + between.size;
    for (const a of live.toArray()) a.abort(closing);
    for (const wake of [...between]) wake();
    return n;
  }

  /** Closes idle upstream connections (streams still open keep theirs until they end). */
  function close(): void {
    if (!deps.http) http.close();
  }

  return { complete, open, breakers, close, endCalls };
}

export type Upstream = ReturnType<typeof createUpstream>;
