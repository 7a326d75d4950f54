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
