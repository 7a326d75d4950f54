import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { createOpenAI } from "@ai-sdk/openai";
import { streamText, tool } from "ai";
import OpenAI from "openai";
import { z } from "zod";
import type { Gateway } from "../../src/server.ts";
import { type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { CHAT_MODEL, TEST_PLANS, arr, chatAlias, post, rec, seedTestOrg, upstreamSettings } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Two shapes of an OpenAI-compatible upstream's answer that vLLM does not
 * send but other servers do, through the gateway over real HTTP, for chat and
 * for the Responses API, JSON and streamed (docs/decisions.md, "Tool-call
 * arguments sent as JSON" and "SSE comments in a Responses stream"):
 *  - `function.arguments` as a JSON object or array rather than a JSON string:
 *    every client gets the JSON text (the SDKs' types say string);
 *  - SSE comments (`: ping`) between chunks: chat passes them on as sent, a
 *    Responses stream as `: keep-alive`, in order, without a sequence_number;
 *  - parallel tool calls that share one id (a server that numbers its calls,
 *    or a model that writes the ids itself and repeats one): chat passes them
 *    on as sent, the Responses API gives each function_call its own call_id.
 */

const ENC = new TextEncoder();
const ARGS = { city: "Oslo", days: [1, 2], nested: { unit: "celsius" } };
const ARGS_TEXT = JSON.stringify(ARGS);
const LIST = ["x", 1, { y: true }];
const LIST_TEXT = JSON.stringify(LIST);

const chunk = (delta: Record<string, unknown>, finish: string | null = null) =>
  `data: ${JSON.stringify({ id: "c1", object: "chat.completion.chunk", created: 1, model: CHAT_MODEL, choices: [{ index: 0, delta, logprobs: null, finish_reason: finish }] })}\n\n`;
const USAGE = `data: ${JSON.stringify({ id: "c1", object: "chat.completion.chunk", created: 1, model: CHAT_MODEL, choices: [], usage: { prompt_tokens: 7, completion_tokens: 9, total_tokens: 16 } })}\n\n`;
const DONE = "data: [DONE]\n\n";

/** A whole chat answer (finish_reason tool_calls) calling get_weather once per [id, arguments] pair, arguments as given. */
function toolCallsAnswer(calls: [id: string, args: unknown][]): Record<string, unknown> {
  const tool_calls = calls.map(([id, args]) => ({ id, type: "function", function: { name: "get_weather", arguments: args } }));
  return {
    id: "c1",
    object: "chat.completion",
    created: 1,
    model: CHAT_MODEL,
    choices: [{ index: 0, message: { role: "assistant", content: null, tool_calls }, finish_reason: "tool_calls" }],
    usage: { prompt_tokens: 7, completion_tokens: 9, total_tokens: 16 },
  };
}

/** What the scripted upstream answers: a JSON answer and the stream's reads (each a string, or a pause until `release`). */
interface Script {
  json: Record<string, unknown>;
  reads: (string | "wait")[];
}
let script: Script;
/** Resolves the scripted stream's pause (the test calls it once it has seen what came before). */
let release: () => void = () => {};
let released: Promise<void> = Promise.resolve();

function pause(): void {
  released = new Promise((r) => (release = r));
}

let upstream: ReturnType<typeof Bun.serve>;
let gw: Gateway;
let org: SeededOrg;

beforeAll(async () => {
  upstream = Bun.serve({
    port: 0,
    hostname: "127.0.0.1",
    idleTimeout: 60,
    async fetch(req) {
      const body = (await req.json()) as { stream?: boolean };
      if (!body.stream) return Response.json(script.json);
      const reads = [...script.reads];
      return new Response(
        new ReadableStream({
          async pull(c) {
            let r = reads.shift();
            while (r === "wait") {
              await Promise.race([released, Bun.sleep(5_000)]);
              r = reads.shift();
            }
            if (r === undefined) c.close();
            else c.enqueue(ENC.encode(r));
          },
        }),
        { headers: { "content-type": "text/event-stream" } },
      );
    },
  });
  gw = await startTestGateway({
    aliases: { "svc-odd": chatAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }]) },
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 1 }),
    responses: { enabled: true },
  });
  org = await seedTestOrg(gw.database);
});
afterAll(async () => {
  await gw.stop();
  upstream.stop(true);
});

const TOOLS_CHAT = [{ type: "function", function: { name: "get_weather", parameters: { type: "object", properties: { city: { type: "string" } } } } }];
const TOOLS_RESPONSES = [{ type: "function", name: "get_weather", parameters: { type: "object", properties: { city: { type: "string" } } }, strict: false }];

/** The Responses events of an SSE body: its `data:` payloads, parsed. */
function events(text: string): Record<string, unknown>[] {
  return text
    .split("\n\n")
    .filter((e) => e.includes("data: "))
    .map((e) => rec(JSON.parse(e.split("\n").find((l) => l.startsWith("data: "))?.slice(6) ?? "null")));
}

/** Each chat tool call's arguments, concatenated over the stream's deltas by index, as a client assembles them. */
function chatStreamArguments(text: string): unknown[] {
  const args: unknown[] = [];
  for (const e of text.split("\n\n")) {
    if (!e.startsWith("data: {")) continue;
    const c = rec(JSON.parse(e.slice(6)));
    for (const choice of arr(c.choices)) {
      const calls = rec(rec(choice).delta).tool_calls;
      if (!Array.isArray(calls)) continue;
      for (const tc of calls) {
        const i = Number(rec(tc).index);
        const a = rec(rec(tc).function).arguments;
        if (a === undefined || a === null) continue;
        args[i] = typeof a === "string" ? String(args[i] ?? "") + a : a;
      }
    }
  }
  return args;
}

describe("tool-call arguments the upstream sends as a JSON object or array", () => {
  // Seen failing before: the Responses API turned them into "" (JSON and streamed: `str(fn.arguments)` in
  // output.ts and stream-state.ts), so the client's function call lost its arguments, and chat passed the
  // object on as sent, where the openai SDK and the Vercel AI SDK take a string.
  const JSON_ANSWER = toolCallsAnswer([
    ["call_a", ARGS],
    ["call_b", LIST],
    ["call_c", '{"city":"Bergen"}'],
  ]);
  /** Whole objects in deltas, one written with Python's separators (`"arguments": {…}`), and a string call alongside. */
  const STREAM = [
    chunk({ role: "assistant", content: null }),
    chunk({ tool_calls: [{ index: 0, id: "call_a", type: "function", function: { name: "get_weather", arguments: ARGS } }] }),
    `data: {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "${CHAT_MODEL}", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": ["x", 1, {"y": true}]}}]}, "logprobs": null, "finish_reason": null}]}\n\n`,
    chunk({ tool_calls: [{ index: 2, id: "call_c", type: "function", function: { name: "get_weather", arguments: '{"city":' } }] }),
    chunk({ tool_calls: [{ index: 2, function: { arguments: '"Bergen"}' } }] }),
    chunk({}, "tool_calls") + USAGE + DONE,
  ];
  const EXPECTED = [ARGS_TEXT, LIST_TEXT, '{"city":"Bergen"}'];

  beforeAll(() => {
    script = { json: JSON_ANSWER, reads: STREAM };
  });

  test("Responses, JSON: each function_call item's arguments are the JSON text", async () => {
    const res = await post(gw, "/v1/responses", org.personalKey, { model: "svc-odd", input: "weather?", tools: TOOLS_RESPONSES, store: false });
    expect(res.status).toBe(200);
    const r = rec(await res.json());
    const calls = arr(r.output).map(rec).filter((i) => i.type === "function_call");
    expect(calls.map((c) => [c.call_id, c.arguments])).toEqual([
      ["call_a", ARGS_TEXT],
      ["call_b", LIST_TEXT],
      ["call_c", '{"city":"Bergen"}'],
    ]);
  });

  test("Responses, streamed: the arguments events and the final items carry the JSON text", async () => {
    const res = await post(gw, "/v1/responses", org.personalKey, { model: "svc-odd", input: "weather?", tools: TOOLS_RESPONSES, store: false, stream: true });
    expect(res.status).toBe(200);
    const all = events(await res.text());
    expect(all.at(-1)?.type).toBe("response.completed");
    const done = all.filter((e) => e.type === "response.function_call_arguments.done").map((e) => e.arguments);
    expect(done).toEqual(EXPECTED);
    const final = rec(all.at(-1)?.response);
    expect(arr(final.output).map((i) => rec(i).arguments)).toEqual(EXPECTED);
  });

  test("the openai SDK's responses.create, JSON and streamed, gets arguments that parse", async () => {
    const client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: org.personalKey, maxRetries: 0 });
    const tools = [{ type: "function" as const, name: "get_weather", parameters: { type: "object", properties: { city: { type: "string" } } }, strict: false }];
    const r = await client.responses.create({ model: "svc-odd", input: "weather?", tools, store: false });
    const streamed = await client.responses.stream({ model: "svc-odd", input: "weather?", tools, store: false }).finalResponse();
    for (const final of [r, streamed]) {
      const args = final.output.map((i) => (i.type === "function_call" ? JSON.parse(i.arguments) : i.type));
      expect(args).toEqual([ARGS, LIST, { city: "Bergen" }]);
    }
  });

  test("chat, JSON: each tool call's arguments are the JSON text; the rest of the answer as sent", async () => {
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-odd", messages: [{ role: "user", content: "weather?" }], tools: TOOLS_CHAT });
    expect(res.status).toBe(200);
    const msg = rec(rec(arr(rec(await res.json()).choices)[0]).message);
    expect(msg.tool_calls).toEqual([
      { id: "call_a", type: "function", function: { name: "get_weather", arguments: ARGS_TEXT } },
      { id: "call_b", type: "function", function: { name: "get_weather", arguments: LIST_TEXT } },
      { id: "call_c", type: "function", function: { name: "get_weather", arguments: '{"city":"Bergen"}' } },
    ]);
  });

  test("chat, streamed: each tool call's argument deltas join to the JSON text", async () => {
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-odd", messages: [{ role: "user", content: "weather?" }], tools: TOOLS_CHAT, stream: true });
    expect(res.status).toBe(200);
    const text = await res.text();
    expect(text.endsWith(DONE)).toBe(true);
    expect(chatStreamArguments(text)).toEqual(EXPECTED);
  });

  test("the openai SDK's chat stream helper assembles the calls with their arguments", async () => {
    const client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: org.personalKey, maxRetries: 0 });
    const final = await client.chat.completions
      .stream({ model: "svc-odd", messages: [{ role: "user", content: "weather?" }], tools: TOOLS_CHAT as OpenAI.ChatCompletionTool[] })
      .finalChatCompletion();
    const calls = final.choices[0]?.message.tool_calls ?? [];
    expect(calls.map((c) => (c.type === "function" ? JSON.parse(c.function.arguments) : null))).toEqual([ARGS, LIST, { city: "Bergen" }]);
  });

  test("the Vercel AI SDK's streamText (openai.chat) gets the calls with their inputs, and no error", async () => {
    const openai = createOpenAI({ baseURL: `${gw.url}/v1`, apiKey: org.personalKey });
    const errors: unknown[] = [];
    const r = streamText({
      model: openai.chat("svc-odd"),
      prompt: "weather?",
      tools: { get_weather: tool({ description: "weather", inputSchema: z.any() }) },
      onError: ({ error }) => {
        errors.push(error);
      },
    });
    const inputs: unknown[] = [];
    for await (const part of r.fullStream) if (part.type === "tool-call") inputs.push(part.input);
    expect(errors).toEqual([]);
    expect(inputs).toEqual([ARGS, LIST, { city: "Bergen" }]);
  });
});

describe("parallel tool calls sharing one id", () => {
  // Seen failing before: both function_call items of a Responses answer carried call_id "call_0", and the
  // openai SDK's responses.stream() threw "duplicate output item identity 'call:function_call:call_0'"
  // (its accumulator keys items by call_id); a client answering both calls sent two outputs for one id.
  const JSON_ANSWER = toolCallsAnswer([
    ["call_0", '{"city":"Oslo"}'],
    ["call_0", '{"city":"Bergen"}'],
  ]);
  const STREAM = [
    chunk({ role: "assistant", content: null }),
    chunk({ tool_calls: [{ index: 0, id: "call_0", type: "function", function: { name: "get_weather", arguments: '{"city":"Oslo"}' } }] }),
    chunk({ tool_calls: [{ index: 1, id: "call_0", type: "function", function: { name: "get_weather", arguments: '{"city":"Bergen"}' } }] }),
    chunk({}, "tool_calls") + USAGE + DONE,
  ];

  beforeAll(() => {
    script = { json: JSON_ANSWER, reads: STREAM };
  });

  /** The function_call items' call_ids: the first keeps the upstream's, the repeat gets a new `call_…`. */
  function expectOwnIds(calls: Record<string, unknown>[]): void {
    expect(calls.map((c) => c.arguments)).toEqual(['{"city":"Oslo"}', '{"city":"Bergen"}']);
    expect(calls[0]?.call_id).toBe("call_0");
    expect(calls[1]?.call_id).toMatch(/^call_[A-Za-z0-9]+$/);
    expect(calls[1]?.call_id).not.toBe("call_0");
  }

  test("Responses, JSON and streamed: each function_call item has its own call_id", async () => {
    const json = await post(gw, "/v1/responses", org.personalKey, { model: "svc-odd", input: "weather?", tools: TOOLS_RESPONSES, store: false });
    expect(json.status).toBe(200);
    expectOwnIds(arr(rec(await json.json()).output).map(rec));

    const streamed = await post(gw, "/v1/responses", org.personalKey, { model: "svc-odd", input: "weather?", tools: TOOLS_RESPONSES, store: false, stream: true });
    const all = events(await streamed.text());
    const added = all.filter((e) => e.type === "response.output_item.added").map((e) => rec(e.item));
    const done = all.filter((e) => e.type === "response.output_item.done").map((e) => rec(e.item));
    const final = arr(rec(all.at(-1)?.response).output).map(rec);
    expect(all.at(-1)?.type).toBe("response.completed");
    expectOwnIds(final);
    // The events name the same call_ids as the final response.
    expect(added.map((i) => i.call_id)).toEqual(final.map((i) => i.call_id));
    expect(done.map((i) => i.call_id)).toEqual(final.map((i) => i.call_id));
  });

  test("the openai SDK's responses.stream() and responses.create get two calls they can answer", async () => {
    const client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: org.personalKey, maxRetries: 0 });
    const tools = [{ type: "function" as const, name: "get_weather", parameters: { type: "object", properties: { city: { type: "string" } } }, strict: false }];
    const streamed = await client.responses.stream({ model: "svc-odd", input: "weather?", tools, store: false }).finalResponse();
    const r = await client.responses.create({ model: "svc-odd", input: "weather?", tools, store: false });
    for (const final of [streamed, r]) {
      const ids = final.output.flatMap((i) => (i.type === "function_call" ? [i.call_id] : []));
      expect(new Set(ids).size).toBe(2);
    }
  });

  test("chat passes the ids on as sent", async () => {
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-odd", messages: [{ role: "user", content: "weather?" }], tools: TOOLS_CHAT });
    const msg = rec(rec(arr(rec(await res.json()).choices)[0]).message);
    expect(arr(msg.tool_calls).map((c) => rec(c).id)).toEqual(["call_0", "call_0"]);
  });
});

describe("SSE comments between the upstream's chunks", () => {
  // Seen failing before: a Responses stream dropped them (events.ts's SseData ignored comment lines), so a
  // reasoning model's long silence reached the client as no bytes at all, where a chat stream carries `: ping`.
  const STREAM = [chunk({ role: "assistant", content: "Hello" }), ": ping\n\n", "wait", chunk({ content: " world" }), chunk({}, "stop") + USAGE + DONE];

  test("Responses, streamed: `: keep-alive` is sent when the comment comes, between the events around it, with no sequence_number", async () => {
    script = { json: {}, reads: STREAM };
    pause();
    const res = await post(gw, "/v1/responses", org.personalKey, { model: "svc-odd", input: "hi", store: false, stream: true });
    expect(res.status).toBe(200);
    // Read until the comment arrives; only then does the upstream send the rest (or after 5 s without it).
    const reader = (res.body as ReadableStream<Uint8Array>).getReader();
    const dec = new TextDecoder();
    let text = "";
    let beforeRest: boolean | undefined;
    for (;;) {
      const r = await reader.read();
      if (r.done) break;
      text += dec.decode(r.value, { stream: true });
      if (beforeRest === undefined && text.includes(": keep-alive\n\n")) {
        beforeRest = !text.includes(" world");
        release();
      }
    }
    expect(beforeRest).toBe(true);
    const blocks = text.split("\n\n").filter((b) => b !== "");
    expect(blocks.filter((b) => b.startsWith(":"))).toEqual([": keep-alive"]);
    const at = blocks.indexOf(": keep-alive");
    const deltas = blocks.map((b, i) => [i, b] as const).filter(([, b]) => b.includes('"type":"response.output_text.delta"'));
    expect(deltas.map(([i, b]) => [i < at, JSON.parse(b.split("\n")[1]?.slice(6) ?? "null").delta])).toEqual([
      [true, "Hello"],
      [false, " world"],
    ]);
    const all = events(text);
    expect(all.map((e) => e.sequence_number)).toEqual(all.map((_, i) => i));
    expect(all.at(-1)?.type).toBe("response.completed");
    expect(rec(all.at(-1)?.response).output_text).toBe("Hello world");
  });

  test("comments in the same read as chunks, a comment event of several lines, and a comment before the first chunk: one `: keep-alive` each, in place", async () => {
    script = {
      json: {},
      reads: [`: first\n\n${chunk({ role: "assistant", content: "A" })}: a\n: b\n\n${chunk({ content: "B" })}`, chunk({}, "stop") + USAGE + DONE],
    };
    const res = await post(gw, "/v1/responses", org.personalKey, { model: "svc-odd", input: "hi", store: false, stream: true });
    const text = await res.text();
    const kinds = text
      .split("\n\n")
      .filter((b) => b !== "")
      .map((b) => (b.startsWith(":") ? b : (/"type":"([^"]+)"/.exec(b)?.[1] ?? b)))
      .filter((k) => k.startsWith(":") || k === "response.output_text.delta" || k === "response.in_progress");
    expect(kinds).toEqual(["response.in_progress", ": keep-alive", "response.output_text.delta", ": keep-alive", "response.output_text.delta"]);
  });

  test("the openai SDK's responses.create({stream: true}) reads the same events as without the comments", async () => {
    const client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: org.personalKey, maxRetries: 0 });
    const read = async (reads: Script["reads"]) => {
      script = { json: {}, reads };
      pause();
      release();
      const types: string[] = [];
      let output = "";
      for await (const e of await client.responses.create({ model: "svc-odd", input: "hi", store: false, stream: true })) {
        types.push(e.type);
        if (e.type === "response.completed") output = e.response.output_text;
      }
      return { types, output };
    };
    const withComments = await read(STREAM);
    const without = await read(STREAM.filter((r) => r !== ": ping\n\n" && r !== "wait"));
    expect(withComments.output).toBe("Hello world");
    expect(withComments).toEqual(without);
  });

  test("chat, streamed: the comment is passed on as sent (as before)", async () => {
    script = { json: {}, reads: STREAM };
    pause();
    release();
    const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-odd", messages: [{ role: "user", content: "hi" }], stream: true });
    const text = await res.text();
    expect(text).toContain("\n\n: ping\n\n");
    expect(text.indexOf(": ping")).toBeLessThan(text.indexOf(" world"));
  });
});
