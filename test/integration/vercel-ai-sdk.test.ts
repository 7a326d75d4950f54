import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { createOpenAI, type OpenAIProvider } from "@ai-sdk/openai";
import {
  APICallError,
  embed,
  embedMany,
  generateObject,
  generateText,
  isStepCount,
  type LanguageModel,
  type ModelMessage,
  Output,
  StreamProviderError,
  streamText,
  tool,
} from "ai";
import { z } from "zod";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { SAY_HI_PROMPT_TOKENS, SIX_TOKEN_TEXT, TEST_PLANS, arr, rec, seedTestOrg, testAliases, upstreamSettings } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s on a busy machine.
setDefaultTimeout(30_000);

/**
 * The unmodified Vercel AI SDK (`ai` with `@ai-sdk/openai`) against a real
 * gateway over real HTTP, the simulated vLLM upstream behind it. Only the
 * base URL and the key are set, as the README promises. The provider's
 * default model factory, `openai(id)`, speaks the Responses API;
 * `openai.chat(id)` speaks chat completions: both are driven here, the
 * first against a gateway with `responses.enabled`.
 *
 * The simulator answers "token0 … token5 " (6 tokens) to plain prompts,
 * calls the first tool when the last user message says "weather", and fills
 * a response_format's JSON Schema with sample values ("Paris" for a city).
 */

let sim: Simulator;
let gw: Gateway;
let chatOnly: Gateway;
let org: SeededOrg;
let openai: OpenAIProvider;

const TEXT = SIX_TOKEN_TEXT;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 6 });
  const common = { aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: upstreamSettings({ attempts: 2 }) };
  // Web search tools accepted and not offered (the operator's opt-in), for openai.tools.webSearch() below.
  gw = await startTestGateway({ ...common, responses: { enabled: true, webSearch: "ignore" } });
  chatOnly = await startTestGateway(common);
  org = await seedTestOrg(gw.database);
  openai = createOpenAI({ baseURL: `${gw.url}/v1`, apiKey: org.personalKey });
});
afterEach(() => sim.reset());
afterAll(async () => {
  await gw.stop();
  await chatOnly.stop();
  await sim.stop();
});

const weather = tool({
  description: "Current weather in a city",
  inputSchema: z.object({ location: z.string(), unit: z.enum(["celsius", "fahrenheit"]) }),
  execute: async ({ location, unit }) => ({ location, unit, temperature: 21 }),
});

const upstreamBodies = () => sim.stats.bodies.map(rec);
const lastUpstream = () => rec(sim.stats.lastBody);

/** Changes the simulator's settings until sim.reset(). */
async function simConfig(patch: Record<string, unknown>): Promise<void> {
  const res = await fetch(`${sim.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify(patch) });
  expect(res.status).toBe(200);
}

/** Sets the simulator's reasoning text (vLLM's reasoning parser: `reasoning_content` before the answer); sim.reset() clears it. */
const simReasoning = (text: string) => simConfig({ reasoning: text });

/** The simulator's first n tokens ("token0 token1 … "). */
const tokens = (n: number) => Array.from({ length: n }, (_, i) => `token${i} `).join("");

/** streamText's onError for streams expected to fail (the default logs each error). */
const quiet = (): void => {};

/** A stream read to its end the way an application does (fullStream): its text and its error parts. */
async function drain(r: ReturnType<typeof streamText>): Promise<{ text: string; errors: unknown[] }> {
  let text = "";
  const errors: unknown[] = [];
  for await (const part of r.fullStream) {
    if (part.type === "text-delta") text += part.text;
    if (part.type === "error") errors.push(part.error);
  }
  return { text, errors };
}

async function callError(p: Promise<unknown>): Promise<APICallError> {
  const e = await p.then(
    () => undefined,
    (x: unknown) => x,
  );
  if (!APICallError.isInstance(e)) throw new Error(`expected an APICallError, got ${String(e)}`);
  return e;
}

const apis: [string, (id: string) => LanguageModel][] = [
  ["chat completions, openai.chat(id)", (id) => openai.chat(id)],
  ["Responses API, openai(id) (the provider's default)", (id) => openai(id)],
];

for (const [api, model] of apis) {
  describe(`Vercel AI SDK, ${api}`, () => {
    test("generateText: text, finish reason, usage, the alias as model id", async () => {
      const r = await generateText({ model: model("svc-fast"), prompt: "Say hi" });
      expect(r.text).toBe(TEXT);
      expect(r.finishReason).toBe("stop");
      expect(r.usage.inputTokens).toBe(SAY_HI_PROMPT_TOKENS);
      expect(r.usage.outputTokens).toBe(6);
      expect(r.usage.totalTokens).toBe(SAY_HI_PROMPT_TOKENS + 6);
      expect(r.response.modelId).toBe("svc-fast");
      expect(r.warnings).toEqual([]);
    });

    test("generateText with a system prompt and maxOutputTokens: finish reason length, settings forwarded", async () => {
      // 16 is the least max_output_tokens the Responses API takes (OpenAI's bound): the answer is made longer than that.
      await simConfig({ completionTokens: 20 });
      const r = await generateText({ model: model("svc-fast"), system: "Be brief.", prompt: "Say hi", temperature: 0.3, topP: 0.9, maxOutputTokens: 16 });
      expect(r.text).toBe(tokens(16));
      expect(r.finishReason).toBe("length");
      expect(r.usage.outputTokens).toBe(16);
      const up = lastUpstream();
      expect(up.max_tokens).toBe(16);
      expect(up.temperature).toBe(0.3);
      expect(up.top_p).toBe(0.9);
      expect(rec(arr(up.messages)[0])).toEqual({ role: "system", content: "Be brief." });
    });

    test("streamText: the whole text stream, then usage and finish reason", async () => {
      const r = streamText({ model: model("svc-fast"), prompt: "Say hi" });
      const pieces: string[] = [];
      for await (const t of r.textStream) pieces.push(t);
      expect(pieces.join("")).toBe(TEXT);
      expect(pieces.length).toBe(6);
      expect(await r.finishReason).toBe("stop");
      const usage = await r.usage;
      expect(usage.inputTokens).toBe(SAY_HI_PROMPT_TOKENS);
      expect(usage.outputTokens).toBe(6);
      expect(usage.totalTokens).toBe(SAY_HI_PROMPT_TOKENS + 6);
      expect(rec(lastUpstream().stream_options).include_usage).toBe(true);
    });

    test("a conversation: each turn's response.messages sent back with the next question, streamed or not", async () => {
      const messages: ModelMessage[] = [{ role: "user", content: "Say hi" }];
      // Each turn's answer a different length (the Responses API takes max_output_tokens from 16).
      await simConfig({ completionTokens: 20 });
      const first = await generateText({ model: model("svc-fast"), messages, maxOutputTokens: 16 });
      expect(first.text).toBe(tokens(16));
      messages.push(...first.response.messages, { role: "user", content: "Once more" });
      const second = streamText({ model: model("svc-fast"), messages, maxOutputTokens: 18 });
      expect(await second.text).toBe(tokens(18));
      messages.push(...(await second.response).messages, { role: "user", content: "And again" });
      const third = await generateText({ model: model("svc-fast"), messages });
      expect(third.text).toBe(tokens(20));
      // The Responses API translation sends user text as parts: compare the text.
      const text = (c: unknown) => (typeof c === "string" ? c : arr(c).map((p) => rec(p).text).join(""));
      const sent = arr(lastUpstream().messages).map(rec);
      expect(sent.map((m) => [m.role, text(m.content)])).toEqual([
        ["user", "Say hi"],
        ["assistant", tokens(16)],
        ["user", "Once more"],
        ["assistant", tokens(18)],
        ["user", "And again"],
      ]);
    });

    test("tool calling: a zod tool the model asks for, executed, its result sent back, then the answer", async () => {
      const r = await generateText({ model: model("svc-fast"), prompt: "What's the weather in Paris?", tools: { get_weather: weather }, stopWhen: isStepCount(3) });
      expect(r.steps.length).toBe(2);
      const [call, answer] = r.steps;
      expect(call?.finishReason).toBe("tool-calls");
      expect(call?.toolCalls.map((c) => [c.toolName, c.input])).toEqual([["get_weather", { location: "Paris", unit: "celsius" }]]);
      expect(call?.toolResults.map((t) => t.output)).toEqual([{ location: "Paris", unit: "celsius", temperature: 21 }]);
      expect(answer?.finishReason).toBe("stop");
      expect(r.text).toBe(TEXT);
      expect(r.totalUsage.outputTokens).toBe((call?.usage.outputTokens ?? 0) + 6);

      // The upstream saw the tool's JSON Schema, then the call and its result as chat messages.
      const [firstBody, secondBody] = upstreamBodies();
      const fn = rec(rec(arr(firstBody?.tools)[0]).function);
      expect(fn.name).toBe("get_weather");
      expect(rec(fn.parameters).required).toEqual(["location", "unit"]);
      const back = arr(secondBody?.messages).map(rec);
      expect(back.map((m) => m.role)).toEqual(["user", "assistant", "tool"]);
      const callId = rec(arr(back[1]?.tool_calls)[0]).id;
      expect(callId).toBe(call?.toolCalls[0]?.toolCallId);
      expect(back[2]?.tool_call_id).toBe(callId);
      expect(JSON.parse(String(back[2]?.content))).toEqual({ location: "Paris", unit: "celsius", temperature: 21 });
    });

    test("tool calling, streamed: the tool call parts, then the answer's text", async () => {
      const r = streamText({ model: model("svc-fast"), prompt: "What's the weather in Paris?", tools: { get_weather: weather }, stopWhen: isStepCount(3) });
      const calls: unknown[] = [];
      let text = "";
      for await (const part of r.fullStream) {
        if (part.type === "tool-call") calls.push([part.toolName, part.input]);
        if (part.type === "text-delta") text += part.text;
        if (part.type === "error") throw part.error;
      }
      expect(calls).toEqual([["get_weather", { location: "Paris", unit: "celsius" }]]);
      expect(text).toBe(TEXT);
      expect((await r.steps).map((s) => s.finishReason)).toEqual(["tool-calls", "stop"]);
      expect(await r.finishReason).toBe("stop");
    });

    test("a tool loop on a reasoning model (vLLM's reasoning_content): the second step carries the first's reasoning", async () => {
      await simReasoning("Let me look that up.");
      const r = await generateText({ model: model("svc-fast"), prompt: "What's the weather in Paris?", tools: { get_weather: weather }, stopWhen: isStepCount(3) });
      expect(r.steps.map((s) => s.finishReason)).toEqual(["tool-calls", "stop"]);
      expect(r.text).toBe(TEXT);
      expect(arr(lastUpstream().messages).map((m) => rec(m).role)).toEqual(["user", "assistant", "tool"]);
    });

    test("structured output: generateText with Output.object (a JSON Schema response_format)", async () => {
      const schema = z.object({ city: z.string(), tags: z.array(z.string()) });
      const r = await generateText({ model: model("svc-fast"), prompt: "Name a city", output: Output.object({ schema }) });
      expect(r.output).toEqual({ city: "Paris", tags: ["sim"] });
      expect(r.finishReason).toBe("stop");
      const format = rec(lastUpstream().response_format);
      expect(format.type).toBe("json_schema");
      expect(rec(rec(format.json_schema).schema).required).toEqual(["city", "tags"]);
    });

    test("structured output, streamed: partial objects, then the whole", async () => {
      const r = streamText({ model: model("svc-fast"), prompt: "Name a city", output: Output.object({ schema: z.object({ city: z.string() }) }) });
      let partials = 0;
      for await (const _ of r.partialOutputStream) partials++;
      expect(partials).toBeGreaterThan(0);
      expect(await r.output).toEqual({ city: "Paris" });
    });

    test("image input (a file part with an image) reaches the upstream as an image_url part", async () => {
      const r = await generateText({
        model: model("svc-fast"),
        messages: [{ role: "user", content: [{ type: "text", text: "What is this?" }, { type: "file", mediaType: "image/png", data: "iVBORw0KGgo=" }] }],
      });
      expect(r.text).toBe(TEXT);
      const parts = arr(rec(arr(lastUpstream().messages)[0]).content).map(rec);
      expect(parts[0]).toEqual({ type: "text", text: "What is this?" });
      expect(rec(parts[1]?.image_url).url).toBe("data:image/png;base64,iVBORw0KGgo=");
    });

    test("errors before the answer: 401, 404 model_not_found, 503 as APICallError with the status", async () => {
      const bad = createOpenAI({ baseURL: `${gw.url}/v1`, apiKey: "sk-gw-not-a-real-key" });
      const unauthorized = await callError(generateText({ model: api.startsWith("chat") ? bad.chat("svc-fast") : bad("svc-fast"), prompt: "hi" }));
      expect(unauthorized.statusCode).toBe(401);
      expect(unauthorized.isRetryable).toBe(false);
      expect(rec(rec(unauthorized.data).error).code).toBe("unauthorized");

      const missing = await callError(generateText({ model: model("gpt-4o"), prompt: "hi" }));
      expect(missing.statusCode).toBe(404);
      expect(missing.isRetryable).toBe(false);
      expect(rec(rec(missing.data).error).code).toBe("model_not_found");

      sim.setFault({ kind: "status", status: 503 });
      const down = await callError(generateText({ model: model("svc-fast"), prompt: "hi", maxRetries: 0 }));
      expect(down.statusCode).toBe(503);
      expect(down.isRetryable).toBe(true);
      // streamText reports the same refusal as an error part of the stream (the SDK throws nothing there).
      const streamed = await drain(streamText({ model: model("svc-fast"), prompt: "hi", maxRetries: 0, onError: quiet }));
      expect(streamed.text).toBe("");
      expect(streamed.errors.map((e) => (APICallError.isInstance(e) ? e.statusCode : String(e)))).toEqual([503]);
    });

    test("a stream failing mid-way: the text so far, then an error part naming the model", async () => {
      sim.setFault({ kind: "drop-mid-stream", afterChunks: 3 });
      const r = streamText({ model: model("svc-fast"), prompt: "hi", maxRetries: 0, onError: quiet });
      const { text, errors } = await drain(r);
      expect(text).toBe("token0 token1 ");
      expect(errors.length).toBeGreaterThan(0);
      for (const e of errors) {
        expect(StreamProviderError.isInstance(e)).toBe(true);
        if (e instanceof Error) expect(e.message).toContain("'svc-fast' was lost mid-stream");
      }
      expect(await r.finishReason).toBe("error");
    });
  });
}

describe("Vercel AI SDK, Responses API only: openai.responses(id)", () => {
  const clock = tool({ description: "The current time in a city", inputSchema: z.object({ city: z.string() }), execute: async ({ city }) => ({ city, time: "12:00" }) });

  test("generateText and streamText with openai.responses(id): text, finish reason, usage", async () => {
    const r = await generateText({ model: openai.responses("svc-fast"), prompt: "Say hi" });
    expect([r.text, r.finishReason, r.usage.outputTokens]).toEqual([TEXT, "stop", 6]);
    const s = streamText({ model: openai.responses("svc-fast"), prompt: "Say hi" });
    expect([await s.text, await s.finishReason, (await s.usage).outputTokens]).toEqual([TEXT, "stop", 6]);
  });

  test("openai.tools.webSearch() next to a function tool, with responses.webSearch: ignore: accepted, web search not offered, the function tool called", async () => {
    // Seen failing before: APICallError 400 "The tool type 'web_search' is not supported" (param tools[0].type).
    const tools = { web_search: openai.tools.webSearch({ externalWebAccess: false, searchContextSize: "low" }), get_weather: weather };
    const r = await generateText({ model: openai.responses("svc-fast"), prompt: "What's the weather in Paris?", tools, stopWhen: isStepCount(2) });
    expect(r.steps.map((s) => s.toolCalls.map((c) => c.toolName))).toEqual([["get_weather"], []]);
    expect(r.text).toBe(TEXT);
    expect(arr(upstreamBodies()[0]?.tools).map((t) => rec(rec(t).function).name)).toEqual(["get_weather"]);
  });

  test("providerOptions.openai.allowedTools: only the allowed tool is offered and called, generateText and streamText", async () => {
    // Seen failing before: APICallError 400 "The tool_choice type 'allowed_tools' is not supported".
    const tools = { get_time: clock, get_weather: weather };
    const providerOptions = { openai: { allowedTools: { toolNames: ["get_weather"], mode: "required" as const } } };
    const r = await generateText({ model: openai.responses("svc-fast"), prompt: "What's the weather in Paris?", tools, providerOptions, stopWhen: isStepCount(1) });
    expect(r.toolCalls.map((c) => c.toolName)).toEqual(["get_weather"]);
    expect(r.warnings).toEqual([]);
    const up = lastUpstream();
    expect(arr(up.tools).map((t) => rec(rec(t).function).name)).toEqual(["get_weather"]);
    expect(up.tool_choice).toBe("required");

    const s = streamText({ model: openai.responses("svc-fast"), prompt: "What's the weather in Paris?", tools, providerOptions, stopWhen: isStepCount(1) });
    const calls: string[] = [];
    for await (const part of s.fullStream) {
      if (part.type === "tool-call") calls.push(part.toolName);
      if (part.type === "error") throw part.error;
    }
    expect(calls).toEqual(["get_weather"]);
  });
});

describe("Vercel AI SDK: rate limit and quota", () => {
  // The AI SDK retries every 429 (it does not read x-should-retry), after
  // retry-after when that is at most 60 s, else after 2 s and 4 s: these
  // tests turn retries off to see the first answer.
  test("429 rate limit → APICallError 429 with retry-after", async () => {
    const tiny = await seedTestOrg(gw.database, { plan: "Tiny" });
    const p = createOpenAI({ baseURL: `${gw.url}/v1`, apiKey: tiny.personalKey });
    for (let i = 0; i < 2; i++) await generateText({ model: p.chat("svc-fast"), prompt: "hi" });
    const e = await callError(generateText({ model: p.chat("svc-fast"), prompt: "hi", maxRetries: 0 }));
    expect(e.statusCode).toBe(429);
    expect(e.isRetryable).toBe(true);
    expect(Number(e.responseHeaders?.["retry-after"])).toBeGreaterThan(0);
    expect(rec(rec(e.data).error).code).toBe("rate_limit_error");
  });

  test("429 budget_exceeded → APICallError 429 whose message says budget_exceeded", async () => {
    const poor = await seedTestOrg(gw.database, { quotaTokens: 1 });
    const p = createOpenAI({ baseURL: `${gw.url}/v1`, apiKey: poor.personalKey });
    for (const m of [p.chat("svc-fast"), p("svc-fast")]) {
      const e = await callError(generateText({ model: m, prompt: "hi", maxRetries: 0 }));
      expect(e.statusCode).toBe(429);
      expect(e.message).toContain("budget_exceeded");
      expect(e.responseHeaders?.["x-should-retry"]).toBe("false");
      expect(rec(rec(e.data).error).code).toBe("budget_exceeded");
    }
    // An embedding reserves only its input's estimate: more than the one token left.
    const emb = await callError(embed({ model: p.embedding("svc-embed"), value: "several words of input", maxRetries: 0 }));
    expect(emb.statusCode).toBe(429);
    expect(emb.message).toContain("budget_exceeded");
  });
});

describe("Vercel AI SDK: the deprecated generateObject still works", () => {
  test("generateObject on chat completions", async () => {
    const r = await generateObject({ model: openai.chat("svc-fast"), prompt: "Name a city", schema: z.object({ city: z.string(), population: z.number().int() }) });
    expect(r.object.city).toBe("Paris");
    expect(Number.isInteger(r.object.population)).toBe(true);
    expect(r.finishReason).toBe("stop");
    expect(r.usage.outputTokens).toBeGreaterThan(0);
  });
});

describe("Vercel AI SDK: embeddings on svc-embed", () => {
  test("embed and embedMany: 1024-dimension vectors, equal inputs embed equally, usage", async () => {
    const one = await embed({ model: openai.embedding("svc-embed"), value: "hello world" });
    expect(one.embedding.length).toBe(1024);
    expect(one.usage.tokens).toBe(3);
    const many = await embedMany({ model: openai.embedding("svc-embed"), values: ["a", "hello world", "b"] });
    expect(many.embeddings.map((e) => e.length)).toEqual([1024, 1024, 1024]);
    expect(many.embeddings[1]).toEqual(one.embedding);
    expect(many.embeddings[0]).not.toEqual(many.embeddings[2]);
    expect(many.usage.tokens).toBe(1 + 3 + 1);
    expect(lastUpstream().input).toEqual(["a", "hello world", "b"]);
  });

  test("dimensions through providerOptions", async () => {
    const r = await embed({ model: openai.embedding("svc-embed"), value: "x", providerOptions: { openai: { dimensions: 256 } } });
    expect(r.embedding.length).toBe(256);
  });
});

describe("Vercel AI SDK against a gateway without the Responses API", () => {
  test("openai.chat(id) works; openai(id) gets 404 (use openai.chat, as the provider's docs say for chat-only servers)", async () => {
    const p = createOpenAI({ baseURL: `${chatOnly.url}/v1`, apiKey: org.personalKey });
    expect((await generateText({ model: p.chat("svc-fast"), prompt: "Say hi" })).text).toBe(TEXT);
    const e = await callError(generateText({ model: p("svc-fast"), prompt: "Say hi" }));
    expect(e.statusCode).toBe(404);
    expect(e.url).toBe(`${chatOnly.url}/v1/responses`);
  });
});
