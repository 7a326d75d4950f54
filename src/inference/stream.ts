import type { ErrorCode } from "../lib/errors.ts";
import type { RelayTransform } from "../lib/relay-transform.ts";
import type { DirectUnderlyingSource } from "bun";
import { type EventSink, SseFramer } from "../lib/sse.ts";
import type { Opened } from "./upstream/index.ts";
import { upstreamMessage } from "./upstream/error-body.ts";
import { isRecord } from "../lib/guards.ts";
import {
  blankLineOf,
  CRLF2,
  carriesChoices,
  carriesUsage,
  choiceIndexOf,
  chunkIdOf,
  type DeltaScan,
  dataAt,
  deltaTextBytes,
  finishes,
  isDone,
  isErrorEvent,
  isPlainData,
  LF2,
  plainDataEvent,
  renumberedChoicesEvent,
  type SwapFields,
  swapFields,
  textArgumentsEvent,
  withAlias,
  withWholeLineEnd,
} from "./chunk-bytes.ts";
import { deliveredTokens } from "./tokens.ts";
import { type Counted, type UsageBounds, type UsageDetails, countUsage, detailsAsSent, usageDetails } from "./usage.ts";
import { wholeAnswer } from "./whole-answer.ts";

/**
 * SSE passthrough: the upstream's bytes go to the client event by event, with
 * no JSON parse or re-serialisation of ordinary chunks (what an event's bytes
 * say is read in chunk-bytes.ts; this module is the relay). Per event we only
 *  - swap the model the upstream names, whatever it is, for the alias (a byte
 *    search for the `"model"` key and its colon, white space around it or not,
 *    the first occurrence, which is the top-level key:
 *    inside JSON strings quotes are escaped, so the pattern cannot match content;
 *    chunk-bytes.ts `withAlias`);
 *  - look for a usage object, the one event we parse (but for the rare one
 *    below), to meter the request; the
 *    usage-only chunk (`"choices":[]`) is dropped when the client did not ask
 *    for usage (the gateway always asks the upstream for it);
 *  - measure delta text (`"content":"…"`, tool-call `"arguments":"…"`, refusal, reasoning),
 *    so a stream that ends without usage is still counted (~4 chars a token),
 *    and rewrite tool-call arguments sent as a JSON object or array as their
 *    JSON text (`textArgumentsEvent`: only such an event is parsed);
 *  - turn an upstream error event into our wire shape;
 *  - count the events that carry delta text, per choice: each stands for at
 *    least one generated token (vLLM sends one event per choice per engine
 *    step, a step generating one token or more), so more of them than the
 *    max_tokens the upstream was sent means it ignored its bound, and the
 *    answer is ended there (`finishAtBound`). Bytes are no such lower bound
 *    (one token may decode to many bytes, or to none).
 *
 * A Bun "direct" ReadableStream rather than `pipeThrough(TransformStream)`:
 * when the upstream fails mid-stream, a TransformStream's readable side errors
 * with it, and the client would see a reset connection; here we still write a
 * final `data: {"error":…}` event (which the SDKs raise as an APIError) and
 * close the response cleanly. Direct, rather than a pull-based stream, because
 * it holds less per open stream (see `Relay.pull`).
 */

export interface StreamEnd {
  /**
   * `ended`: cut by the gateway itself (shutdown), not by the upstream or the client;
   * `bound`: the upstream went past the max_tokens it was sent, and the gateway ended the answer there.
   */
  outcome: "done" | "failed" | "ended" | "client_gone" | "bound";
  /**
   * The upstream's last usage report, when it sent one, plus the text
   * delivered after that report (~4 bytes a token): a server that
   * reports usage early (on the first chunk, or on every chunk) and is then
   * cut off has not counted what followed.
   */
  usage: { promptTokens: number; completionTokens: number } | undefined;
  /** UTF-8 bytes of the delta text delivered to the client (its text, whatever escapes the upstream wrote it with). */
  deliveredChars: number;
  /** Events of delta text delivered to the client: each stands for at least one generated token. */
  deliveredEvents: number;
  reason?: string;
}

export interface RelayOptions {
  alias: string;
  /** The client asked for `stream_options.include_usage`. */
  clientWantsUsage: boolean;
  idleMs: number;
  /** The client's request signal (Bun aborts it when the client disconnects). */
  signal: AbortSignal;
  /** Stands in for an implausible upstream prompt count (usage.ts); 0 when not given. */
  promptEstimate?: number;
  /** The most each count can be (n × max_tokens as sent, the context window); a larger one is capped (usage.ts). */
  bounds?: UsageBounds;
  /**
   * The max_tokens each choice was sent and the number of choices (`n`), when a
   * bound was sent: a choice that sends more events of text than that has
   * certainly ignored it, and the answer ends there (`finishAtBound`).
   */
  generation?: { maxTokens: number; choices: number };
  /** The number of choices (`n`) the upstream was asked for; 1 when not given. */
  choices?: number;
  /**
   * The most delta text the stream may carry, in bytes as sent (escapes
   * included: `DeltaScan.sentBytes`, not the UTF-8 bytes of the text that
   * `deliveredChars` counts); an event that would pass it is dropped and the
   * stream fails there, its upstream call closed. Set for a transform that
   * holds the whole answer (the Responses API keeps it for its final event
   * and the store): what it holds is bounded as a non-streamed answer is
   * (upstream.maxResponseBytes), and it writes that text as JSON again,
   * where a control character takes the 6 bytes of `\u0001` it may have
   * been sent as: counted decoded, 8 MiB could come out as 48.
   */
  maxTextBytes?: number;
  /** The usage chunk carried implausible counts (`counted.rejected`); they were replaced before the client saw them. */
  onImplausibleUsage?(counted: Counted): void;
  onEnd(end: StreamEnd): void;
  /** The wire's error body (src/http/errors.ts) for the error event a failed stream ends with. */
  errorBody(code: ErrorCode, message: string): unknown;
  /**
   * Open streams register here until they end, so shutdown can end them all
   * (one add and one delete per stream, nothing per chunk).
   */
  open?: Set<EndableStream>;
  /**
   * Rewrites what is sent (the Responses API's events): each read's events,
   * the gateway's own error event included, go through it on the same write,
   * and the close waits for its finish().
   */
  transform?: RelayTransform;
  /** Just before the response closes after its last event (the route gives the connection its idle timeout back: http/idle.ts). */
  beforeClose?(): void;
}

/** An open stream, as shutdown sees it. */
export interface EndableStream {
  /** Ends the stream the way a mid-stream upstream failure does: an error event, then a clean close. */
  endStream(message: string): void;
}

/** No breakdowns (before any usage report): one object for every stream, never written. */
const NO_DETAILS: UsageDetails = Object.freeze({});

/**
 * How long the rest of an upstream's body may take after [DONE] (normally the
 * end of its chunked framing, at once); and how long its usage chunk may take
 * after a client left once the answer was complete (`cancel`).
 */
const DRAIN_MS = 1_000;
/** The most read for that usage chunk (it and [DONE] are a few hundred bytes). */
const DRAIN_BYTES = 64 * 1024;

/**
 * The usage in an event's JSON, its counts checked (usage.ts). When one had
 * to be replaced, or its total_tokens is not the sum of the two (or absent),
 * `rewritten` is the event's JSON with the figures counted and their sum, so
 * the client never sees what the upstream made up, nor a total other than
 * what is charged (a JSON answer's usage is rebuilt the same way); likewise
 * when a breakdown (`prompt_tokens_details`, `completion_tokens_details`)
 * holds a count that is not a known one within its part (usageDetails).
 */
function usageOf(
  payload: string,
  estimate: { promptTokens: number; completionTokens: number },
  bounds: UsageBounds | undefined,
): { counted: Counted; onlyUsage: boolean; details: UsageDetails; rewritten: string | undefined } | undefined {
  let v: unknown;
  try {
    v = JSON.parse(payload);
  } catch {
    return undefined;
  }
  if (!isRecord(v) || !isRecord(v.usage)) return undefined;
  const counted = countUsage(v.usage, estimate, bounds);
  const onlyUsage = Array.isArray(v.choices) && v.choices.length === 0;
  const { promptTokens: p, completionTokens: c } = counted;
  // The breakdowns (cached, reasoning tokens…) checked as a JSON answer's are (usage.ts).
  const details = usageDetails(v.usage, p, c);
  if (!counted.rejected && v.usage.total_tokens === p + c && detailsAsSent(v.usage, details)) return { counted, onlyUsage, details, rewritten: undefined };
  const { prompt_tokens_details: _p, completion_tokens_details: _c, ...rest } = v.usage;
  const usage = { ...rest, prompt_tokens: p, completion_tokens: c, total_tokens: p + c, ...details };
  return { counted, onlyUsage, details, rewritten: JSON.stringify({ ...v, usage }) };
}

function errorEvent(opts: RelayOptions, message: string): Uint8Array {
  return Buffer.from(`data: ${JSON.stringify(opts.errorBody("service_unavailable", message))}\n\n`);
}

/**
 * A stream's completion so far: the last usage report plus the text delivered
 * after it (deliveredTokens), or before any report the delivered text alone.
 * Module functions, not closures: an open stream holds none of them.
 */
function completionSoFar(usage: StreamEnd["usage"], delivered: number, atUsage: number, events: number, eventsAtUsage: number): number {
  return usage === undefined ? deliveredTokens(delivered, events) : usage.completionTokens + deliveredTokens(delivered - atUsage, events - eventsAtUsage);
}

/**
 * What a stream that ended is charged: the upstream's count (with the text
 * after its last report), else an estimate from what the client received;
 * either way never past the bound the upstream was sent (usage.ts): that is
 * all that was reserved. A stream the upstream (or the gateway's shutdown)
 * ended before any text reached the client, with no report, delivered
 * nothing and failed through no fault of the client's: charged nothing, as
 * the same failure of a JSON answer is. The service settles this
 * (StreamCall.onEnd), and a Responses stream the client left is stored with
 * it (`end`): one rule for both.
 */
export function streamCharge(end: StreamEnd, promptEstimate: number, completionBound: number): { promptTokens: number; completionTokens: number } {
  const nothing = end.usage === undefined && end.deliveredChars === 0 && (end.outcome === "failed" || end.outcome === "ended");
  if (nothing) return { promptTokens: 0, completionTokens: 0 };
  const counted = end.usage ?? { promptTokens: promptEstimate, completionTokens: deliveredTokens(end.deliveredChars, end.deliveredEvents) };
  return { promptTokens: counted.promptTokens, completionTokens: Math.min(counted.completionTokens, completionBound) };
}

/** The usage of a chunk the gateway writes itself: the counts charged and the last report's breakdowns, checked again within them. */
function usageOut(u: { promptTokens: number; completionTokens: number }, breakdowns: UsageDetails) {
  const { promptTokens: p, completionTokens: t } = u;
  return { prompt_tokens: p, completion_tokens: t, total_tokens: p + t, ...usageDetails(breakdowns as Record<string, unknown>, p, t) };
}

/**
 * One open stream's relay: its state as fields and its steps as methods, which
 * every stream shares; an open stream holds this object, its framer and the
 * arrays it needs, where a closure per step (~15, each with its scope) was
 * made per stream before. It is also what the stream needs around it:
 *  - the ReadableStream's direct source (`type`, `pull`, `cancel`: Bun calls
 *    them with the source as `this`). Bun also reads a source's `start`,
 *    `close` and `autoAllocateChunkSize`, and calls its `close` when the
 *    controller closes: nothing here may be named so;
 *  - its framer's event sink (`onEvent`), its delta scan (`structuredArguments`,
 *    chunk-bytes.ts), its idle timer's argument (`idleCheck`), and the entry
 *    shutdown ends (`endStream`, in `opts.open`).
 */
class Relay implements DirectUnderlyingSource<Uint8Array>, EventSink, DeltaScan, EndableStream {
  private readonly swap: SwapFields;
  private readonly tf: RelayTransform | undefined;
  /** The upstream's events, as SSE reads them (lib/sse.ts). */
  private readonly framer = new SseFramer();
  /** What the current read's events give the client (sent once per read). */
  private readonly out: Buffer[] = [];
  /** How the upstream's first event ended (undefined until one has). */
  private sep: Buffer | undefined;
  /** DeltaScan: the current event's tool-call arguments are a JSON object or array. */
  structuredArguments = false;
  /** DeltaScan: the current event's delta text in bytes as sent, escapes included. */
  sentBytes = 0;
  private sawDone = false;
  private usage: StreamEnd["usage"];
  /** The breakdowns (cached, reasoning tokens…) of the upstream's last usage report, checked: a usage chunk the gateway adds after it keeps them. */
  private usageBreakdowns: UsageDetails = NO_DETAILS;
  /** The upstream's chunk id (read from its first chunk), for a usage chunk the gateway adds. */
  private chunkId: string | undefined;
  /** UTF-8 bytes of the delta text delivered (its decoded text, whatever escapes it was sent with): what the estimate counts. */
  private deliveredChars = 0;
  /** The same text's bytes as sent, escapes included: what maxTextBytes bounds. */
  private sentChars = 0;
  /** deliveredChars when the last usage report arrived (that event's own text included): what followed is not in it. */
  private charsAtUsage = 0;
  /** Events of delta text delivered to the client, and their number when the last usage report arrived (as charsAtUsage). */
  private deliveredEvents = 0;
  private eventsAtUsage = 0;
  private ended = false;
  private upstreamError: string | undefined;
  private readonly gen: RelayOptions["generation"];
  /** Events of delta text so far, over all choices: each stands for at least one generated token. */
  private textEvents = 0;
  /** With n > 1 and a bound: events of text per choice. */
  private readonly perChoice: number[] | undefined;
  /** The choices asked for (`n`), and how many have finished (their finish_reason came); with n > 1, which. */
  private readonly choices: number;
  private finishedChoices = 0;
  private readonly finished: boolean[] | undefined;
  /**
   * With n > 1: the index each of the upstream's choices goes to the client with (`renumbered`), and
   * the indices given so far (the choices begun). At most n entries, and one for each choice past n.
   */
  private indexMap: Map<number | string | null, number> | undefined;
  private readonly begun: boolean[] | undefined;
  /** The indices (n or more) given to choices past the n asked, and the lowest one to try next (`clientIndex`). */
  private extraGiven: Set<number> | undefined;
  private nextExtra = 0;
  /**
   * The client left once the answer was complete, before its usage chunk: the
   * upstream is read on for that chunk, relaying nothing (`cancel`); `drainTimer`
   * gives up after DRAIN_MS, `drained` counts the bytes read meanwhile.
   */
  private clientLeft = false;
  private drainTimer: ReturnType<typeof setTimeout> | undefined;
  private drained = 0;
  /** A usage report came with or after the event that finished the answer: it counts the whole answer. */
  private usageAfterFinish = false;
  /** The upstream went past its bound: the event that did so was dropped, and the answer ends (finishAtBound). */
  private pastBound = false;
  /** The answer would pass maxTextBytes: the event that would have was dropped, and the stream fails. */
  private tooLarge = false;
  // Idle timer without per-chunk timer churn: each read only stamps when it
  // started waiting; the timer wakes once per idle period and re-arms for the
  // remainder. Only time spent waiting on the upstream counts: a slow client
  // (back-pressure, no read pending) is not the upstream being idle.
  private waitingSince: number | undefined;
  private idleFired = false;
  private idleTimer: ReturnType<typeof setTimeout> | undefined;
  /** Set when the gateway ends the stream itself: the read below then fails with this message. */
  private endedBecause: string | undefined;

  constructor(
    private readonly up: Opened,
    private readonly opts: RelayOptions,
  ) {
    this.swap = swapFields(up.target, opts.alias);
    this.tf = opts.transform;
    const gen = opts.generation;
    this.gen = gen;
    this.perChoice = gen && gen.choices > 1 ? new Array<number>(gen.choices).fill(0) : undefined;
    this.choices = gen?.choices ?? opts.choices ?? 1;
    this.finished = this.choices > 1 ? new Array<boolean>(this.choices).fill(false) : undefined;
    this.begun = this.choices > 1 ? new Array<boolean>(this.choices).fill(false) : undefined;
    this.idleTimer = setTimeout(idleCheck, opts.idleMs, this);
  }

  /** A direct stream (Bun's): see `pull`. On the prototype, as every other member the source is read for. */
  get type(): "direct" {
    return "direct";
  }

  /** The line ends of the events the gateway writes itself: the upstream's first event's CRLF, else LF. */
  private termOut(): string {
    return this.sep === CRLF2 ? "\r\n\r\n" : "\n\n";
  }

  checkIdle(): void {
    const idle = this.waitingSince === undefined ? 0 : performance.now() - this.waitingSince;
    if (idle >= this.opts.idleMs) {
      this.idleFired = true;
      this.up.abort(`stream idle for ${this.opts.idleMs} ms`);
    } else this.idleTimer = setTimeout(idleCheck, this.opts.idleMs - idle, this);
  }

  endStream(message: string): void {
    if (this.ended || this.endedBecause !== undefined) return;
    this.endedBecause = message;
    this.up.abort(message);
  }

  /** The completion so far (the module's completionSoFar of this stream's counts). */
  private completionSoFar(): number {
    return completionSoFar(this.usage, this.deliveredChars, this.charsAtUsage, this.deliveredEvents, this.eventsAtUsage);
  }

  /** The text delivered so far is counted by the usage now taken (a report, or the gateway's own). */
  private usageCoversDelivered(): void {
    this.charsAtUsage = this.deliveredChars;
    this.eventsAtUsage = this.deliveredEvents;
  }

  private end(outcome: StreamEnd["outcome"], reason?: string): void {
    if (this.ended) return;
    this.ended = true;
    clearTimeout(this.idleTimer);
    clearTimeout(this.drainTimer);
    this.opts.open?.delete(this);
    // Only the upstream's own failures count against its breaker.
    this.up.finish(outcome === "done" ? true : outcome === "failed" ? false : null);
    const usage = this.usage;
    const reported = usage && { promptTokens: usage.promptTokens, completionTokens: this.completionSoFar() };
    const { deliveredChars, deliveredEvents } = this;
    const end: StreamEnd = reason ? { outcome, usage: reported, deliveredChars, deliveredEvents, reason } : { outcome, usage: reported, deliveredChars, deliveredEvents };
    this.opts.onEnd(end);
    // The client left: a transform (a stored Response) is told now, with what the request is charged; not at
    // the moment the client left, as a complete answer's usage chunk may still come then (`cancel`), and is charged.
    if (outcome === "client_gone" && this.tf) {
      const opts = this.opts;
      const charged = streamCharge(end, opts.promptEstimate ?? 0, opts.bounds?.completionTokens ?? Number.POSITIVE_INFINITY);
      this.tf.cancel(usageOut(charged, this.usageBreakdowns));
    }
  }

  /**
   * Counts an event of the answer against the bound the upstream was sent;
   * true when it goes past it: a choice has sent more events of text than its
   * max_tokens (or, where an event's choice cannot be told, the stream more
   * than n × max_tokens). With n = 1 that is one counter.
   */
  private beyondBound(g: NonNullable<RelayOptions["generation"]>, event: Buffer, at: number, text: number): boolean {
    if (text > 0) this.textEvents++;
    const perChoice = this.perChoice;
    if (perChoice && text > 0) {
      const k = choiceIndexOf(event, at);
      if (k >= 0 && k < perChoice.length) {
        const seen = (perChoice[k] ?? 0) + 1;
        perChoice[k] = seen;
        if (seen > g.maxTokens) return true;
      }
    }
    return this.textEvents > g.maxTokens * g.choices;
  }

  /**
   * The index the client gets the upstream's choice `u` with (n > 1): its own when it is below n and
   * not given to another, else the lowest one not given yet. Once n are given (an upstream answering
   * more choices than asked), its own when that is n or more and not given, else the lowest such one
   * not given: never one another choice has, whose text it would be merged into (choices 0, 2, 1 of
   * n = 2 sent 2 as 1, then 1 as 1 too). An index that is no whole number (`1.5`, `-1`, `"1"`,
   * none: null) is its choice's name only, and takes the lowest one not given, as one that skips.
   */
  private clientIndex(u: number | string | null, begun: boolean[]): number {
    this.indexMap ??= new Map();
    const map = this.indexMap;
    const had = map.get(u);
    if (had !== undefined) return had;
    const own = typeof u === "number" && Number.isSafeInteger(u) && u >= 0 ? u : -1;
    let k = own >= 0 && own < begun.length && !begun[own] ? own : begun.indexOf(false);
    if (k === -1) {
      this.extraGiven ??= new Set();
      const given = this.extraGiven;
      if (own >= begun.length && !given.has(own)) k = own;
      else {
        this.nextExtra = Math.max(this.nextExtra, begun.length);
        while (given.has(this.nextExtra)) this.nextExtra++;
        k = this.nextExtra;
      }
      given.add(k);
    } else begun[k] = true;
    map.set(u, k);
    return k;
  }

  /**
   * The event with its choices numbered as the client may read them (n > 1), or undefined when it
   * goes as sent: the openai SDK's chat stream refuses a choice index at or past the n it asked for
   * ("invalid choice index") and keys choices by index, so an upstream that skips one (choices 0
   * and 2 of 2) broke it. Only an event whose choice needs a new index is parsed (as is one whose
   * choice cannot be read from its bytes: several choices, or an index not written as a plain
   * integer, `1.5`, `1e0`, `"1"`), and one that is parsed is written again, its indices as plain
   * integers: before, `1.5` was read as choice 1 by its bytes and went to the client as sent.
   */
  private renumbered(event: Buffer, at: number, termLen: number, begun: boolean[]): Buffer | undefined {
    const k = choiceIndexOf(event, at);
    if (k >= 0 ? k < begun.length && this.clientIndex(k, begun) === k : !carriesChoices(event, at)) return undefined;
    return renumberedChoicesEvent(event.toString("utf8", at, event.length - termLen), (u) => this.clientIndex(u, begun), this.termOut(), k < 0);
  }

  /**
   * Notes the choice a relayed event finishes (its finish_reason came; with
   * n > 1 only an event of one choice tells which). Once every choice has,
   * the upstream has stopped generating: the client leaving no longer aborts
   * its call by itself (`cancel` decides).
   */
  private noteFinish(event: Buffer, at: number): void {
    const finished = this.finished;
    if (finished) {
      const k = choiceIndexOf(event, at);
      if (k < 0 || k >= finished.length || finished[k] || !finishes(event, at)) return;
      finished[k] = true;
    } else if (!finishes(event, at)) return;
    if (++this.finishedChoices === this.choices) this.up.detach();
  }

  /** The usage an event carries, its counts checked (usage.ts) and taken as the stream's; undefined when it cannot be read. */
  private takeUsage(event: Buffer, at: number, termLen: number, text: number): ReturnType<typeof usageOf> {
    const opts = this.opts;
    // A report that leaves the prompt out (a server reporting it on the first chunk, the completion on the
    // last) keeps the count reported before; before, the estimate took its place.
    const estimate = { promptTokens: this.usage?.promptTokens ?? opts.promptEstimate ?? 0, completionTokens: deliveredTokens(this.deliveredChars + text, this.deliveredEvents + (text > 0 ? 1 : 0)) };
    const parsed = usageOf(event.toString("utf8", at, event.length - termLen), estimate, opts.bounds);
    if (parsed) {
      this.usage = { promptTokens: parsed.counted.promptTokens, completionTokens: parsed.counted.completionTokens };
      this.usageBreakdowns = parsed.details;
      if (this.finishedChoices === this.choices) this.usageAfterFinish = true;
      if (parsed.counted.rejected) opts.onImplausibleUsage?.(parsed.counted);
    }
    return parsed;
  }

  /** Handles one complete event (terminator included); returns the bytes for the client, or undefined to drop it. */
  private handle(received: Buffer): Buffer | undefined {
    const opts = this.opts;
    let event = received;
    // [DONE] ends the answer: anything after it (in the same read) is neither relayed nor counted.
    if (this.sawDone) return undefined;
    /** The length of the event's own line end, which its data ends before. */
    let termLen: number;
    const own = blankLineOf(event);
    if (own && isPlainData(event, own)) termLen = own.length;
    else {
      const plain = plainDataEvent(event, this.termOut());
      if (plain === "keep") return event; // comments, keep-alives: pass through
      if (plain === "drop") return undefined;
      event = plain;
      termLen = this.termOut().length;
    }
    let at = dataAt(event);
    // Empty data is no chunk (the SDKs would fail parsing it as JSON): dropped, as plainDataEvent drops it.
    if (at === event.length - termLen) return undefined;
    if (this.clientLeft) {
      // The client left once the answer was complete: nothing is relayed, the usage (or [DONE]) is looked for.
      if (isDone(event, at)) this.sawDone = true;
      else if (carriesUsage(event, at) && this.takeUsage(event, at, termLen, 0)) this.usageCoversDelivered();
      return undefined;
    }
    if (isDone(event, at)) {
      this.sawDone = true;
      // Asked for usage and none came (an upstream that ignores include_usage), or text came after the
      // last report (a server that reports on the first or on every chunk): the client gets what is
      // counted, as a JSON answer carries it, before [DONE]. Before, such a client's last word on usage
      // was the early report (1 completion token) while the record charged the text after it too.
      if (opts.clientWantsUsage && (this.usage === undefined || this.deliveredChars > this.charsAtUsage)) {
        // Never past the bound the upstream was sent (usage.ts): that is what is charged.
        const completion = this.completionSoFar();
        const usage = { promptTokens: this.usage?.promptTokens ?? opts.promptEstimate ?? 0, completionTokens: Math.min(completion, opts.bounds?.completionTokens ?? Number.POSITIVE_INFINITY) };
        this.usage = usage;
        this.usageCoversDelivered();
        const chunk = {
          id: this.chunkId ?? "",
          object: "chat.completion.chunk",
          created: Math.floor(Date.now() / 1000),
          model: opts.alias,
          choices: [],
          // The last report's breakdowns, checked again within the counts charged (the completion only grew).
          usage: usageOut(usage, this.usageBreakdowns),
        };
        return Buffer.concat([Buffer.from(`data: ${JSON.stringify(chunk)}${this.termOut()}`), event]);
      }
      return event;
    }
    this.chunkId ??= chunkIdOf(event, at);
    if (isErrorEvent(event, at)) {
      this.upstreamError = upstreamMessage(event.toString("utf8", at, event.length - termLen)).message;
      return undefined;
    }
    let text = deltaTextBytes(event, this);
    if (this.structuredArguments) {
      // Rare (servers that send the arguments parsed): the event is rebuilt with them as text, then counted.
      const rebuilt = textArgumentsEvent(event.toString("utf8", at, event.length - termLen), this.termOut());
      if (rebuilt) {
        event = rebuilt;
        termLen = this.termOut().length;
        at = dataAt(event);
        text = deltaTextBytes(event, this);
      }
    }
    if (this.begun) {
      const rebuilt = this.renumbered(event, at, termLen, this.begun);
      if (rebuilt) {
        event = rebuilt;
        termLen = this.termOut().length;
        at = dataAt(event);
        text = deltaTextBytes(event, this);
      }
    }
    if (this.gen && this.beyondBound(this.gen, event, at, text)) {
      this.pastBound = true;
      return undefined;
    }
    if (opts.maxTextBytes !== undefined && this.sentChars + this.sentBytes > opts.maxTextBytes) {
      this.tooLarge = true;
      return undefined;
    }
    if (this.finishedChoices < this.choices) this.noteFinish(event, at);
    let reported = false;
    if (carriesUsage(event, at)) {
      const parsed = this.takeUsage(event, at, termLen, text);
      if (parsed) {
        reported = true;
        if (!opts.clientWantsUsage && parsed.onlyUsage) {
          this.usageCoversDelivered();
          return undefined;
        }
        if (parsed.rewritten !== undefined) {
          // Rare: the event is rebuilt around the checked figures (and still gets the model swap below).
          event = Buffer.from(`data: ${parsed.rewritten}${this.termOut()}`);
          termLen = this.termOut().length;
          at = dataAt(event);
        }
      }
    }
    this.deliveredChars += text;
    if (text > 0) this.deliveredEvents++;
    this.sentChars += this.sentBytes;
    if (reported) this.usageCoversDelivered();
    // A transform re-serialises the events (the Responses API names the alias itself): no swap to make.
    // Otherwise every event is swapped, an alias equal to the configured id too: a server may name another model.
    if (this.tf) return event;
    return withAlias(event, at, this.swap);
  }

  /** Each complete upstream event; false (stop reading) once one has ended the stream or the answer ([DONE]). */
  onEvent(received: Buffer): boolean {
    const event = withWholeLineEnd(received);
    this.sep ??= blankLineOf(event) === CRLF2 ? CRLF2 : LF2;
    const e = this.handle(event);
    if (this.upstreamError !== undefined || this.pastBound || this.tooLarge) return false;
    if (e) this.out.push(e);
    return !this.sawDone;
  }

  /** Splits a read into complete events, adding what goes to the client to `out`; a trailing partial event is held for the next read. */
  private feed(chunk: Uint8Array): void {
    this.framer.push(chunk, this);
  }

  /**
   * Writes events and pushes them out now (one write per upstream read, so no
   * event waits for the next). Returns a promise only when the client's socket
   * pushed back (a write or the flush did not complete at once), so that a
   * read relayed at once allocates no async frame, nor its promise.
   */
  private send(c: ReadableStreamDirectController, out: Uint8Array[]): Promise<void> | undefined {
    const tf = this.tf;
    if (tf) {
      const text = tf.events(out);
      if (text === "") return undefined;
      const w = c.write(text);
      if (pending(w)) return sendRest(c, w, undefined, 0);
    } else {
      for (let i = 0; i < out.length; i++) {
        const w = c.write(out[i] as Uint8Array);
        if (pending(w)) return sendRest(c, w, out, i + 1);
      }
    }
    const f = c.flush();
    return pending(f) ? f.then(ignore) : undefined;
  }

  /**
   * The client went away (the direct source's `cancel`): generation upstream
   * is stopped at once. Unless it has stopped already: every choice finished
   * and only the usage chunk is still to come. Then the upstream is read on
   * for it, relaying nothing, for at most DRAIN_MS and DRAIN_BYTES, and its
   * counts are charged (`settleGone`); past those, it is cut and the request
   * charged by estimate, as any client that leaves is.
   */
  cancel(): void {
    if (this.clientLeft) return;
    if (this.awaitsUsage()) {
      this.clientLeft = true;
      this.drainTimer = setTimeout(drainGiveUp, DRAIN_MS, this);
      return;
    }
    this.up.abort("client disconnected");
    this.end("client_gone");
  }

  /** The answer is complete upstream, and nothing but its usage chunk (and [DONE]) is missing. */
  private awaitsUsage(): boolean {
    return (
      !this.ended &&
      this.finishedChoices === this.choices &&
      !this.usageAfterFinish &&
      !this.sawDone &&
      !this.pastBound &&
      !this.tooLarge &&
      this.upstreamError === undefined &&
      this.endedBecause === undefined
    );
  }

  /** The usage did not come within DRAIN_MS (or DRAIN_BYTES) of the client leaving: cut, charged by estimate. */
  giveUpDrain(): void {
    this.up.abort("client disconnected");
    this.end("client_gone");
  }

  /** The usage (or [DONE]) came after the client left: charged now; the rest of the body is read as after [DONE]. */
  private settleGone(): Promise<void> {
    this.end("client_gone");
    return this.drainRest();
  }

  /**
   * Closes the response once the transform (if any) has finished (a stored
   * Response is written first); a promise only when there is that to wait for.
   */
  private closeResponse(c: ReadableStreamDirectController): Promise<void> | undefined {
    const f = this.tf?.finish();
    if (f) return closeAfter(this, c, f);
    this.closeNow(c);
    return undefined;
  }

  closeNow(c: ReadableStreamDirectController): void {
    this.opts.beforeClose?.();
    c.close();
  }

  /**
   * [DONE] was relayed: the answer is complete and settled now, and the
   * client's response closes. The rest of the upstream's body (normally just
   * the end of its chunked framing) is read and dropped so its connection can
   * be reused; an upstream that sends more, or keeps the body open, is cut
   * after DRAIN_MS. Before, such an upstream held the client until idleMs and
   * then failed a finished stream (an error event after [DONE], a 503), and
   * text sent after [DONE] was relayed and charged.
   */
  private finishAtDone(c: ReadableStreamDirectController): Promise<void> {
    this.end("done");
    let closed: Promise<void> | undefined;
    try {
      closed = this.closeResponse(c);
    } catch {
      // The client left while the transform finished: the request is done all the same.
    }
    // One async frame a stream, the drain's, unless a transform is still finishing.
    return closed ? closeThenDrain(this, closed) : this.drainRest();
  }

  /** Reads the rest of a finished answer's body and drops it, so its connection can be reused; cut after DRAIN_MS. */
  async drainRest(): Promise<void> {
    const cut = setTimeout(drainCut, DRAIN_MS, this.up);
    try {
      for (;;) if ((await this.up.reader.read()).done) break;
    } catch {
      // Cut, or the connection went: nothing after the answer matters.
    } finally {
      clearTimeout(cut);
    }
  }

  /**
   * The upstream went past the max_tokens it was sent (it ignores the bound):
   * its call is closed (the GPU stops) and the answer ends as one cut at its
   * bound would: a chunk with finish_reason "length" for each choice begun and
   * not yet finished, the usage chunk when the client asked for it, then [DONE]. The
   * completion is charged at most the bound: what the upstream counted or the
   * text delivered (~4 bytes a token), but never less than the events of
   * text seen (each at least one token), and never more than n × max_tokens.
   */
  private async finishAtBound(c: ReadableStreamDirectController, g: NonNullable<RelayOptions["generation"]>): Promise<void> {
    const opts = this.opts;
    this.up.abort("the upstream went past max_tokens");
    const completion = Math.min(g.maxTokens * g.choices, Math.max(this.completionSoFar(), this.textEvents));
    const usage = { promptTokens: this.usage?.promptTokens ?? opts.promptEstimate ?? 0, completionTokens: completion };
    this.usage = usage;
    this.usageCoversDelivered();
    const term = this.termOut();
    const head = `data: {"id":${JSON.stringify(this.chunkId ?? "")},"object":"chat.completion.chunk","created":${Math.floor(Date.now() / 1000)},"model":${JSON.stringify(opts.alias)},"choices":`;
    const closing: Buffer[] = [];
    for (let k = 0; k < g.choices; k++) {
      // Not a choice that never began (fewer than n came): the openai SDK refuses a choice with no role ("missing role").
      if (this.begun && !this.begun[k]) continue;
      if (!this.finished?.[k]) closing.push(Buffer.from(`${head}[{"index":${k},"delta":{},"logprobs":null,"finish_reason":"length"}]}${term}`));
    }
    if (opts.clientWantsUsage) {
      // With the last report's breakdowns, as the chunk added before [DONE] has them.
      closing.push(Buffer.from(`${head}[],"usage":${JSON.stringify(usageOut(usage, this.usageBreakdowns))}}${term}`));
    }
    closing.push(Buffer.from(`data: [DONE]${term}`));
    try {
      const sent = this.send(c, closing);
      if (sent) await sent;
    } catch {
      this.cancel();
      return;
    }
    this.end("bound");
    try {
      const closed = this.closeResponse(c);
      if (closed) await closed;
    } catch {
      // The client left while the transform finished: the request is done all the same.
    }
  }

  private async fail(c: ReadableStreamDirectController, message: string): Promise<void> {
    this.up.abort(message);
    this.end(message === this.endedBecause ? "ended" : "failed", message);
    try {
      const sent = this.send(c, [errorEvent(this.opts, message)]);
      if (sent) await sent;
      const closed = this.closeResponse(c);
      if (closed) await closed;
    } catch {
      // The client is already gone.
    }
  }

  /**
   * The upstream's reads, relayed until the stream ends (the direct source's
   * `pull`). A Bun "direct" stream: events are written straight to the
   * response (awaiting the write is the back-pressure), with no queue, read
   * request or promise per chunk: ~5 KB less per open stream than a
   * pull-based ReadableStream (measured).
   */
  async pull(c: ReadableStreamDirectController): Promise<void> {
    const { opts, up, tf, out } = this;
    // Registered once relaying starts, so a response never sent holds no entry (`end` removes it).
    if (this.ended) return;
    opts.open?.add(this);
    if (tf) {
      const first = tf.start();
      try {
        if (first !== "") {
          const w = c.write(first);
          if (typeof w !== "number") await w;
        }
      } catch {
        this.cancel();
        return;
      }
    }
    try {
      this.feed(up.first);
    } catch (e) {
      return this.fail(c, `The model '${opts.alias}' sent an unreadable stream: ${(e as Error).message}`);
    }
    for (;;) {
      // Events before an upstream error event still go out, then the error.
      if (out.length > 0) {
        if (!this.clientLeft) {
          try {
            const sent = this.send(c, out);
            if (sent) await sent;
          } catch {
            this.cancel();
            if (!this.clientLeft) return;
          }
        }
        out.length = 0;
      }
      if (this.ended) return;
      if (this.clientLeft) {
        // Waiting for the usage of an answer complete when the client left (`cancel`).
        if (this.usageAfterFinish || this.sawDone) return this.settleGone();
      } else {
        if (this.upstreamError !== undefined) return this.fail(c, `The model '${opts.alias}' failed while generating: ${this.upstreamError}`);
        // The transform failed the answer itself (its final events are sent): nothing more would be, so the
        // upstream call is closed now and the stream ends as failed, rather than running silent to its end.
        // Before [DONE] is looked at: a read that carried both ended as the failure the client saw, not as done.
        const failed = tf?.failed();
        if (failed !== undefined) return this.fail(c, failed);
        if (this.sawDone) return this.finishAtDone(c);
        if (this.pastBound && this.gen) return this.finishAtBound(c, this.gen);
        if (this.tooLarge) {
          return this.fail(
            c,
            `The model '${opts.alias}' sent an answer larger than ${opts.maxTextBytes} bytes, the most the gateway holds for one answer (upstream.maxResponseBytes); the stream was ended.`,
          );
        }
      }
      this.waitingSince = performance.now();
      let r: Awaited<ReturnType<Opened["reader"]["read"]>>;
      try {
        r = await up.reader.read();
      } catch {
        if (this.ended) return;
        if (opts.signal.aborted || this.clientLeft) {
          this.end("client_gone");
          return;
        }
        return this.fail(
          c,
          this.endedBecause ??
            (this.idleFired
              ? `The model '${opts.alias}' stopped sending for ${opts.idleMs} ms; the stream was ended.`
              : `The connection to the model '${opts.alias}' was lost mid-stream.`),
        );
      }
      this.waitingSince = undefined;
      if (this.ended) return;
      if (this.clientLeft) {
        // No usage before the body ended, or more bytes than a usage chunk and [DONE] take: charged by estimate.
        if (r.done) {
          this.end("client_gone");
          return;
        }
        this.drained += r.value.byteLength;
        if (this.drained > DRAIN_BYTES) {
          this.giveUpDrain();
          return;
        }
      }
      if (r.done) {
        // No event at all, and one JSON document: a server that does not stream answered whole (whole-answer.ts).
        const framer = this.framer;
        const body = this.sep === undefined && framer.pendingBytes > 0 && this.endedBecause === undefined ? framer.pending() : undefined;
        let whole: ReturnType<typeof wholeAnswer>;
        try {
          whole = body ? wholeAnswer(body, opts.alias) : undefined;
          if (whole && "error" in whole) this.upstreamError = upstreamMessage(String(body)).message;
          else if (whole) {
            framer.reset();
            this.feed(whole.events);
          }
        } catch {
          // An answer the gateway cannot write again as chunks (nested past JSON.stringify's stack): unreadable, as
          // the same answer to a non-streamed request is (a 503). Before, the error escaped the relay: the
          // connection was reset and the request never settled.
          return this.fail(c, `The model '${opts.alias}' sent an unreadable answer.`);
        }
        // [DONE] ends a stream before its body does (finishAtDone): a body that ends first was cut off.
        if (!whole) return this.fail(c, this.endedBecause ?? `The model '${opts.alias}' ended the stream early.`);
        continue;
      }
      try {
        this.feed(r.value);
      } catch (e) {
        return this.fail(c, `The model '${opts.alias}' sent an unreadable stream: ${(e as Error).message}`);
      }
    }
  }
}

/**
 * A write or flush that did not complete at once. Bun's HTTP response gives a
 * number when it did and a promise when the socket pushed back; a stream read
 * in-process (a reader, `.text()`) gives numbers or undefined.
 */
function pending<T>(r: T | Promise<T>): r is Promise<T> {
  return typeof r === "object" && r !== null;
}

/** The rest of `send` once a write did not complete at once: that write awaited, then the events after it, then the flush. */
async function sendRest(c: ReadableStreamDirectController, first: Promise<number>, out: Uint8Array[] | undefined, from: number): Promise<void> {
  await first;
  if (out) {
    for (let i = from; i < out.length; i++) {
      const w = c.write(out[i] as Uint8Array);
      if (pending(w)) await w;
    }
  }
  const f = c.flush();
  if (pending(f)) await f;
}

function ignore(): void {}

async function closeAfter(r: Relay, c: ReadableStreamDirectController, finished: Promise<void>): Promise<void> {
  await finished;
  r.closeNow(c);
}

/** The idle timer's callback: module functions with the relay as argument, no closure per stream. */
function idleCheck(r: Relay): void {
  r.checkIdle();
}

async function closeThenDrain(r: Relay, closed: Promise<void>): Promise<void> {
  try {
    await closed;
  } catch {
    // The client left while the transform finished: the request is done all the same.
  }
  return r.drainRest();
}

function drainCut(up: Opened): void {
  up.abort("the upstream went on after its answer");
}

function drainGiveUp(r: Relay): void {
  r.giveUpDrain();
}

export function relayStream(up: Opened, opts: RelayOptions): ReadableStream<Uint8Array> {
  return new ReadableStream<Uint8Array>(new Relay(up, opts));
}
