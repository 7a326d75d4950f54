import type { AliasConfig } from "../config/schema.ts";
import { parseChatBody } from "../inference/model.ts";
import { checkChatAgainstAlias } from "../inference/service.ts";
import { estimatePromptTokens } from "../inference/tokens.ts";
import { responsesError, type Translation } from "./translate.ts";

/**
 * POST /v1/responses/input_tokens (the SDK's `responses.inputTokens.count`):
 * the translated request's prompt as the gateway estimates it. The gateway
 * has no tokenizer, and the upstreams speak chat completions only (vLLM's
 * /tokenize is its own extension, outside /v1, absent from other servers), so
 * the figure is the estimate that usage falls back on when an upstream
 * reports none (inference/tokens.ts: ~4 bytes of UTF-8 a token, the chat
 * template's overhead per message, a flat price per image), not the model's
 * own count; docs/decisions.md says so. The chat body is checked as the chat
 * service checks it (its rules, the alias's capabilities), each refusal named
 * in the Responses request's terms, so what create would refuse is refused here.
 */

export const INPUT_TOKENS_OBJECT = "response.input_tokens";

export function inputTokens(t: Translation, alias: AliasConfig): { object: typeof INPUT_TOKENS_OBJECT; input_tokens: number } {
  try {
    const chat = parseChatBody(t.chat);
    checkChatAgainstAlias(chat, chat.model, alias);
    return { object: INPUT_TOKENS_OBJECT, input_tokens: estimatePromptTokens(chat) };
  } catch (e) {
    throw responsesError(e, t);
  }
}
