import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { pathToFileURL } from "node:url";
import OpenAI from "openai";
import type { ChatCompletionMessageParam, ChatCompletionTool } from "openai/resources/chat/completions";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { TEST_PLANS, seedTestOrg, testAliases, upstreamSettings } from "./inference-fixtures.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * The unmodified official `openai` SDK against the gateway: every byte the
 * gateway sends must parse there, and its errors must map to the SDK's classes.
 */

let sim: Simulator;
let gw: Gateway;
let org: SeededOrg;
let client: OpenAI;

const WEATHER: ChatCompletionTool = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Current weather in a city",
    parameters: {
      $schema: "http://json-schema.org/draft-07/schema#",
      type: "object",
      properties: { location: { type: "string" }, unit: { type: "string", enum: ["celsius", "fahrenheit"] } },
      required: ["location"],
      additionalProperties: false,
    },
  },
};

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 6 });
  gw = await startTestGateway({ aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: upstreamSettings({ attempts: 2 }) });
  org = await seedTestOrg(gw.database);
  client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: org.personalKey, maxRetries: 0 });
});
afterEach(() => sim.reset());
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

async function errorFrom(p: Promise<unknown>): Promise<unknown> {
  return p.then(
    () => null,
    (e: unknown) => e,
  );
}

describe("openai SDK: chat", () => {
  test("non-streamed completion", async () => {
    const r = await client.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "Say hi" }], temperature: 0.2, max_tokens: 50 });
    expect(r.object).toBe("chat.completion");
    expect(r.model).toBe("svc-fast");
    expect(r.choices[0]?.message.role).toBe("assistant");
    expect(r.choices[0]?.message.content).toBe("token0 token1 token2 token3 token4 token5 ");
    expect(r.choices[0]?.finish_reason).toBe("stop");
    expect(r.usage?.completion_tokens).toBe(6);
    expect(r.usage?.total_tokens).toBe((r.usage?.prompt_tokens ?? 0) + 6);
  });

  test("withResponse exposes the x-request-id header", async () => {
    const { response } = await client.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }).withResponse();
    expect(response.headers.get("x-request-id")).toMatch(/^req_/);
  });

  test("streaming: chunks, then usage when asked", async () => {
    const stream = await client.chat.completions.create({
      model: "svc-fast",
      messages: [{ role: "user", content: "Say hi" }],
      stream: true,
      stream_options: { include_usage: true },
    });
    let text = "";
    let chunks = 0;
    let usage: OpenAI.CompletionUsage | null | undefined;
    const models = new Set<string>();
    for await (const chunk of stream) {
      chunks++;
      models.add(chunk.model);
      text += chunk.choices[0]?.delta.content ?? "";
      if (chunk.usage) usage = chunk.usage;
    }
    expect([...models]).toEqual(["svc-fast"]);
    expect(text).toBe("token0 token1 token2 token3 token4 token5 ");
    expect(chunks).toBe(9);
    expect(usage?.completion_tokens).toBe(6);
  });

  test("streaming without include_usage: no usage chunk", async () => {
    const stream = await client.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "hi" }], stream: true });
    let chunks = 0;
    let withUsage = 0;
    let text = "";
    for await (const chunk of stream) {
      chunks++;
      if (chunk.usage) withUsage++;
      if (chunk.choices.length !== 1) throw new Error(`a chunk with ${chunk.choices.length} choices`);
      text += chunk.choices[0]?.delta.content ?? "";
    }
    // role, six tokens, finish; the usage-only chunk the gateway asked for is not passed on.
    expect(chunks).toBe(8);
    expect(withUsage).toBe(0);
    expect(text).toBe("token0 token1 token2 token3 token4 token5 ");
  });

  test("the stream helper assembles a final completion", async () => {
    const runner = client.chat.completions.stream({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] });
    const final = await runner.finalChatCompletion();
    expect(final.model).toBe("svc-fast");
    expect(final.choices[0]?.message.content).toBe("token0 token1 token2 token3 token4 token5 ");
  });

  test("tool calling round trip, appending the SDK's own message objects", async () => {
    const messages: ChatCompletionMessageParam[] = [{ role: "user", content: "What's the weather in Paris?" }];
    const first = await client.chat.completions.create({ model: "svc-fast", messages, tools: [WEATHER], tool_choice: "auto" });
    const reply = first.choices[0]?.message;
    expect(first.choices[0]?.finish_reason).toBe("tool_calls");
    const call = reply?.tool_calls?.[0];
    if (!reply || !call || call.type !== "function") throw new Error("no function tool call");
    expect(call.function.name).toBe("get_weather");
    expect(JSON.parse(call.function.arguments)).toEqual({ location: "Paris", unit: "celsius" });

    messages.push(reply);
    messages.push({ role: "tool", tool_call_id: call.id, content: JSON.stringify({ temperature: 21 }) });
    const second = await client.chat.completions.create({ model: "svc-fast", messages, tools: [WEATHER] });
    expect(second.choices[0]?.finish_reason).toBe("stop");
    expect(typeof second.choices[0]?.message.content).toBe("string");
  });

  test("streamed tool calls assemble through the stream helper", async () => {
    const runner = client.chat.completions.stream({
      model: "svc-fast",
      messages: [{ role: "user", content: "weather in Paris?" }],
      tools: [WEATHER],
      tool_choice: { type: "function", function: { name: "get_weather" } },
    });
    const final = await runner.finalChatCompletion();
    const call = final.choices[0]?.message.tool_calls?.[0];
    if (call?.type !== "function") throw new Error("no function tool call");
    expect(call.function.name).toBe("get_weather");
    expect(JSON.parse(call.function.arguments)).toEqual({ location: "Paris", unit: "celsius" });
  });

  test("image input", async () => {
    const r = await client.chat.completions.create({
      model: "svc-fast",
      messages: [
        {
          role: "user",
          content: [
            { type: "text", text: "What is this?" },
            { type: "image_url", image_url: { url: "data:image/png;base64,iVBORw0KGgo=", detail: "low" } },
          ],
        },
      ],
    });
    expect(r.choices[0]?.message.content).toBeTruthy();
  });
});

describe("openai SDK: embeddings and models", () => {
  test("embeddings with the SDK's default encoding (base64, decoded by the SDK)", async () => {
    const r = await client.embeddings.create({ model: "svc-embed", input: "hello world" });
    expect(r.object).toBe("list");
    expect(r.model).toBe("svc-embed");
    expect(r.data[0]?.embedding.length).toBe(1024);
    expect(typeof r.data[0]?.embedding[0]).toBe("number");
    expect(r.usage.prompt_tokens).toBeGreaterThan(0);
    const asFloat = await client.embeddings.create({ model: "svc-embed", input: "hello world", encoding_format: "float" });
    expect(asFloat.data[0]?.embedding).toEqual(r.data[0]?.embedding ?? []);
  });

  test("embeddings of several inputs", async () => {
    const r = await client.embeddings.create({ model: "svc-embed", input: ["a", "b"], dimensions: 256 });
    expect(r.data.map((d) => d.index)).toEqual([0, 1]);
    expect(r.data[1]?.embedding.length).toBe(256);
  });

  test("models list", async () => {
    const ids: string[] = [];
    const objects = new Set<string>();
    for await (const m of client.models.list()) {
      objects.add(m.object);
      ids.push(m.id);
    }
    expect(ids.sort()).toEqual(["svc-embed", "svc-fast", "svc-smart", "svc-text"]);
    expect([...objects]).toEqual(["model"]);
  });
});

describe("openai SDK: error classes", () => {
  test("401 → AuthenticationError", async () => {
    const bad = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: "sk-gw-not-a-real-key", maxRetries: 0 });
    const err = await errorFrom(bad.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }));
    expect(err).toBeInstanceOf(OpenAI.AuthenticationError);
    if (err instanceof OpenAI.APIError) {
      expect(err.status).toBe(401);
      expect(err.code).toBe("unauthorized");
    }
    expect(await errorFrom(bad.models.list())).toBeInstanceOf(OpenAI.AuthenticationError);
    expect(await errorFrom(bad.embeddings.create({ model: "svc-embed", input: "x" }))).toBeInstanceOf(OpenAI.AuthenticationError);
  });

  test("404 → NotFoundError", async () => {
    const err = await errorFrom(client.chat.completions.create({ model: "gpt-4o", messages: [{ role: "user", content: "hi" }] }));
    expect(err).toBeInstanceOf(OpenAI.NotFoundError);
    if (err instanceof OpenAI.APIError) {
      expect(err.code).toBe("model_not_found");
      expect(err.param).toBe("model");
    }
    expect(await errorFrom(client.embeddings.create({ model: "svc-fast", input: "x" }))).toBeInstanceOf(OpenAI.NotFoundError);
  });

  test("429 → RateLimitError (upstream overloaded everywhere), with retry-after", async () => {
    sim.setFault({ kind: "status", status: 429 });
    const err = await errorFrom(client.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }));
    expect(err).toBeInstanceOf(OpenAI.RateLimitError);
    if (err instanceof OpenAI.APIError) {
      expect(err.code).toBe("rate_limit_error");
      expect(err.headers?.get("retry-after")).toBe("1");
    }
  });

  test("429 → RateLimitError from the organisation's rate limit", async () => {
    const tiny = await seedTestOrg(gw.database, { plan: "Tiny" });
    const c = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: tiny.personalKey, maxRetries: 0 });
    for (let i = 0; i < 2; i++) await c.models.list();
    const err = await errorFrom(c.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }));
    expect(err).toBeInstanceOf(OpenAI.RateLimitError);
  });

  test("429 budget_exceeded → RateLimitError whose message says budget_exceeded", async () => {
    const poor = await seedTestOrg(gw.database, { quotaTokens: 1 });
    const c = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: poor.personalKey, maxRetries: 0 });
    // A quota of 1 token holds no request's reservation (prompt estimate + 1,024): the first one is refused.
    const err = await errorFrom(c.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }));
    expect(err).toBeInstanceOf(OpenAI.RateLimitError);
    if (err instanceof OpenAI.APIError) {
      expect(err.code).toBe("budget_exceeded");
      expect(err.message).toContain("budget_exceeded");
    }
  });

  test("400 → BadRequestError naming the parameter", async () => {
    const err = await errorFrom(client.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "hi" }], temperature: 3 }));
    expect(err).toBeInstanceOf(OpenAI.BadRequestError);
    if (err instanceof OpenAI.APIError) expect(err.param).toBe("temperature");
  });

  test("503 → InternalServerError", async () => {
    sim.setFault({ kind: "status", status: 503 });
    const err = await errorFrom(client.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }));
    expect(err).toBeInstanceOf(OpenAI.InternalServerError);
    if (err instanceof OpenAI.APIError) expect(err.status).toBe(503);
  });

  test("a stream failing mid-way raises an APIError during iteration", async () => {
    sim.setFault({ kind: "drop-mid-stream", afterChunks: 3 });
    const stream = await client.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "hi" }], stream: true });
    let seen = 0;
    const err = await errorFrom(
      (async () => {
        for await (const _ of stream) seen++;
      })(),
    );
    expect(err).toBeInstanceOf(OpenAI.APIError);
    if (err instanceof OpenAI.APIError) expect(err.message).toContain("svc-fast");
    expect(seen).toBe(3);
  });
});

describe("openai SDK on Node.js", () => {
  // Node's built-in fetch (undici) sends Sec-Fetch-Mode: cors on every request; Bun's does not, so the suite above cannot see it.
  test.skipIf(!Bun.which("node"))("a chat completion and the model list, through the SDK's default fetch", async () => {
    const dir = await mkdtemp(join(tmpdir(), "gw-node-sdk-"));
    const script = join(dir, "call.mjs");
    const sdk = pathToFileURL(Bun.resolveSync("openai", import.meta.dir)).href;
    await Bun.write(
      script,
      `const { default: OpenAI } = await import(${JSON.stringify(sdk)});
const client = new OpenAI({ baseURL: process.argv[2], apiKey: process.argv[3], maxRetries: 0 });
try {
  const models = await client.models.list();
  const chat = await client.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "Say hi" }] });
  console.log(JSON.stringify({ models: models.data.length, object: chat.object }));
} catch (e) {
  console.log(JSON.stringify({ status: e.status, code: e.code }));
}`,
    );
    try {
      const p = Bun.spawn(["node", script, `${gw.url}/v1`, org.personalKey], { stdout: "pipe", stderr: "inherit", timeout: 20_000 });
      const out = await new Response(p.stdout).text();
      expect(await p.exited).toBe(0);
      expect(JSON.parse(out)).toEqual({ models: expect.any(Number), object: "chat.completion" });
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});
