import { describe, expect, test } from "bun:test";
import fc from "fast-check";
import { AppError } from "../../src/lib/errors.ts";
import { firstImage, paramOf, parseChatBody, parseEmbeddingsBody } from "../../src/inference/model.ts";
import { embeddingTokenBound, estimateEmbeddingTokens, estimatePromptTokens, promptTokenBound } from "../../src/inference/tokens.ts";

function paramFor(f: () => unknown): string | null {
  try {
    f();
  } catch (e) {
    if (e instanceof AppError) {
      expect(e.code).toBe("invalid_request_error");
      return e.param;
    }
    throw e;
  }
  throw new Error("expected a validation error");
}

const user = [{ role: "user", content: "hi" }];

describe("paramOf", () => {
  test("JSON pointers become OpenAI-style paths", () => {
    expect(paramOf("/messages/0/content/1/image_url/url")).toBe("messages[0].content[1].image_url.url");
    expect(paramOf("/temperature")).toBe("temperature");
    expect(paramOf("/logit_bias/a~1b")).toBe("logit_bias.a/b");
    expect(paramOf("")).toBe("");
  });
});

describe("parseChatBody", () => {
  test("a minimal body is accepted and returned as is", () => {
    const body = { model: "svc-fast", messages: user };
    expect(parseChatBody(body)).toBe(body as never);
  });

  test("unknown fields are named, at the top level and inside messages", () => {
    expect(paramFor(() => parseChatBody({ model: "m", messages: user, foo: 1 }))).toBe("foo");
    expect(paramFor(() => parseChatBody({ model: "m", messages: [{ role: "user", content: "x", bar: 1 }] }))).toBe("messages[0].bar");
  });

  test("the wrong tag is reported rather than the fields another tag would need", () => {
    expect(paramFor(() => parseChatBody({ model: "m", messages: user, tools: [{ type: "custom" }] }))).toBe("tools[0].type");
    expect(paramFor(() => parseChatBody({ model: "m", messages: user, response_format: { type: "json_schema" } }))).toBe("response_format.json_schema");
    expect(paramFor(() => parseChatBody({ model: "m", messages: user, tool_choice: { type: "function", function: {} } }))).toBe("tool_choice.function.name");
  });

  test("nullable fields report the inner field", () => {
    expect(paramFor(() => parseChatBody({ model: "m", messages: user, stream_options: { include_usage: 1 } }))).toBe("stream_options.include_usage");
    expect(paramFor(() => parseChatBody({ model: "m", messages: user, temperature: 9 }))).toBe("temperature");
  });

  test("assistant messages as the SDK returns them are accepted back", () => {
    const echoed = {
      role: "assistant",
      content: null,
      refusal: null,
      annotations: [],
      audio: null,
      function_call: null,
      reasoning_content: null,
      tool_calls: [{ id: "c1", type: "function", function: { name: "f", arguments: "{}" } }],
    };
    expect(() => parseChatBody({ model: "m", messages: [...user, echoed, { role: "tool", tool_call_id: "c1", content: [{ type: "text", text: "ok" }] }] })).not.toThrow();
  });

  test("tool parameters are arbitrary JSON Schema", () => {
    const parameters = { $schema: "x", type: "object", additionalProperties: false, properties: { a: { anyOf: [{ type: "string" }, { type: "null" }] } }, "x-anything": [1, { deep: true }] };
    expect(() => parseChatBody({ model: "m", messages: user, tools: [{ type: "function", function: { name: "f", parameters } }] })).not.toThrow();
  });

  test("firstImage", () => {
    expect(firstImage([{ role: "user", content: "x" }, { role: "user", content: [{ type: "text" }, { type: "image_url" }] }] as never)).toBe("messages[1].content[1]");
    expect(firstImage([{ role: "user", content: "x" }] as never)).toBeUndefined();
  });
});

describe("parseEmbeddingsBody", () => {
  test("input shapes", () => {
    for (const input of ["a", ["a", "b"], [1, 2], [[1], [2, 3]]]) expect(() => parseEmbeddingsBody({ model: "e", input })).not.toThrow();
    for (const input of [[], [[]], [1, "a"], { text: "a" }, null]) expect(paramFor(() => parseEmbeddingsBody({ model: "e", input }))).toContain("input");
  });
});

describe("token estimates", () => {
  test("~4 bytes of UTF-8 a token plus per-message overhead, images at a flat cost", () => {
    const body = parseChatBody({
      model: "m",
      messages: [{ role: "user", content: [{ type: "text", text: "x".repeat(400) }, { type: "image_url", image_url: { url: "https://a/b.png" } }] }],
    });
    expect(estimatePromptTokens(body)).toBe(3 + 4 + 100 + 85);
    // 2 bytes a character (é), 3 (漢), 4 (an emoji, two UTF-16 units): each counted by its bytes, tool calls and tools too.
    const dense = parseChatBody({
      model: "m",
      messages: [
        { role: "user", content: "é".repeat(100) },
        { role: "assistant", content: "漢".repeat(100), tool_calls: [{ id: "c", type: "function", function: { name: "f", arguments: "😀".repeat(100) } }] },
      ],
      tools: [{ type: "function", function: { name: "f", description: "漢".repeat(100) } }],
    });
    const toolsJson = JSON.stringify(dense.tools);
    expect(estimatePromptTokens(dense)).toBe(3 + (4 + 50) + (4 + Math.ceil((300 + 1 + 400) / 4)) + Math.ceil((toolsJson.length + 200) / 4));
    expect(estimateEmbeddingTokens(parseEmbeddingsBody({ model: "e", input: ["abcd", "abcdefgh"] }))).toBe(3);
    expect(estimateEmbeddingTokens(parseEmbeddingsBody({ model: "e", input: [[1, 2, 3], [4]] }))).toBe(4);
  });
});

describe("the prompt's bound (what the quota reserves)", () => {
  test("a token per UTF-8 byte, 16 per message, 512 per request, images at imageTokens", () => {
    const body = parseChatBody({
      model: "m",
      messages: [
        { role: "system", content: "sé" },
        { role: "user", content: [{ type: "text", text: "漢😀" }, { type: "image_url", image_url: { url: "https://a/b.png" } }], name: "ann" },
      ],
    });
    // "sé" is 3 bytes; "漢😀" 7; "ann" 3.
    expect(promptTokenBound(body, 1_000, undefined)).toBe(512 + 16 + 3 + 16 + 3 + 7 + 1_000);
  });

  test("tool calls, their ids and answers, echoed reasoning and tools are counted", () => {
    const tools = [{ type: "function", function: { name: "f", parameters: { type: "object" } } }];
    const body = parseChatBody({
      model: "m",
      messages: [
        { role: "user", content: "hi" },
        { role: "assistant", content: null, reasoning_content: "think", tool_calls: [{ id: "c1", type: "function", function: { name: "f", arguments: "{}" } }] },
        { role: "tool", tool_call_id: "c1", content: "42" },
      ],
      tools,
    });
    // Strings count as quoted JSON (2 more), the tools as rendered with indent 4 (below).
    const toolsRendered = Buffer.byteLength(JSON.stringify(body.tools, null, 4));
    const bound = promptTokenBound(body, 1, undefined);
    expect(bound).toBeGreaterThanOrEqual(512 + (16 + 2) + (16 + 5 + 16 + 4 + 3 + 4) + (16 + 4 + 4) + toolsRendered + 512);
    expect(bound).toBeLessThan(512 + (16 + 2) + (16 + 5 + 16 + 4 + 3 + 4) + (16 + 4 + 4) + toolsRendered + 512 + 64);
  });

  /**
   * How chat templates render structured values (HF's `tojson`: Python's
   * json.dumps, optionally indented; Jinja's own `tojson` escapes non-ASCII
   * and < > & '), to hold the bound to the largest of them.
   */
  function render(v: unknown, o: { indent?: number; ascii?: boolean; html?: boolean }, depth = 0): string {
    const pad = (d: number) => (o.indent === undefined ? "" : `\n${" ".repeat(o.indent * d)}`);
    const sep = o.indent === undefined ? ", " : ",";
    if (typeof v === "string") {
      let s = JSON.stringify(v);
      const u = (c: string) => `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`;
      if (o.ascii) s = s.replace(/[\u0080-\uffff]/g, u);
      if (o.html) s = s.replace(/[<>&']/g, u);
      return s;
    }
    if (Array.isArray(v)) {
      if (v.length === 0) return "[]";
      return `[${v.map((x) => pad(depth + 1) + render(x, o, depth + 1)).join(sep)}${pad(depth)}]`;
    }
    if (v !== null && typeof v === "object") {
      const entries = Object.entries(v);
      if (entries.length === 0) return "{}";
      return `{${entries.map(([k, x]) => `${pad(depth + 1)}${render(k, o)}: ${render(x, o, depth + 1)}`).join(sep)}${pad(depth)}}`;
    }
    return JSON.stringify(v);
  }
  const RENDERINGS = [{}, { indent: 4 }, { ascii: true }, { indent: 4, ascii: true, html: true }, { ascii: true, html: true }];
  const bytes = (s: string) => Buffer.byteLength(s, "utf8");
  const ask = [{ role: "user", content: "x" }];

  test("tools, functions and a response format's schema: at least as many bytes as any template renders them (indented, escaped)", () => {
    const base = promptTokenBound(parseChatBody({ model: "m", messages: ask }), 1, undefined);
    fc.assert(
      fc.property(fc.jsonValue({ maxDepth: 6 }), fc.string({ unit: "binary" }), (value, text) => {
        const parameters = { x: value, d: text };
        const tools = [{ type: "function", function: { name: "f", description: text, parameters } }];
        const withTools = promptTokenBound(parseChatBody({ model: "m", messages: ask, tools }), 1, undefined) - base;
        const functions = [{ name: "f", description: text, parameters }];
        const withFunctions = promptTokenBound(parseChatBody({ model: "m", messages: ask, functions }), 1, undefined) - base;
        const format = { type: "json_schema", json_schema: { name: "f", schema: parameters } };
        const withFormat = promptTokenBound(parseChatBody({ model: "m", messages: ask, response_format: format }), 1, undefined) - base;
        for (const o of RENDERINGS) {
          // The whole list, and each tool alone (Llama 3.1 renders `t | tojson(indent=4)` per tool).
          expect(withTools).toBeGreaterThanOrEqual(bytes(render(tools, o)) + 512);
          expect(withTools).toBeGreaterThanOrEqual(bytes(render(tools[0], o)) + 512);
          expect(withFunctions).toBeGreaterThanOrEqual(bytes(render(functions, o)) + 512);
          expect(withFormat).toBeGreaterThanOrEqual(bytes(render(format.json_schema.schema, o)) + 512);
        }
      }),
      { numRuns: 300, seed: 7 },
    );
  });

  test("tool call arguments and tool results: at least as many bytes as tojson makes of them", () => {
    fc.assert(
      fc.property(fc.jsonValue({ maxDepth: 4 }), fc.string({ unit: "binary" }), (args, result) => {
        const call = (a: string) => ({ role: "assistant", content: null, tool_calls: [{ id: "c", type: "function", function: { name: "f", arguments: a } }] });
        const bodyOf = (a: string, r: string) => parseChatBody({ model: "m", messages: [...ask, call(a), { role: "tool", tool_call_id: "c", content: r }] });
        const base = promptTokenBound(bodyOf("", ""), 1, undefined);
        const text = JSON.stringify(args) ?? "null";
        const counted = promptTokenBound(bodyOf(text, result), 1, undefined) - base;
        for (const o of RENDERINGS) {
          // vLLM parses the arguments for the template, which re-serialises them; Llama 3.1 passes a tool result through tojson.
          expect(counted).toBeGreaterThanOrEqual(bytes(render(args, { ...o, indent: undefined })) + bytes(render(result, o)) - 4);
          expect(counted).toBeGreaterThanOrEqual(bytes(render(text, o)) + bytes(render(result, o)) - 4);
        }
      }),
      { numRuns: 300, seed: 11 },
    );
  });

  // decisions.md, Quota: the JSON a template may render (tools, functions, a named tool_choice/function_call,
  // a response format) "each with 512 for the instructions around it"; echoed reasoning and tool call ids count.
  test("exact allowances: 512 around tools and around a response format, a named tool_choice or function_call, echoed reasoning, tool call ids", () => {
    const ask = [{ role: "user", content: "hi" }];
    const bound = (extra: Record<string, unknown>, messages: unknown[] = ask) => promptTokenBound(parseChatBody({ model: "m", messages, ...extra }), 1, undefined);
    const base = bound({});
    // An empty list renders as "[]" (2 bytes): tools and functions are counted together, with one 512.
    expect(bound({ tools: [] }) - base).toBe(512 + 2 + 2);
    const format = { type: "json_object" };
    // {"type": "json_object"} indented: 3 + (2 + 4 + 6 + 2 + 13) = 30 bytes at most.
    expect(bound({ response_format: format }) - base).toBe(512 + 30);
    const named = { type: "function", function: { name: "f" } };
    const tools = [{ type: "function", function: { name: "f" } }];
    const functions = [{ name: "f" }];
    expect(bound({ tools, tool_choice: named }) - bound({ tools, tool_choice: "auto" })).toBeGreaterThanOrEqual(Buffer.byteLength(JSON.stringify(named, null, 4)));
    expect(bound({ functions, function_call: { name: "f" } }) - bound({ functions, function_call: "auto" })).toBeGreaterThanOrEqual(
      Buffer.byteLength(JSON.stringify({ name: "f" }, null, 4)),
    );
    const assistant = (extra: Record<string, unknown>) => [...ask, { role: "assistant", content: null, ...extra }];
    const plain = bound({}, assistant({}));
    expect(bound({}, assistant({ reasoning_content: "think" })) - plain).toBe(5);
    expect(bound({}, assistant({ reasoning: "think" })) - plain).toBe(5);
    const call = (id: string) => assistant({ tool_calls: [{ id, type: "function", function: { name: "f", arguments: "{}" } }] });
    expect(bound({}, call("c".repeat(101))) - bound({}, call("c"))).toBe(100);
  });

  // decisions.md, Quota: "Embeddings reserve their own bound the same way (a byte a token and 16 per input)".
  test("embeddings: a token per UTF-8 byte and 16 per input; a token list is its own length", () => {
    expect(embeddingTokenBound(parseEmbeddingsBody({ model: "m", input: "sé" }))).toBe(3 + 16);
    expect(embeddingTokenBound(parseEmbeddingsBody({ model: "m", input: ["ab", "漢"] }))).toBe(2 + 16 + 3 + 16);
    expect(embeddingTokenBound(parseEmbeddingsBody({ model: "m", input: [1, 2, 3] }))).toBe(3 + 16);
    expect(embeddingTokenBound(parseEmbeddingsBody({ model: "m", input: [[1, 2], [3]] }))).toBe(2 + 16 + 1 + 16);
  });

  test("never more than the context window, and never less than the text's bytes", () => {
    const body = parseChatBody({ model: "m", messages: [{ role: "user", content: "漢".repeat(10_000) }] });
    expect(promptTokenBound(body, 1, 8_192)).toBe(8_192);
    expect(promptTokenBound(body, 1, undefined)).toBeGreaterThanOrEqual(30_000);
    // The estimate is a quarter of the bytes (before: of the UTF-16 units, 2,507); the bound is what a byte-level tokenizer could count.
    expect(estimatePromptTokens(body)).toBe(3 + 4 + 7_500);
  });
});
