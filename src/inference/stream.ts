import type { ErrorCode } from "../lib/errors.ts";
import type { RelayTransform } from "../lib/relay-transform.ts";
import { SseFramer } from "../lib/sse.ts";
import type { Opened } from "./upstream/index.ts";
import { upstreamMessage } from "./upstream/error-body.ts";
import { isRecord } from "../lib/guards.ts";
import {
  blankLineOf,
  CRLF2,
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
  swapFields,
  textArgumentsEvent,
  withAlias,
  withWholeLineEnd,
} from "./chunk-bytes.ts";
import { charsToTokens } from "./tokens.ts";
import { type Counted, type UsageBounds, type UsageDetails, countUsage, detailsAsSent, usageDetails } from "./usage.ts";
import { wholeAnswer } from "./whole-answer.ts";

/**
 * SSE passthrough: the upstream's bytes go to the client event by event, with
 * no JSON parse or re-serialisation of ordinary chunks (what an event's bytes
 * say is read in chunk-bytes.ts; this module is the relay). Per event we only
 *  - swap the upstream model id for the alias (a byte search for
 *    `"model":"<upstream id>"`, the first occurrence, which is the top-level key:
 *    inside JSON strings quotes are escaped, so the pattern cannot match content);
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
 * it holds less per open stream (see `relay`).
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
   * Open streams register their `EndStream` here until they end, so shutdown
   * can end them all (one add and one delete per stream, nothing per chunk).
   */
  open?: Set<EndStream>;
  /**
   * Rewrites what is sent (the Responses API's events): each read's events,
   * the gateway's own error event included, go through it on the same write,
   * and the close waits for its finish().
   */
  transform?: RelayTransform;
  /** Just before the response closes after its last event (the route gives the connection its idle timeout back: http/idle.ts). */
  beforeClose?(): void;
}

/** Ends an open stream the way a mid-stream upstream failure does: an error event, then a clean close. */
export type EndStream = (message: string) => void;

/** How long the rest of an upstream's body may take after [DONE] (normally the end of its chunked framing, at once). */
const DRAIN_MS = 1_000;

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
 * after it (~4 bytes a token), or before any report the delivered text alone.
 * Module functions, not closures: an open stream holds none of them.
 */
function completionSoFar(usage: StreamEnd["usage"], delivered: number, atUsage: number): number {
  return usage === undefined ? charsToTokens(delivered) : usage.completionTokens + charsToTokens(delivered - atUsage);
}

/** The usage of a chunk the gateway writes itself: the counts charged and the last report's breakdowns, checked again within them. */
function usageOut(u: { promptTokens: number; completionTokens: number }, breakdowns: UsageDetails) {
  const { promptTokens: p, completionTokens: t } = u;
  return { prompt_tokens: p, completion_tokens: t, total_tokens: p + t, ...usageDetails(breakdowns as Record<string, unknown>, p, t) };
}

export function relayStream(up: Opened, opts: RelayOptions): ReadableStream<Uint8Array> {
  const swap = swapFields(up.target, opts.alias);
  const tf = opts.transform;
  /** The upstream's events, as SSE reads them (lib/sse.ts). */
  const framer = new SseFramer();
  /** How the upstream's first event ended (undefined until one has). */
  let sep: Buffer | undefined;
  /** The line ends of the events the gateway writes itself: the upstream's first event's CRLF, else LF. */
  const termOut = () => (sep === CRLF2 ? "\r\n\r\n" : "\n\n");
  const scan: DeltaScan = { structuredArguments: false, sentBytes: 0 };
  let sawDone = false;
  let usage: StreamEnd["usage"];
  /** The breakdowns (cached, reasoning tokens…) of the upstream's last usage report, checked: a usage chunk the gateway adds after it keeps them. */
  let usageBreakdowns: UsageDetails = {};
  /** The upstream's chunk id (read from its first chunk), for a usage chunk the gateway adds. */
  let chunkId: string | undefined;
  /** UTF-8 bytes of the delta text delivered (its decoded text, whatever escapes it was sent with): what the estimate counts. */
  let deliveredChars = 0;
  /** The same text's bytes as sent, escapes included: what maxTextBytes bounds. */
  let sentChars = 0;
  /** deliveredChars when the last usage report arrived (that event's own text included): what followed is not in it. */
  let charsAtUsage = 0;
  let ended = false;
  let upstreamError: string | undefined;
  const gen = opts.generation;
  /** Events of delta text so far, over all choices: each stands for at least one generated token. */
  let textEvents = 0;
  /** With n > 1: events of text per choice, and which choices have finished (their finish_reason came). */
  const perChoice = gen && gen.choices > 1 ? new Array<number>(gen.choices).fill(0) : undefined;
  const finished = perChoice ? new Array<boolean>(perChoice.length).fill(false) : undefined;
  /** The upstream went past its bound: the event that did so was dropped, and the answer ends (finishAtBound). */
  let pastBound = false;
  /** The answer would pass maxTextBytes: the event that would have was dropped, and the stream fails. */
  let tooLarge = false;

  // Idle timer without per-chunk timer churn: each read only stamps when it
  // started waiting; the timer wakes once per idle period and re-arms for the
  // remainder. Only time spent waiting on the upstream counts: a slow client
  // (back-pressure, no read pending) is not the upstream being idle.
  let waitingSince: number | undefined;
  let idleFired = false;
  let idleTimer: ReturnType<typeof setTimeout> | undefined;
  const checkIdle = () => {
    const idle = waitingSince === undefined ? 0 : performance.now() - waitingSince;
    if (idle >= opts.idleMs) {
      idleFired = true;
      up.abort(`stream idle for ${opts.idleMs} ms`);
    } else idleTimer = setTimeout(checkIdle, opts.idleMs - idle);
  };
  idleTimer = setTimeout(checkIdle, opts.idleMs);

  /** Set when the gateway ends the stream itself: the read below then fails with this message. */
  let endedBecause: string | undefined;
  const endStream: EndStream = (message) => {
    if (ended || endedBecause !== undefined) return;
    endedBecause = message;
    up.abort(message);
  };

  const end = (outcome: StreamEnd["outcome"], reason?: string) => {
    if (ended) return;
    ended = true;
    clearTimeout(idleTimer);
    opts.open?.delete(endStream);
    // Only the upstream's own failures count against its breaker.
    up.finish(outcome === "done" ? true : outcome === "failed" ? false : null);
    const reported = usage && { promptTokens: usage.promptTokens, completionTokens: completionSoFar(usage, deliveredChars, charsAtUsage) };
    opts.onEnd({ outcome, usage: reported, deliveredChars, ...(reason ? { reason } : {}) });
  };

  /**
   * Counts an event of the answer against the bound the upstream was sent;
   * true when it goes past it: a choice has sent more events of text than its
   * max_tokens (or, where an event's choice cannot be told, the stream more
   * than n × max_tokens). With n = 1 that is one counter.
   */
  const beyondBound = (g: NonNullable<RelayOptions["generation"]>, event: Buffer, at: number, text: number): boolean => {
    if (text > 0) textEvents++;
    if (perChoice && finished) {
      const k = choiceIndexOf(event, at);
      if (k >= 0 && k < perChoice.length) {
        if (text > 0) {
          const seen = (perChoice[k] ?? 0) + 1;
          perChoice[k] = seen;
          if (seen > g.maxTokens) return true;
        }
        if (finishes(event, at)) finished[k] = true;
      }
    }
    return textEvents > g.maxTokens * g.choices;
  };

  /** Handles one complete event (terminator included); returns the bytes for the client, or undefined to drop it. */
  const handle = (received: Buffer): Buffer | undefined => {
    let event = received;
    // [DONE] ends the answer: anything after it (in the same read) is neither relayed nor counted.
    if (sawDone) return undefined;
    /** The length of the event's own line end, which its data ends before. */
    let termLen: number;
    const own = blankLineOf(event);
    if (own && isPlainData(event, own)) termLen = own.length;
    else {
      const plain = plainDataEvent(event, termOut());
      if (plain === "keep") return event; // comments, keep-alives: pass through
      if (plain === "drop") return undefined;
      event = plain;
      termLen = termOut().length;
    }
    let at = dataAt(event);
    // Empty data is no chunk (the SDKs would fail parsing it as JSON): dropped, as plainDataEvent drops it.
    if (at === event.length - termLen) return undefined;
    if (isDone(event, at)) {
      sawDone = true;
      // Asked for usage and none came (an upstream that ignores include_usage), or text came after the
      // last report (a server that reports on the first or on every chunk): the client gets what is
      // counted, as a JSON answer carries it, before [DONE]. Before, such a client's last word on usage
      // was the early report (1 completion token) while the record charged the text after it too.
      if (opts.clientWantsUsage && (usage === undefined || deliveredChars > charsAtUsage)) {
        // Never past the bound the upstream was sent (usage.ts): that is what is charged.
        const completion = completionSoFar(usage, deliveredChars, charsAtUsage);
        usage = { promptTokens: usage?.promptTokens ?? opts.promptEstimate ?? 0, completionTokens: Math.min(completion, opts.bounds?.completionTokens ?? Number.POSITIVE_INFINITY) };
        charsAtUsage = deliveredChars;
        const chunk = {
          id: chunkId ?? "",
          object: "chat.completion.chunk",
          created: Math.floor(Date.now() / 1000),
          model: opts.alias,
          choices: [],
          // The last report's breakdowns, checked again within the counts charged (the completion only grew).
          usage: usageOut(usage, usageBreakdowns),
        };
        return Buffer.concat([Buffer.from(`data: ${JSON.stringify(chunk)}${termOut()}`), event]);
      }
      return event;
    }
    chunkId ??= chunkIdOf(event, at);
    if (isErrorEvent(event, at)) {
      upstreamError = upstreamMessage(event.toString("utf8", at, event.length - termLen)).message;
      return undefined;
    }
    let text = deltaTextBytes(event, scan);
    if (scan.structuredArguments) {
      // Rare (servers that send the arguments parsed): the event is rebuilt with them as text, then counted.
      const rebuilt = textArgumentsEvent(event.toString("utf8", at, event.length - termLen), termOut());
      if (rebuilt) {
        event = rebuilt;
        termLen = termOut().length;
        at = dataAt(event);
        text = deltaTextBytes(event, scan);
      }
    }
    if (gen && beyondBound(gen, event, at, text)) {
      pastBound = true;
      return undefined;
    }
    if (opts.maxTextBytes !== undefined && sentChars + scan.sentBytes > opts.maxTextBytes) {
      tooLarge = true;
      return undefined;
    }
    let reported = false;
    if (carriesUsage(event, at)) {
      // A report that leaves the prompt out (a server reporting it on the first chunk, the completion on the
      // last) keeps the count reported before; before, the estimate took its place.
      const estimate = { promptTokens: usage?.promptTokens ?? opts.promptEstimate ?? 0, completionTokens: charsToTokens(deliveredChars + text) };
      const parsed = usageOf(event.toString("utf8", at, event.length - termLen), estimate, opts.bounds);
      if (parsed) {
        usage = { promptTokens: parsed.counted.promptTokens, completionTokens: parsed.counted.completionTokens };
        usageBreakdowns = parsed.details;
        reported = true;
        if (parsed.counted.rejected) opts.onImplausibleUsage?.(parsed.counted);
        if (!opts.clientWantsUsage && parsed.onlyUsage) {
          charsAtUsage = deliveredChars;
          return undefined;
        }
        if (parsed.rewritten !== undefined) {
          // Rare: the event is rebuilt around the checked figures (and still gets the model swap below).
          event = Buffer.from(`data: ${parsed.rewritten}${termOut()}`);
          termLen = termOut().length;
          at = dataAt(event);
        }
      }
    }
    deliveredChars += text;
    sentChars += scan.sentBytes;
    if (reported) charsAtUsage = deliveredChars;
    // A transform re-serialises the events (the Responses API names the alias itself): no swap to make.
    if (!swap.swapModel || tf) return event;
    return withAlias(event, at, swap);
  };

  /** Where `feed` puts what goes to the client. */
  let feeding: Buffer[] = [];
  /** Each complete upstream event; false (stop reading) once one has ended the stream or the answer ([DONE]). */
  const onEvent = (received: Buffer): boolean => {
    const event = withWholeLineEnd(received);
    sep ??= blankLineOf(event) === CRLF2 ? CRLF2 : LF2;
    const e = handle(event);
    if (upstreamError !== undefined || pastBound || tooLarge) return false;
    if (e) feeding.push(e);
    return !sawDone;
  };

  /** Splits a read into complete events, adding what goes to the client to `out`; a trailing partial event is held for the next read. */
  const feed = (chunk: Uint8Array, out: Buffer[]) => {
    feeding = out;
    framer.push(chunk, onEvent);
  };

  /** Writes events and pushes them out now (one write per upstream read, so no event waits for the next). */
  const send = async (c: ReadableStreamDirectController, out: Uint8Array[]) => {
    if (tf) {
      const text = tf.events(out);
      if (text === "") return;
      const w = c.write(text);
      if (typeof w !== "number") await w;
    } else {
      for (const event of out) {
        const w = c.write(event);
        if (typeof w !== "number") await w;
      }
    }
    const f = c.flush();
    if (typeof f !== "number") await f;
  };

  /** The client went away: stop generation upstream at once. */
  const clientGone = () => {
    up.abort("client disconnected");
    end("client_gone");
    tf?.cancel();
  };

  /** Closes the response once the transform (if any) has finished (a stored Response is written first). */
  const close = async (c: ReadableStreamDirectController) => {
    const f = tf?.finish();
    if (f) await f;
    opts.beforeClose?.();
    c.close();
  };

  /**
   * [DONE] was relayed: the answer is complete and settled now, and the
   * client's response closes. The rest of the upstream's body (normally just
   * the end of its chunked framing) is read and dropped so its connection can
   * be reused; an upstream that sends more, or keeps the body open, is cut
   * after DRAIN_MS. Before, such an upstream held the client until idleMs and
   * then failed a finished stream (an error event after [DONE], a 503), and
   * text sent after [DONE] was relayed and charged.
   */
  const finishAtDone = async (c: ReadableStreamDirectController) => {
    end("done");
    try {
      await close(c);
    } catch {
      // The client left while the transform finished: the request is done all the same.
    }
    const cut = setTimeout(() => up.abort("the upstream went on after [DONE]"), DRAIN_MS);
    try {
      for (;;) if ((await up.reader.read()).done) break;
    } catch {
      // Cut, or the connection went: nothing after [DONE] matters.
    } finally {
      clearTimeout(cut);
    }
  };

  /**
   * The upstream went past the max_tokens it was sent (it ignores the bound):
   * its call is closed (the GPU stops) and the answer ends as one cut at its
   * bound would: a chunk with finish_reason "length" for each choice not yet
   * finished, the usage chunk when the client asked for it, then [DONE]. The
   * completion is charged at most the bound: what the upstream counted or the
   * text delivered (~4 bytes a token), but never less than the events of
   * text seen (each at least one token), and never more than n × max_tokens.
   */
  const finishAtBound = async (c: ReadableStreamDirectController, g: NonNullable<RelayOptions["generation"]>) => {
    up.abort("the upstream went past max_tokens");
    const completion = Math.min(g.maxTokens * g.choices, Math.max(completionSoFar(usage, deliveredChars, charsAtUsage), textEvents));
    usage = { promptTokens: usage?.promptTokens ?? opts.promptEstimate ?? 0, completionTokens: completion };
    charsAtUsage = deliveredChars;
    const term = termOut();
    const head = `data: {"id":${JSON.stringify(chunkId ?? "")},"object":"chat.completion.chunk","created":${Math.floor(Date.now() / 1000)},"model":${JSON.stringify(opts.alias)},"choices":`;
    const closing: Buffer[] = [];
    for (let k = 0; k < g.choices; k++) {
      if (!finished?.[k]) closing.push(Buffer.from(`${head}[{"index":${k},"delta":{},"logprobs":null,"finish_reason":"length"}]}${term}`));
    }
    if (opts.clientWantsUsage) {
      // With the last report's breakdowns, as the chunk added before [DONE] has them.
      closing.push(Buffer.from(`${head}[],"usage":${JSON.stringify(usageOut(usage, usageBreakdowns))}}${term}`));
    }
    closing.push(Buffer.from(`data: [DONE]${term}`));
    try {
      await send(c, closing);
    } catch {
      clientGone();
      return;
    }
    end("bound");
    try {
      await close(c);
    } catch {
      // The client left while the transform finished: the request is done all the same.
    }
  };

  const fail = async (c: ReadableStreamDirectController, message: string) => {
    up.abort(message);
    end(message === endedBecause ? "ended" : "failed", message);
    try {
      await send(c, [errorEvent(opts, message)]);
      await close(c);
    } catch {
      // The client is already gone.
    }
  };

  /**
   * The upstream's reads, relayed until the stream ends. A Bun "direct"
   * stream: events are written straight to the response (awaiting the write is
   * the back-pressure), with no queue, read request or promise per chunk:
   * ~5 KB less per open stream than a pull-based ReadableStream (measured).
   */
  async function relay(c: ReadableStreamDirectController): Promise<void> {
    // Registered once relaying starts, so a response never sent holds no entry (`end` removes it).
    if (ended) return;
    opts.open?.add(endStream);
    if (tf) {
      const first = tf.start();
      try {
        if (first !== "") {
          const w = c.write(first);
          if (typeof w !== "number") await w;
        }
      } catch {
        clientGone();
        return;
      }
    }
    const out: Buffer[] = [];
    try {
      feed(up.first, out);
    } catch (e) {
      return fail(c, `The model '${opts.alias}' sent an unreadable stream: ${(e as Error).message}`);
    }
    for (;;) {
      // Events before an upstream error event still go out, then the error.
      if (out.length > 0) {
        try {
          await send(c, out);
        } catch {
          clientGone();
          return;
        }
        out.length = 0;
      }
      if (ended) return;
      if (upstreamError !== undefined) return fail(c, `The model '${opts.alias}' failed while generating: ${upstreamError}`);
      // The transform failed the answer itself (its final events are sent): nothing more would be, so the
      // upstream call is closed now and the stream ends as failed, rather than running silent to its end.
      // Before [DONE] is looked at: a read that carried both ended as the failure the client saw, not as done.
      const failed = tf?.failed();
      if (failed !== undefined) return fail(c, failed);
      if (sawDone) return finishAtDone(c);
      if (pastBound && gen) return finishAtBound(c, gen);
      if (tooLarge) {
        return fail(
          c,
          `The model '${opts.alias}' sent an answer larger than ${opts.maxTextBytes} bytes, the most the gateway holds for one answer (upstream.maxResponseBytes); the stream was ended.`,
        );
      }
      waitingSince = performance.now();
      let r: Awaited<ReturnType<Opened["reader"]["read"]>>;
      try {
        r = await up.reader.read();
      } catch {
        if (ended) return;
        if (opts.signal.aborted) {
          end("client_gone");
          return;
        }
        return fail(
          c,
          endedBecause ??
            (idleFired
              ? `The model '${opts.alias}' stopped sending for ${opts.idleMs} ms; the stream was ended.`
              : `The connection to the model '${opts.alias}' was lost mid-stream.`),
        );
      }
      waitingSince = undefined;
      if (ended) return;
      if (r.done) {
        // No event at all, and one JSON document: a server that does not stream answered whole (whole-answer.ts).
        const body = sep === undefined && framer.pendingBytes > 0 && endedBecause === undefined ? framer.pending() : undefined;
        const whole = body ? wholeAnswer(body, opts.alias) : undefined;
        if (whole && "error" in whole) upstreamError = upstreamMessage(String(body)).message;
        else if (whole) {
          framer.reset();
          feed(whole.events, out);
        }
        // [DONE] ends a stream before its body does (finishAtDone): a body that ends first was cut off.
        else return fail(c, endedBecause ?? `The model '${opts.alias}' ended the stream early.`);
        continue;
      }
      try {
        feed(r.value, out);
      } catch (e) {
        return fail(c, `The model '${opts.alias}' sent an unreadable stream: ${(e as Error).message}`);
      }
    }
  }

  return new ReadableStream<Uint8Array>({
    type: "direct",
    pull: relay,
    cancel: clientGone,
  } satisfies import("bun").DirectUnderlyingSource<Uint8Array>);
}
