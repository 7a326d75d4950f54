import { isRecord } from "../lib/guards.ts";
import { readEvent } from "../lib/sse.ts";
import type { Opened } from "./upstream/index.ts";

/**
 * What a chat chunk's bytes say, read without parsing it: where its data
 * begins, whether it is [DONE] or an upstream error, its id, the bytes of its
 * delta text, which choice it carries and whether that choice finishes,
 * whether it has a usage object, and the model it names swapped for the alias.
 * The relay (stream.ts) asks these of every event it passes on.
 *
 * On bytes, not on parsed JSON: this is the hot path of every streamed token,
 * and a parse and re-serialisation per chunk costs more than the few byte
 * searches each answer takes. The searches are sound on JSON because a key
 * pattern (`"content"`, `"model"` followed by a colon, with any JSON white
 * space around it: `keyValueAt`) cannot match inside a string value: there,
 * a quote is escaped. Only the rare event these cannot read (a usage
 * object, tool-call arguments sent as JSON rather than text, an event that
 * is not one `data:` line) is parsed (`textArgumentsEvent`, `plainDataEvent`;
 * the usage in stream.ts).
 */

export const LF2 = Buffer.from("\n\n");
export const CRLF2 = Buffer.from("\r\n\r\n");
const LF1 = Buffer.from("\n");
const LF = 0x0a;
const CR = 0x0d;
const DATA = Buffer.from("data:");
const DONE = Buffer.from("[DONE]");
/** Keys, with their quotes: found with any JSON white space around their colon (`keyValueAt`). */
const USAGE = Buffer.from('"usage"');
const CHOICES = Buffer.from('"choices"');
const DELTA = Buffer.from('"delta"');
const INDEX = Buffer.from('"index"');
const FINISH_REASON = Buffer.from('"finish_reason"');
/**
 * A chunk's `"id"` near its start (vLLM writes it first): a JSON string, escapes included; JSON white space may
 * stand before the brace too (the SSE field drops one space after `data:`, not two, nor a tab).
 */
const CHUNK_ID = /^[ \t\r\n]*\{[ \t\r\n]*"id"[ \t\r\n]*:[ \t\r\n]*("(?:[^"\\]|\\.){0,256}")/;

/** The id of a chunk (`data` from `at`), or "" when it has none we can read: looked up once per stream. */
export function chunkIdOf(event: Buffer, at: number): string {
  const m = CHUNK_ID.exec(event.toString("utf8", at, Math.min(event.length, at + 300)));
  if (!m?.[1]) return "";
  try {
    const id = JSON.parse(m[1]) as unknown;
    return typeof id === "string" ? id : "";
  } catch {
    return "";
  }
}
/** Keys whose string values are delta text; white space may stand around the colon (Python's default separators: `": "`). */
const TEXT_FIELDS = ['"content"', '"arguments"', '"refusal"'].map((s) => Buffer.from(s));
const ARGUMENTS = TEXT_FIELDS[1];
/** vLLM's reasoning text, under its older name, its newer one, or both (the same text): counted once. */
const REASONING_FIELDS = ['"reasoning_content"', '"reasoning"'].map((s) => Buffer.from(s));
/** An error event's first key (`{"error"…`, FastAPI's `{"detail"…`), or `"object"` with the value `"error"` (older vLLM). */
const ERROR_KEY = Buffer.from('"error"');
const DETAIL_KEY = Buffer.from('"detail"');
const OBJECT_KEY = Buffer.from('"object"');
const QUOTE = 0x22;
const BACKSLASH = 0x5c;
const SPACE = 0x20;
const OPEN_BRACE = 0x7b;
const OPEN_BRACKET = 0x5b;
const TAB = 0x09;
const COLON = 0x3a;
const ZERO = 0x30;

/** JSON white space: what may stand before and after a key's colon. */
function isSpace(c: number | undefined): boolean {
  return c === SPACE || c === TAB || c === LF || c === CR;
}

/** Set by keyValueAt: where the key it found begins (its opening quote). */
let keyFound = -1;

/**
 * `b[i]` is just past a key's closing quote: where its value begins, past the
 * colon and any JSON white space before and after it; -1 when no colon
 * follows (the string was a value, not a key).
 */
function valueAfterKey(b: Buffer, i: number): number {
  let v = i;
  while (isSpace(b[v])) v++;
  if (b[v] !== COLON) return -1;
  v++;
  while (isSpace(b[v])) v++;
  return v;
}

/**
 * Where the value of the first `key` (a JSON string, its quotes included:
 * `"usage"`) from `from` begins: past its colon and any JSON white space
 * before and after it (`"usage":{`, `"usage": {`, `"usage" :\t{`); -1 when no
 * such key is found. `keyFound` is set to where the key begins. An
 * occurrence not followed by a colon is a string value, not a key, and is
 * passed over. Inside a JSON string every quote is escaped, so `"usage"`
 * with both its quotes is not found in text (`\"usage\" : 1` is text).
 */
function keyValueAt(b: Buffer, key: Buffer, from: number): number {
  for (let k = b.indexOf(key, from); k !== -1; k = b.indexOf(key, k + 1)) {
    const v = valueAfterKey(b, k + key.length);
    if (v === -1) continue;
    keyFound = k;
    return v;
  }
  return -1;
}

/** keyValueAt backwards: the last `key` that begins at `from` or after and before `before`; where its value begins, or -1. */
function lastKeyValueAt(b: Buffer, key: Buffer, from: number, before: number): number {
  for (let k = before > 0 ? b.lastIndexOf(key, before - 1) : -1; k !== -1 && k >= from; k = k > 0 ? b.lastIndexOf(key, k - 1) : -1) {
    const v = valueAfterKey(b, k + key.length);
    if (v !== -1) return v;
  }
  return -1;
}

/** Where an event's data begins: after `data:` and the one space that may follow it. */
export function dataAt(event: Buffer): number {
  return event[DATA.length] === SPACE ? DATA.length + 1 : DATA.length;
}

/** The data (from `at`) is `[DONE]`. */
export function isDone(event: Buffer, at: number): boolean {
  return startsWithAt(event, at, DONE);
}

/**
 * The data (from `at`) is an upstream error (`{"error"…`, `{"object":"error"…`,
 * FastAPI's `{"detail"…`), not a chunk: with any JSON white space before and
 * inside the brace and around the colon (`{ "object" : "error"…`).
 */
export function isErrorEvent(event: Buffer, at: number): boolean {
  let i = at;
  while (isSpace(event[i])) i++;
  if (event[i] !== OPEN_BRACE) return false;
  i++;
  while (isSpace(event[i])) i++;
  // Every error's first key starts `"e`, `"o` or `"d` (a chunk's, `"id"`).
  const c = event[i + 1];
  if (event[i] !== QUOTE || (c !== 0x65 && c !== 0x6f && c !== 0x64)) return false;
  if (startsWithAt(event, i, ERROR_KEY) || startsWithAt(event, i, DETAIL_KEY)) return true;
  if (!startsWithAt(event, i, OBJECT_KEY)) return false;
  const v = valueAfterKey(event, i + OBJECT_KEY.length);
  return v !== -1 && startsWithAt(event, v, ERROR_KEY);
}

/**
 * Set by jsonStringBytes: the string it measured holds a backslash, so its
 * length as sent is not its text's UTF-8 bytes (decodedBytes counts those).
 * One flag, not a second return value: this runs for every string of every
 * streamed event, and a string without escapes (nearly all of them) costs no
 * more than before.
 */
let escaped = false;

/** Length of the JSON string starting at `start` (just after its opening quote) as sent, escapes included; notes an escape in `escaped`. */
function jsonStringBytes(b: Buffer, start: number): number {
  for (let i = start; i < b.length; i++) {
    const c = b[i];
    if (c === BACKSLASH) {
      escaped = true;
      i++;
    } else if (c === QUOTE) return i - start;
  }
  return b.length - start;
}

const U = 0x75;

/** The value of the 4 hex digits at `at` (before `end`), or -1 when they are not 4 hex digits. */
function hex4(b: Buffer, at: number, end: number): number {
  if (at + 4 > end) return -1;
  let v = 0;
  for (let i = at; i < at + 4; i++) {
    const c = b[i] ?? 0;
    const d = c >= 0x30 && c <= 0x39 ? c - 0x30 : c >= 0x61 && c <= 0x66 ? c - 0x57 : c >= 0x41 && c <= 0x46 ? c - 0x37 : -1;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

/**
 * UTF-8 bytes of the text a JSON string's bytes (`start` to `end`, between
 * its quotes) stand for, read without parsing: a byte that is no escape is
 * one byte of the text; `\n`, `\"`, `\\`, `\/` and the other one-letter
 * escapes one byte each; `\uXXXX` the bytes of its code point (1 to 3), a
 * surrogate pair 4, a lone surrogate 3 (U+FFFD, as TextEncoder and
 * Buffer.byteLength make it). So a server that writes non-ASCII as `\uXXXX`
 * (Python's json.dumps default) is counted what one writing UTF-8 is, and
 * what a whole answer, parsed, is counted (tokens.ts utf8). A malformed escape
 * counts one byte for its backslash and letter: never less than one a string
 * that has text, never more than it was sent as.
 */
function decodedBytes(b: Buffer, start: number, end: number): number {
  let n = 0;
  for (let i = start; i < end; i++) {
    if (b[i] !== BACKSLASH) {
      n++;
      continue;
    }
    n++;
    i++;
    if (b[i] !== U) continue;
    const cu = hex4(b, i + 1, end);
    if (cu < 0) continue;
    i += 4;
    if (cu < 0x80) continue;
    if (cu < 0x800) {
      n += 1;
      continue;
    }
    if (cu >= 0xd800 && cu <= 0xdbff && b[i + 1] === BACKSLASH && b[i + 2] === U) {
      const low = hex4(b, i + 3, end);
      if (low >= 0xdc00 && low <= 0xdfff) {
        // A surrogate pair: one code point beyond the BMP, 4 bytes.
        n += 3;
        i += 6;
        continue;
      }
    }
    // The rest of the BMP, and a lone surrogate (U+FFFD): 3 bytes.
    n += 2;
  }
  return n;
}

/** What a scan of an event's delta text saw besides its bytes (one per stream, reused for each event). */
export interface DeltaScan {
  /** A tool call's arguments are a JSON object or array, not a string (`textArgumentsEvent`). */
  structuredArguments: boolean;
  /**
   * The delta text's bytes as sent, escapes included (deltaTextBytes counts
   * the text's own UTF-8 bytes): the Responses API bounds what it holds by
   * these, since it writes the text again as JSON (stream.ts, maxTextBytes).
   */
  sentBytes: number;
}

/**
 * UTF-8 bytes of the text of every string value of `field` (a key with its
 * quotes) in the event: each choice's (`n`), each parallel tool call's.
 * `"content":"…"`, `"content": "…"` (servers built on Python's json write
 * it) and any other JSON white space around the colon alike. Adds the
 * strings' bytes as sent to `scan.sentBytes`; a value that opens an object
 * or an array is noted there when `structured`.
 */
function fieldBytes(event: Buffer, field: Buffer, scan: DeltaScan, structured: boolean): number {
  let n = 0;
  let v = keyValueAt(event, field, 0);
  while (v !== -1) {
    if (event[v] !== QUOTE) {
      if (structured && (event[v] === OPEN_BRACE || event[v] === OPEN_BRACKET)) scan.structuredArguments = true;
      v = keyValueAt(event, field, v);
      continue;
    }
    escaped = false;
    const len = jsonStringBytes(event, v + 1);
    // Only a string with an escape is read again, byte by byte; the rest are their length as sent.
    n += escaped ? decodedBytes(event, v + 1, v + 1 + len) : len;
    scan.sentBytes += len;
    v = keyValueAt(event, field, v + 1 + len);
  }
  return n;
}

/**
 * UTF-8 bytes of the delta text in the event (its decoded text, whatever
 * escapes it was written with); `scan` notes tool-call arguments that are not
 * a string, and the text's bytes as sent.
 */
export function deltaTextBytes(event: Buffer, scan: DeltaScan): number {
  scan.structuredArguments = false;
  scan.sentBytes = 0;
  let n = 0;
  for (const f of TEXT_FIELDS) n += fieldBytes(event, f, scan, f === ARGUMENTS);
  const sent = scan.sentBytes;
  let reasoning = 0;
  let reasoningSent = 0;
  for (const f of REASONING_FIELDS) {
    scan.sentBytes = 0;
    reasoning = Math.max(reasoning, fieldBytes(event, f, scan, false));
    reasoningSent = Math.max(reasoningSent, scan.sentBytes);
  }
  scan.sentBytes = sent + reasoningSent;
  return n + reasoning;
}

/**
 * The index of the one choice an event carries (vLLM sends each choice in an
 * event of its own, `"choices":[{"index":K,"delta":…`), or -1 when it carries
 * several, its index is not found before its delta, or the index is not
 * written as a plain integer from 0 to 9999 (digits, no leading zero, then
 * `,`, `}` or white space: not `1.5`, `1e0`, `-1`, `"1"`, `01`): such an
 * event counts only towards the stream's total, and with n > 1 is parsed and
 * renumbered (stream.ts, `Relay.renumbered`). Before, the leading digits were
 * read, so `1.5` was choice 1 here while the client got 1.5 as sent.
 * `"delta":` is found only as a key (inside a JSON string its closing quote
 * would be escaped); a tool call's `"index"` lies inside the delta, after it.
 */
export function choiceIndexOf(event: Buffer, at: number): number {
  const c = keyValueAt(event, CHOICES, at);
  if (c === -1) return -1;
  const d = keyValueAt(event, DELTA, c);
  if (d === -1) return -1;
  const delta = keyFound;
  if (keyValueAt(event, DELTA, d) !== -1) return -1;
  let v = lastKeyValueAt(event, INDEX, c, delta);
  if (v === -1) return -1;
  let k = 0;
  const first = v;
  for (let b = event[v]; b !== undefined && b >= 0x30 && b <= 0x39 && v - first < 4; b = event[++v]) k = k * 10 + b - 0x30;
  if (v === first || (event[first] === ZERO && v - first > 1)) return -1;
  // The byte after the digits ends the number: else it was not all of it (a fraction, an exponent, a fifth digit).
  const after = event[v];
  return after === COMMA || after === CLOSE_BRACE || isSpace(after) ? k : -1;
}

/** The data (from `at`) has a `"choices":` key whose value is not an empty array (a usage-only chunk's `[]`). */
export function carriesChoices(event: Buffer, at: number): boolean {
  let v = keyValueAt(event, CHOICES, at);
  if (v === -1) return false;
  if (event[v] !== OPEN_BRACKET) return true;
  do v++;
  while (isSpace(event[v]));
  return event[v] !== CLOSE_BRACKET;
}

/** A chunk's data parsed, when it is an object with a `choices` list (the rare events rewritten below); else undefined. */
function parsedChunk(payload: string): (Record<string, unknown> & { choices: unknown[] }) | undefined {
  let v: unknown;
  try {
    v = JSON.parse(payload);
  } catch {
    return undefined;
  }
  return isRecord(v) && Array.isArray(v.choices) ? (v as Record<string, unknown> & { choices: unknown[] }) : undefined;
}

/**
 * The event with each choice's `index` replaced by `indexFor(index)`, parsed
 * and written again: the rare event of a choice the answer numbers otherwise
 * than the client may read it (stream.ts, `Relay.renumbered`). An index that
 * is not a number (`"1"`, null, none) is passed as what tells its choice
 * apart: a string as it is, anything else as null. Undefined when no index
 * changes and `always` is false, or the event is not a chunk that can be
 * read (it then goes on as sent). `always` writes it again even so: its
 * indices' bytes were no plain integer (`1e0`, `1.0`), which a strict client
 * (an integer field) refuses while JSON.parse reads them as one.
 */
export function renumberedChoicesEvent(payload: string, indexFor: (index: number | string | null) => number, term: string, always: boolean): Buffer | undefined {
  const v = parsedChunk(payload);
  if (!v) return undefined;
  let changed = always;
  for (const c of v.choices) {
    if (!isRecord(c)) continue;
    const i = c.index;
    const k = indexFor(typeof i === "number" || typeof i === "string" ? i : null);
    if (k === i) continue;
    c.index = k;
    changed = true;
  }
  if (!changed) return undefined;
  try {
    return Buffer.from(`data: ${JSON.stringify(v)}${term}`);
  } catch {
    return undefined;
  }
}

/** The event gives a finish_reason (a string, not null); asked of one-choice events only. */
export function finishes(event: Buffer, at: number): boolean {
  const v = keyValueAt(event, FINISH_REASON, at);
  return v !== -1 && event[v] === QUOTE;
}

/** Byte by byte: the prefixes are a few bytes, shorter than a call into Buffer.compare costs. */
function startsWithAt(b: Buffer, at: number, prefix: Buffer): boolean {
  if (b.length - at < prefix.length) return false;
  for (let i = 0; i < prefix.length; i++) if (b[at + i] !== prefix[i]) return false;
  return true;
}

/** The data (from `at`) has a `"usage":` key whose value is an object (not null): the one event parsed for its counts. */
export function carriesUsage(event: Buffer, at: number): boolean {
  const v = keyValueAt(event, USAGE, at);
  return v !== -1 && event[v] === OPEN_BRACE;
}

/**
 * The event with each tool call's `function.arguments` that is a JSON object
 * or array replaced by its JSON text: some OpenAI-compatible servers send the
 * arguments parsed, where the SDKs take a string (the openai SDK appends it to
 * the text so far, "[object Object]"; the Vercel AI SDK refuses the chunk).
 * Only an event whose scan saw such arguments is parsed. Undefined when there
 * is nothing to replace or it cannot be done (the event then goes on as sent).
 */
export function textArgumentsEvent(payload: string, term: string): Buffer | undefined {
  const v = parsedChunk(payload);
  if (!v) return undefined;
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

const MODEL_KEY = Buffer.from('"model"');
const COLON_MODEL_KEY = Buffer.from('"model":');
const COMMA = 0x2c;
const CLOSE_BRACE = 0x7d;
const CLOSE_BRACKET = 0x5d;

export interface SwapFields {
  /** The configured upstream id as a JSON string (`"meta-llama/…"`, quotes included): what vLLM answers with. */
  modelValue: Buffer;
  /** The alias as a JSON string: a value already equal to it is left as sent. */
  aliasValue: Buffer;
  /** `"model":` and the alias: what the key and its value are replaced with. */
  aliasField: Buffer;
}

/**
 * The byte patterns of the model swap, made once per target and alias (both
 * come from the configuration, so the cache is as small as it is) rather than
 * three buffers and a string round trip per stream.
 */
const swapFieldCache = new WeakMap<Opened["target"], Map<string, SwapFields>>();
export function swapFields(target: Opened["target"], alias: string): SwapFields {
  let byAlias = swapFieldCache.get(target);
  if (!byAlias) {
    byAlias = new Map();
    swapFieldCache.set(target, byAlias);
  }
  let f = byAlias.get(alias);
  if (!f) {
    const aliasValue = Buffer.from(JSON.stringify(alias));
    f = {
      // target.modelField is `"model":"<id>"`: its value is what follows the key.
      modelValue: Buffer.from(target.modelField).subarray(COLON_MODEL_KEY.length),
      aliasValue,
      aliasField: Buffer.concat([COLON_MODEL_KEY, aliasValue]),
    };
    byAlias.set(alias, f);
  }
  return f;
}

/**
 * Where the JSON value starting at `v` ends (the index just after it), read
 * without parsing: a string to its closing quote (escapes skipped), an object
 * or array to its closing bracket (strings inside skipped), anything else
 * (null, a number, true, false) to the first byte that ends a token. -1 when
 * the event ends first (a string or bracket never closed: no JSON a client
 * can read).
 */
function jsonValueEnd(b: Buffer, v: number): number {
  const c = b[v];
  if (c === QUOTE) {
    for (let i = v + 1; i < b.length; i++) {
      const x = b[i];
      if (x === BACKSLASH) i++;
      else if (x === QUOTE) return i + 1;
    }
    return -1;
  }
  if (c === OPEN_BRACE || c === OPEN_BRACKET) {
    let depth = 0;
    for (let i = v; i < b.length; i++) {
      const x = b[i];
      if (x === QUOTE) {
        for (i++; i < b.length && b[i] !== QUOTE; i++) if (b[i] === BACKSLASH) i++;
      } else if (x === OPEN_BRACE || x === OPEN_BRACKET) depth++;
      else if ((x === CLOSE_BRACE || x === CLOSE_BRACKET) && --depth === 0) return i + 1;
    }
    return -1;
  }
  let i = v;
  for (let x = b[i]; x !== undefined && x !== COMMA && x !== CLOSE_BRACE && x !== CLOSE_BRACKET && x !== SPACE && x !== TAB && x !== CR && x !== LF; x = b[++i]);
  return i;
}

/**
 * The event with its model swapped for the alias (`f`, from swapFields): the
 * first `"model":` key from `at` has its whole value, whatever it is,
 * replaced by the alias. vLLM names the model id it was sent (the configured
 * one), but other OpenAI-compatible servers name their own whatever the
 * request said (Hugging Face TGI its loaded model id, llama.cpp's server its
 * alias, vLLM with a LoRA adapter the adapter), some `null`: before, only
 * `"model":"<configured id>"` was looked for, and any other name reached the
 * client (docs/decisions.md, "The model an answer names").
 *
 * The first `"model":` is the top-level key in practice: the pattern cannot
 * match inside a JSON string (there, the quote after `model` would be
 * escaped, `\"`), so what it finds is a key; and every server writes a
 * chunk's top-level `model` before its `choices` (id, object, created, model,
 * choices: vLLM, TGI, llama.cpp, OpenAI alike), the only place a nested
 * object could hold a key of that name (tool-call arguments sent as an
 * object are made text before this, `textArgumentsEvent`, their quotes then
 * escaped). `"model": …` (Python's default separators), any other JSON white
 * space around the colon (`"model" : …`, tabs: `keyValueAt`), and `null`, a
 * number or any string (escapes included) alike.
 *
 * The cost per chunk is one byte search and a comparison, no parse: the
 * common case (the configured id, vLLM's) is `"model":` found, the value
 * compared with the configured one, and one copy (as fast as the search for
 * the whole `"model":"<id>"` it replaces: a shorter pattern). Only another
 * value is scanned for its end. As sent when the event has no `"model":`,
 * when its value is the alias already, or when the value never ends (no JSON).
 * The relay passes whole events (lib/sse.ts frames them across reads), so a
 * name split across reads is swapped as one sent whole.
 */
export function withAlias(event: Buffer, at: number, f: SwapFields): Buffer {
  const v = keyValueAt(event, MODEL_KEY, at);
  if (v === -1) return event;
  const k = keyFound;
  let end: number;
  if (startsWithAt(event, v, f.modelValue)) end = v + f.modelValue.length;
  else {
    end = jsonValueEnd(event, v);
    if (end === -1) return event;
  }
  if (end - v === f.aliasValue.length && startsWithAt(event, v, f.aliasValue)) return event;
  const out = Buffer.allocUnsafe(event.length - (end - k) + f.aliasField.length);
  event.copy(out, 0, 0, k);
  f.aliasField.copy(out, k);
  event.copy(out, k + f.aliasField.length, end);
  return out;
}

/**
 * A complete event as read: one whose read ended between the two bytes of a
 * CRLF event's last line end is complete (lib/sse.ts drops the LF that may
 * follow), and gets that LF back, so it is relayed as a CRLF event, as it
 * would have been read whole. Rare (a read ending just there): the one copy
 * it costs.
 */
export function withWholeLineEnd(received: Buffer): Buffer {
  const n = received.length;
  return received[n - 1] === CR && received[n - 2] === LF && received[n - 3] === CR ? Buffer.concat([received, LF1]) : received;
}

/** The line end an event (its blank line included) ends with, when it is `\n\n` or `\r\n\r\n` (the only ones a plain event has). */
export function blankLineOf(event: Buffer): Buffer | undefined {
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
export function isPlainData(event: Buffer, sep: Buffer): boolean {
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
