/**
 * Chat chunk shapes matched on their bytes, without parsing the chunk: the
 * chunks vLLM (and the simulator) write most often (a plain text, reasoning
 * or argument delta of choice 0, the opening role chunk), which the
 * chat -> Responses translation (stream-state.ts) passes from the upstream's
 * bytes to its events' bytes. Anything else does not match and is decoded.
 */
import { isStringifiedText } from "./json-text.ts";

/** A plain text delta as vLLM (and the simulator) write one: `{…,"choices":[{"index":0,"delta":{"content":"…"},"logprobs":null,"finish_reason":null}]}`. */
const PLAIN_HEAD = ',"choices":[{"index":0,"delta":{"content":"';
/**
 * A plain reasoning delta as vLLM's reasoning parsers write one (a DeltaMessage
 * with only its reasoning set, dumped with exclude_unset): the same chunk with
 * `reasoning_content` (older vLLM, and the simulator) or `reasoning` (newer) in
 * place of `content`. A delta with both names, or reasoning and content
 * together (the chunk where the reasoning ends), is not one: it is decoded.
 */
const REASONING_HEADS = [',"choices":[{"index":0,"delta":{"reasoning_content":"', ',"choices":[{"index":0,"delta":{"reasoning":"'].map((h) => Buffer.from(h));
const PLAIN_TAIL = '"},"logprobs":null,"finish_reason":null}]}';

/**
 * The text of a chunk that is a plain text delta of choice 0 and nothing else
 * (most chunks of an answer), read without parsing the whole chunk: only its
 * text is parsed, as one JSON string. Undefined for any other chunk (usage, an
 * error, logprobs, a finish, tool calls, several choices, other spacing),
 * which takes the full parse. The tail must end the chunk, so the choices are
 * the root object's; a quote inside the text is escaped, so a text that is not
 * one JSON string (say, two choices) fails to parse and is not taken.
 */
export function plainTextDelta(payload: string): string | undefined {
  if (payload.charCodeAt(0) !== 0x7b || !payload.endsWith(PLAIN_TAIL)) return undefined;
  const at = payload.indexOf(PLAIN_HEAD);
  if (at === -1 || payload.lastIndexOf('"usage"', at) !== -1 || payload.lastIndexOf('"error"', at) !== -1) return undefined;
  let text: unknown;
  try {
    text = JSON.parse(payload.slice(at + PLAIN_HEAD.length - 1, payload.length - PLAIN_TAIL.length + 1));
  } catch {
    return undefined;
  }
  return typeof text === "string" ? text : undefined;
}

const PLAIN_HEAD_BYTES = Buffer.from(PLAIN_HEAD);
export const PLAIN_TAIL_BYTES = Buffer.from(PLAIN_TAIL);
const USAGE_KEY = Buffer.from('"usage"');
const ERROR_KEY = Buffer.from('"error"');

/**
 * `plainTextDelta` on the chunk's bytes (b[from..to), not decoded): where the
 * text's JSON string content starts (it ends where PLAIN_TAIL starts), or -1.
 * The chunk passes the same checks, and the text must be as JSON.stringify
 * would write it (`isStringifiedText`): any other text, one plainTextDelta
 * would take included, is -1, for the decoding path.
 */
export function plainTextAt(b: Buffer, from: number, to: number): number {
  return deltaStringAt(b, from, to, PLAIN_HEAD_BYTES);
}

/**
 * `plainTextAt` for a plain reasoning delta (REASONING_HEADS): where its
 * reasoning text's JSON string content starts (it ends where PLAIN_TAIL
 * starts), or -1. The same checks, the same strictness (`isStringifiedText`).
 */
export function reasoningTextAt(b: Buffer, from: number, to: number): number {
  for (const head of REASONING_HEADS) {
    const start = deltaStringAt(b, from, to, head);
    if (start !== -1) return start;
  }
  return -1;
}

/**
 * The chunk b[from..to) is `{…` + head + … + tail, with no usage or error key before its head: where what follows
 * the head starts (what precedes the tail ends at to - tail.length), or -1.
 */
function framedAt(b: Buffer, from: number, to: number, head: Buffer, tail: Buffer): number {
  const end = to - tail.length;
  if (b[from] !== 0x7b || end < from || b.compare(tail, 0, tail.length, end, to) !== 0) return -1;
  const at = b.indexOf(head, from);
  if (at === -1 || at + head.length > end) return -1;
  const u = b.lastIndexOf(USAGE_KEY, at);
  const e = b.lastIndexOf(ERROR_KEY, at);
  if ((u !== -1 && u >= from) || (e !== -1 && e >= from)) return -1;
  return at + head.length;
}

/** The chunk b[from..to) is `{…` + head + one JSON string's content + PLAIN_TAIL, with no usage or error: where the content starts, or -1. */
function deltaStringAt(b: Buffer, from: number, to: number, head: Buffer): number {
  const start = framedAt(b, from, to, head, PLAIN_TAIL_BYTES);
  return start !== -1 && isStringifiedText(b, start, to - PLAIN_TAIL_BYTES.length) ? start : -1;
}

/** The role chunk that opens vLLM's (and the simulator's) answers: its delta has no text, so it causes no event. */
const ROLE_TAIL = Buffer.from(',"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}');
const QUOTE = 0x22;
const BACKSLASH = 0x5c;

/** b[i] opens a JSON string as JSON.stringify writes it (isStringifiedText) that closes before `end`: the index after its closing quote, or -1. */
function stringifiedEnd(b: Buffer, i: number, end: number): number {
  if (b[i] !== QUOTE) return -1;
  let j = i + 1;
  while (j < end && b[j] !== QUOTE) j += b[j] === BACKSLASH ? 2 : 1;
  return j < end && isStringifiedText(b, i + 1, j) ? j + 1 : -1;
}

/**
 * Whether b[from..to) is the role chunk as vLLM writes it, the whole of it
 * well-formed JSON: `{`, members whose keys are strings and whose values are
 * strings, non-negative integers or null (id, object, created, model),
 * nothing named usage or error, then ROLE_TAIL. Such a chunk is JSON whose
 * choice 0 has an empty delta and no finish: `data` would parse it and write
 * nothing, so it is passed over without being decoded. Any other spelling
 * (spaces, other fields, a prefix that is not JSON) is decoded, as before.
 */
export function isRoleChunk(b: Buffer, from: number, to: number): boolean {
  const end = to - ROLE_TAIL.length;
  if (b[from] !== 0x7b || end <= from + 1 || b.compare(ROLE_TAIL, 0, ROLE_TAIL.length, end, to) !== 0) return false;
  const u = b.indexOf(USAGE_KEY, from);
  const e = b.indexOf(ERROR_KEY, from);
  if ((u !== -1 && u < end) || (e !== -1 && e < end)) return false;
  let i = from + 1;
  for (;;) {
    i = stringifiedEnd(b, i, end);
    if (i === -1 || b[i] !== 0x3a) return false;
    i++;
    if (b[i] === QUOTE) i = stringifiedEnd(b, i, end);
    else if (b[i] === 0x6e) i = b[i + 1] === 0x75 && b[i + 2] === 0x6c && b[i + 3] === 0x6c ? i + 4 : -1;
    else {
      // A non-negative integer, no leading zero.
      const first = i;
      while (i < end && (b[i] as number) >= 0x30 && (b[i] as number) <= 0x39) i++;
      if (i === first || (b[first] === 0x30 && i > first + 1)) return false;
    }
    if (i === -1 || i > end) return false;
    if (i === end) return true;
    if (b[i] !== 0x2c) return false;
    i++;
  }
}

/**
 * A plain argument delta as vLLM's tool parsers (and the simulator) write one, after the call's first chunk
 * (its id and name): `{…,"choices":[{"index":0,"delta":{"tool_calls":[{"index":K,"function":{"arguments":"…"}}]},"logprobs":null,"finish_reason":null}]}`.
 */
const ARGS_HEAD = Buffer.from(',"choices":[{"index":0,"delta":{"tool_calls":[{"index":');
const ARGS_MID = Buffer.from(',"function":{"arguments":"');
export const ARGS_TAIL = Buffer.from('"}}]},"logprobs":null,"finish_reason":null}]}');
/** The tool-call index `argumentsAt` read (set when it returns a start; stream-state.ts reads it through its import). */
export let argsIndex = 0;

/**
 * The chunk b[from..to) is a plain argument delta (ARGS_HEAD … ARGS_TAIL, no usage or error) whose tool-call index
 * is a plain integer (at most 9 digits, no leading zero) and whose arguments are JSON string content as
 * JSON.stringify writes it (isStringifiedText): where that content starts (it ends where ARGS_TAIL starts), the index
 * in `argsIndex`; else -1, for the decoding path.
 */
export function argumentsAt(b: Buffer, from: number, to: number): number {
  let i = framedAt(b, from, to, ARGS_HEAD, ARGS_TAIL);
  if (i === -1) return -1;
  const end = to - ARGS_TAIL.length;
  const first = i;
  let k = 0;
  while (i < end && (b[i] as number) >= 0x30 && (b[i] as number) <= 0x39) k = k * 10 + ((b[i++] as number) - 0x30);
  if (i === first || i - first > 9 || (b[first] === 0x30 && i > first + 1)) return -1;
  const start = i + ARGS_MID.length;
  if (start > end || b.compare(ARGS_MID, 0, ARGS_MID.length, i, start) !== 0 || !isStringifiedText(b, start, end)) return -1;
  argsIndex = k;
  return start;
}
