import type { ResponseEcho, ResponseMeta } from "../../src/responses/output.ts";

/** The echoed request fields of a plain request (what 16a builds from `{model, input}`). */
export function echo(over: Partial<ResponseEcho> = {}): ResponseEcho {
  return {
    instructions: null,
    max_output_tokens: null,
    metadata: {},
    parallel_tool_calls: true,
    previous_response_id: null,
    temperature: null,
    top_p: null,
    tool_choice: "auto",
    tools: [],
    text: { format: { type: "text" } },
    reasoning: { effort: null, summary: null },
    store: true,
    truncation: "disabled",
    user: null,
    ...over,
  };
}
export const meta = (over: Partial<ResponseEcho> = {}): ResponseMeta => ({ id: "resp_test1", createdAt: 1_790_000_000, model: "chat-small", echo: echo(over) });
