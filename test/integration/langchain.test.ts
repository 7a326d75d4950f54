import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { ContextOverflowError } from "@langchain/core/errors";
import { type AIMessage, type AIMessageChunk, type BaseMessage, HumanMessage, ToolMessage } from "@langchain/core/messages";
import { tool } from "@langchain/core/tools";
import { ChatOpenAI, type ChatOpenAIFields, OpenAIEmbeddings } from "@langchain/openai";
import OpenAI from "openai";
import { z } from "zod";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { SAY_HI_PROMPT_TOKENS, SIX_TOKEN_TEXT, TEST_PLANS, arr, rec, seedTestOrg, testAliases, upstreamSettings } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s on a busy machine.
setDefaultTimeout(30_000);

/**
 * The unmodified LangChain (`@langchain/openai` on `@langchain/core`)
 * against a real gateway over real HTTP, the simulated vLLM upstream behind
 * it, configured the way its docs say for an OpenAI-compatible server: the
 * key and `configuration: { baseURL }`. `ChatOpenAI` speaks chat completions
 * unless `useResponsesApi` is set; that is driven too, against a gateway with
 * `responses.enabled`.
 *
 * The simulator answers "token0 … token5 " (6 tokens) to plain prompts,
 * calls the first tool when the last user message says "weather", and fills
 * a response_format's JSON Schema with sample values ("Paris" for a city).
 */

let sim: Simulator;
let gw: Gateway;
let org: SeededOrg;

const TEXT = SIX_TOKEN_TEXT;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 6 });
  gw = await startTestGateway({ aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: upstreamSettings({ attempts: 2 }), responses: { enabled: true } });
  org = await seedTestOrg(gw.database);
});
afterEach(() => sim.reset());
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

function chat(fields: ChatOpenAIFields = {}, key = org.personalKey): ChatOpenAI {
  return new ChatOpenAI({ model: "svc-fast", apiKey: key, configuration: { baseURL: `${gw.url}/v1` }, ...fields });
}

const weather = tool(async ({ location, unit }) => JSON.stringify({ location, unit, temperature: 21 }), {
  name: "get_weather",
  description: "Current weather in a city",
  schema: z.object({ location: z.string(), unit: z.enum(["celsius", "fahrenheit"]) }),
});

const lastUpstream = () => rec(sim.stats.lastBody);
const upstreamBodies = () => sim.stats.bodies.map(rec);

async function simReasoning(text: string): Promise<void> {
  const res = await fetch(`${sim.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify({ reasoning: text }) });
  expect(res.status).toBe(200);
}

async function streamed(model: { stream(input: BaseMessage[] | string): Promise<AsyncIterable<AIMessageChunk>> }, input: BaseMessage[] | string): Promise<{ message: AIMessageChunk; chunks: number }> {
  let message: AIMessageChunk | undefined;
  let chunks = 0;
  for await (const c of await model.stream(input)) {
    chunks++;
    message = message ? message.concat(c) : c;
  }
  if (!message) throw new Error("an empty stream");
  return { message, chunks };
}

function textOf(m: AIMessage | AIMessageChunk): string {
  if (typeof m.content === "string") return m.content;
  return m.content.map((p) => (p.type === "text" && typeof p.text === "string" ? p.text : "")).join("");
}

async function rejection(p: Promise<unknown>): Promise<Error & { status?: number; lc_error_code?: string; code?: string; param?: string }> {
  const e = await p.then(
    () => undefined,
    (x: unknown) => x,
  );
  if (!(e instanceof Error)) throw new Error(`expected an error, got ${String(e)}`);
  return e;
}

/** A fetch that counts the requests the client makes (LangChain's documented `configuration.fetch`), to see its retries. */
function countingFetch(): { fetch: typeof fetch; count: () => number } {
  let n = 0;
  const f = Object.assign((input: Parameters<typeof fetch>[0], init?: RequestInit) => {
    n++;
    return fetch(input, init);
  }, { preconnect: fetch.preconnect });
  return { fetch: f, count: () => n };
}

describe("LangChain ChatOpenAI (chat completions)", () => {
  test("invoke: text, usage_metadata, finish reason, the alias as model name; what LangChain sends by default is accepted", async () => {
    const r = await chat().invoke("Say hi");
    expect(r.content).toBe(TEXT);
    expect(r.usage_metadata?.input_tokens).toBe(SAY_HI_PROMPT_TOKENS);
    expect(r.usage_metadata?.output_tokens).toBe(6);
    expect(r.usage_metadata?.total_tokens).toBe(SAY_HI_PROMPT_TOKENS + 6);
    expect(r.response_metadata.finish_reason).toBe("stop");
    expect(r.response_metadata.model_name).toBe("svc-fast");
    // LangChain sends stream: false explicitly; the gateway forwards it.
    expect(lastUpstream().stream).toBe(false);
  });

  test("the sampling parameters LangChain users set are accepted and forwarded", async () => {
    const model = chat({ temperature: 0.2, topP: 0.9, frequencyPenalty: 0.1, presencePenalty: 0.2, n: 1, logprobs: true, topLogprobs: 2, maxTokens: 4, stop: ["zz"], user: "u-1" });
    const r = await model.invoke("Say hi", { seed: 7 });
    expect(r.content).toBe("token0 token1 token2 token3 ");
    expect(r.response_metadata.finish_reason).toBe("length");
    expect(arr(rec(r.response_metadata.logprobs).content).length).toBe(4);
    const up = lastUpstream();
    expect({
      temperature: up.temperature,
      top_p: up.top_p,
      frequency_penalty: up.frequency_penalty,
      presence_penalty: up.presence_penalty,
      n: up.n,
      logprobs: up.logprobs,
      top_logprobs: up.top_logprobs,
      max_tokens: up.max_tokens,
      stop: up.stop,
      user: up.user,
      seed: up.seed,
    }).toEqual({ temperature: 0.2, top_p: 0.9, frequency_penalty: 0.1, presence_penalty: 0.2, n: 1, logprobs: true, top_logprobs: 2, max_tokens: 4, stop: ["zz"], user: "u-1", seed: 7 });
  });

  test("n: 2 through generate: two generations", async () => {
    const r = await chat({ n: 2 }).generate([[new HumanMessage("Say hi")]]);
    expect(r.generations[0]?.map((g) => g.text)).toEqual([TEXT, TEXT]);
    expect(lastUpstream().n).toBe(2);
  });

  test("stream: the chunks concatenate to the text; usage comes at the end (stream_options sent by default)", async () => {
    const { message, chunks } = await streamed(chat(), "Say hi");
    expect(textOf(message)).toBe(TEXT);
    expect(chunks).toBeGreaterThanOrEqual(6);
    expect(message.usage_metadata?.input_tokens).toBe(SAY_HI_PROMPT_TOKENS);
    expect(message.usage_metadata?.output_tokens).toBe(6);
    expect(message.response_metadata.finish_reason).toBe("stop");
    expect(lastUpstream().stream_options).toEqual({ include_usage: true });
  });

  test("bindTools: the model asks for the zod tool, the ToolMessage goes back, then the answer", async () => {
    const model = chat().bindTools([weather]);
    const messages: BaseMessage[] = [new HumanMessage("What's the weather in Paris?")];
    const first = await model.invoke(messages);
    expect(first.response_metadata.finish_reason).toBe("tool_calls");
    expect(first.tool_calls?.map((c) => [c.name, c.args])).toEqual([["get_weather", { location: "Paris", unit: "celsius" }]]);
    const call = first.tool_calls?.[0];
    if (!call?.id) throw new Error("no tool call id");
    messages.push(first, await weather.invoke(call));
    const second = await model.invoke(messages);
    expect(second.content).toBe(TEXT);
    expect(second.response_metadata.finish_reason).toBe("stop");

    const back = arr(lastUpstream().messages).map(rec);
    expect(back.map((m) => m.role)).toEqual(["user", "assistant", "tool"]);
    expect(rec(arr(back[1]?.tool_calls)[0]).id).toBe(call.id);
    expect(back[2]?.tool_call_id).toBe(call.id);
    expect(JSON.parse(String(back[2]?.content))).toEqual({ location: "Paris", unit: "celsius", temperature: 21 });
  });

  test("bindTools, streamed: the tool call assembles from its argument deltas", async () => {
    const { message } = await streamed(chat().bindTools([weather]), [new HumanMessage("What's the weather in Paris?")]);
    expect(message.tool_calls?.map((c) => [c.name, c.args])).toEqual([["get_weather", { location: "Paris", unit: "celsius" }]]);
    expect(message.response_metadata.finish_reason).toBe("tool_calls");
    expect(message.usage_metadata?.output_tokens).toBeGreaterThan(0);
  });

  test("bindTools with strict, tool_choice and parallel_tool_calls: accepted and forwarded", async () => {
    const r = await chat()
      .bindTools([weather], { strict: true, tool_choice: "get_weather", parallel_tool_calls: false })
      .invoke("Paris, please");
    expect(r.tool_calls?.map((c) => c.args)).toEqual([{ location: "Paris", unit: "celsius" }]);
    const up = lastUpstream();
    expect(rec(rec(arr(up.tools)[0]).function).strict).toBe(true);
    expect(up.tool_choice).toEqual({ type: "function", function: { name: "get_weather" } });
    expect(up.parallel_tool_calls).toBe(false);
  });

  test("a tool loop on a reasoning model: LangChain reads reasoning_content and the conversation goes on", async () => {
    await simReasoning("Let me look that up.");
    const model = chat().bindTools([weather]);
    const messages: BaseMessage[] = [new HumanMessage("What's the weather in Paris?")];
    const first = await model.invoke(messages);
    expect(first.additional_kwargs.reasoning_content).toBe("Let me look that up.");
    const call = first.tool_calls?.[0];
    if (!call?.id) throw new Error("no tool call id");
    messages.push(first, new ToolMessage({ tool_call_id: call.id, content: "21 degrees" }));
    const second = await model.invoke(messages);
    expect(second.content).toBe(TEXT);
    messages.push(second, new HumanMessage("Thanks"));
    expect((await model.invoke(messages)).content).toBe(TEXT);
    expect(arr(lastUpstream().messages).map((m) => rec(m).role)).toEqual(["user", "assistant", "tool", "assistant", "user"]);
  });

  test("withStructuredOutput: the default (a strict JSON Schema response_format), functionCalling, and includeRaw", async () => {
    const schema = z.object({ city: z.string(), population: z.number() });
    expect(await chat().withStructuredOutput(schema).invoke("Name a city")).toEqual({ city: "Paris", population: 1.5 });
    const format = rec(lastUpstream().response_format);
    expect(format.type).toBe("json_schema");
    expect(rec(format.json_schema).strict).toBe(true);

    expect(await chat().withStructuredOutput(schema, { method: "functionCalling" }).invoke("Name a city")).toEqual({ city: "Paris", population: 1.5 });
    expect(rec(rec(lastUpstream().tool_choice).function).name).toBe("extract");

    const raw = await chat().withStructuredOutput(schema, { includeRaw: true }).invoke("Name a city");
    expect(raw.parsed).toEqual({ city: "Paris", population: 1.5 });
    expect(rec(raw.raw.response_metadata).finish_reason).toBe("stop");

    // jsonMode: response_format json_object (the simulator answers {"answer": …} to it).
    const json = await chat().withStructuredOutput(z.object({ answer: z.string() }), { method: "jsonMode" }).invoke("Answer in JSON");
    expect(json).toEqual({ answer: "token0 token1 token2 token3 token4 token5" });
    expect(lastUpstream().response_format).toEqual({ type: "json_object" });
  });

  test("image input: an OpenAI image_url part, and LangChain's base64 data block, reach the upstream as image_url", async () => {
    const url = "data:image/png;base64,iVBORw0KGgo=";
    for (const image of [
      { type: "image_url", image_url: { url } },
      { type: "image", source_type: "base64", data: "iVBORw0KGgo=", mime_type: "image/png" },
    ]) {
      const r = await chat().invoke([new HumanMessage({ content: [{ type: "text", text: "What is this?" }, image] })]);
      expect(r.content).toBe(TEXT);
      const parts = arr(rec(arr(lastUpstream().messages)[0]).content).map(rec);
      expect(parts).toEqual([
        { type: "text", text: "What is this?" },
        { type: "image_url", image_url: { url } },
      ]);
    }
  });
});

describe("LangChain ChatOpenAI with useResponsesApi", () => {
  test("invoke and stream: text and usage", async () => {
    const model = chat({ useResponsesApi: true });
    const r = await model.invoke("Say hi");
    expect(textOf(r)).toBe(TEXT);
    expect(r.usage_metadata?.input_tokens).toBe(SAY_HI_PROMPT_TOKENS);
    expect(r.usage_metadata?.output_tokens).toBe(6);
    const { message } = await streamed(model, "Say hi");
    expect(textOf(message)).toBe(TEXT);
    expect(message.usage_metadata?.output_tokens).toBe(6);
  });

  test("a tool loop on a reasoning model, invoked and streamed: LangChain echoes the reasoning and function call items", async () => {
    await simReasoning("Let me look that up.");
    const model = chat({ useResponsesApi: true }).bindTools([weather]);
    for (const stream of [false, true]) {
      const messages: BaseMessage[] = [new HumanMessage("What's the weather in Paris?")];
      const first = stream ? (await streamed(model, messages)).message : await model.invoke(messages);
      expect(first.tool_calls?.map((c) => [c.name, c.args])).toEqual([["get_weather", { location: "Paris", unit: "celsius" }]]);
      const call = first.tool_calls?.[0];
      if (!call?.id) throw new Error("no tool call id");
      messages.push(first, new ToolMessage({ tool_call_id: call.id, content: "21 degrees" }));
      const second = await model.invoke(messages);
      expect(textOf(second)).toBe(TEXT);
      const up = arr(lastUpstream().messages).map(rec);
      expect(up.map((m) => m.role)).toEqual(["user", "assistant", "tool"]);
      expect(up[2]).toEqual({ role: "tool", tool_call_id: call.id, content: "21 degrees" });
    }
  });
});

describe("LangChain OpenAIEmbeddings on svc-embed", () => {
  function embeddings(fields: { dimensions?: number; batchSize?: number } = {}) {
    return new OpenAIEmbeddings({ model: "svc-embed", apiKey: org.personalKey, configuration: { baseURL: `${gw.url}/v1` }, ...fields });
  }

  test("embedQuery and embedDocuments (base64 on the wire, LangChain's default): 1024 dimensions, equal texts embed equally", async () => {
    const q = await embeddings().embedQuery("hello world");
    expect(q.length).toBe(1024);
    expect(lastUpstream().encoding_format).toBe("base64");
    const docs = await embeddings().embedDocuments(["a", "hello world", "b"]);
    expect(docs.map((d) => d.length)).toEqual([1024, 1024, 1024]);
    expect(docs[1]).toEqual(q);
    expect(docs[0]).not.toEqual(docs[2]);
    // The same vector as the openai SDK asking for floats.
    const sdk = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: org.personalKey, maxRetries: 0 });
    const floats = await sdk.embeddings.create({ model: "svc-embed", input: "hello world", encoding_format: "float" });
    expect(q).toEqual(floats.data[0]?.embedding ?? []);
  });

  test("batches of batchSize, in order; dimensions forwarded", async () => {
    const docs = await embeddings({ batchSize: 2 }).embedDocuments(["a", "b", "c", "d", "e"]);
    expect(docs.length).toBe(5);
    // LangChain sends the batches at once: they may arrive in any order.
    expect(upstreamBodies().map((b) => JSON.stringify(b.input)).sort()).toEqual(['["a","b"]', '["c","d"]', '["e"]']);
    expect(docs[4]).toEqual(await embeddings().embedQuery("e"));
    expect((await embeddings({ dimensions: 256 }).embedQuery("x")).length).toBe(256);
  });
});

describe("LangChain errors", () => {
  test("401 → AuthenticationError (MODEL_AUTHENTICATION), 404 → NotFoundError (MODEL_NOT_FOUND), not retried", async () => {
    const counted = countingFetch();
    const bad = new ChatOpenAI({ model: "svc-fast", apiKey: "sk-gw-not-a-real-key", configuration: { baseURL: `${gw.url}/v1`, fetch: counted.fetch } });
    const e401 = await rejection(bad.invoke("hi"));
    expect(e401).toBeInstanceOf(OpenAI.AuthenticationError);
    expect(e401.status).toBe(401);
    expect(e401.lc_error_code).toBe("MODEL_AUTHENTICATION");
    expect(e401.code).toBe("unauthorized");
    expect(counted.count()).toBe(1);

    const e404 = await rejection(chat({ model: "gpt-4o" }).invoke("hi"));
    expect(e404).toBeInstanceOf(OpenAI.NotFoundError);
    expect(e404.status).toBe(404);
    expect(e404.lc_error_code).toBe("MODEL_NOT_FOUND");
    expect(e404.code).toBe("model_not_found");
    const emb = await rejection(new OpenAIEmbeddings({ model: "svc-fast", apiKey: org.personalKey, configuration: { baseURL: `${gw.url}/v1` } }).embedQuery("x"));
    expect(emb).toBeInstanceOf(OpenAI.NotFoundError);
  });

  test("400 → BadRequestError naming the parameter", async () => {
    const e = await rejection(chat({ temperature: 3 }).invoke("hi"));
    expect(e).toBeInstanceOf(OpenAI.BadRequestError);
    expect(e.status).toBe(400);
    expect(e.param).toBe("temperature");
  });

  test("the upstream's context-length 400 reaches LangChain as a ContextOverflowError", async () => {
    sim.setFault({ kind: "status", status: 400, message: "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens." });
    const e = await rejection(chat().invoke("hi"));
    expect(ContextOverflowError.isInstance(e)).toBe(true);
    expect(e.message).toContain("maximum context length is 4096 tokens");
  });

  test("429 rate limit → RateLimitError (MODEL_RATE_LIMIT)", async () => {
    const tiny = await seedTestOrg(gw.database, { plan: "Tiny" });
    const model = chat({ maxRetries: 0 }, tiny.personalKey);
    for (let i = 0; i < 2; i++) await model.invoke("hi");
    const e = await rejection(model.invoke("hi"));
    expect(e).toBeInstanceOf(OpenAI.RateLimitError);
    expect(e.status).toBe(429);
    expect(e.lc_error_code).toBe("MODEL_RATE_LIMIT");
    expect(e.code).toBe("rate_limit_error");
  });

  test("429 budget_exceeded with LangChain's default retries: refused once, not retried (its message reads as an exhausted quota)", async () => {
    const poor = await seedTestOrg(gw.database, { quotaTokens: 1 });
    const counted = countingFetch();
    const model = new ChatOpenAI({ model: "svc-fast", apiKey: poor.personalKey, configuration: { baseURL: `${gw.url}/v1`, fetch: counted.fetch } });
    const e = await rejection(model.invoke("hi"));
    expect(e.status).toBe(429);
    expect(e.code).toBe("budget_exceeded");
    expect(e.message).toContain("budget_exceeded");
    expect(counted.count()).toBe(1);
  });

  test("a stream failing mid-way raises an error during iteration, after the text so far", async () => {
    sim.setFault({ kind: "drop-mid-stream", afterChunks: 3 });
    let text = "";
    const e = await rejection(
      (async () => {
        for await (const c of await chat({ maxRetries: 0 }).stream("hi")) text += textOf(c);
      })(),
    );
    expect(e).toBeInstanceOf(OpenAI.APIError);
    expect(e.message).toContain("'svc-fast' was lost mid-stream");
    expect(text).toBe("token0 token1 ");
  });
});
