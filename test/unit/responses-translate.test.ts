import { describe, expect, test } from "bun:test";
import { AppError } from "../../src/lib/errors.ts";
import { parseResponsesBody } from "../../src/responses/request.ts";
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

  test("only reasoning items: no messages is a 400 on input", () => {
    expect(() => toChat(parseResponsesBody({ model: "m", input: [{ type: "reasoning", summary: [] }] }), [], false)).toThrow(AppError);
  });
});
