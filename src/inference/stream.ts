import type { ErrorCode } from "../lib/errors.ts";
import type { RelayTransform } from "../lib/relay-transform.ts";
import { readEvent, SseFramer } from "../lib/sse.ts";
import type { Opened } from "./upstream/index.ts";
import { upstreamMessage } from "./upstream/error-body.ts";
import { isRecord } from "../lib/guards.ts";
import { charsToTokens } from "./tokens.ts";
import { type Counted, type UsageBounds, countUsage } from "./usage.ts";
import { wholeAnswer } from "./whole-answer.ts";

/**
 * SSE passthrough: the upstream's bytes go to the client event by event, with
 * no JSON parse or re-serialisation of ordinary chunks. Per event we only
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
   * delivered after that report (~4 characters a token): a server that
   * reports usage early (on the first chunk, or on every chunk) and is then
   * cut off has not counted what followed.
   */
  usage: { promptTokens: number; completionTokens: number } | undefined;
  /** Bytes of delta text delivered to the client. */
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
   * The most delta text (bytes, as `deliveredChars` counts them) the stream
   * may carry; an event that would pass it is dropped and the stream fails
   * there, its upstream call closed. Set for a transform that holds the whole
   * answer (the Responses API keeps it for its final event and the store):
   * what it holds is bounded as a non-streamed answer is (upstream.maxResponseBytes).
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

const LF2 = Buffer.from("\n\n");
const CRLF2 = Buffer.from("\r\n\r\n");
const LF1 = Buffer.from("\n");
const LF = 0x0a;
const CR = 0x0d;
const DATA = Buffer.from("data:");
const DONE = Buffer.from("[DONE]");
const USAGE = Buffer.from('"usage":');
const CHOICES = Buffer.from('"choices":');
const DELTA = Buffer.from('"delta":');
const INDEX = Buffer.from('"index":');
const FINISH_REASON = Buffer.from('"finish_reason":');
/** A chunk's `"id"` near its start (vLLM writes it first): a JSON string, escapes included. */
const CHUNK_ID = /^\{\s*"id"\s*:\s*("(?:[^"\\]|\\.){0,256}")/;

/** The id of a chunk (`data` from `at`), or "" when it has none we can read: looked up once per stream. */
function chunkIdOf(event: Buffer, at: number): string {
  const m = CHUNK_ID.exec(event.toString("utf8", at, Math.min(event.length, at + 300)));
  if (!m?.[1]) return "";
  try {
    const id = JSON.parse(m[1]) as unknown;
    return typeof id === "string" ? id : "";
  } catch {
    return "";
  }
}
/** Keys whose string values are delta text; the value's quote may follow a space (Python's default separators). */
const TEXT_FIELDS = ['"content":', '"arguments":', '"refusal":'].map((s) => Buffer.from(s));
const ARGUMENTS = TEXT_FIELDS[1];
/** vLLM's reasoning text, under its older name, its newer one, or both (the same text): counted once. */
const REASONING_FIELDS = ['"reasoning_content":', '"reasoning":'].map((s) => Buffer.from(s));
const ERROR_PREFIXES = ['{"error"', '{"object":"error"', '{"object": "error"'].map((s) => Buffer.from(s));
/** How long the rest of an upstream's body may take after [DONE] (normally the end of its chunked framing, at once). */
const DRAIN_MS = 1_000;
const QUOTE = 0x22;
const BACKSLASH = 0x5c;
const SPACE = 0x20;
const OPEN_BRACE = 0x7b;
const OPEN_BRACKET = 0x5b;

/** Length of the JSON string starting at `start` (just after its opening quote), escapes included. */
function jsonStringBytes(b: Buffer, start: number): number {
  for (let i = start; i < b.length; i++) {
    const c = b[i];
    if (c === BACKSLASH) i++;
    else if (c === QUOTE) return i - start;
  }
  return b.length - start;
}

/** What a scan of an event's delta text saw besides its bytes (one per stream, reused for each event). */
interface DeltaScan {
  /** A tool call's arguments are a JSON object or array, not a string (`textArgumentsEvent`). */
  structuredArguments: boolean;
}

/**
 * Bytes of every string value of `field` (a key with its colon) in the event:
 * each choice's (`n`), each parallel tool call's. `"content":"…"` and
 * `"content": "…"` alike: servers built on Python's json write the second.
 * With `scan`, a value that opens an object or an array is noted there.
 */
function fieldBytes(event: Buffer, field: Buffer, scan?: DeltaScan): number {
  let n = 0;
  let at = event.indexOf(field);
  while (at !== -1) {
    let v = at + field.length;
    while (event[v] === SPACE) v++;
    if (event[v] !== QUOTE) {
      if (scan && (event[v] === OPEN_BRACE || event[v] === OPEN_BRACKET)) scan.structuredArguments = true;
      at = event.indexOf(field, v);
      continue;
    }
    const len = jsonStringBytes(event, v + 1);
    n += len;
    at = event.indexOf(field, v + 1 + len);
  }
  return n;
}

/** Bytes of delta text in the event; `scan` notes tool-call arguments that are not a string. */
function deltaTextBytes(event: Buffer, scan: DeltaScan): number {
  scan.structuredArguments = false;
  let n = 0;
  for (const f of TEXT_FIELDS) n += fieldBytes(event, f, f === ARGUMENTS ? scan : undefined);
  let reasoning = 0;
  for (const f of REASONING_FIELDS) reasoning = Math.max(reasoning, fieldBytes(event, f));
  return n + reasoning;
}

/**
 * The index of the one choice an event carries (vLLM sends each choice in an
 * event of its own, `"choices":[{"index":K,"delta":…`), or -1 when it carries
 * several or its index is not found before its delta: such an event counts
 * only towards the stream's total. `"delta":` is found only as a key (inside
 * a JSON string its closing quote would be escaped); a tool call's `"index"`
 * lies inside the delta, after it.
 */
function choiceIndexOf(event: Buffer, at: number): number {
  const c = event.indexOf(CHOICES, at);
  if (c === -1) return -1;
  const d = event.indexOf(DELTA, c);
  if (d === -1 || event.indexOf(DELTA, d + DELTA.length) !== -1) return -1;
  const i = event.lastIndexOf(INDEX, d);
  if (i < c) return -1;
  let v = i + INDEX.length;
  while (event[v] === SPACE) v++;
  let k = 0;
  const first = v;
  for (let b = event[v]; b !== undefined && b >= 0x30 && b <= 0x39 && v - first < 4; b = event[++v]) k = k * 10 + b - 0x30;
  return v === first ? -1 : k;
}

/** The event gives a finish_reason (a string, not null); asked of one-choice events only. */
function finishes(event: Buffer, at: number): boolean {
  const f = event.indexOf(FINISH_REASON, at);
  if (f === -1) return false;
  let v = f + FINISH_REASON.length;
  while (event[v] === SPACE) v++;
  return event[v] === QUOTE;
}

/** Byte by byte: the prefixes are a few bytes, shorter than a call into Buffer.compare costs. */
function startsWithAt(b: Buffer, at: number, prefix: Buffer): boolean {
  if (b.length - at < prefix.length) return false;
  for (let i = 0; i < prefix.length; i++) if (b[at + i] !== prefix[i]) return false;
  return true;
}

/**
 * The usage in an event's JSON, its counts checked (usage.ts). When one had
 * to be replaced, or its total_tokens is not the sum of the two (or absent),
 * `rewritten` is the event's JSON with the figures counted and their sum, so
 * the client never sees what the upstream made up, nor a total other than
 * what is charged (a JSON answer's usage is rebuilt the same way).
 */
function usageOf(
  payload: string,
  estimate: { promptTokens: number; completionTokens: number },
  bounds: UsageBounds | undefined,
): { counted: Counted; onlyUsage: boolean; rewritten: string | undefined } | undefined {
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
  if (!counted.rejected && v.usage.total_tokens === p + c) return { counted, onlyUsage, rewritten: undefined };
  const usage = { ...v.usage, prompt_tokens: p, completion_tokens: c, total_tokens: p + c };
  return { counted, onlyUsage, rewritten: JSON.stringify({ ...v, usage }) };
}

/**
 * The event with each tool call's `function.arguments` that is a JSON object
 * or array replaced by its JSON text: some OpenAI-compatible servers send the
 * arguments parsed, where the SDKs take a string (the openai SDK appends it to
 * the text so far, "[object Object]"; the Vercel AI SDK refuses the chunk).
 * Only an event whose scan saw such arguments is parsed. Undefined when there
 * is nothing to replace or it cannot be done (the event then goes on as sent).
 */
function textArgumentsEvent(payload: string, term: string): Buffer | undefined {
  let v: unknown;
  try {
    v = JSON.parse(payload);
  } catch {
    return undefined;
  }
  if (!isRecord(v) || !Array.isArray(v.choices)) return undefined;
  let replaced = false;
  try {
    for (const c of v.choices) {
      if (!isRecord(c) || !isRecord(c.delta) || !Array.isArray(c.delta.tool_calls)) continue;
      for (const tc of c.delta.tool_calls) {
        if (!isRecord(tc) || !isRecord(tc.function)) continue;
        const args = tc.function.arguments;
        if (typeof args !== "object" || args === null) continue;
        tc.function.arguments = JSON.stringify(args);
        replaced = true;
      }
    }
    return replaced ? Buffer.from(`data: ${JSON.stringify(v)}${term}`) : undefined;
  } catch {
    // Nesting too deep to serialise again (JSON.stringify recurses: a RangeError): as sent.
    return undefined;
  }
}

function errorEvent(opts: RelayOptions, message: string): Uint8Array {
  return Buffer.from(`data: ${JSON.stringify(opts.errorBody("service_unavailable", message))}\n\n`);
}

interface SwapFields {
  modelField: Buffer;
  /** As servers using Python's default separators write it: `"model": "…"`. */
  spacedModelField: Buffer;
  aliasField: Buffer;
  swapModel: boolean;
}

/**
 * The byte patterns of the model swap, made once per target and alias (both
 * come from the configuration, so the cache is as small as it is) rather than
 * four buffers and a string round trip per stream.
 */
const swapFieldCache = new WeakMap<Opened["target"], Map<string, SwapFields>>();
function swapFields(target: Opened["target"], alias: string): SwapFields {
  let byAlias = swapFieldCache.get(target);
  if (!byAlias) {
    byAlias = new Map();
    swapFieldCache.set(target, byAlias);
  }
  let f = byAlias.get(alias);
  if (!f) {
    const modelField = Buffer.from(target.modelField);
    const aliasField = Buffer.from(`"model":${JSON.stringify(alias)}`);
    f = {
      modelField,
      spacedModelField: Buffer.from(modelField.toString().replace('"model":', '"model": ')),
      aliasField,
      swapModel: !modelField.equals(aliasField),
    };
    byAlias.set(alias, f);
  }
  return f;
}

/** The line end an event (its blank line included) ends with, when it is `\n\n` or `\r\n\r\n` (the only ones a plain event has). */
function blankLineOf(event: Buffer): Buffer | undefined {
  const n = event.length;
  if (event[n - 1] !== LF) return undefined;
  if (event[n - 2] === LF) return LF2;
  return event[n - 2] === CR && event[n - 3] === LF && event[n - 4] === CR ? CRLF2 : undefined;
}

/**
 * Whether an event (its terminator `sep` included) is one `data:` line, as
 * vLLM's all are, rather than anything else SSE allows: other fields
 * (`event:`, `id:`, `retry:`), comment lines, data over several `data:`
 * lines, other line ends. Two byte searches.
 */
function isPlainData(event: Buffer, sep: Buffer): boolean {
  if (!startsWithAt(event, 0, DATA)) return false;
  const end = event.length - sep.length;
  const lf = event.indexOf(LF);
  return sep === LF2 ? lf === end && event.indexOf(CR) === -1 : lf === end + 1 && event.indexOf(CR) === end;
}

/**
 * An event that is not one `data:` line, as what the chat wire carries
 * (OpenAI's streams have nothing but `data:` lines and comments), read the
 * way an SSE client reads it (lib/sse.ts): its `data:` lines joined (a JSON
 * text split over lines is made one line again), the other fields dropped.
 * Without this, such events were relayed unread: their text and usage
 * uncounted, their error and bound unchecked. `keep` for an event of
 * comments only (a keep-alive, passed on as it is), `drop` for one without
 * data or with empty data (nothing a chat client can read: the SDKs parse
 * each event's data as JSON).
 */
export function plainDataEvent(event: Buffer, term: string): Buffer | "keep" | "drop" {
  const { data, comments, others } = readEvent(event);
  if (data === undefined) return comments > 0 && others === 0 ? "keep" : "drop";
  if (data === "") return "drop";
  let payload = data;
  if (data.includes("\n")) {
    try {
      // The line feeds SSE joins with are white space to JSON, and JSON has no raw line feed inside a string.
      payload = JSON.stringify(JSON.parse(data));
    } catch {
      // Not JSON: relayed as its lines, as it came (a client fails on it as it would on the upstream's).
      payload = data.replaceAll("\n", "\ndata: ");
    }
  }
  return Buffer.from(`data: ${payload}${term}`);
}

export function relayStream(up: Opened, opts: RelayOptions): ReadableStream<Uint8Array> {
  const { modelField, spacedModelField, aliasField, swapModel } = swapFields(up.target, opts.alias);
  const tf = opts.transform;
  /** The upstream's events, as SSE reads them (lib/sse.ts). */
  const framer = new SseFramer();
  /** How the upstream's first event ended (undefined until one has). */
  let sep: Buffer | undefined;
  /** The line ends of the events the gateway writes itself: the upstream's first event's CRLF, else LF. */
  const termOut = () => (sep === CRLF2 ? "\r\n\r\n" : "\n\n");
  const scan: DeltaScan = { structuredArguments: false };
  let sawDone = false;
  let usage: StreamEnd["usage"];
  /** The upstream's chunk id (read from its first chunk), for a usage chunk the gateway adds. */
  let chunkId: string | undefined;
  let deliveredChars = 0;
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
    const reported = usage && { promptTokens: usage.promptTokens, completionTokens: usage.completionTokens + charsToTokens(deliveredChars - charsAtUsage) };
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
    let at = DATA.length;
    if (event[at] === SPACE) at++;
    // Empty data is no chunk (the SDKs would fail parsing it as JSON): dropped, as plainDataEvent drops it.
    if (at === event.length - termLen) return undefined;
    if (startsWithAt(event, at, DONE)) {
      sawDone = true;
      // Asked for usage and none came (an upstream that ignores include_usage), or text came after the
      // last report (a server that reports on the first or on every chunk): the client gets what is
      // counted, as a JSON answer carries it, before [DONE]. Before, such a client's last word on usage
      // was the early report (1 completion token) while the record charged the text after it too.
      if (opts.clientWantsUsage && (usage === undefined || deliveredChars > charsAtUsage)) {
        // Never past the bound the upstream was sent (usage.ts): that is what is charged.
        const completion = usage === undefined ? charsToTokens(deliveredChars) : usage.completionTokens + charsToTokens(deliveredChars - charsAtUsage);
        usage = { promptTokens: usage?.promptTokens ?? opts.promptEstimate ?? 0, completionTokens: Math.min(completion, opts.bounds?.completionTokens ?? Number.POSITIVE_INFINITY) };
        charsAtUsage = deliveredChars;
        const chunk = {
          id: chunkId ?? "",
          object: "chat.completion.chunk",
          created: Math.floor(Date.now() / 1000),
          model: opts.alias,
          choices: [],
          usage: { prompt_tokens: usage.promptTokens, completion_tokens: usage.completionTokens, total_tokens: usage.promptTokens + usage.completionTokens },
        };
        return Buffer.concat([Buffer.from(`data: ${JSON.stringify(chunk)}${termOut()}`), event]);
      }
      return event;
    }
    chunkId ??= chunkIdOf(event, at);
    // Every error prefix starts `{"e` or `{"o` (a chunk starts `{"id"`).
    if (event[at] === OPEN_BRACE && event[at + 1] === QUOTE && (event[at + 2] === 0x65 || event[at + 2] === 0x6f) && ERROR_PREFIXES.some((p) => startsWithAt(event, at, p))) {
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
        at = DATA.length + 1;
        text = deltaTextBytes(event, scan);
      }
    }
    if (gen && beyondBound(gen, event, at, text)) {
      pastBound = true;
      return undefined;
    }
    if (opts.maxTextBytes !== undefined && deliveredChars + text > opts.maxTextBytes) {
      tooLarge = true;
      return undefined;
    }
    let reported = false;
    const u = event.indexOf(USAGE, at);
    if (u !== -1) {
      let v = u + USAGE.length;
      while (event[v] === SPACE) v++;
      if (event[v] === OPEN_BRACE) {
        // A report that leaves the prompt out (a server reporting it on the first chunk, the completion on the
        // last) keeps the count reported before; before, the estimate took its place.
        const estimate = { promptTokens: usage?.promptTokens ?? opts.promptEstimate ?? 0, completionTokens: charsToTokens(deliveredChars + text) };
        const parsed = usageOf(event.toString("utf8", at, event.length - termLen), estimate, opts.bounds);
        if (parsed) {
          usage = { promptTokens: parsed.counted.promptTokens, completionTokens: parsed.counted.completionTokens };
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
            at = DATA.length + 1;
          }
        }
      }
    }
    deliveredChars += text;
    if (reported) charsAtUsage = deliveredChars;
    // A transform re-serialises the events (the Responses API names the alias itself): no swap to make.
    if (!swapModel || tf) return event;
    let field = modelField;
    let m = event.indexOf(field, at);
    if (m === -1) {
      // Servers that serialise with Python's default separators write `"model": "…"`.
      field = spacedModelField;
      m = event.indexOf(field, at);
      if (m === -1) return event;
    }
    const out = Buffer.allocUnsafe(event.length - field.length + aliasField.length);
    event.copy(out, 0, 0, m);
    aliasField.copy(out, m);
    event.copy(out, m + aliasField.length, m + field.length);
    return out;
  };

  /** Where `feed` puts what goes to the client. */
  let feeding: Buffer[] = [];
  /** Each complete upstream event; false (stop reading) once one has ended the stream or the answer ([DONE]). */
  const onEvent = (received: Buffer): boolean => {
    // A read that ended between the two bytes of a CRLF event's last line end: the event is complete
    // (lib/sse.ts drops the LF that may follow), and is relayed as a CRLF event, as it would have been
    // read whole. Rare (a read ending just there): the one copy it costs.
    const n = received.length;
    const event = received[n - 1] === CR && received[n - 2] === LF && received[n - 3] === CR ? Buffer.concat([received, LF1]) : received;
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
   * text delivered (~4 characters a token), but never less than the events of
   * text seen (each at least one token), and never more than n × max_tokens.
   */
  const finishAtBound = async (c: ReadableStreamDirectController, g: NonNullable<RelayOptions["generation"]>) => {
    up.abort("the upstream went past max_tokens");
    const counted = usage ? usage.completionTokens + charsToTokens(deliveredChars - charsAtUsage) : charsToTokens(deliveredChars);
    const completion = Math.min(g.maxTokens * g.choices, Math.max(counted, textEvents));
    usage = { promptTokens: usage?.promptTokens ?? opts.promptEstimate ?? 0, completionTokens: completion };
    charsAtUsage = deliveredChars;
    const term = termOut();
    const head = `data: {"id":${JSON.stringify(chunkId ?? "")},"object":"chat.completion.chunk","created":${Math.floor(Date.now() / 1000)},"model":${JSON.stringify(opts.alias)},"choices":`;
    const closing: Buffer[] = [];
    for (let k = 0; k < g.choices; k++) {
      if (!finished?.[k]) closing.push(Buffer.from(`${head}[{"index":${k},"delta":{},"logprobs":null,"finish_reason":"length"}]}${term}`));
    }
    if (opts.clientWantsUsage) {
      const { promptTokens: p, completionTokens: t } = usage;
      closing.push(Buffer.from(`${head}[],"usage":{"prompt_tokens":${p},"completion_tokens":${t},"total_tokens":${p + t}}}${term}`));
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
