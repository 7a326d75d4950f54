import { describe, expect, test } from "bun:test";
import OpenAI from "openai";
import type { Response as SdkResponse, ResponseOutputItem } from "openai/resources/responses/responses";
import { type ResponseEcho, type ResponseObject, responseFromChat } from "../../src/responses/output.ts";
import { meta } from "../helpers/responses.ts";

/** Type-level checks: what the gateway sends must be assignable to the SDK's own types. */
const asWire = (r: ResponseObject): SdkResponse => r;
const asItem = (i: ResponseObject["output"][number]): ResponseOutputItem => i;

function chat(message: Record<string, unknown>, finish: string, usage: unknown = { prompt_tokens: 11, completion_tokens: 5, total_tokens: 16 }) {
  return {
    id: "chatcmpl-1",
    object: "chat.completion",
    created: 1,
    model: "chat-small",
    choices: [{ index: 0, message: { role: "assistant", ...message }, logprobs: null, finish_reason: finish }],
    ...(usage === null ? {} : { usage }),
  };
}

describe("responseFromChat", () => {
  test("a text answer becomes a completed Response with one message item", () => {
    const r = responseFromChat(chat({ content: "Hello there" }, "stop"), meta({ temperature: 0.2, metadata: { k: "v" } }));
    expect(r.completed_at).toBeNumber();
    expect(r).toEqual({
      id: "resp_test1",
      object: "response",
      created_at: 1_790_000_000,
      status: "completed",
      background: false,
      completed_at: expect.any(Number),
      error: null,
      incomplete_details: null,
      instructions: null,
      max_output_tokens: null,
      max_tool_calls: null,
      model: "chat-small",
      output: [
        {
          type: "message",
          id: expect.stringMatching(/^msg_[0-9a-f]{48}$/),
          status: "completed",
          role: "assistant",
          content: [{ type: "output_text", text: "Hello there", annotations: [], logprobs: [] }],
        },
      ],
      output_text: "Hello there",
      parallel_tool_calls: true,
      previous_response_id: null,
      prompt_cache_key: null,
      prompt_cache_retention: null,
      reasoning: { effort: null, summary: null },
      safety_identifier: null,
      service_tier: "default",
      store: true,
      temperature: 0.2,
      text: { format: { type: "text" }, verbosity: null },
      tool_choice: "auto",
      tools: [],
      top_logprobs: null,
      top_p: null,
      truncation: "disabled",
      usage: {
        input_tokens: 11,
        input_tokens_details: { cached_tokens: 0, cache_write_tokens: 0 },
        output_tokens: 5,
        output_tokens_details: { reasoning_tokens: 0 },
        total_tokens: 16,
      },
      metadata: { k: "v" },
      access_programs: null,
    });
    expect(asWire(r).object).toBe("response");
    expect("user" in r).toBe(false);
  });

  test("tool calls become function_call items with call_id = the chat tool_call id, no empty message", () => {
    const r = responseFromChat(
      chat(
        {
          content: null,
          tool_calls: [
            { id: "call_a", type: "function", function: { name: "get_weather", arguments: '{"city":"Oslo"}' } },
            { id: "call_b", type: "function", function: { name: "get_time", arguments: "{}" } },
          ],
        },
        "tool_calls",
      ),
      meta(),
    );
    expect(r.status).toBe("completed");
    expect(r.output).toEqual([
      { type: "function_call", id: expect.stringMatching(/^fc_/), call_id: "call_a", name: "get_weather", arguments: '{"city":"Oslo"}', status: "completed" },
      { type: "function_call", id: expect.stringMatching(/^fc_/), call_id: "call_b", name: "get_time", arguments: "{}", status: "completed" },
    ]);
    expect(new Set(r.output.map((i) => i.id)).size).toBe(2);
    for (const item of r.output) expect(asItem(item).type).toBe("function_call");
  });

  test("finish_reason length -> incomplete (max_output_tokens), the message item incomplete too", () => {
    const r = responseFromChat(chat({ content: "cut sh" }, "length"), meta({ max_output_tokens: 3 }));
    expect(r.status).toBe("incomplete");
    expect(r.incomplete_details).toEqual({ reason: "max_output_tokens" });
    expect(r.max_output_tokens).toBe(3);
    expect(r.output[0]?.status).toBe("incomplete");
    // The SDK's Response type: completed_at is "only present when the status is completed".
    expect(r.completed_at).toBeNull();
  });

  test("finish_reason content_filter -> incomplete (content_filter)", () => {
    const r = responseFromChat(chat({ content: "" }, "content_filter"), meta());
    expect(r.status).toBe("incomplete");
    expect(r.incomplete_details).toEqual({ reason: "content_filter" });
  });

  test("reasoning text (reasoning_content or reasoning) becomes a reasoning item before the message", () => {
    for (const field of ["reasoning_content", "reasoning"]) {
      const r = responseFromChat(chat({ content: "42", [field]: "thinking hard" }, "stop"), meta());
      expect(r.output.map((i) => i.type)).toEqual(["reasoning", "message"]);
      expect(r.output[0]).toEqual({
        type: "reasoning",
        id: expect.stringMatching(/^rs_/),
        summary: [],
        content: [{ type: "reasoning_text", text: "thinking hard" }],
        status: "completed",
      });
    }
  });

  test("a refusal becomes a refusal content part", () => {
    const r = responseFromChat(chat({ content: null, refusal: "I can't help with that." }, "stop"), meta());
    expect(r.output).toEqual([
      { type: "message", id: expect.any(String), status: "completed", role: "assistant", content: [{ type: "refusal", refusal: "I can't help with that." }] },
    ]);
  });

  test("an empty answer still has a message with empty text", () => {
    const r = responseFromChat(chat({ content: null }, "stop"), meta());
    expect(r.output).toHaveLength(1);
    expect(r.output[0]).toMatchObject({ type: "message", content: [{ type: "output_text", text: "" }] });
  });

  test("usage: the upstream's cached and reasoning counts pass, absurd values are clamped, absent usage is left out", () => {
    const withDetails = responseFromChat(
      chat({ content: "x" }, "stop", {
        prompt_tokens: 100,
        completion_tokens: 40,
        total_tokens: 140,
        prompt_tokens_details: { cached_tokens: 64 },
        completion_tokens_details: { reasoning_tokens: 30 },
      }),
      meta(),
    );
    expect(withDetails.usage).toEqual({
      input_tokens: 100,
      input_tokens_details: { cached_tokens: 64, cache_write_tokens: 0 },
      output_tokens: 40,
      output_tokens_details: { reasoning_tokens: 30 },
      total_tokens: 140,
    });
    const odd = responseFromChat(chat({ content: "x" }, "stop", { prompt_tokens: -5, completion_tokens: "7", prompt_tokens_details: { cached_tokens: 9 } }), meta());
    expect(odd.usage).toEqual({
      input_tokens: 0,
      input_tokens_details: { cached_tokens: 0, cache_write_tokens: 0 },
      output_tokens: 0,
      output_tokens_details: { reasoning_tokens: 0 },
      total_tokens: 0,
    });
    expect("usage" in responseFromChat(chat({ content: "x" }, "stop", null), meta())).toBe(false);
  });

  test("echoed request fields: tools, tool_choice, text format, user, effort (unknown effort echoed as null)", () => {
    const tools: ResponseEcho["tools"] = [{ type: "function", name: "f", description: null, parameters: { type: "object" }, strict: true }];
    const text: ResponseEcho["text"] = { format: { type: "json_schema", name: "out", schema: { type: "object" }, strict: true }, verbosity: "high" };
    const r = responseFromChat(
      chat({ content: "{}" }, "stop"),
      meta({ tools, tool_choice: { type: "function", name: "f" }, text, user: "u-1", reasoning: { effort: "high", summary: null }, store: false, previous_response_id: "resp_prev", instructions: "be brief" }),
    );
    expect(r).toMatchObject({ tools, tool_choice: { type: "function", name: "f" }, text, user: "u-1", reasoning: { effort: "high", summary: null }, store: false, previous_response_id: "resp_prev", instructions: "be brief" });
    expect(responseFromChat(chat({ content: "{}" }, "stop"), meta({ reasoning: { effort: "turbo", summary: null } })).reasoning).toEqual({ effort: null, summary: null });
  });

  // decisions.md, The Response object: efforts are echoed "when the value is one the SDK's type names (efforts `none` … `max`)".
  test("every effort the SDK names is echoed as sent", () => {
    for (const effort of ["none", "minimal", "low", "medium", "high", "xhigh", "max"] as const) {
      expect(responseFromChat(chat({ content: "{}" }, "stop"), meta({ reasoning: { effort, summary: null } })).reasoning.effort).toBe(effort);
    }
  });

  // decisions.md, Items: "Entries that are not a token with a finite number are skipped, and `bytes` is computed from the token when the upstream omits it."
  test("logprobs: entries without a token or a finite logprob are skipped; bytes computed from the token when omitted", () => {
    const answer = chat({ content: "hé" }, "stop");
    const choice = answer.choices[0] as Record<string, unknown>;
    choice.logprobs = {
      content: [
        { token: "h", logprob: -0.5, bytes: [104], top_logprobs: [{ token: "h", logprob: -0.5 }, { token: "x", logprob: Number.NEGATIVE_INFINITY }, { logprob: -1 }] },
        { token: "lost", logprob: Number.NEGATIVE_INFINITY, bytes: [1], top_logprobs: [] },
        { token: "nan", logprob: Number.NaN, top_logprobs: [] },
        { logprob: -0.1, top_logprobs: [] },
        { token: "é", logprob: -0.25, top_logprobs: [] },
      ],
    };
    const r = responseFromChat(answer, meta());
    const part = (r.output[0] as { content: { logprobs: unknown }[] }).content[0];
    expect(part?.logprobs).toEqual([
      { token: "h", bytes: [104], logprob: -0.5, top_logprobs: [{ token: "h", bytes: [104], logprob: -0.5 }] },
      { token: "é", bytes: [195, 169], logprob: -0.25, top_logprobs: [] },
    ]);
  });

  test("the openai SDK's responses.create reads it (output_text computed from the items)", async () => {
    const answer = responseFromChat(chat({ content: "Hello ", reasoning_content: "hmm" }, "stop"), meta());
    const server = Bun.serve({ port: 0, hostname: "127.0.0.1", fetch: () => Response.json(answer) });
    try {
      const client = new OpenAI({ baseURL: `http://127.0.0.1:${server.port}/v1`, apiKey: "k", maxRetries: 0 });
      const got = await client.responses.create({ model: "chat-small", input: "hi" });
      expect(got.output_text).toBe("Hello ");
      expect(got).toEqual(JSON.parse(JSON.stringify(answer)));
    } finally {
      await server.stop(true);
    }
  });
});
