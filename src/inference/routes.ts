import { Elysia } from "elysia";
import type { authPlugin } from "../http/auth.ts";
import type { Config } from "../config/schema.ts";
import { stateOf } from "../http/context.ts";
import { answered, type ConnectionTimer, liftIdleTimeout, readInferenceBody, restoreIdleTimeout } from "../http/idle.ts";
import { errorBody, statusOf } from "../http/errors.ts";
import type { Logger } from "../lib/log.ts";
import type { RelayTransform } from "../lib/relay-transform.ts";
import type { Metrics } from "../metrics/registry.ts";
import type { Metering } from "../limits/metering.ts";
import { allowedAliases } from "./aliases.ts";
import type { Principal } from "../auth/types.ts";
import { type CheckedCall, createInferenceService, type Reply, type Served } from "./service.ts";
import { type ConnectProbe, createConnectProbe } from "./upstream/probe.ts";
import { createUpstream } from "./upstream/index.ts";
import { createImageUrlCheck, type HostLookup } from "./image-url.ts";
import { resolvesWithin } from "../lib/within.ts";

export { allowedAliases } from "./aliases.ts";

/** How long the stop waits for calls to settle before its final usage write. */
const STOP_SETTLE_MS = 2_000;

export interface InferenceDeps {
  config: Config;
  metering: Metering;
  log: Logger;
  /** The connect probe for requests on kept-alive connections (tests inject a connector that never connects). */
  probe?: ConnectProbe;
  metrics?: Metrics;
  /** Resolves image URL hosts; the system resolver by default. */
  lookup?: HostLookup;
}

export function createInference(deps: InferenceDeps) {
  const { config, log } = deps;
  const m = deps.metrics;
  const upstream = createUpstream({
    config,
    log,
    probe: deps.probe ?? createConnectProbe(),
    ...(m
      ? {
          observe: {
            attempt(alias, target, outcome, seconds) {
              m.upstreamAttempts.inc({ alias, target, outcome });
              if (seconds !== undefined) m.upstreamFirstByte.record(alias, seconds);
            },
          },
        }
      : {}),
  });
  m?.onScrape(() => {
    for (const b of upstream.breakers()) m.breakerOpen.set({ target: b.target }, b.open ? 1 : 0);
  });
  const service = createInferenceService({
    config,
    metering: deps.metering,
    log,
    upstream,
    imageUrls: createImageUrlCheck(config.upstream.imageUrls ?? {}, deps.lookup),
    wire: { statusOf, errorBody },
    ...(m ? { streams: { inc: () => m.activeStreams.inc(), dec: () => m.activeStreams.dec() } } : {}),
  });
  const created = Math.floor(Date.now() / 1000);

  /**
   * Calls not yet settled (from the call's start, through its wait for quota and the upstream, to the
   * end of its stream): the stop waits for them before its final usage write (`stop`), so no request
   * that settles during the stop is left out of it.
   */
  let unsettled = 0;
  let allSettled: (() => void) | undefined;
  const callSettled = () => {
    if (--unsettled === 0) allSettled?.();
  };


  /**
   * Runs a checked call and writes what it came to into the request's
   * access-log state: the alias first (a refusal on quota or by the upstream
   * is still logged with it), then the tokens, or for a stream, when it ends.
   */
  async function run(call: CheckedCall, request: Request, transform?: RelayTransform): Promise<Reply> {
    const state = stateOf(request);
    // Written field by field: no object literal per request for what the state already holds.
    if (state) {
      state.alias = call.alias;
      state.streamed = call.streamed;
    }
    const signal = request.signal;
    const requestId = state?.id ?? "";
    // Only a stream closes later: its relay gives the idle timeout back just before (non-streams: answered()).
    unsettled++;
    let served: Served;
    try {
      served = await call.run(
        call.streamed ? { signal, requestId, transform, beforeClose: () => restoreIdleTimeout(request) } : transform ? { signal, requestId, transform } : { signal, requestId },
      );
    } catch (e) {
      callSettled();
      throw e;
    }
    // A stream settles when it ends (its `ended` only ever resolves), and its tokens and status are written
    // into the access-log state then: one reaction does both.
    if (served.ended) {
      const ended = served.ended.then((o) => {
        callSettled();
        if (state) Object.assign(state, { promptTokens: o.usage.promptTokens, completionTokens: o.usage.completionTokens }, o.error ? { errorCode: o.error } : {});
        return o.status;
      });
      if (state) state.ended = ended;
    } else callSettled();
    if (served.usage && state) {
      state.promptTokens = served.usage.promptTokens;
      state.completionTokens = served.usage.completionTokens;
    }
    // A client that left before any answer: its unread Response says 499, which the access line and metrics take.
    if (state && !served.ended && typeof served.reply !== "string") state.status = served.reply.status;
    return served.reply;
  }

  /**
   * A POST route's handler (one made per route, none per request): the body
   * read and checked into a call, the call run, and the connection's idle
   * timeout given back once the answer (or the error) is written. A call
   * checked without waiting (no image host to resolve) is not awaited: no
   * promise for it. JSON text gets its content type here; a Response carries its own.
   */
  function inferenceRoute(check: (principal: Principal, body: unknown) => CheckedCall | Promise<CheckedCall>) {
    return async ({ principal, request, server, set }: { principal: Principal; request: Request; server: ConnectionTimer; set: { headers: Record<string, string | number> } }) => {
      let reply: Reply | undefined;
      try {
        const raw = await readInferenceBody(request, server, config);
        liftIdleTimeout(request, server);
        const checked = check(principal, raw);
        reply = await run(checked instanceof Promise ? await checked : checked, request);
        if (typeof reply === "string") set.headers["content-type"] = "application/json";
        return reply;
      } finally {
        answered(request, reply);
      }
    };
  }

  return {
    upstream,
    /**
     * Chat as POST /v1/chat/completions runs it (the checked call, the
     * access-log state), for the Responses API (src/responses/chat-call.ts).
     */
    chat: async (principal: Principal, body: unknown, request: Request, transform?: RelayTransform): Promise<Reply> =>
      run(await service.chat(principal, body), request, transform),
    routes: (auth: ReturnType<typeof authPlugin>) =>
      new Elysia({ name: "inference" })
        .use(auth)
        // Spec 2.2: only the aliases this key may call.
        .get(
          "/v1/models",
          ({ principal }) => ({
            object: "list",
            data: allowedAliases(config, principal).map((id) => ({ id, object: "model", created, owned_by: config.aliases[id]?.ownedBy ?? "gateway" })),
          }),
          { auth: { scope: "inference" } },
        )
        // Bodies are read after authentication (parse: "none"), so an anonymous caller gets 401 before any 400.
        .post(
          "/v1/chat/completions",
          inferenceRoute(service.chat),
          { auth: { scope: "inference" }, parse: "none" },
        )
        .post(
          "/v1/embeddings",
          inferenceRoute(service.embeddings),
          { auth: { scope: "inference" }, parse: "none" },
        ),
    /** Shutdown past the drain limit: open streams end with an error event (service.ts); returns how many. */
    endStreams: (message: string) => service.endStreams(message),
    /** Shutdown past the drain limit: calls still waiting for an upstream's answer end with a 503 (router.ts, endCalls); returns how many. */
    endCalls: (message: string) => upstream.endCalls(message),
    /**
     * After the drain: waits (at most `waitMs`) for every call to settle, so that the final usage write
     * that follows holds them all; the calls the drain ended settle within moments. Then closes idle
     * upstream connections.
     */
    async stop(waitMs = STOP_SETTLE_MS) {
      if (unsettled > 0) {
        const done = await resolvesWithin(
          new Promise<void>((r) => {
            allSettled = r;
          }),
          waitMs,
        );
        allSettled = undefined;
        if (!done) log.warn("requests still unsettled at the final usage write; their usage is not recorded", { requests: unsettled });
      }
      upstream.close();
    },
  };
}
