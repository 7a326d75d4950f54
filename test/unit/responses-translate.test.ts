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
