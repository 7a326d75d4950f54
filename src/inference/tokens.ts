import type { ChatBody, ChatMessage, EmbeddingsBody } from "./model.ts";

/**
 * Token estimates without a tokenizer: ~4 bytes of UTF-8 per token, the rule
 * of thumb for English BPE vocabularies (one byte a character there). They
 * stand in for usage only when the upstream never reported it (a stream cut
 * off before its usage chunk, a server that never reports), so nothing goes
 * uncounted; the upstream's own usage always wins when it arrives. Quota
 * reservations use the prompt's bound (promptTokenBound), not the estimate.
 * Bytes, not characters: a CJK character is 3 bytes and about one token, an
 * accented Latin or a Cyrillic one 2 bytes; counted in UTF-16 units such a
 * prompt was charged a quarter to a sixth of its tokens (decisions.md,
 * Upstream token counts).
 */

export const charsToTokens = (chars: number): number => Math.ceil(chars / 4);

/**
 * The tokens delivered text stands for when no count says: ~4 bytes a token,
 * but never fewer than its events of text, each at least one generated token
 * (a server streams a token an event, or more: text of one byte a token, such
 * as digits in Qwen's tokenizer, is a token an event and a quarter of that by
 * its bytes). The stream relay's cut at the bound counts the events so too (stream.ts, `finishAtBound`).
 */
export function deliveredTokens(bytes: number, events: number): number {
  return Math.max(events, charsToTokens(bytes));
}

/** UTF-8 bytes of a string: what the estimates count (service.ts and whole-answer.ts count answers with it too). */
export const utf8 = (s: string): number => Buffer.byteLength(s, "utf8");

/** What an image costs before the upstream says: OpenAI's flat price for a low-detail image. */
const IMAGE_TOKENS = 85;
/** Chat-template overhead per message (role markers), as OpenAI documents it. */
const PER_MESSAGE = 4;

function messageTokens(m: ChatMessage): number {
  let bytes = 0;
  let images = 0;
  const c = m.content;
  if (typeof c === "string") bytes += utf8(c);
  else if (Array.isArray(c)) {
    for (const p of c) {
      const part = p as { type: string; text?: unknown; refusal?: unknown };
      if (typeof part.text === "string") bytes += utf8(part.text);
      else if (typeof part.refusal === "string") bytes += utf8(part.refusal);
      else if (part.type === "image_url") images++;
    }
  }
  if (m.role === "assistant" && m.tool_calls) {
    for (const t of m.tool_calls) bytes += utf8(t.function.name) + utf8(t.function.arguments);
  }
  return PER_MESSAGE + charsToTokens(bytes) + images * IMAGE_TOKENS;
}

/** The prompt's estimate: ~4 bytes of its text a token, plus the template's overhead and each image's flat price. */
export function estimatePromptTokens(body: ChatBody): number {
  let tokens = 3;
  for (const m of body.messages) tokens += messageTokens(m);
  // Tool definitions are rendered into the prompt by the chat template.
  if (body.tools) tokens += charsToTokens(utf8(JSON.stringify(body.tools)));
  return tokens;
}

/**
 * What a chat template may add beyond the messages' own text, in tokens: once
 * per request (a BOS token, the generation prompt, fixed text such as a date
 * line or a default system prompt), per message (role markers, separators),
 * and when tools or a response format are sent (a template's instructions
 * around them).
 */
const BOUND_PER_REQUEST = 512;
const BOUND_PER_MESSAGE = 16;
const BOUND_TOOLS = 512;
/** The wrapper `tojson` puts around one part of a tool result sent as parts (`{"type": "text", "text": …}`). */
const BOUND_PER_PART = 32;

/** What one image may cost when the alias does not say (`imageTokens`): a 1024×1024 image on most open VLMs. */
export const DEFAULT_IMAGE_TOKENS = 2_048;

/** UTF-8 bytes of a string; 0 for anything else. */
export const stringBytes = (s: unknown): number => (typeof s === "string" ? utf8(s) : 0);

/**
 * The most bytes a string takes in any JSON rendering a template makes of it,
 * quotes included: each UTF-16 unit outside ASCII and each of < > & ' at
 * most 6 (`\u00e9`: Python's json.dumps escapes non-ASCII by default,
 * Jinja's own `tojson` also the HTML-special characters); a control character
 * 2 (\n, \t, \r, \b, \f) or 6; " and \ 2 (escaped); and , and : 2 as well
 * (text that is itself JSON, a tool call's arguments, is parsed and
 * re-serialised with Python's ", " and ": "). Never less than the string's
 * UTF-8 bytes (at most 3 a unit).
 */
function jsonTextBytes(s: string): number {
  let n = 2;
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c >= 0x80 || c === 0x3c || c === 0x3e || c === 0x26 || c === 0x27) n += 6;
    else if (c < 0x20) n += c === 0x0a || c === 0x09 || c === 0x0d || c === 0x08 || c === 0x0c ? 2 : 6;
    else n += c === 0x22 || c === 0x5c || c === 0x2c || c === 0x3a ? 2 : 1;
  }
  return n;
}

/** Indentation a template may render structured values with (Llama 3.1: `tojson(indent=4)`). */
const INDENT = 4;

/**
 * The most bytes a JSON value takes as a template renders it: indented by
 * INDENT at `depth` (each element on its own line, ": " after each key), its
 * strings as jsonTextBytes counts them. Indentation grows with depth: an enum
 * of numbers five levels deep renders at 27 bytes a number, not 2. Counted,
 * not rendered: linear in the value, and allocates nothing (a rendering of a
 * deep value could be hundreds of times its size).
 */
function renderedBytes(v: unknown, depth: number): number {
  if (typeof v === "string") return jsonTextBytes(v);
  if (Array.isArray(v)) {
    if (v.length === 0) return 2;
    // Brackets, and the closing bracket's own line; per element a line (newline, indent, comma).
    let n = 3 + INDENT * depth;
    for (const x of v) n += 2 + INDENT * (depth + 1) + renderedBytes(x, depth + 1);
    return n;
  }
  if (v !== null && typeof v === "object") {
    let n = 3 + INDENT * depth;
    let members = 0;
    const o = v as Record<string, unknown>;
    for (const k in o) {
      n += 2 + INDENT * (depth + 1) + jsonTextBytes(k) + 2 + renderedBytes(o[k], depth + 1);
      members++;
    }
    return members === 0 ? 2 : n;
  }
  // Numbers, booleans, null; a number may render a little longer elsewhere (Python's 1e-07 for 1e-7).
  return String(v).length + 2;
}

/**
 * The most prompt tokens a chat request can be, which the quota reserves so
 * that no request overshoots it: no tokenizer makes more than one token per
 * byte of text (byte-level BPE falls back to bytes; other schemes' pieces are
 * whole characters), plus the template's allowances above, plus `imageTokens`
 * per image; and never more than the context window, since a longer prompt is
 * refused upstream. Text a template may render as JSON (tool definitions,
 * legacy functions, a response format's schema, tool call arguments, tool
 * results, which Llama 3.1's template passes through `tojson`) is counted as
 * its largest JSON rendering (renderedBytes, jsonTextBytes), not its bytes.
 * The estimate (estimatePromptTokens) stays what is charged when the upstream
 * reports no count.
 */
export function promptTokenBound(body: ChatBody, imageTokens: number, contextWindow: number | undefined): number {
  let bound = BOUND_PER_REQUEST;
  for (const m of body.messages) {
    bound += BOUND_PER_MESSAGE + stringBytes(m.name);
    const c = m.content;
    if (m.role === "tool") {
      bound += jsonTextBytes(m.tool_call_id);
      if (typeof c === "string") bound += jsonTextBytes(c);
      else if (Array.isArray(c)) {
        for (const p of c) {
          const text = (p as { text?: unknown }).text;
          bound += BOUND_PER_PART + (typeof text === "string" ? jsonTextBytes(text) : 0);
        }
      }
      continue;
    }
    if (typeof c === "string") bound += utf8(c);
    else if (Array.isArray(c)) {
      for (const p of c) {
        const part = p as { type: string; text?: unknown; refusal?: unknown };
        if (part.type === "image_url") bound += imageTokens;
        else bound += stringBytes(part.text) + stringBytes(part.refusal);
      }
    }
    if (m.role === "assistant") {
      bound += stringBytes(m.refusal) + stringBytes(m.reasoning_content) + stringBytes(m.reasoning);
      if (m.function_call) bound += BOUND_PER_MESSAGE + jsonTextBytes(m.function_call.name) + jsonTextBytes(m.function_call.arguments);
      if (m.tool_calls) {
        for (const t of m.tool_calls) bound += BOUND_PER_MESSAGE + jsonTextBytes(t.id) + jsonTextBytes(t.function.name) + jsonTextBytes(t.function.arguments);
      }
    }
  }
  if (body.tools || body.functions) bound += BOUND_TOOLS + renderedBytes(body.tools ?? [], 0) + renderedBytes(body.functions ?? [], 0);
  // A named tool or function to call ("auto", "none" and "required" are within the request's allowance).
  if (typeof body.tool_choice === "object") bound += renderedBytes(body.tool_choice, 0);
  if (typeof body.function_call === "object") bound += renderedBytes(body.function_call, 0);
  // A server may inject the response format, a json_schema's schema above all, into the prompt (gpt-oss's harmony format does).
  if (body.response_format && body.response_format.type !== "text") bound += BOUND_TOOLS + renderedBytes(body.response_format, 0);
  return contextWindow === undefined ? bound : Math.min(bound, contextWindow);
}

/** The completion bound the caller set, if any (max_completion_tokens wins, as in vLLM and OpenAI). */
export function completionLimit(body: ChatBody): number | undefined {
  return body.max_completion_tokens ?? body.max_tokens ?? undefined;
}

/** How many choices the upstream generates (`n`, 1 when unset); max_tokens bounds each of them. */
export function choiceCount(body: ChatBody): number {
  return body.n ?? 1;
}

/** An embedding request's estimate: ~4 bytes of each input's text a token (at least 1), a token list its own length. */
export function estimateEmbeddingTokens(body: EmbeddingsBody): number {
  const input = body.input;
  if (typeof input === "string") return Math.max(1, charsToTokens(utf8(input)));
  let tokens = 0;
  for (const item of input) {
    if (typeof item === "string") tokens += Math.max(1, charsToTokens(utf8(item)));
    else if (typeof item === "number") tokens += 1;
    else tokens += item.length;
  }
  return tokens;
}

/** Special tokens a model may add to one embedding input (BOS/EOS, [CLS]/[SEP], an instruction's markers): a generous allowance. */
const SPECIAL_TOKENS_PER_INPUT = 16;

/**
 * The most prompt tokens an embedding request can be: no tokenizer makes more
 * than one token per byte of text (byte-level BPE falls back to bytes; pieces
 * of other schemes are whole characters), a token list is its own length, and
 * each input may get a few special tokens. A count above it is no model's.
 */
export function embeddingTokenBound(body: EmbeddingsBody): number {
  const input = body.input;
  if (typeof input === "string") return utf8(input) + SPECIAL_TOKENS_PER_INPUT;
  // A flat list of numbers is one input of token ids.
  if (input.length > 0 && typeof input[0] === "number") return input.length + SPECIAL_TOKENS_PER_INPUT;
  let bound = 0;
  for (const item of input) bound += (typeof item === "string" ? utf8(item) : typeof item === "number" ? 1 : item.length) + SPECIAL_TOKENS_PER_INPUT;
  return bound;
}
