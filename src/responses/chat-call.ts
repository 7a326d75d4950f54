import type { Principal } from "../auth/types.ts";
import type { Reply } from "../inference/service.ts";
import { isRecord } from "../lib/guards.ts";
import type { RelayTransform } from "../lib/relay-transform.ts";

/**
 * The one place the Responses API calls the chat service, so that keys,
 * scopes, the browser rule, rate limits, quota, usage, failover, metrics and
 * client aborts apply exactly as for POST /v1/chat/completions. The body is a
 * chat completions body (translate.ts); for a stream, include_usage is forced
 * so the final usage chunk arrives (the chat service forces it too: it meters
 * every stream).
 */

/**
 * Chat as POST /v1/chat/completions runs it: the inference module's checked
 * call (service.chat, then run with the request's signal and id) with its
 * access-log writing (src/inference/routes.ts).
 */
export interface ChatService {
  /** `transform`: a stream's events rewritten inside the chat relay (lib/relay-transform.ts). */
  chat(principal: Principal, body: unknown, request: Request, transform?: RelayTransform): Promise<Reply>;
}

export type ChatAnswer = { kind: "json"; completion: Record<string, unknown> } | { kind: "stream"; body: ReadableStream<Uint8Array>; headers: Headers } | { kind: "gone"; response: Response };

export async function callChat(
  service: ChatService,
  principal: Principal,
  chat: Record<string, unknown>,
  request: Request,
  transform?: RelayTransform,
): Promise<ChatAnswer> {
  if (chat.stream === true) chat.stream_options = { include_usage: true };
  const reply = await service.chat(principal, chat, request, transform);
  if (typeof reply === "string") {
    // The chat service's own answer: always a JSON object.
    const parsed: unknown = JSON.parse(reply);
    return { kind: "json", completion: isRecord(parsed) ? parsed : {} };
  }
  // A client that left gets a response nobody reads (499); a stream has a body.
  if (reply.status !== 200 || reply.body === null) return { kind: "gone", response: reply };
  return { kind: "stream", body: reply.body, headers: reply.headers };
}
