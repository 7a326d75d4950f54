import type { ChatBody, ChatMessage, EmbeddingsBody } from "./model.ts";

/**
 * Token estimates without a tokenizer: ~4 characters per token, the rule of
 * thumb for English BPE vocabularies. They size quota reservations before a
 * request goes upstream and stand in for usage only when the upstream never
 * reported it (a stream cut off before its usage chunk), so nothing goes
 * uncounted. The upstream's own usage always wins when it arrives.
 */

export const charsToTokens = (chars: number): number => Math.ceil(chars / 4);

/** What an image costs before the upstream says: OpenAI's flat price for a low-detail image. */
const IMAGE_TOKENS = 85;
/** Chat-template overhead per message (role markers), as OpenAI documents it. */
const PER_MESSAGE = 4;

function messageTokens(m: ChatMessage): number {
  let chars = 0;
  let images = 0;
  const c = m.content;
  if (typeof c === "string") chars += c.length;
  else if (Array.isArray(c)) {
    for (const p of c) {
      const part = p as { type: string; text?: unknown; refusal?: unknown };
      if (typeof part.text === "string") chars += part.text.length;
      else if (typeof part.refusal === "string") chars += part.refusal.length;
      else if (part.type === "image_url") images++;
    }
  }
  if (m.role === "assistant" && m.tool_calls) {
    for (const t of m.tool_calls) chars += t.function.name.length + t.function.arguments.length;
  }
  return PER_MESSAGE + charsToTokens(chars) + images * IMAGE_TOKENS;
}

export function estimatePromptTokens(body: ChatBody): number {
  let tokens = 3;
  for (const m of body.messages) tokens += messageTokens(m);
  // Tool definitions are rendered into the prompt by the chat template.
  if (body.tools) tokens += charsToTokens(JSON.stringify(body.tools).length);
  return tokens;
}

/**
 * What a chat template may add beyond the messages' own text, in tokens: once
 * per request (a BOS token, the generation prompt, fixed text such as a date
 * line or a default system prompt), per message (role markers, separators),
 * and when tools are sent (a tool-calling template's instructions around the
 * tool definitions, which it may also render with indentation: counted twice).
 */
const BOUND_PER_REQUEST = 512;
const BOUND_PER_MESSAGE = 16;
const BOUND_TOOLS = 512;

/** What one image may cost when the alias does not say (`imageTokens`): a 1024×1024 image on most open VLMs. */
export const DEFAULT_IMAGE_TOKENS = 2_048;

const utf8 = (s: string): number => Buffer.byteLength(s, "utf8");
const maybe = (s: unknown): number => (typeof s === "string" ? utf8(s) : 0);

/**
 * The most prompt tokens a chat request can be, which the quota reserves so
 * that no request overshoots it: no tokenizer makes more than one token per
 * byte of text (byte-level BPE falls back to bytes; other schemes' pieces are
 * whole characters), plus the template's allowances above, plus `imageTokens`
 * per image; and never more than the context window, since a longer prompt is
 * refused upstream. The estimate (estimatePromptTokens) stays what is charged
 * when the upstream reports no count.
 */
export function promptTokenBound(body: ChatBody, imageTokens: number, contextWindow: number | undefined): number {
  let bound = BOUND_PER_REQUEST;
  for (const m of body.messages) {
    bound += BOUND_PER_MESSAGE + maybe(m.name);
    const c = m.content;
    if (typeof c === "string") bound += utf8(c);
    else if (Array.isArray(c)) {
      for (const p of c) {
        const part = p as { type: string; text?: unknown; refusal?: unknown };
        if (part.type === "image_url") bound += imageTokens;
        else bound += maybe(part.text) + maybe(part.refusal);
      }
    }
    if (m.role === "tool") bound += utf8(m.tool_call_id);
    else if (m.role === "assistant") {
      bound += maybe(m.refusal) + maybe(m.reasoning_content) + maybe(m.reasoning);
      if (m.function_call) bound += BOUND_PER_MESSAGE + utf8(m.function_call.name) + utf8(m.function_call.arguments);
      if (m.tool_calls) {
        for (const t of m.tool_calls) bound += BOUND_PER_MESSAGE + utf8(t.id) + utf8(t.function.name) + utf8(t.function.arguments);
      }
    }
  }
  if (body.tools) bound += 2 * utf8(JSON.stringify(body.tools)) + BOUND_TOOLS;
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

export function estimateEmbeddingTokens(body: EmbeddingsBody): number {
  const input = body.input;
  if (typeof input === "string") return Math.max(1, charsToTokens(input.length));
  let tokens = 0;
  for (const item of input) {
    if (typeof item === "string") tokens += Math.max(1, charsToTokens(item.length));
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
  if (typeof input === "string") return Buffer.byteLength(input) + SPECIAL_TOKENS_PER_INPUT;
  // A flat list of numbers is one input of token ids.
  if (input.length > 0 && typeof input[0] === "number") return input.length + SPECIAL_TOKENS_PER_INPUT;
  let bound = 0;
  for (const item of input) bound += (typeof item === "string" ? Buffer.byteLength(item) : typeof item === "number" ? 1 : item.length) + SPECIAL_TOKENS_PER_INPUT;
  return bound;
}
