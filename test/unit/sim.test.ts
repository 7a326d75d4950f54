import { afterAll, afterEach, beforeAll, describe, expect, test } from "bun:test";
import OpenAI from "openai";
import { DEFAULT_SIM_MODELS, SIM_EMBEDDING_DIMS, startSimulator, type Simulator } from "../../src/sim/index.ts";
import { until } from "../helpers/poll.ts";

function isRecord(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function rec(v: unknown): Record<string, unknown> {
  if (!isRecord(v)) throw new Error(`expected object, got ${JSON.stringify(v)}`);
  return v;
}

function arr(v: unknown): unknown[] {
  if (!Array.isArray(v)) throw new Error(`expected array, got ${JSON.stringify(v)}`);
  return v;
}

function firstChoice(chunk: unknown): Record<string, unknown> {
  return rec(arr(rec(chunk).choices)[0]);
}

const WEATHER_TOOL = {
  type: "function" as const,
  function: {
    name: "get_weather",
    description: "Current weather",
    parameters: {
      type: "object",
      properties: { location: { type: "string" }, unit: { type: "string", enum: ["celsius", "fahrenheit"] } },
      required: ["location"],
    },
  },
};

/** Splits an SSE body into its `data:` payloads, asserting the exact framing. */
function sseData(text: string): string[] {
  expect(text.endsWith("\n\n")).toBe(true);
  return text
    .slice(0, -2)
    .split("\n\n")
    .map((frame) => {
      expect(frame.startsWith("data: ")).toBe(true);
      return frame.slice("data: ".length);
    });
}

async function post(sim: Simulator, path: string, body: unknown, init: RequestInit = {}): Promise<Response> {
  return fetch(`${sim.url}${path}`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: typeof body === "string" ? body : JSON.stringify(body),
    ...init,
  });
}

const userMsg = (content: string) => [{ role: "user", content }];

describe("simulator (instant)", () => {
  let sim: Simulator;
  let client: OpenAI;

  beforeAll(async () => {
    sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 8 });
    client = new OpenAI({ baseURL: sim.url, apiKey: "x", maxRetries: 0 });
  });
  afterEach(() => sim.reset());
  afterAll(() => sim.stop());

  test("binds a real port and exposes a /v1 base url", () => {
    expect(sim.port).toBeGreaterThan(0);
    expect(sim.url).toBe(`http://127.0.0.1:${sim.port}/v1`);
  });

  test("GET /v1/models lists served models (raw and via SDK)", async () => {
    const body = rec(await (await fetch(`${sim.url}/models`)).json());
    expect(body.object).toBe("list");
    const first = rec(arr(body.data)[0]);
    expect(first.object).toBe("model");
    expect(first.owned_by).toBe("vllm");
    expect(typeof first.created).toBe("number");

    const ids: string[] = [];
    for await (const m of client.models.list()) ids.push(m.id);
    expect(ids).toEqual([...DEFAULT_SIM_MODELS]);
  });

  test("non-streamed chat completion has the vLLM/OpenAI shape", async () => {
    const res = await post(sim, "/chat/completions", { model: "any/model", messages: userMsg("hello there") });
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toContain("application/json");
    const body = rec(await res.json());
    expect(String(body.id)).toStartWith("chatcmpl-");
    expect(body.object).toBe("chat.completion");
    expect(typeof body.created).toBe("number");
    expect(body.model).toBe("any/model");
    const choice = firstChoice(body);
    expect(choice.index).toBe(0);
    expect(choice.logprobs).toBeNull();
    expect(choice.finish_reason).toBe("stop");
    const message = rec(choice.message);
    expect(message.role).toBe("assistant");
    expect(message.content).toBe("token0 token1 token2 token3 token4 token5 token6 token7 ");
    const usage = rec(body.usage);
    expect(usage.completion_tokens).toBe(8);
    expect(Number(usage.prompt_tokens)).toBeGreaterThan(0);
    expect(usage.total_tokens).toBe(Number(usage.prompt_tokens) + 8);
    expect(sim.stats.requests).toBe(1);
    expect(rec(sim.stats.lastBody).model).toBe("any/model");
  });

  test("max_tokens / max_completion_tokens cut generation with finish_reason length", async () => {
    const a = await client.chat.completions.create({ model: "m", messages: [{ role: "user", content: "hi" }], max_tokens: 3 });
    expect(a.choices[0]?.finish_reason).toBe("length");
    expect(a.choices[0]?.message.content).toBe("token0 token1 token2 ");
    expect(a.usage?.completion_tokens).toBe(3);

    const b = await client.chat.completions.create({
      model: "m",
      messages: [{ role: "user", content: "hi" }],
      max_completion_tokens: 2,
    });
    expect(b.usage?.completion_tokens).toBe(2);
    expect(b.choices[0]?.finish_reason).toBe("length");
  });

  test("reasoning tokens count within max_tokens, as vLLM's do: the answer gets what the reasoning leaves, streamed or not", async () => {
    // "Let me think." is 4 reasoning tokens (4 characters each).
    await fetch(`${sim.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify({ reasoning: "Let me think." }) });
    const ask = async (max_tokens: number, stream: boolean) => {
      const res = await post(sim, "/chat/completions", { model: "m", messages: userMsg("hi"), max_tokens, stream, ...(stream ? { stream_options: { include_usage: true } } : {}) });
      if (!stream) {
        const body = rec(await res.json());
        const message = rec(firstChoice(body).message);
        return [message.reasoning_content, message.content, firstChoice(body).finish_reason, rec(body.usage).completion_tokens];
      }
      const chunks = sseData(await res.text()).filter((d) => d !== "[DONE]").map((d) => rec(JSON.parse(d)));
      let reasoning = "";
      let content = "";
      let finish: unknown;
      let events = 0;
      for (const c of chunks) {
        const choice = arr(c.choices)[0];
        if (choice === undefined) continue;
        const delta = rec(rec(choice).delta);
        if (typeof delta.reasoning_content === "string") reasoning += delta.reasoning_content;
        if (typeof delta.content === "string") content += delta.content;
        if (typeof delta.reasoning_content === "string" || (typeof delta.content === "string" && delta.content !== "")) events++;
        finish = rec(choice).finish_reason ?? finish;
      }
      // One event of text per token: no more than max_tokens of them.
      expect(events).toBeLessThanOrEqual(max_tokens);
      return [reasoning, content, finish, rec(chunks.at(-1)?.usage).completion_tokens];
    };
    for (const stream of [false, true]) {
      expect(await ask(6, stream)).toEqual(["Let me think.", "token0 token1 ", "length", 6]);
      expect(await ask(2, stream)).toEqual(["Let me t", "", "length", 2]);
    }
  });

  test("n: that many choices, each up to max_tokens; the completion count is their sum, the prompt counted once", async () => {
    const one = await client.chat.completions.create({ model: "m", messages: [{ role: "user", content: "hi" }], max_tokens: 3 });
    const a = await client.chat.completions.create({ model: "m", messages: [{ role: "user", content: "hi" }], max_tokens: 3, n: 3 });
    expect(a.choices.map((c) => [c.index, c.message.content, c.finish_reason])).toEqual([0, 1, 2].map((i) => [i, "token0 token1 token2 ", "length"]));
    expect(a.usage?.completion_tokens).toBe(9);
    expect(a.usage?.prompt_tokens).toBe(one.usage?.prompt_tokens ?? -1);

    const res = await post(sim, "/chat/completions", { model: "m", messages: userMsg("hi"), n: 2, stream: true, stream_options: { include_usage: true } });
    const chunks = sseData(await res.text()).filter((d) => d !== "[DONE]").map((d) => rec(JSON.parse(d)));
    const text = ["", ""];
    for (const c of chunks) {
      for (const ch of arr(c.choices)) {
        const choice = rec(ch);
        const i = Number(choice.index);
        text[i] += String(rec(choice.delta).content ?? "");
      }
    }
    expect(text).toEqual(["token0 token1 token2 token3 token4 token5 token6 token7 ", "token0 token1 token2 token3 token4 token5 token6 token7 "]);
    expect(rec(chunks.at(-1)?.usage).completion_tokens).toBe(16);
  });

  test("prompt token estimate is deterministic and grows with the prompt", async () => {
    const short = await client.chat.completions.create({ model: "m", messages: [{ role: "user", content: "hi" }] });
    const again = await client.chat.completions.create({ model: "m", messages: [{ role: "user", content: "hi" }] });
    const long = await client.chat.completions.create({ model: "m", messages: [{ role: "user", content: "hi ".repeat(400) }] });
    expect(short.usage?.prompt_tokens).toBe(again.usage?.prompt_tokens ?? -1);
    expect(long.usage?.prompt_tokens ?? 0).toBeGreaterThan((short.usage?.prompt_tokens ?? 0) + 250);
  });

  for (const includeUsage of [false, true]) {
    test(`streamed SSE sequence (include_usage=${includeUsage})`, async () => {
      const res = await post(sim, "/chat/completions", {
        model: "stream/model",
        messages: userMsg("hi"),
        stream: true,
        ...(includeUsage ? { stream_options: { include_usage: true } } : {}),
      });
      expect(res.status).toBe(200);
      expect(res.headers.get("content-type")).toStartWith("text/event-stream");
      const data = sseData(await res.text());
      expect(data[data.length - 1]).toBe("[DONE]");
      const chunks = data.slice(0, -1).map((d) => rec(JSON.parse(d)));
      const ids = new Set(chunks.map((c) => c.id));
      expect(ids.size).toBe(1);
      for (const c of chunks) {
        expect(c.object).toBe("chat.completion.chunk");
        expect(c.model).toBe("stream/model");
        expect(typeof c.created).toBe("number");
      }

      const usageChunks = includeUsage ? 1 : 0;
      expect(chunks.length).toBe(1 + 8 + 1 + usageChunks);

      const role = firstChoice(chunks[0]);
      expect(role.delta).toEqual({ role: "assistant", content: "" });
      expect(role.finish_reason).toBeNull();
      expect(role.logprobs).toBeNull();

      for (let i = 0; i < 8; i++) {
        const c = firstChoice(chunks[1 + i]);
        expect(c.index).toBe(0);
        expect(c.delta).toEqual({ content: `token${i} ` });
        expect(c.finish_reason).toBeNull();
      }

      const fin = firstChoice(chunks[9]);
      expect(fin.delta).toEqual({});
      expect(fin.finish_reason).toBe("stop");

      if (includeUsage) {
        const u = rec(chunks[10]);
        expect(u.choices).toEqual([]);
        expect(rec(u.usage).completion_tokens).toBe(8);
      } else {
        expect(chunks.some((c) => c.usage !== undefined)).toBe(false);
      }
      expect(sim.stats.inFlight).toBe(0);
    });
  }

  test("SDK parses streamed chat including usage", async () => {
    const stream = await client.chat.completions.create({
      model: "m",
      messages: [{ role: "user", content: "hi" }],
      stream: true,
      stream_options: { include_usage: true },
    });
    let text = "";
    let finish: string | null = null;
    let completionTokens = 0;
    for await (const chunk of stream) {
      const c = chunk.choices[0];
      if (c) {
        text += c.delta.content ?? "";
        finish = c.finish_reason ?? finish;
      }
      if (chunk.usage) completionTokens = chunk.usage.completion_tokens;
    }
    expect(text).toBe("token0 token1 token2 token3 token4 token5 token6 token7 ");
    expect(finish).toBe("stop");
    expect(completionTokens).toBe(8);
  });

  test("tool call (non-streamed) triggered by 'weather'", async () => {
    const r = await client.chat.completions.create({
      model: "m",
      messages: [{ role: "user", content: "What's the weather in Paris?" }],
      tools: [WEATHER_TOOL],
    });
    const choice = r.choices[0];
    expect(choice?.finish_reason).toBe("tool_calls");
    expect(choice?.message.content).toBeNull();
    const call = choice?.message.tool_calls?.[0];
    expect(call?.id).toStartWith("call_");
    expect(call?.type).toBe("function");
    if (call?.type !== "function") throw new Error("expected function call");
    expect(call.function.name).toBe("get_weather");
    const args = rec(JSON.parse(call.function.arguments));
    expect(typeof args.location).toBe("string");
    expect(args.unit).toBe("celsius");
  });

  test("tool_choice none / auto without trigger give text; required and named force a call", async () => {
    const base = { model: "m", tools: [WEATHER_TOOL] };
    const none = await client.chat.completions.create({
      ...base,
      messages: [{ role: "user", content: "weather?" }],
      tool_choice: "none",
    });
    expect(none.choices[0]?.message.tool_calls ?? []).toEqual([]);
    expect(none.choices[0]?.finish_reason).toBe("stop");

    const auto = await client.chat.completions.create({ ...base, messages: [{ role: "user", content: "hello" }] });
    expect(auto.choices[0]?.finish_reason).toBe("stop");

    const required = await client.chat.completions.create({
      ...base,
      messages: [{ role: "user", content: "hello" }],
      tool_choice: "required",
    });
    expect(required.choices[0]?.finish_reason).toBe("tool_calls");

    const named = await client.chat.completions.create({
      model: "m",
      tools: [WEATHER_TOOL, { type: "function", function: { name: "other", parameters: { type: "object", properties: {} } } }],
      messages: [{ role: "user", content: "hello" }],
      tool_choice: { type: "function", function: { name: "other" } },
    });
    const call = named.choices[0]?.message.tool_calls?.[0];
    if (call?.type !== "function") throw new Error("expected function call");
    expect(call.function.name).toBe("other");
    expect(call.function.arguments).toBe("{}");
  });

  test("tool call (streamed) in vLLM delta format, reassembled by the SDK", async () => {
    const raw = await post(sim, "/chat/completions", {
      model: "m",
      messages: userMsg("weather in Paris"),
      tools: [WEATHER_TOOL],
      stream: true,
    });
    const chunks = sseData(await raw.text())
      .slice(0, -1)
      .map((d) => firstChoice(JSON.parse(d)));
    const announce = rec(arr(rec(chunks[1]?.delta).tool_calls)[0]);
    expect(announce.index).toBe(0);
    expect(String(announce.id)).toStartWith("call_");
    expect(announce.type).toBe("function");
    expect(rec(announce.function)).toEqual({ name: "get_weather", arguments: "" });
    expect(chunks[chunks.length - 1]?.finish_reason).toBe("tool_calls");

    const stream = await client.chat.completions.create({
      model: "m",
      messages: [{ role: "user", content: "weather in Paris" }],
      tools: [WEATHER_TOOL],
      stream: true,
    });
    let name = "";
    let args = "";
    let fragments = 0;
    let finish: string | null = null;
    for await (const chunk of stream) {
      const c = chunk.choices[0];
      if (!c) continue;
      finish = c.finish_reason ?? finish;
      for (const tc of c.delta.tool_calls ?? []) {
        name += tc.function?.name ?? "";
        if (tc.function?.arguments) fragments++;
        args += tc.function?.arguments ?? "";
      }
    }
    expect(name).toBe("get_weather");
    expect(fragments).toBeGreaterThan(1);
    expect(rec(JSON.parse(args)).location).toBe("Paris");
    expect(finish).toBe("tool_calls");
  });

  test("response_format json_object / json_schema yield valid JSON content", async () => {
    const obj = await client.chat.completions.create({
      model: "m",
      messages: [{ role: "user", content: "give json" }],
      response_format: { type: "json_object" },
    });
    expect(() => JSON.parse(obj.choices[0]?.message.content ?? "")).not.toThrow();

    const schema = await client.chat.completions.create({
      model: "m",
      messages: [{ role: "user", content: "give json" }],
      response_format: {
        type: "json_schema",
        json_schema: {
          name: "p",
          schema: { type: "object", properties: { name: { type: "string" }, age: { type: "integer" }, tags: { type: "array", items: { type: "string" } } } },
        },
      },
    });
    const parsed = rec(JSON.parse(schema.choices[0]?.message.content ?? ""));
    expect(typeof parsed.name).toBe("string");
    expect(Number.isInteger(parsed.age)).toBe(true);
    expect(Array.isArray(parsed.tags)).toBe(true);

    const streamed = await client.chat.completions.create({
      model: "m",
      messages: [{ role: "user", content: "give json" }],
      response_format: { type: "json_object" },
      stream: true,
    });
    let text = "";
    for await (const chunk of streamed) text += chunk.choices[0]?.delta.content ?? "";
    expect(text).toBe(obj.choices[0]?.message.content ?? "");
  });

  test("embeddings: float and base64 agree, are deterministic and unit length", async () => {
    const float = await client.embeddings.create({ model: "BAAI/bge-m3", input: ["alpha", "beta"], encoding_format: "float" });
    expect(float.object).toBe("list");
    expect(float.model).toBe("BAAI/bge-m3");
    expect(float.data.map((d) => d.index)).toEqual([0, 1]);
    expect(float.data[0]?.object).toBe("embedding");
    const a = float.data[0]?.embedding ?? [];
    expect(a.length).toBe(SIM_EMBEDDING_DIMS);
    const norm = Math.sqrt(a.reduce((s, x) => s + x * x, 0));
    expect(norm).toBeCloseTo(1, 4);
    expect(float.data[1]?.embedding).not.toEqual(a);
    expect(float.usage.prompt_tokens).toBeGreaterThan(0);
    expect(float.usage.total_tokens).toBe(float.usage.prompt_tokens);

    // The SDK asks for base64 by default and decodes it itself.
    const b64 = await client.embeddings.create({ model: "BAAI/bge-m3", input: ["alpha", "beta"] });
    expect(rec(sim.stats.lastBody).encoding_format).toBe("base64");
    expect(b64.data[0]?.embedding).toEqual(a);

    const rawB64 = rec(await (await post(sim, "/embeddings", { model: "e", input: "alpha", encoding_format: "base64" })).json());
    expect(typeof rec(arr(rawB64.data)[0]).embedding).toBe("string");

    const single = await client.embeddings.create({ model: "e", input: "alpha", dimensions: 64, encoding_format: "float" });
    expect(single.data.length).toBe(1);
    expect(single.data[0]?.embedding.length).toBe(64);

    const tokens = await client.embeddings.create({ model: "e", input: [[1, 2, 3], [4, 5]], encoding_format: "float" });
    expect(tokens.data.length).toBe(2);
    expect(tokens.usage.prompt_tokens).toBe(5);
  });

  test("bad JSON → 400 in vLLM's error shape", async () => {
    const res = await post(sim, "/chat/completions", "{nope");
    expect(res.status).toBe(400);
    expect(await res.json()).toEqual({
      object: "error",
      message: "Request body is not valid JSON",
      type: "BadRequestError",
      param: null,
      code: 400,
    });
  });

  test("unknown route → 404 FastAPI detail", async () => {
    const res = await fetch(`${sim.url}/nope`);
    expect(res.status).toBe(404);
    expect(await res.json()).toEqual({ detail: "Not Found" });
  });

  test("status fault with count clears itself; SDK surfaces APIError", async () => {
    sim.setFault({ kind: "status", status: 503, count: 2, message: "overloaded" });
    for (let i = 0; i < 2; i++) {
      const res = await post(sim, "/chat/completions", { model: "m", messages: userMsg("hi") });
      expect(res.status).toBe(503);
      const body = rec(await res.json());
      expect(body.object).toBe("error");
      expect(body.message).toBe("overloaded");
      expect(body.code).toBe(503);
    }
    const ok = await post(sim, "/chat/completions", { model: "m", messages: userMsg("hi") });
    expect(ok.status).toBe(200);
    expect(sim.stats.requests).toBe(3);

    sim.setFault({ kind: "status", status: 429 });
    const err: unknown = await client.chat.completions
      .create({ model: "m", messages: [{ role: "user", content: "hi" }] })
      .then(() => null, (e: unknown) => e);
    expect(err).toBeInstanceOf(OpenAI.APIError);
    if (err instanceof OpenAI.APIError) expect(err.status).toBe(429);
    // Unlimited faults stay set.
    expect((await post(sim, "/embeddings", { model: "e", input: "x" })).status).toBe(429);
  });

  test("control endpoints: POST /__sim/fault, /__sim/config, GET /__sim/stats", async () => {
    const root = sim.url.replace(/\/v1$/, "");
    const set = await fetch(`${root}/__sim/fault`, {
      method: "POST",
      body: JSON.stringify({ kind: "status", status: 500, count: 1 }),
    });
    expect(set.status).toBe(200);
    expect((await post(sim, "/chat/completions", { model: "m", messages: userMsg("hi") })).status).toBe(500);
    expect((await post(sim, "/chat/completions", { model: "m", messages: userMsg("hi") })).status).toBe(200);

    const bad = await fetch(`${root}/__sim/fault`, { method: "POST", body: JSON.stringify({ kind: "explode" }) });
    expect(bad.status).toBe(400);

    await fetch(`${root}/__sim/config`, { method: "POST", body: JSON.stringify({ completionTokens: 3 }) });
    const r = await client.chat.completions.create({ model: "m", messages: [{ role: "user", content: "hi" }] });
    expect(r.usage?.completion_tokens).toBe(3);

    const stats = rec(await (await fetch(`${root}/__sim/stats`)).json());
    expect(stats.requests).toBe(3);
    expect(stats.inFlight).toBe(0);
    expect(arr(stats.bodies).length).toBe(3);

    const cleared = await fetch(`${root}/__sim/fault`, { method: "POST", body: "null" });
    expect(rec(await cleared.json()).fault).toBeNull();
  });

  test("drop-mid-stream sends N chunks then resets the connection", async () => {
    sim.setFault({ kind: "drop-mid-stream", afterChunks: 3 });
    const res = await post(sim, "/chat/completions", { model: "m", messages: userMsg("hi"), stream: true });
    expect(res.status).toBe(200);
    const reader = res.body?.getReader();
    if (!reader) throw new Error("no body");
    const dec = new TextDecoder();
    let text = "";
    let failed = false;
    try {
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        text += dec.decode(value, { stream: true });
      }
    } catch {
      failed = true;
    }
    expect(failed).toBe(true);
    expect(text).not.toContain("[DONE]");
    expect(text.split("\n\n").filter((f) => f.startsWith("data: ")).length).toBe(3);
    expect(sim.stats.inFlight).toBe(0);
    expect(sim.stats.aborts).toBe(0);
  });

  test("drop-mid-stream surfaces as an error through the SDK (streamed and not)", async () => {
    sim.setFault({ kind: "drop-mid-stream", afterChunks: 2 });
    const stream = await client.chat.completions.create({
      model: "m",
      messages: [{ role: "user", content: "hi" }],
      stream: true,
    });
    let seen = 0;
    const streamErr: unknown = await (async () => {
      for await (const chunk of stream) if (chunk.choices.length > 0) seen++;
    })().then(
      () => null,
      (e: unknown) => e,
    );
    expect(streamErr).toBeInstanceOf(Error);
    expect(seen).toBe(2);

    const err: unknown = await client.embeddings
      .create({ model: "e", input: "x", encoding_format: "float" })
      .then(() => null, (e: unknown) => e);
    expect(err).toBeInstanceOf(Error);
    expect(sim.stats.inFlight).toBe(0);
  });

  test("malformed-sse emits an unparsable data line", async () => {
    sim.setFault({ kind: "malformed-sse" });
    const res = await post(sim, "/chat/completions", { model: "m", messages: userMsg("hi"), stream: true });
    const data = sseData(await res.text());
    expect(data).toContain("{not json");
    expect(() => JSON.parse(data[0] ?? "")).not.toThrow();
  });

  test("apiKey requires a bearer token (vLLM's 401 body)", async () => {
    const locked = await startSimulator({ port: 0, apiKey: "secret", ttftMs: 0, interTokenMs: 0 });
    try {
      const denied = await fetch(`${locked.url}/models`);
      expect(denied.status).toBe(401);
      expect(await denied.json()).toEqual({ error: "Unauthorized" });
      const allowed = await fetch(`${locked.url}/models`, { headers: { authorization: "Bearer secret" } });
      expect(allowed.status).toBe(200);
    } finally {
      await locked.stop();
    }
  });

  test("errorFormat nested matches current vLLM and the SDK reads its message", async () => {
    const nested = await startSimulator({ port: 0, errorFormat: "nested", ttftMs: 0 });
    try {
      nested.setFault({ kind: "status", status: 400, message: "bad thing" });
      const c = new OpenAI({ baseURL: nested.url, apiKey: "x", maxRetries: 0 });
      const err: unknown = await c.chat.completions.create({ model: "m", messages: [{ role: "user", content: "hi" }] }).then(
        () => null,
        (e: unknown) => e,
      );
      expect(err).toBeInstanceOf(OpenAI.BadRequestError);
      if (err instanceof OpenAI.APIError) {
        expect(err.message).toContain("bad thing");
        expect(err.type).toBe("BadRequestError");
      }
    } finally {
      await nested.stop();
    }
  });

  test("bodies history is capped at 50", async () => {
    for (let i = 0; i < 55; i++) await post(sim, "/embeddings", { model: "e", input: `t${i}` });
    expect(sim.stats.requests).toBe(55);
    expect(sim.stats.bodies.length).toBe(50);
    expect(rec(sim.stats.bodies[0]).input).toBe("t5");
  });

  test("refuse closes the listener; clearing it re-listens on the same port", async () => {
    sim.setFault({ kind: "refuse" });
    const err: unknown = await fetch(`${sim.url}/models`).then(
      () => null,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(Error);
    sim.setFault(null);
    expect((await fetch(`${sim.url}/models`)).status).toBe(200);
  });
});

describe("simulator (timed)", () => {
  let sim: Simulator;

  beforeAll(async () => {
    sim = await startSimulator({ port: 0, ttftMs: 30, interTokenMs: 10, completionTokens: 5 });
  });
  afterEach(() => sim.reset());
  afterAll(() => sim.stop());

  test("ttft and inter-token pacing", async () => {
    const t0 = performance.now();
    const res = await post(sim, "/chat/completions", { model: "m", messages: userMsg("hi"), stream: true });
    const reader = res.body?.getReader();
    if (!reader) throw new Error("no body");
    const dec = new TextDecoder();
    let firstAt = -1;
    let text = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      if (firstAt < 0) firstAt = performance.now() - t0;
      text += dec.decode(value, { stream: true });
    }
    const total = performance.now() - t0;
    expect(firstAt).toBeGreaterThanOrEqual(25);
    // 30ms TTFT + 4 gaps of 10ms.
    expect(total).toBeGreaterThanOrEqual(65);
    expect(text).toContain("[DONE]");
  });

  test("slow-headers delays the response head", async () => {
    sim.setFault({ kind: "slow-headers", ms: 150 });
    const t0 = performance.now();
    const res = await post(sim, "/embeddings", { model: "e", input: "x" });
    expect(performance.now() - t0).toBeGreaterThanOrEqual(140);
    expect(res.status).toBe(200);
  });

  test("hang never responds; client abort is counted and releases the request", async () => {
    sim.setFault({ kind: "hang" });
    const ac = new AbortController();
    const pending = post(sim, "/chat/completions", { model: "m", messages: userMsg("hi") }, { signal: ac.signal });
    await until(() => sim.stats.inFlight === 1, "the request to reach the simulator");
    ac.abort();
    const err: unknown = await pending.then(
      () => null,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(Error);
    await until(() => sim.stats.aborts >= 1 && sim.stats.inFlight === 0, "the abort to be counted");
    expect(sim.stats.aborts).toBe(1);
    expect(sim.stats.inFlight).toBe(0);
  });

  test("client abort mid-stream stops generation and counts one abort", async () => {
    const ac = new AbortController();
    const res = await post(
      sim,
      "/chat/completions",
      { model: "m", messages: userMsg("hi"), stream: true, max_tokens: 5 },
      { signal: ac.signal },
    );
    const reader = res.body?.getReader();
    if (!reader) throw new Error("no body");
    await reader.read();
    expect(sim.stats.inFlight).toBe(1);
    ac.abort();
    await until(() => sim.stats.aborts >= 1 && sim.stats.inFlight === 0, "the abort to be counted");
    expect(sim.stats.aborts).toBe(1);
    expect(sim.stats.inFlight).toBe(0);
  });

  test("stop() tears down open streams without leaving in-flight work", async () => {
    const other = await startSimulator({ port: 0, ttftMs: 10_000 });
    const pending = post(other, "/chat/completions", { model: "m", messages: userMsg("hi"), stream: true }).then(
      (r) => r.text(),
    );
    await until(() => other.stats.inFlight === 1, "the stream to reach the simulator");
    await other.stop();
    expect(other.stats.inFlight).toBe(0);
    await pending.catch(() => undefined);
  });
});
