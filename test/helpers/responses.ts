import { errorBody } from "../../src/http/errors.ts";
import type { ResponseEcho, ResponseMeta } from "../../src/responses/output.ts";

/** The echoed request fields of a plain request (what 16a builds from `{model, input}`). */
export function echo(over: Partial<ResponseEcho> = {}): ResponseEcho {
  return {
    instructions: null,
    max_output_tokens: null,
    max_tool_calls: null,
    metadata: {},
    parallel_tool_calls: true,
    previous_response_id: null,
    prompt_cache_key: null,
    prompt_cache_retention: null,
    safety_identifier: null,
    temperature: null,
    top_logprobs: null,
    top_p: null,
    tool_choice: "auto",
    tools: [],
    text: { format: { type: "text" }, verbosity: null },
    reasoning: { effort: null, summary: null },
    store: true,
    truncation: "disabled",
    user: null,
    ...over,
  };
}
export const meta = (over: Partial<ResponseEcho> = {}): ResponseMeta => ({ id: "resp_test1", createdAt: 1_790_000_000, model: "chat-small", echo: echo(over) });

export const enc = new TextEncoder();

/** A chunk exactly as vLLM (and the simulator, and so the gateway's relay) writes it. */
export function chunk(delta: Record<string, unknown>, finish: string | null = null): string {
  return `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"chat-small","choices":[{"index":0,"delta":${JSON.stringify(delta)},"logprobs":null,"finish_reason":${JSON.stringify(finish)}}]}\n\n`;
}
export const ROLE = chunk({ role: "assistant", content: "" });
export const USAGE = `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"chat-small","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":4,"total_tokens":16,"prompt_tokens_details":{"cached_tokens":8}}}\n\n`;
export const DONE = "data: [DONE]\n\n";
/** The gateway relay's own mid-stream error event (inference/stream.ts). */
export const ERROR = `data: ${JSON.stringify(errorBody("service_unavailable", "The model 'chat-small' failed while generating: boom"))}\n\n`;

/** A chat SSE body that yields `parts` one read each, and records its cancellation. */
export function source(parts: Uint8Array[]) {
  const state = { cancelled: undefined as unknown, reads: 0 };
  const stream = new ReadableStream<Uint8Array>({
    pull(c) {
      const p = parts[state.reads++];
      if (p === undefined) c.close();
      else c.enqueue(p);
    },
    cancel(reason) {
      state.cancelled = reason ?? "cancelled";
    },
  });
  return { stream, state };
}
