import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import OpenAI from "openai";
import type { ResponseStreamEvent } from "openai/resources/responses/responses";
import { responseEventStream } from "../../src/responses/events.ts";
import type { ResponseObject } from "../../src/responses/output.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { chunk, DONE, ERROR, enc, meta, ROLE, source, USAGE } from "../helpers/responses.ts";

/** A tiny server that answers /v1/responses with the translation of a chat stream (scripted, or the simulator's). */
describe("the openai SDK accepts the event stream", () => {
  let sim: Simulator;
  let server: ReturnType<typeof Bun.serve>;
  let client: OpenAI;
  let script: string[] | undefined;
  let lastFinal: ResponseObject | undefined;

  beforeAll(async () => {
    sim = await startSimulator({ ttftMs: 0, interTokenMs: 0, completionTokens: 6, reasoning: "Think first." });
    server = Bun.serve({
      port: 0,
      hostname: "127.0.0.1",
      async fetch(req) {
        const body = (await req.json()) as { input: string; tools?: unknown[] };
        let chatSse: ReadableStream<Uint8Array>;
        if (script) chatSse = source(script.map((p) => enc.encode(p))).stream;
        else {
          const tools = (body.tools ?? []).map((t) => ({ type: "function", function: t }));
          const res = await fetch(`${sim.url}/chat/completions`, {
            method: "POST",
            headers: { "content-type": "application/json" },
            body: JSON.stringify({ model: "chat-small", messages: [{ role: "user", content: body.input }], stream: true, stream_options: { include_usage: true }, ...(tools.length ? { tools } : {}) }),
          });
          if (!res.body) throw new Error("no body");
          chatSse = res.body;
        }
        return new Response(
          responseEventStream(chatSse, meta(), (r) => {
            lastFinal = r;
          }),
          { headers: { "content-type": "text/event-stream" } },
        );
      },
    });
    client = new OpenAI({ baseURL: `http://127.0.0.1:${server.port}/v1`, apiKey: "k", maxRetries: 0 });
  });
  afterAll(async () => {
    await server.stop(true);
    await sim.stop();
  });

  const plain = (r: unknown) => JSON.parse(JSON.stringify(r));
  /** finalResponse() adds its parse results (`output_parsed`, `parsed`, `parsed_arguments`); the rest must be the wire payload. */
  const unparsed = (r: unknown) =>
    JSON.parse(JSON.stringify(r), (k, v) => (k === "output_parsed" || k === "parsed" || k === "parsed_arguments" ? undefined : v));

  test("responses.stream(): finalResponse() equals the response.completed payload (simulator reasoning + text)", async () => {
    script = undefined;
    const stream = client.responses.stream({ model: "chat-small", input: "hello" });
    const seen: ResponseStreamEvent[] = [];
    stream.on("event", (e) => seen.push(e));
    const final = await stream.finalResponse();
    const completed = seen.at(-1);
    if (completed?.type !== "response.completed") throw new Error(`last event ${completed?.type}`);
    const rest = unparsed(final);
    const output_text = rest.output_text;
    expect(rest).toEqual(plain(completed.response));
    expect(rest).toEqual(plain(lastFinal));
    expect(output_text).toBe("token0 token1 token2 token3 token4 token5 ");
    expect(final.output.map((i) => i.type)).toEqual(["reasoning", "message"]);
    expect(final.usage?.output_tokens).toBeGreaterThan(0);
  });

  test("responses.stream() with a tool call from the simulator; responses.create({stream:true}) yields the same typed events", async () => {
    script = undefined;
    const tools = [{ type: "function" as const, name: "get_weather", parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] }, strict: false }];
    const final = await client.responses.stream({ model: "chat-small", input: "weather in Oslo?", tools }).finalResponse();
    const call = final.output.find((i) => i.type === "function_call");
    expect(call).toMatchObject({ type: "function_call", name: "get_weather", call_id: expect.stringMatching(/^call_/), status: "completed" });
    expect(JSON.parse(call?.type === "function_call" ? call.arguments : "null")).toHaveProperty("city");
    const types: string[] = [];
    for await (const e of await client.responses.create({ model: "chat-small", input: "weather?", tools, stream: true })) types.push(e.type);
    expect(types.at(-1)).toBe("response.completed");
    expect(types).toContain("response.function_call_arguments.done");
  });

  test("scripted interleaved tool calls and an incomplete answer accumulate to the final payload", async () => {
    script = [
      chunk({ content: "Let me check." }),
      chunk({ tool_calls: [{ index: 0, id: "call_A", type: "function", function: { name: "a", arguments: "{" } }] }),
      chunk({ tool_calls: [{ index: 1, id: "call_B", type: "function", function: { name: "b", arguments: "{" } }] }),
      chunk({ tool_calls: [{ index: 0, function: { arguments: "}" } }, { index: 1, function: { arguments: "}" } }] }),
      chunk({}, "length"),
      USAGE,
      DONE,
    ];
    const stream = client.responses.stream({ model: "chat-small", input: "x" });
    const seen: ResponseStreamEvent[] = [];
    stream.on("event", (e) => seen.push(e));
    const final = await stream.finalResponse();
    const last = seen.at(-1);
    if (last?.type !== "response.incomplete") throw new Error(`last event ${last?.type}`);
    const rest = unparsed(final);
    const output_text = rest.output_text;
    expect(rest).toEqual(plain(last.response));
    expect(output_text).toBe("Let me check.");
    expect(final.output.map((i) => (i.type === "function_call" ? i.arguments : i.type))).toEqual(["message", "{}", "{}"]);
  });

  test("a reasoning-only answer: the SDK accepts the closing empty message's events; finalResponse ends with it", async () => {
    script = [ROLE, chunk({ reasoning_content: "all thought" }), chunk({}, "stop"), USAGE, DONE];
    const stream = client.responses.stream({ model: "chat-small", input: "x" });
    const seen: ResponseStreamEvent[] = [];
    stream.on("event", (e) => seen.push(e));
    const final = await stream.finalResponse();
    const last = seen.at(-1);
    if (last?.type !== "response.completed") throw new Error(`last event ${last?.type}`);
    expect(unparsed(final)).toEqual(plain(last.response));
    expect(final.output.map((i) => i.type)).toEqual(["reasoning", "message"]);
    expect(final.output_text).toBe("");
  });

  test("a mid-stream failure: the SDK raises an APIError with the gateway's message, after response.failed", async () => {
    script = [ROLE, chunk({ content: "partial" }), ERROR];
    const stream = client.responses.stream({ model: "chat-small", input: "x" });
    const seen: string[] = [];
    stream.on("event", (e) => seen.push(e.type));
    const err = await stream.finalResponse().then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(OpenAI.APIError);
    expect((err as Error).message).toContain("failed while generating: boom");
    expect(seen.at(-1)).toBe("response.failed");
    expect(lastFinal?.status).toBe("failed");
  });
});
