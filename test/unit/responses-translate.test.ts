import { describe, expect, test } from "bun:test";
import { AppError } from "../../src/lib/errors.ts";
import { isReplayable, parseResponsesBody } from "../../src/responses/request.ts";
import { responsesError, responsesParam, toChat } from "../../src/responses/translate.ts";

/** The mapping of chat field paths back to the Responses request's (what error `param`s say). */
describe("responsesParam", () => {
  const origin = ["instructions", "previous_response_id", "input[0]", "input[2]"];
  const cases: [string | null, string | null][] = [
    [null, null],
    ["messages[0].content", "instructions"],
    ["messages[1].content[0]", "previous_response_id"],
    ["messages[2].content[1]", "input[0].content[1]"],
    ["messages[3].content[0].image_url.url", "input[2].content[0]"],
    ["messages[3].tool_calls[0].id", "input[2]"],
    ["messages[9]", "input"],
    ["messages", "input"],
    ["max_tokens", "max_output_tokens"],
    ["max_completion_tokens", "max_output_tokens"],
    ["response_format.json_schema.name", "text.format.name"],
    ["reasoning_effort", "reasoning.effort"],
    ["tool_choice.function.name", "tool_choice.name"],
    ["tools[2].function.parameters", "tools[2].parameters"],
    ["tools", "tools"],
    ["temperature", "temperature"],
    ["model", "model"],
  ];
  for (const [chat, responses] of cases) test(`${chat} -> ${responses}`, () => expect(responsesParam(chat, origin)).toBe(responses));
});

describe("toChat", () => {
  test("an error about a translated message names the input item it came from, in param and message", () => {
    const t = toChat(parseResponsesBody({ model: "m", instructions: "sys", input: [{ role: "user", content: "a" }, { role: "user", content: [{ type: "input_text", text: "b" }] }] }), [], false);
    const e = responsesError(new AppError("invalid_request_error", "Invalid value for 'messages[2].content[0]': bad.", "messages[2].content[0]"), t);
    expect(e).toBeInstanceOf(AppError);
    expect(e instanceof AppError && [e.param, e.message]).toEqual(["input[1].content[0]", "Invalid value for 'input[1].content[0]': bad."]);
  });

  test("function calls after assistant text join its message; a call with no text before it starts one", () => {
    const t = toChat(
      parseResponsesBody({
        model: "m",
        input: [
          { type: "function_call", call_id: "a", name: "f", arguments: "{}" },
          { type: "function_call_output", call_id: "a", output: "1" },
          { role: "assistant", content: "" },
          { type: "function_call", call_id: "b", name: "f", arguments: "{}" },
        ],
      }),
      [],
      false,
    );
    expect(t.chat.messages).toEqual([
      { role: "assistant", content: null, tool_calls: [{ id: "a", type: "function", function: { name: "f", arguments: "{}" } }] },
      { role: "tool", tool_call_id: "a", content: "1" },
      { role: "assistant", content: null, tool_calls: [{ id: "b", type: "function", function: { name: "f", arguments: "{}" } }] },
    ]);
  });

  test("assistant text after the calls of its turn joins their message, so the outputs that follow still answer it", () => {
    // An upstream that streamed its tool calls before its text gives output items in that order, and the
    // Agents SDK echoes them so: chat has one assistant message with both, then the tool messages.
    const input = [
      { role: "user", content: "weather?" },
      { type: "function_call", call_id: "a", name: "f", arguments: "{}" },
      { role: "assistant", content: [{ type: "output_text", text: "Checking.", annotations: [] }] },
      { type: "function_call", call_id: "b", name: "f", arguments: "{}" },
      { type: "function_call_output", call_id: "a", output: "1" },
      { type: "function_call_output", call_id: "b", output: "2" },
    ];
    const t = toChat(parseResponsesBody({ model: "m", input }), [], false);
    const call = (id: string) => ({ id, type: "function", function: { name: "f", arguments: "{}" } });
    expect(t.chat.messages).toEqual([
      { role: "user", content: "weather?" },
      { role: "assistant", content: "Checking.", tool_calls: [call("a"), call("b")] },
      { role: "tool", tool_call_id: "a", content: "1" },
      { role: "tool", tool_call_id: "b", content: "2" },
    ]);
  });

  test("a function_call_output with an empty list of parts is sent as empty text (chat refuses content: [])", () => {
    const input = [
      { type: "function_call", call_id: "a", name: "f", arguments: "{}" },
      { type: "function_call_output", call_id: "a", output: [] },
    ];
    const t = toChat(parseResponsesBody({ model: "m", input }), [], false);
    expect(t.chat.messages).toEqual([
      { role: "assistant", content: null, tool_calls: [{ id: "a", type: "function", function: { name: "f", arguments: "{}" } }] },
      { role: "tool", tool_call_id: "a", content: "" },
    ]);
  });

  test("pinned: the chat body and the echo of a request with every field translated or echoed, byte for byte (as serialised)", () => {
    const body = parseResponsesBody(
      {
        model: "m",
        instructions: "sys",
        stream: true,
        store: false,
        input: [
          { role: "developer", content: "dev" },
          { role: "user", content: [{ type: "input_text", text: "hi" }, { type: "input_image", image_url: "https://x.example/a.png", detail: "low" }] },
          { type: "function_call", call_id: "c1", name: "f", arguments: "{}" },
          { type: "function_call_output", call_id: "c1", output: "ok" },
          { role: "assistant", content: "done" },
        ],
        tools: [{ type: "web_search" }, { type: "function", name: "f", description: "d", parameters: { type: "object" }, strict: true }, { type: "function", name: "g" }],
        tool_choice: { type: "allowed_tools", mode: "required", tools: [{ type: "function", name: "f" }] },
        parallel_tool_calls: false,
        max_output_tokens: 100,
        temperature: 0.5,
        top_p: 0.9,
        top_logprobs: 2,
        include: ["message.output_text.logprobs"],
        reasoning: { effort: "low", summary: "auto", context: "all_turns", mode: "x" },
        metadata: { a: "b" },
        user: "u",
        safety_identifier: "s",
        prompt_cache_key: "k",
        prompt_cache_retention: "24h",
        truncation: "auto",
        max_tool_calls: 3,
        text: { format: { type: "json_schema", name: "n", schema: { type: "object" }, strict: true, description: "dd" }, verbosity: "low" },
      },
      "ignore",
    );
    const t = toChat(body, [], false);
    expect(JSON.stringify(t.chat)).toBe(
      "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"sys\"},{\"role\":\"system\",\"content\":\"dev\"},{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi\"},{\"type\":\"image_url\",\"image_url\":{\"url\":\"https://x.example/a.png\",\"detail\":\"low\"}}]},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"ok\"},{\"role\":\"assistant\",\"content\":\"done\"}],\"stream\":true,\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"description\":\"d\",\"parameters\":{\"type\":\"object\"},\"strict\":true}}],\"tool_choice\":\"required\",\"parallel_tool_calls\":false,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\",\"schema\":{\"type\":\"object\"},\"strict\":true,\"description\":\"dd\"}},\"max_tokens\":100,\"temperature\":0.5,\"top_p\":0.9,\"logprobs\":true,\"top_logprobs\":2,\"reasoning_effort\":\"low\",\"user\":\"u\"}",
    );
    expect(JSON.stringify(t.echo)).toBe(
      "{\"instructions\":\"sys\",\"max_output_tokens\":100,\"max_tool_calls\":3,\"metadata\":{\"a\":\"b\"},\"parallel_tool_calls\":false,\"previous_response_id\":null,\"prompt_cache_key\":\"k\",\"prompt_cache_retention\":\"24h\",\"safety_identifier\":\"s\",\"temperature\":0.5,\"top_logprobs\":2,\"top_p\":0.9,\"tool_choice\":{\"type\":\"allowed_tools\",\"mode\":\"required\",\"tools\":[{\"type\":\"function\",\"name\":\"f\"}]},\"tools\":[{\"type\":\"function\",\"name\":\"f\",\"description\":\"d\",\"parameters\":{\"type\":\"object\"},\"strict\":true},{\"type\":\"function\",\"name\":\"g\",\"description\":null,\"parameters\":null,\"strict\":null}],\"text\":{\"format\":{\"type\":\"json_schema\",\"name\":\"n\",\"schema\":{\"type\":\"object\"},\"strict\":true,\"description\":\"dd\"},\"verbosity\":\"low\"},\"reasoning\":{\"effort\":\"low\",\"summary\":\"auto\",\"context\":\"all_turns\",\"mode\":\"x\"},\"store\":false,\"truncation\":\"auto\",\"user\":\"u\"}",
    );
    const plain = toChat(parseResponsesBody({ model: "m", input: "hello" }), [], false);
    expect(JSON.stringify(plain.chat)).toBe("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}]}");
    expect(JSON.stringify(plain.echo)).toBe(
      "{\"instructions\":null,\"max_output_tokens\":null,\"max_tool_calls\":null,\"metadata\":{},\"parallel_tool_calls\":true,\"previous_response_id\":null,\"prompt_cache_key\":null,\"prompt_cache_retention\":null,\"safety_identifier\":null,\"temperature\":null,\"top_logprobs\":null,\"top_p\":null,\"tool_choice\":\"auto\",\"tools\":[],\"text\":{\"format\":{\"type\":\"text\"},\"verbosity\":null},\"reasoning\":{\"effort\":null,\"summary\":null},\"store\":false,\"truncation\":\"disabled\",\"user\":null}",
    );
  });

  test("store: false builds no stored input items (nothing would read them); stored, each input item has its id", () => {
    expect(toChat(parseResponsesBody({ model: "m", input: "hello" }), [], false).inputItems).toEqual([]);
    expect(toChat(parseResponsesBody({ model: "m", input: [{ role: "user", content: "a" }, { role: "assistant", content: "b" }] }), [], false).inputItems).toEqual([]);
    const ok = parseResponsesBody({ model: "m", input: "hello" });
    const stored = toChat(ok, [], true).inputItems;
    expect(stored).toHaveLength(1);
    expect(stored[0]).toMatchObject({ type: "message", role: "user", content: [{ type: "input_text", text: "hello" }], status: "completed" });
    expect(stored[0]?.id).toMatch(/^msg_[0-9a-f]{32}$/);
  });

  test("only reasoning items: no messages is a 400 on input", () => {
    expect(() => toChat(parseResponsesBody({ model: "m", input: [{ type: "reasoning", summary: [] }] }), [], false)).toThrow(AppError);
  });
});

/** item_reference: OpenAI's ItemReference, `type` optional; resolved by the route before translation. */
describe("item_reference in the request", () => {
  const paramOf = (input: unknown[]): string | null => {
    try {
      parseResponsesBody({ model: "m", input });
      return "accepted";
    } catch (e) {
      if (e instanceof AppError) return e.param;
      throw e;
    }
  };

  test("accepted with or without type; its id is checked; nothing else may ride along", () => {
    expect(paramOf([{ type: "item_reference", id: "msg_1" }])).toBe("accepted");
    expect(paramOf([{ id: "msg_1" }, { type: null, id: "rs_2" }])).toBe("accepted");
    expect(paramOf([{ type: "item_reference" }])).toBe("input[0].id");
    expect(paramOf([{ role: "user", content: "x" }, { id: "msg 1" }])).toBe("input[1].id");
    expect(paramOf([{ type: "item_reference", id: "msg_1", text: "x" }])).toBe("input[0].text");
    expect(paramOf([{}])).toBe("input[0].id");
    expect(paramOf([{ type: "web_search_call", id: "ws_1" }])).toBe("input[0].type");
  });

  test("isReplayable: a stored item may not be a reference", () => {
    expect(isReplayable({ type: "item_reference", id: "msg_1" })).toBe(false);
    expect(isReplayable({ id: "msg_1" })).toBe(false);
    expect(isReplayable({ type: "message", id: "msg_1", role: "assistant", content: [{ type: "output_text", text: "hi", annotations: [] }] })).toBe(true);
  });

  test("a reference that reaches the translation unresolved is a programming error, never sent on", () => {
    expect(() => toChat(parseResponsesBody({ model: "m", input: [{ id: "msg_1" }] }), [], false)).toThrow("unresolved");
  });
});
