import type { Principal, RequestMeta } from "../auth/types.ts";
import type { AliasConfig, Config } from "../config/schema.ts";
import { AppError, type ErrorCode } from "../lib/errors.ts";
import type { Logger } from "../lib/log.ts";
import type { Metering, RequestOutcome, Ticket, UsageReport } from "../limits/metering.ts";
import { resolveAlias } from "./aliases.ts";
import { type ChatBody, type EmbeddingsBody, firstImage, parseChatBody, parseEmbeddingsBody } from "./model.ts";
import type { ImageUrlCheck } from "./image-url.ts";
import { type EndableStream, type RelayOptions, relayStream, type StreamEnd, streamCharge } from "./stream.ts";
import { countTextAfterReport, type ReportedText, sseAsCompletion } from "./whole-answer.ts";
import { shapeCompletion } from "./completion.ts";
import { upstreamMessage } from "./upstream/error-body.ts";
import type { RelayTransform } from "../lib/relay-transform.ts";
import { type Counted, type UsageBounds, countUsage, usageDetails } from "./usage.ts";
import { embeddingData, embeddingInputs } from "./embedding-answer.ts";
import {
  DEFAULT_IMAGE_TOKENS,
  choiceCount,
  completionLimit,
  deliveredTokens,
  embeddingTokenBound,
  estimateEmbeddingTokens,
  estimatePromptTokens,
  promptTokenBound,
} from "./tokens.ts";
import { ClientGone, type Opened, type Target, type Upstream, timeoutsFor } from "./upstream/index.ts";
import { isRecord } from "../lib/guards.ts";
import { firstSeen } from "../lib/once.ts";

/**
 * Chat completions and embeddings: validate, resolve the alias, admit against
 * the quota, call the upstream, shape the answer, settle the quota exactly
 * once with what was delivered. The service never sees the HTTP request:
 * a route hands over the parsed body, then runs the call with the request's
 * signal and id (RequestMeta), and writes what the call reports (alias,
 * streamed, usage, a stream's end) into the request's access-log state.
 */

/** The HTTP layer's word on errors (src/http/errors.ts), handed in by the routes so that no service imports HTTP. */
export interface WireErrors {
  statusOf(code: ErrorCode): number;
  errorBody(code: ErrorCode, message: string): unknown;
}

export interface ServiceDeps {
  config: Config;
  metering: Metering;
  log: Logger;
  upstream: Upstream;
  /** Refuses image URLs that name internal hosts (image-url.ts). */
  imageUrls: ImageUrlCheck;
  /** Streams in progress (a metrics gauge). */
  streams?: { inc(): void; dec(): void };
  wire: WireErrors;
}

/**
 * What a call answers: a JSON document as text, or a Response (a stream, or
 * the unread answer to a client that left). JSON goes back as text because
 * Elysia rebuilds every returned Response around its body stream to merge its
 * headers, which turns a plain buffer into a stream for Bun to send (~9 µs a
 * request, measured); for text it builds one Response with its own headers.
 */
export type Reply = string | Response;

/** How a stream ended: the status it came to (200; 499 the client left; 503 the upstream failed or shutdown cut it) and the tokens counted. */
export interface StreamOutcome {
  status: number;
  usage: UsageReport;
  /** The error the stream ended with, for the access log. */
  error?: ErrorCode;
}

/** What a call came to. */
export interface Served {
  reply: Reply;
  /** The tokens counted for an answer sent whole, or charged to a client that left; absent for a stream. */
  usage?: UsageReport;
  /** A stream: settles when it ends. */
  ended?: Promise<StreamOutcome>;
}

/**
 * A request checked against its alias (body valid, alias allowed to this key,
 * capabilities and context window respected), not yet admitted against the
 * quota or sent: the route learns the alias before anything can fail on
 * quota or upstream, so the access line of such a failure still names it.
 */
export interface CheckedCall {
  alias: string;
  streamed: boolean;
  run(meta: RequestMeta): Promise<Served>;
}

const SSE_HEADERS = {
  "content-type": "text/event-stream; charset=utf-8",
  "cache-control": "no-cache",
  // Proxies (nginx) must not buffer the stream.
  "x-accel-buffering": "no",
};
const NO_USAGE: UsageReport = { promptTokens: 0, completionTokens: 0 };

/** `new Promise(takeResolve)` leaves the promise's resolve function in `taken`: a promise made with no closure. */
let taken: (o: StreamOutcome) => void = () => {};
function takeResolve(resolve: (o: StreamOutcome) => void): void {
  taken = resolve;
}


const BOUND_PARAMS = ["max_tokens", "max_completion_tokens"] as const;

/** Alias-dependent rules: capabilities (images, tools) and the context window. */
export function checkChatAgainstAlias(body: ChatBody, name: string, alias: AliasConfig): void {
  const image = alias.capabilities.includes("images") ? undefined : firstImage(body.messages);
  if (image) throw new AppError("invalid_request_error", `The model '${name}' does not accept image input.`, image);
  if (!alias.capabilities.includes("tools") && body.tools && body.tools.length > 0) {
    throw new AppError("invalid_request_error", `The model '${name}' does not support tools.`, "tools");
  }
  const window = alias.contextWindow;
  if (window !== undefined) {
    for (let i = 0; i < BOUND_PARAMS.length; i++) {
      const param = BOUND_PARAMS[i] as (typeof BOUND_PARAMS)[number];
      const v = body[param];
      if (typeof v === "number" && v > window) {
        throw new AppError(
          "invalid_request_error",
          `'${param}' is ${v}, more than the context window of '${name}' (${window} tokens).`,
          param,
        );
      }
    }
  }
}

/**
 * The most an embedding answer may take: the configured cap, or what the
 * inputs need (a JSON float is at most ~24 bytes), so a full batch of 2,048
 * inputs is never refused for its size.
 */
function embeddingAnswerLimit(body: EmbeddingsBody, aliasDimensions: number | undefined, configured: number): number {
  const inputs = embeddingInputs(body.input);
  return Math.max(configured, inputs * (body.dimensions ?? aliasDimensions ?? 4096) * 24 + 64 * 1024);
}

function parseJson(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return undefined;
  }
}

export function createInferenceService(deps: ServiceDeps) {
  const { config, metering, log, upstream } = deps;
  /** Streams being relayed, so shutdown can end them cleanly (`endStreams`). */
  const open = new Set<EndableStream>();

  function outcome(alias: string, target: Target | undefined, status: number, start: number, streamed: boolean): RequestOutcome {
    return { alias, target: target?.label ?? "", status, latencyMs: performance.now() - start, streamed };
  }

  /**
   * Settles a failed call with nothing delivered and turns "client gone" into a response nobody reads.
   * A client that left once the request was sent upstream (the upstream had the prompt and worked on
   * it) is charged `promptEstimate`, as a stream it leaves before any text is (streamCharge); one that
   * left before (waiting for quota, connecting, between attempts) or after a refusal, nothing.
   */
  function settleFailure(ticket: Ticket, alias: string, start: number, streamed: boolean, e: unknown, promptEstimate = 0): Served {
    if (e instanceof ClientGone) {
      const usage = e.sent ? { promptTokens: promptEstimate, completionTokens: 0 } : NO_USAGE;
      metering.settle(ticket, usage, outcome(alias, undefined, 499, start, streamed));
      return { reply: new Response(null, { status: 499 }), usage };
    }
    metering.settle(ticket, NO_USAGE, outcome(alias, undefined, e instanceof AppError ? deps.wire.statusOf(e.code) : 500, start, streamed));
    throw e;
  }

  function badUpstreamAnswer(name: string, target: Target): AppError {
    log.warn("upstream sent an unreadable answer", { alias: name, target: target.label });
    return new AppError("service_unavailable", `The model '${name}' sent an unreadable answer; retry with backoff.`);
  }

  /**
   * An error thrown while reading a 2xx answer (`target` set: the upstream
   * answered): JSON.parse reads nesting of any depth, but serialising such an
   * answer again (JSON.stringify recurses) overflows the stack, a RangeError.
   * That answer is unreadable like any other; anything else is passed on.
   * Runs only on the error path.
   */
  function unreadable(e: unknown, name: string, target: Target | undefined): unknown {
    return target && e instanceof RangeError ? badUpstreamAnswer(name, target) : e;
  }

  const overBoundSeen = firstSeen(1_000);
  /**
   * The upstream counted more prompt tokens than the request reserved: charged in full (its count is
   * within the context window), but the quota could be passed by the difference. Only an image above the
   * alias's imageTokens (or a template beyond the bound's allowances) does that: said once per alias.
   */
  function promptOverReserve(name: string, promptTokens: number, reserved: number | undefined, requestId: string): void {
    if (reserved === undefined || promptTokens <= reserved || !overBoundSeen(name)) return;
    log.warn("upstream counted a prompt above what was reserved for it; raise the alias's imageTokens if it sends images", {
      alias: name,
      prompt_tokens: promptTokens,
      reserved_prompt_tokens: reserved,
      request_id: requestId,
    });
  }

  /** An upstream reported token counts no model produces: its figures were replaced by our estimate. */
  function implausibleUsage(name: string, target: Target, rejected: Record<string, string | undefined>, requestId: string): void {
    log.warn("upstream sent implausible usage; counted the gateway's estimate instead", { alias: name, target: target.label, ...rejected, request_id: requestId });
  }

  /**
   * The warnings a checked usage calls for. `reservedCap`: the prompt's reservation when it was the prompt
   * count's bound (under a quota, on an alias without a context window); a count above it is what an image
   * above imageTokens makes as well as a made-up one, so it is said once per alias (promptOverReserve), with
   * the upstream's figure, not at every request.
   */
  function checkedUsage(name: string, target: Target, counted: Counted, reservedCap: number | undefined, requestId: string): void {
    let rejected = counted.rejected;
    if (rejected && reservedCap !== undefined && counted.promptOver !== undefined) {
      promptOverReserve(name, counted.promptOver, reservedCap, requestId);
      const { prompt_tokens: _, ...rest } = rejected;
      rejected = rest.completion_tokens === undefined ? undefined : rest;
    }
    if (rejected) implausibleUsage(name, target, rejected, requestId);
  }

  /**
   * A chat body checked into a call (CheckedCall); throws AppError for a body refused. Not async: the
   * call is returned as it is unless an image URL names a host to resolve (then a promise of it).
   */
  function chat(principal: Principal, raw: unknown): CheckedCall | Promise<CheckedCall> {
    const start = performance.now();
    const body = parseChatBody(raw);
    const name = body.model;
    const alias = resolveAlias(config, name, principal, "chat");
    checkChatAgainstAlias(body, name, alias);
    const call = new ChatCall(principal, body, alias, start);
    // Synchronous (and allocation-free) unless an image URL names a host to resolve.
    const resolving = deps.imageUrls(body.messages);
    return resolving ? resolving.then(() => call) : call;
  }

  /** A checked chat request (CheckedCall) whose run is a method: one object a request, not a closure and its scope. */
  class ChatCall implements CheckedCall {
    readonly alias: string;
    readonly streamed: boolean;

    constructor(
      private readonly principal: Principal,
      private readonly body: ChatBody,
      private readonly aliasConfig: AliasConfig,
      private readonly start: number,
    ) {
      this.alias = body.model;
      this.streamed = body.stream === true;
    }

    run(meta: RequestMeta): Promise<Served> {
      return runChat(this.principal, this.body, this.aliasConfig, meta, this.start);
    }
  }

  async function runChat(principal: Principal, body: ChatBody, alias: AliasConfig, ctx: RequestMeta, start: number): Promise<Served> {
    const name = body.model;
    const streamed = body.stream === true;
    const promptEstimate = estimatePromptTokens(body);
    const limit = completionLimit(body);
    // max_tokens bounds each choice: with `n` the upstream may generate n
    // times it (the prompt is counted once), so every choice is reserved.
    const choices = choiceCount(body);
    // The default bound leaves the prompt its room in the context window: vLLM
    // refuses a request whose prompt plus max_tokens exceeds it.
    const room = alias.contextWindow === undefined ? Number.POSITIVE_INFINITY : alias.contextWindow - promptEstimate;
    // The prompt is reserved at the most it can be (its bytes, the template's allowances, each image at the
    // alias's imageTokens, at most the context window), never at the estimate: a prompt that tokenizes
    // denser than the estimate (CJK text, code, images) would overshoot the quota by the difference.
    // Without a quota nothing is reserved: the bound (a pass over the whole body) is not computed. Metered
    // by the organisation's newest quota, not the principal's: its key may have been checked before a change.
    const metered = metering.quotaOf(principal) !== null;
    const promptReserve = metered ? Math.max(promptEstimate, promptTokenBound(body, alias.imageTokens ?? DEFAULT_IMAGE_TOKENS, alias.contextWindow)) : promptEstimate;
    const reservation = promptReserve + choices * (limit ?? Math.max(1, Math.min(config.quota.defaultMaxTokens, room)));
    // A caller who set a bound gets it or a refusal. Without one the request
    // can run with less: down to one completion token per choice. Either way,
    // under a quota no request goes upstream unbounded: max_tokens becomes
    // each choice's share of what the quota granted beyond the prompt, so the
    // answer stays within its reservation and the quota cannot be overshot by
    // a completion.
    const least = limit === undefined ? promptReserve + choices : undefined;
    let ticket = metering.admitNow(principal, reservation, least);
    if (ticket === undefined) {
      // Waited for quota: a client that left meanwhile gave up its place and reserved nothing (metering.ts, admit).
      ticket = await metering.admit(principal, reservation, least, ctx.signal);
      if (ctx.signal.aborted) return settleFailure(ticket, name, start, streamed, new ClientGone());
    }
    if (limit === undefined && metered) body.max_tokens = Math.floor((ticket.reserved - promptReserve) / choices);
    // The reserved bound is max_completion_tokens when set (as vLLM and OpenAI take it); a server
    // that knows only max_tokens, or takes it first, gets the same bound there.
    else if (metered && body.max_completion_tokens != null) body.max_tokens = body.max_completion_tokens;

    // What the upstream may generate at most: n × the larger of the bounds it was sent (a server may take
    // either); and no prompt is longer than the context window. A count above its bound is capped (usage.ts),
    // so no upstream figure overshoots the reservation by more than the prompt can. Without a window, under a
    // quota, the prompt's reservation is its bound: nothing else would bound a count (10^9 claimed for "hi"
    // was charged against a quota of 100,000).
    const told = Math.max(body.max_tokens ?? 0, body.max_completion_tokens ?? 0);
    const reservedCap = alias.contextWindow === undefined && metered ? promptReserve : undefined;
    const bounds: UsageBounds = {
      promptTokens: alias.contextWindow ?? reservedCap ?? Number.POSITIVE_INFINITY,
      completionTokens: told > 0 ? choices * told : Number.POSITIVE_INFINITY,
    };

    // The client's stream_options are kept; include_usage is forced on so every stream can be metered.
    const clientWantsUsage = body.stream_options?.include_usage === true;
    if (streamed) body.stream_options = { ...(body.stream_options ?? {}), include_usage: true };
    const payloadFor = (t: Target) => {
      body.model = t.cfg.model;
      return JSON.stringify(body);
    };

    if (!streamed) {
      let target: Target | undefined;
      try {
        const res = await upstream.complete(name, alias, "/chat/completions", payloadFor, ctx);
        target = res.target;
        let parsed = parseJson(res.body);
        /** Text around the last usage report of an answer sent as SSE: the report does not count what followed it. */
        const reported: ReportedText = { before: 0, after: 0, events: 0, eventsAfter: 0 };
        if (parsed === undefined) {
          // A server that streams what it was asked for whole (whole-answer.ts).
          const assembled = sseAsCompletion(res.body, reported);
          if (assembled && "error" in assembled && typeof assembled.error === "string") {
            throw new AppError("service_unavailable", `The model '${name}' failed while generating: ${upstreamMessage(assembled.error).message}`);
          }
          parsed = assembled;
        }
        const shaped = shapeCompletion(parsed, name);
        if (!shaped) throw badUpstreamAnswer(name, res.target);
        const rawUsage = isRecord(parsed) && isRecord(parsed.usage) ? parsed.usage : undefined;
        // Text after the report is added to its count once the report is checked, as a stream's is: a
        // warning names only what the upstream sent, never a sum the gateway made.
        const counted =
          rawUsage && reported.after > 0
            ? countTextAfterReport(rawUsage, promptEstimate, reported, bounds)
            : // An answer sent as SSE: each event of text at least one token, as a stream's (tokens.ts, deliveredTokens).
              countUsage(rawUsage, { promptTokens: promptEstimate, completionTokens: deliveredTokens(shaped.completionBytes, reported.events) }, bounds);
        checkedUsage(name, res.target, counted, reservedCap, ctx.requestId);
        const { promptTokens, completionTokens } = counted;
        promptOverReserve(name, promptTokens, metered ? promptReserve : undefined, ctx.requestId);
        // The counts charged, and the upstream's breakdowns of them (cached, reasoning tokens…), checked, as a stream passes them on.
        shaped.out.usage = { prompt_tokens: promptTokens, completion_tokens: completionTokens, total_tokens: promptTokens + completionTokens, ...usageDetails(rawUsage, promptTokens, completionTokens) };
        // Serialised before settling: an answer that cannot be is a failure, settled once as one.
        const reply = JSON.stringify(shaped.out);
        // One report for the quota (which only reads it) and for the route's access-log state.
        const usage: UsageReport = { promptTokens, completionTokens };
        metering.settle(ticket, usage, outcome(name, target, 200, start, false));
        return { reply, usage };
      } catch (e) {
        return settleFailure(ticket, name, start, false, unreadable(e, name, target), promptEstimate);
      }
    }

    let opened: Opened;
    try {
      opened = await upstream.open(name, alias, "/chat/completions", payloadFor, ctx);
    } catch (e) {
      return settleFailure(ticket, name, start, true, e, promptEstimate);
    }
    // A bound was sent: an upstream that streams past it is cut there (stream.ts).
    const generation = told > 0 ? { maxTokens: told, choices } : undefined;
    const idleMs = timeoutsFor(config, alias).idleMs;
    return relay(opened, new StreamCall(name, opened.target, ctx, ticket, start, clientWantsUsage, promptEstimate, metered ? promptReserve : undefined, reservedCap, bounds, generation, choices, idleMs));
  }

  /**
   * A streamed answer's options for the relay and what its end settles
   * (RelayOptions): one object per stream, whose methods every stream shares
   * (the class is made once per service), where an options object, two
   * closures and the spreads that built it were made per stream before. It
   * holds no request body: a closure made inside `runChat` would keep the
   * parsed messages (large prompts, base64 images) for the stream's whole life.
   */
  class StreamCall implements RelayOptions {
    readonly signal: AbortSignal;
    private readonly requestId: string;
    readonly transform: RelayTransform | undefined;
    readonly beforeClose: (() => void) | undefined;
    /**
     * A transform holds the whole answer (the Responses API: its final event and the store), so the answer
     * is bounded as a non-streamed one is; a plain chat stream holds none of it.
     */
    readonly maxTextBytes: number | undefined;
    /** Settles when the stream ends (`onEnd`). */
    readonly ended: Promise<StreamOutcome>;
    private readonly settled: (o: StreamOutcome) => void;

    constructor(
      /** The alias the client named. */
      readonly alias: string,
      private readonly target: Target,
      ctx: RequestMeta,
      private readonly ticket: Ticket,
      private readonly start: number,
      readonly clientWantsUsage: boolean,
      readonly promptEstimate: number,
      /** The prompt tokens the quota reserved (its bound); undefined without a quota. */
      private readonly promptReserve: number | undefined,
      /** promptReserve when it is also the prompt count's bound (no context window); see checkedUsage. */
      private readonly reservedCap: number | undefined,
      readonly bounds: UsageBounds,
      readonly generation: { maxTokens: number; choices: number } | undefined,
      /** `n`: the relay tells when every choice has finished. */
      readonly choices: number,
      readonly idleMs: number,
    ) {
      this.signal = ctx.signal;
      this.requestId = ctx.requestId;
      this.transform = ctx.transform;
      this.beforeClose = ctx.beforeClose;
      this.maxTextBytes = ctx.transform ? config.upstream.maxResponseBytes : undefined;
      this.ended = new Promise(takeResolve);
      this.settled = taken;
    }

    get open(): Set<EndableStream> {
      return open;
    }

    errorBody(code: ErrorCode, message: string): unknown {
      return deps.wire.errorBody(code, message);
    }

    onImplausibleUsage(counted: Counted): void {
      checkedUsage(this.alias, this.target, counted, this.reservedCap, this.requestId);
    }

    onEnd(end: StreamEnd): void {
      const name = this.alias;
      deps.streams?.dec();
      // The upstream's count, else an estimate from what the client received, within the bound sent; nothing
      // for a failure before any text (stream.ts, streamCharge: a stored Response the client left says the same).
      const usage = streamCharge(end, this.promptEstimate, this.bounds.completionTokens);
      promptOverReserve(name, usage.promptTokens, this.promptReserve, this.requestId);
      // "ended" (cut at shutdown) is a 503 like an upstream failure: the client got the same error event.
      // "bound" (ended at the bound the upstream ignored) ended as a complete answer does.
      const status = end.outcome === "done" || end.outcome === "bound" ? 200 : end.outcome === "client_gone" ? 499 : 503;
      if (end.outcome === "bound") {
        log.warn("upstream streamed past max_tokens; the answer was ended at the bound", { alias: name, target: this.target.label, max_tokens: this.generation?.maxTokens, request_id: this.requestId });
      }
      metering.settle(this.ticket, usage, outcome(name, this.target, status, this.start, true));
      if (end.outcome === "failed") log.warn("upstream stream failed", { alias: name, target: this.target.label, reason: end.reason, request_id: this.requestId });
      this.settled(status === 503 ? { status, usage, error: "service_unavailable" } : { status, usage });
    }
  }

  /** The streamed answer: the relay's stream as the response, and when it ends. */
  function relay(opened: Opened, call: StreamCall): Served {
    deps.streams?.inc();
    return { reply: new Response(relayStream(opened, call), { headers: SSE_HEADERS }), ended: call.ended };
  }

  async function embeddings(principal: Principal, raw: unknown): Promise<CheckedCall> {
    const start = performance.now();
    const body: EmbeddingsBody = parseEmbeddingsBody(raw);
    const name = body.model;
    const alias = resolveAlias(config, name, principal, "embedding");
    if (alias.dimensions !== undefined && body.dimensions !== undefined && body.dimensions > alias.dimensions) {
      throw new AppError(
        "invalid_request_error",
        `'dimensions' is ${body.dimensions}; the model '${name}' produces at most ${alias.dimensions}.`,
        "dimensions",
      );
    }
    return { alias: name, streamed: false, run: (meta) => runEmbeddings(principal, body, alias, meta, start) };
  }

  async function runEmbeddings(principal: Principal, body: EmbeddingsBody, alias: AliasConfig, ctx: RequestMeta, start: number): Promise<Served> {
    const name = body.model;
    const estimate = estimateEmbeddingTokens(body);
    // Reserved at the most the inputs can be (as chat's prompt), so no request overshoots the quota.
    const bound = embeddingTokenBound(body);
    let ticket = metering.admitNow(principal, bound);
    if (ticket === undefined) {
      // As chat's: a client that left while it waited for quota ends here (499, nothing charged).
      ticket = await metering.admit(principal, bound, undefined, ctx.signal);
      if (ctx.signal.aborted) return settleFailure(ticket, name, start, false, new ClientGone());
    }
    const payloadFor = (t: Target) => {
      body.model = t.cfg.model;
      return JSON.stringify(body);
    };
    let target: Target | undefined;
    try {
      const res = await upstream.complete(name, alias, "/embeddings", payloadFor, ctx, embeddingAnswerLimit(body, alias.dimensions, config.upstream.maxResponseBytes));
      target = res.target;
      const parsed = parseJson(res.body);
      if (!isRecord(parsed) || !Array.isArray(parsed.data)) throw badUpstreamAnswer(name, res.target);
      // One vector of numbers per input, in index order, in the encoding asked (embedding-answer.ts); else unreadable.
      const data = embeddingData(parsed.data, body);
      if (!data) throw badUpstreamAnswer(name, res.target);
      const counted = countUsage(
        isRecord(parsed.usage) ? parsed.usage : undefined,
        { promptTokens: estimate, completionTokens: 0 },
        { promptTokens: bound, completionTokens: Number.POSITIVE_INFINITY },
      );
      if (counted.rejected) implausibleUsage(name, res.target, { prompt_tokens: counted.rejected.prompt_tokens }, ctx.requestId);
      const promptTokens = counted.promptTokens;
      // Spec 2.4. Serialised before settling, as chat's.
      const reply = JSON.stringify({ object: "list", data, model: name, usage: { prompt_tokens: promptTokens, total_tokens: promptTokens } });
      metering.settle(ticket, { promptTokens, completionTokens: 0 }, outcome(name, res.target, 200, start, false));
      return { reply, usage: { promptTokens, completionTokens: 0 } };
    } catch (e) {
      return settleFailure(ticket, name, start, false, unreadable(e, name, target), estimate);
    }
  }

  /**
   * Ends every open stream with an error event and a clean close, the way a
   * mid-stream upstream failure ends (usage of what was delivered is settled);
   * returns how many there were.
   */
  function endStreams(message: string): number {
    const n = open.size;
    for (const s of [...open]) s.endStream(message);
    return n;
  }

  return { chat, embeddings, endStreams };
}
