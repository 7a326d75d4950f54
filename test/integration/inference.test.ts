import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { eq } from "drizzle-orm";
import { usageEvents } from "../../src/db/schema.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { errorOf, type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import {
  CHAT_MODEL,
  EMBED_MODEL,
  TEST_PLANS,
  arr,
  post,
  rec,
  seedTestOrg,
  testAliases,
  upstreamSettings,
  userMessages,
} from "./inference-fixtures.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Spec 4.1-4.3 through real HTTP: request rules, response shapes and every
 * error code, against the simulator.
 */

let sim: Simulator;
let gw: Gateway;
let org: SeededOrg;
const BODY_LIMIT = 64 * 1024;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 5 });
  gw = await startTestGateway({
    aliases: testAliases(sim.url),
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 2 }),
    bodyLimitBytes: BODY_LIMIT,
  });
  org = await seedTestOrg(gw.database);
});
afterEach(() => sim.reset());
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

const chat = (body: unknown, key: string | undefined = org.personalKey, init?: RequestInit) => post(gw, "/v1/chat/completions", key, body, init);
const embed = (body: unknown, key: string | undefined = org.personalKey) => post(gw, "/v1/embeddings", key, body);

async function expectInvalid(res: Response, param: string | null, messageHas?: string): Promise<void> {
  expect(res.status).toBe(400);
  const err = await errorOf(res);
  expect(err.code).toBe("invalid_request_error");
  expect(err.type).toBe("invalid_request_error");
  expect(err.param).toBe(param);
  if (messageHas) expect(err.message).toContain(messageHas);
}

describe("POST /v1/chat/completions: answers", () => {
  test("non-streamed: exactly spec 2.3, model = alias, upstream asked with its own model id", async () => {
    const res = await chat({ model: "svc-fast", messages: userMessages("hello") });
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toContain("application/json");
    expect(res.headers.get("x-request-id")).toMatch(/^req_/);
    const body = rec(await res.json());
    expect(Object.keys(body).sort()).toEqual(["choices", "created", "id", "model", "object", "usage"]);
    expect(body.object).toBe("chat.completion");
    expect(body.model).toBe("svc-fast");
    expect(typeof body.id).toBe("string");
    expect(Number.isInteger(body.created)).toBe(true);
    const choice = rec(arr(body.choices)[0]);
    // logprobs and message.refusal as OpenAI always sends them, null here (the simulator sends logprobs: null, as vLLM does, and no refusal).
    expect(Object.keys(choice).sort()).toEqual(["finish_reason", "index", "logprobs", "message"]);
    expect(choice.index).toBe(0);
    expect(choice.finish_reason).toBe("stop");
    expect(choice.logprobs).toBeNull();
    expect(choice.message).toEqual({ role: "assistant", content: "token0 token1 token2 token3 token4 ", refusal: null });
    const usage = rec(body.usage);
    expect(Object.keys(usage).sort()).toEqual(["completion_tokens", "prompt_tokens", "total_tokens"]);
    expect(usage.completion_tokens).toBe(5);
    expect(usage.total_tokens).toBe(Number(usage.prompt_tokens) + 5);
    expect(rec(sim.stats.lastBody).model).toBe(CHAT_MODEL);
  });

  test("non-streamed answers are sent whole: a content-length, no chunked encoding, rate-limit headers kept", async () => {
    for (const res of [
      await chat({ model: "svc-fast", messages: userMessages("hello") }),
      await embed({ model: "svc-embed", input: "hello" }),
    ]) {
      expect(res.status).toBe(200);
      expect(res.headers.get("content-type")).toBe("application/json");
      expect(res.headers.get("transfer-encoding")).toBeNull();
      expect(res.headers.get("x-ratelimit-limit-requests")).not.toBeNull();
      expect(res.headers.get("x-request-id")).toMatch(/^req_/);
      const bytes = new Uint8Array(await res.arrayBuffer());
      expect(Number(res.headers.get("content-length"))).toBe(bytes.byteLength);
    }
  });

  test("finish_reason length passes through", async () => {
    const body = rec(await (await chat({ model: "svc-fast", messages: userMessages(), max_tokens: 2 })).json());
    expect(rec(arr(body.choices)[0]).finish_reason).toBe("length");
    expect(rec(body.usage).completion_tokens).toBe(2);
  });

  test("tool call: tool_calls and finish_reason tool_calls pass through, content null", async () => {
    const tools = [
      {
        type: "function",
        function: {
          name: "get_weather",
          description: "Weather for a city",
          parameters: { type: "object", properties: { location: { type: "string" } }, required: ["location"] },
        },
      },
    ];
    const res = await chat({ model: "svc-fast", messages: userMessages("What is the weather in Paris?"), tools, tool_choice: "auto" });
    expect(res.status).toBe(200);
    const choice = rec(arr(rec(await res.json()).choices)[0]);
    expect(choice.finish_reason).toBe("tool_calls");
    const message = rec(choice.message);
    expect(message.content).toBeNull();
    const call = rec(arr(message.tool_calls)[0]);
    expect(call.type).toBe("function");
    expect(typeof call.id).toBe("string");
    expect(rec(call.function).name).toBe("get_weather");
    expect(JSON.parse(String(rec(call.function).arguments))).toEqual({ location: "Paris" });
  });

  test("the tool round trip as real clients send it reaches the upstream unchanged", async () => {
    const tools = [
      {
        type: "function",
        function: {
          name: "get_weather",
          parameters: {
            $schema: "http://json-schema.org/draft-07/schema#",
            type: "object",
            properties: { location: { type: "string" }, unit: { enum: ["celsius", "fahrenheit"] }, extra: { $ref: "#/$defs/x" } },
            required: ["location"],
            additionalProperties: false,
            $defs: { x: { type: "object", additionalProperties: { type: "number" } } },
          },
          strict: true,
        },
      },
    ];
    const messages = [
      { role: "system", content: "You are terse.", name: "policy" },
      { role: "user", content: [{ type: "text", text: "Weather in Paris?" }], name: "alice" },
      {
        role: "assistant",
        content: null,
        refusal: null,
        tool_calls: [{ id: "call_1", type: "function", function: { name: "get_weather", arguments: '{"location":"Paris"}' } }],
      },
      { role: "tool", tool_call_id: "call_1", content: '{"temp":21}' },
    ];
    const sent = { model: "svc-fast", messages, tools, tool_choice: { type: "function", function: { name: "get_weather" } }, parallel_tool_calls: false };
    const res = await chat(sent);
    expect(res.status).toBe(200);
    expect(sim.stats.lastBody).toEqual({ ...sent, model: CHAT_MODEL });
  });

  test("standard parameters pass through to the upstream untouched", async () => {
    const sent = {
      model: "svc-fast",
      messages: userMessages(),
      temperature: 0.7,
      top_p: 0.9,
      n: 1,
      stop: ["\n\n", "END"],
      max_tokens: 3,
      max_completion_tokens: 3,
      presence_penalty: 0.1,
      frequency_penalty: -0.2,
      logit_bias: { "50256": -100 },
      logprobs: false,
      top_logprobs: 0,
      seed: 42,
      user: "user-123",
      parallel_tool_calls: true,
      reasoning_effort: "low",
      metadata: { team: "a" },
      store: false,
      modalities: ["text"],
      service_tier: "auto",
      prediction: { type: "content", content: "x" },
      response_format: { type: "json_schema", json_schema: { name: "r", schema: { type: "object", properties: { a: { type: "string" } } }, strict: true } },
      prompt_cache_key: "k",
      safety_identifier: "s",
      verbosity: "low",
      top_k: 40,
      min_p: 0.05,
      repetition_penalty: 1.1,
      temperature_unused_by_null: undefined,
    };
    const res = await chat(sent);
    expect(res.status).toBe(200);
    expect(sim.stats.lastBody).toEqual({ ...JSON.parse(JSON.stringify(sent)), model: CHAT_MODEL });
  });

  test("reasoning text, refusals and requested logprobs pass through; logprobs null when not asked", async () => {
    await fetch(`${sim.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify({ reasoning: "Let me think it over." }) });
    const asked = rec(await (await chat({ model: "svc-fast", messages: userMessages(), logprobs: true, top_logprobs: 2 })).json());
    const choice = rec(arr(asked.choices)[0]);
    expect(choice.message).toEqual({ role: "assistant", content: "token0 token1 token2 token3 token4 ", refusal: null, reasoning_content: "Let me think it over." });
    const lp = arr(rec(choice.logprobs).content).map(rec);
    expect(lp.map((t) => t.token)).toEqual(["token0 ", "token1 ", "token2 ", "token3 ", "token4 "]);
    expect(lp[0]).toEqual({
      token: "token0 ",
      logprob: -0.25,
      bytes: [...Buffer.from("token0 ")],
      top_logprobs: [
        { token: "token0 ", logprob: -0.25, bytes: [...Buffer.from("token0 ")] },
        { token: "alt1", logprob: -2, bytes: [...Buffer.from("alt1")] },
      ],
    });
    // The reasoning's tokens are part of the completion (6 pieces of 4 characters, plus the 5 answer tokens).
    expect(rec(asked.usage).completion_tokens).toBe(11);

    const refused = rec(await (await chat({ model: "svc-fast", messages: userMessages("Please refuse this.") })).json());
    const r = rec(arr(refused.choices)[0]);
    expect(r.message).toEqual({ role: "assistant", content: null, refusal: "I can't help with that.", reasoning_content: "Let me think it over." });
    expect(Object.keys(r).sort()).toEqual(["finish_reason", "index", "logprobs", "message"]);
    expect(r.logprobs).toBeNull();
  });

  test("null for optional parameters is accepted (the SDKs send it)", async () => {
    const sent = { model: "svc-fast", messages: userMessages(), temperature: null, max_tokens: null, stop: null, stream: null, seed: null };
    const res = await chat(sent);
    expect(res.status).toBe(200);
    expect(rec(await res.json()).object).toBe("chat.completion");
    expect(sim.stats.lastBody).toEqual({ ...sent, model: CHAT_MODEL });
  });

  test("images: image_url parts with a URL or a data URL reach an images-capable alias", async () => {
    const content = [
      { type: "text", text: "What is in these?" },
      { type: "image_url", image_url: { url: "https://93.184.216.34/cat.png", detail: "low" } },
      { type: "image_url", image_url: { url: "data:image/png;base64,iVBORw0KGgo=" } },
    ];
    const res = await chat({ model: "svc-fast", messages: [{ role: "user", content }] });
    expect(res.status).toBe(200);
    expect(rec(arr(rec(sim.stats.lastBody).messages)[0]).content).toEqual(content);
  });

  test("response_format json_object and text are accepted", async () => {
    for (const rf of [{ type: "json_object" }, { type: "text" }]) {
      const res = await chat({ model: "svc-fast", messages: userMessages(), response_format: rf });
      expect(res.status).toBe(200);
      expect(rec(sim.stats.lastBody).response_format).toEqual(rf);
      const content = String(rec(rec(arr(rec(await res.json()).choices)[0]).message).content);
      if (rf.type === "json_object") expect(rec(JSON.parse(content)).answer).toBe("token0 token1 token2 token3 token4");
      else expect(content).toBe("token0 token1 token2 token3 token4 ");
    }
  });

  test("usage is recorded for the organisation with alias and target", async () => {
    const o = await seedTestOrg(gw.database);
    await chat({ model: "svc-fast", messages: userMessages() }, o.serviceKey);
    await gw.quota.flush();
    const rows = await gw.database.db.select().from(usageEvents).where(eq(usageEvents.orgId, o.orgId));
    expect(rows.length).toBe(1);
    expect(rows[0]?.alias).toBe("svc-fast");
    expect(rows[0]?.target).toBe(`${sim.url}|${CHAT_MODEL}`);
    expect(rows[0]?.completionTokens).toBe(5);
    expect(rows[0]?.status).toBe(200);
    expect(rows[0]?.streamed).toBe(false);
  });
});

describe("POST /v1/chat/completions: request rules (400 invalid_request_error with param)", () => {
  test("unknown top-level parameters are refused by name", async () => {
    await expectInvalid(await chat({ model: "svc-fast", messages: userMessages(), foo: 1 }), "foo", "Unrecognized request argument supplied: foo");
    await expectInvalid(await chat({ model: "svc-fast", messages: userMessages(), guided_json: {} }), "guided_json");
    await expectInvalid(await chat('{"__proto__":{"x":1},"model":"svc-fast","messages":[{"role":"user","content":"x"}]}'), "__proto__");
    expect(sim.stats.requests).toBe(0);
  });

  test("required fields", async () => {
    await expectInvalid(await chat({ messages: userMessages() }), "model", "Missing required parameter");
    await expectInvalid(await chat({ model: "svc-fast" }), "messages", "Missing required parameter");
    await expectInvalid(await chat({ model: "svc-fast", messages: [] }), "messages");
    await expectInvalid(await chat({ model: 7, messages: userMessages() }), "model");
    await expectInvalid(await chat({ model: "svc-fast", messages: [{ content: "x" }] }), "messages[0].role");
    await expectInvalid(await chat({ model: "svc-fast", messages: [{ role: "user" }] }), "messages[0].content");
  });

  test("roles: system, user, assistant and tool only", async () => {
    for (const role of ["developer", "function", "bot", ""]) {
      await expectInvalid(await chat({ model: "svc-fast", messages: [{ role, content: "x" }] }), "messages[0].role");
    }
  });

  test("message fields", async () => {
    const ok = { role: "user", content: "x" };
    await expectInvalid(await chat({ model: "svc-fast", messages: [ok, { role: "user", content: 5 }] }), "messages[1].content");
    await expectInvalid(await chat({ model: "svc-fast", messages: [{ role: "user", content: "x", foo: 1 }] }), "messages[0].foo");
    await expectInvalid(await chat({ model: "svc-fast", messages: [ok, { role: "tool", content: "r" }] }), "messages[1].tool_call_id");
    await expectInvalid(await chat({ model: "svc-fast", messages: [{ role: "user", content: null }] }), "messages[0].content");
    await expectInvalid(
      await chat({ model: "svc-fast", messages: [ok, { role: "assistant", content: null, tool_calls: [{ id: "c", type: "function", function: { name: "f" } }] }] }),
      "messages[1].tool_calls[0].function.arguments",
    );
  });

  test("content parts", async () => {
    const m = (content: unknown, role = "user") => ({ model: "svc-fast", messages: [{ role, content }] });
    await expectInvalid(await chat(m([{ type: "input_audio", input_audio: {} }])), "messages[0].content[0].type");
    await expectInvalid(await chat(m([{ type: "text" }])), "messages[0].content[0].text");
    await expectInvalid(await chat(m([{ type: "text", text: "a" }, { type: "image_url", image_url: { url: "ftp://x" } }])), "messages[0].content[1].image_url.url");
    await expectInvalid(await chat(m([{ type: "image_url", image_url: { url: "https://x/y.png", detail: "ultra" } }])), "messages[0].content[0].image_url.detail");
    await expectInvalid(await chat(m([{ type: "image_url", image_url: { url: "https://x/y.png" } }], "system")), "messages[0].content[0].type");
    await expectInvalid(await chat(m(["just a string"])), "messages[0].content[0]");
  });

  test("an empty array of content parts is refused in every role, as OpenAI does; an assistant that only calls tools sends null or no content", async () => {
    const ok = { role: "user", content: "x" };
    const call = { id: "c1", type: "function", function: { name: "f", arguments: "{}" } };
    const cases: [unknown[], string][] = [
      [[{ role: "user", content: [] }], "messages[0].content"],
      [[{ role: "system", content: [] }, ok], "messages[0].content"],
      [[ok, { role: "assistant", content: [] }], "messages[1].content"],
      [[ok, { role: "assistant", content: [], tool_calls: [call] }, { role: "tool", tool_call_id: "c1", content: "r" }], "messages[1].content"],
      [[ok, { role: "assistant", content: null, tool_calls: [call] }, { role: "tool", tool_call_id: "c1", content: [] }], "messages[2].content"],
    ];
    for (const [messages, param] of cases) {
      await expectInvalid(await chat({ model: "svc-fast", messages }), param, `Invalid '${param}': empty array. Expected an array with minimum length 1`);
    }
    await expectInvalid(await chat({ model: "svc-fast", messages: [] }), "messages", "Invalid 'messages': empty array.");
    expect(sim.stats.requests).toBe(0);
    for (const assistant of [{ role: "assistant", content: null, tool_calls: [call] }, { role: "assistant", tool_calls: [call] }]) {
      expect((await chat({ model: "svc-fast", messages: [ok, assistant, { role: "tool", tool_call_id: "c1", content: [{ type: "text", text: "r" }] }] })).status).toBe(200);
    }
  });

  test("response_format.json_schema.name: 1 to 64 letters, digits, underscores or dashes, as OpenAI; the SDKs' default names pass", async () => {
    const format = (name: string) => ({ model: "svc-fast", messages: userMessages(), response_format: { type: "json_schema", json_schema: { name, schema: { type: "object" } } } });
    for (const name of ["has space", "a.b", "x/y", "naïve", "x".repeat(65), ""]) {
      await expectInvalid(await chat(format(name)), "response_format.json_schema.name", "response_format.json_schema.name");
    }
    expect(sim.stats.requests).toBe(0);
    // The defaults of the Vercel AI SDK ("response"), LangChain ("extract") and the Agents SDK ("output"; "final_output" in Python).
    for (const name of ["response", "extract", "output", "final_output", "My-Schema_2", "x".repeat(64)]) {
      expect((await chat(format(name))).status).toBe(200);
      expect(rec(rec(rec(sim.stats.lastBody).response_format).json_schema).name).toBe(name);
    }
  });

  test("a tool message answers a call of the assistant message just before it (other tool messages between), as OpenAI requires", async () => {
    const call = (id: string) => ({ id, type: "function", function: { name: "f", arguments: "{}" } });
    const user = { role: "user", content: "x" };
    const calling = (...ids: string[]) => ({ role: "assistant", content: null, tool_calls: ids.map(call) });
    const tool = (id: string) => ({ role: "tool", tool_call_id: id, content: "r" });
    const orphan = "must be a response to a preceding message with 'tool_calls'";
    const cases: [unknown[], string, string][] = [
      [[user, tool("c1")], "messages[1].role", orphan],
      [[tool("c1"), user], "messages[0].role", orphan],
      [[user, { role: "assistant", content: "sure" }, tool("c1")], "messages[2].role", orphan],
      [[user, { role: "assistant", content: "sure", tool_calls: [] }, tool("c1")], "messages[2].role", orphan],
      [[user, calling("c1"), tool("c1"), user, tool("c1")], "messages[4].role", orphan],
      [[user, calling("c1"), tool("c2")], "messages[2].tool_call_id", "'tool_call_id' of 'c2' not found in 'tool_calls' of previous message"],
      // A call of an earlier assistant message is not answered later on.
      [[user, calling("c1"), tool("c1"), calling("c2"), tool("c1")], "messages[4].tool_call_id", "'c1' not found"],
    ];
    for (const [messages, param, message] of cases) await expectInvalid(await chat({ model: "svc-fast", messages }), param, message);
    expect(sim.stats.requests).toBe(0);
    // Parallel calls answered in any order, several rounds, and a final answer after them.
    const rounds = [user, calling("c1", "c2"), tool("c2"), tool("c1"), calling("c3"), tool("c3"), { role: "assistant", content: "done" }, user];
    expect((await chat({ model: "svc-fast", messages: rounds })).status).toBe(200);
    expect(rec(sim.stats.lastBody).messages).toEqual(rounds);
    // Calls left unanswered are not refused (OpenAI refuses them; clients that cut a conversation's history would be).
    for (const cut of [
      [user, calling("c1", "c2"), tool("c2"), user],
      [user, calling("c1"), user],
      [user, calling("c1")],
    ]) {
      expect((await chat({ model: "svc-fast", messages: cut })).status).toBe(200);
    }
  });

  test("temperature 0 to 2", async () => {
    for (const t of [-0.01, 2.01, "1"]) await expectInvalid(await chat({ model: "svc-fast", messages: userMessages(), temperature: t }), "temperature");
    for (const t of [0, 2, 1.3]) {
      expect((await chat({ model: "svc-fast", messages: userMessages(), temperature: t })).status).toBe(200);
      expect(rec(sim.stats.lastBody).temperature).toBe(t);
    }
  });

  test("seed: a whole number JavaScript holds exactly (|seed| <= 2^53 - 1), forwarded as sent; a larger one would reach the upstream rounded (a different seed), so it is refused", async () => {
    for (const seed of [2 ** 53, -(2 ** 53), 1e300, 1.5]) await expectInvalid(await chat({ model: "svc-fast", messages: userMessages(), seed }), "seed");
    for (const seed of [0, -1, 42, Number.MAX_SAFE_INTEGER, -Number.MAX_SAFE_INTEGER]) {
      expect((await chat({ model: "svc-fast", messages: userMessages(), seed })).status).toBe(200);
      expect(rec(sim.stats.lastBody).seed).toBe(seed);
    }
  });

  test("OpenAI's bounds that the upstream would word its own way or not check: top_logprobs 0-20, logit_bias token ids to -100..100, metadata 16 pairs of 64/512 characters, stream_options only with stream, stop at most 4 sequences", async () => {
    const base = { model: "svc-fast", messages: userMessages() };
    // vLLM takes any number and searches the new text for each one at every token.
    await expectInvalid(await chat({ ...base, stop: ["a", "b", "c", "d", "e"] }), "stop", "4");
    await expectInvalid(await chat({ ...base, stop: Array.from({ length: 1_000 }, (_, i) => `s${i}`) }), "stop", "4");
    expect(sim.stats.requests).toBe(0);
    expect((await chat({ ...base, stop: ["a", "b", "c", "d"] })).status).toBe(200);
    expect(rec(sim.stats.lastBody).stop).toEqual(["a", "b", "c", "d"]);
    expect((await chat({ ...base, stop: "a" })).status).toBe(200);
    expect((await chat({ ...base, stop: [] })).status).toBe(200);
    await expectInvalid(await chat({ ...base, logprobs: true, top_logprobs: 21 }), "top_logprobs");
    expect((await chat({ ...base, logprobs: true, top_logprobs: 20 })).status).toBe(200);
    await expectInvalid(await chat({ ...base, logit_bias: { "50256": 101 } }), "logit_bias[50256]");
    await expectInvalid(await chat({ ...base, logit_bias: { abc: 1 } }), "logit_bias", "token ids");
    await expectInvalid(await chat({ ...base, logit_bias: { "-1": 1 } }), "logit_bias", "token ids");
    expect((await chat({ ...base, logit_bias: { "50256": -100, "11": 100 } })).status).toBe(200);
    expect(rec(sim.stats.lastBody).logit_bias).toEqual({ "50256": -100, "11": 100 });
    const pairs = (n: number) => Object.fromEntries(Array.from({ length: n }, (_, i) => [`k${i}`, "v"]));
    await expectInvalid(await chat({ ...base, metadata: pairs(17) }), "metadata");
    await expectInvalid(await chat({ ...base, metadata: { ["k".repeat(65)]: "v" } }), "metadata", "64");
    await expectInvalid(await chat({ ...base, metadata: { k: "v".repeat(513) } }), "metadata.k");
    expect((await chat({ ...base, metadata: { ...pairs(15), ["k".repeat(64)]: "v".repeat(512) } })).status).toBe(200);
    await expectInvalid(await chat({ ...base, stream_options: { include_usage: true } }), "stream_options", "only allowed when 'stream'");
    await expectInvalid(await chat({ ...base, stream: false, stream_options: { include_usage: true } }), "stream_options", "only allowed when 'stream'");
    expect((await chat({ ...base, stream_options: null })).status).toBe(200);
  });

  test("max_tokens: a positive integer within the alias's context window", async () => {
    for (const v of [0, -1, 1.5, "10"]) await expectInvalid(await chat({ model: "svc-fast", messages: userMessages(), max_tokens: v }), "max_tokens");
    await expectInvalid(await chat({ model: "svc-fast", messages: userMessages(), max_tokens: 128_001 }), "max_tokens", "context window");
    await expectInvalid(await chat({ model: "svc-text", messages: userMessages(), max_completion_tokens: 5000 }), "max_completion_tokens");
    expect((await chat({ model: "svc-fast", messages: userMessages(), max_tokens: 128_000 })).status).toBe(200);
    expect(rec(sim.stats.lastBody).max_tokens).toBe(128_000);
    expect((await chat({ model: "svc-smart", messages: userMessages(), max_tokens: 180_000 })).status).toBe(200);
    expect(rec(sim.stats.lastBody).max_tokens).toBe(180_000);
  });

  test("tools, tool_choice and response_format shapes", async () => {
    const base = { model: "svc-fast", messages: userMessages() };
    await expectInvalid(await chat({ ...base, tools: [{ type: "custom", custom: { name: "x" } }] }), "tools[0].type");
    await expectInvalid(await chat({ ...base, tools: [{ type: "function", function: { description: "no name" } }] }), "tools[0].function.name");
    await expectInvalid(await chat({ ...base, tools: { type: "function" } }), "tools");
    await expectInvalid(await chat({ ...base, tool_choice: "sometimes" }), "tool_choice");
    // OpenAI's rules, which vLLM leaves to the chat template or checks in its own words: a function
    // name is 1-64 letters, digits, _ or -; a tool_choice that requires or names a tool needs tools,
    // and a named one must be among them.
    const fn = (name: string) => ({ type: "function", function: { name } });
    for (const name of ["get weather", "a.b", "x".repeat(65), "naïve"]) await expectInvalid(await chat({ ...base, tools: [fn("ok"), fn(name)] }), "tools[1].function.name", "letters, digits");
    for (const name of ["get_weather", "A-1", "x".repeat(64)]) expect((await chat({ ...base, tools: [fn(name)] })).status).toBe(200);
    await expectInvalid(await chat({ ...base, tool_choice: "required" }), "tool_choice", "only allowed when 'tools'");
    await expectInvalid(await chat({ ...base, tool_choice: fn("f") }), "tool_choice", "only allowed when 'tools'");
    await expectInvalid(await chat({ ...base, tools: [fn("f")], tool_choice: fn("g") }), "tool_choice.function.name", "'g'");
    // "auto" and "none" without tools say nothing a model could misread: they pass, as before.
    for (const tc of ["auto", "none"]) expect((await chat({ ...base, tool_choice: tc })).status).toBe(200);
    await expectInvalid(await chat({ ...base, response_format: { type: "yaml" } }), "response_format");
    for (const tc of ["auto", "none", "required", { type: "function", function: { name: "f" } }]) {
      const tools = [{ type: "function", function: { name: "f", parameters: { type: "object", properties: {} } } }];
      const res = await chat({ ...base, tools, tool_choice: tc });
      expect(res.status).toBe(200);
      expect(sim.stats.lastBody).toEqual({ ...base, model: CHAT_MODEL, tools, tool_choice: tc });
      // "required" and a named function make the model call f; "auto" without a trigger word and "none" answer in text.
      const finish = rec(arr(rec(await res.json()).choices)[0]).finish_reason;
      expect(finish).toBe(tc === "auto" || tc === "none" ? "stop" : "tool_calls");
    }
  });

  test("stream and stream_options types", async () => {
    await expectInvalid(await chat({ model: "svc-fast", messages: userMessages(), stream: "yes" }), "stream");
    await expectInvalid(await chat({ model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: "y" } }), "stream_options.include_usage");
    // With stream, every field the SDK declares reaches the upstream; include_usage is forced on for metering.
    const res = await chat({ model: "svc-fast", messages: userMessages(), stream: true, stream_options: { include_usage: false, include_obfuscation: false } });
    expect(res.status).toBe(200);
    await res.text();
    expect(rec(sim.stats.lastBody).stream_options).toEqual({ include_usage: true, include_obfuscation: false });
  });

  test("unknown fields inside nested objects are refused by their path, never forwarded", async () => {
    const base = { model: "svc-fast", messages: userMessages() };
    const fnTool = { type: "function", function: { name: "f" } };
    const cases: [Record<string, unknown>, string][] = [
      [{ stream: true, stream_options: { include_usage: true, evil_param: 1 } }, "stream_options.evil_param"],
      [{ response_format: { type: "json_object", evil: 1 } }, "response_format.evil"],
      [{ response_format: { type: "json_schema", json_schema: { name: "r", evil: 1 } } }, "response_format.json_schema.evil"],
      [{ tools: [{ type: "function", function: { name: "f", evil: 1 } }] }, "tools[0].function.evil"],
      [{ tools: [{ ...fnTool, evil: 1 }] }, "tools[0].evil"],
      [{ tools: [fnTool], tool_choice: { type: "function", function: { name: "f", evil: 1 } } }, "tool_choice.function.evil"],
      [{ tools: [fnTool], tool_choice: { type: "function", function: { name: "f" }, evil: 1 } }, "tool_choice.evil"],
      [{ prediction: { type: "content", content: "x", evil: 1 } }, "prediction.evil"],
      [{ prediction: { type: "content", content: [{ type: "text", text: "x", evil: 1 }] } }, "prediction.content[0].evil"],
      [{ audio: { format: "wav", voice: "alloy", evil: 1 } }, "audio.evil"],
      [{ web_search_options: { evil: 1 } }, "web_search_options.evil"],
      [{ web_search_options: { user_location: { type: "approximate", approximate: { city: "Paris", evil: 1 } } } }, "web_search_options.user_location.approximate.evil"],
      [{ moderation: { model: "m", evil: 1 } }, "moderation.evil"],
      [{ prompt_cache_options: { mode: "implicit", evil: 1 } }, "prompt_cache_options.evil"],
      [{ functions: [{ name: "f", evil: 1 }] }, "functions[0].evil"],
      [{ function_call: { name: "f", evil: 1 } }, "function_call.evil"],
      [{ messages: [{ role: "user", content: [{ type: "image_url", image_url: { url: "data:image/png;base64,AA==", evil: 1 } }] }] }, "messages[0].content[0].image_url.evil"],
      [{ messages: [{ role: "user", content: [{ type: "text", text: "x", prompt_cache_breakpoint: { mode: "explicit", evil: 1 } }] }] }, "messages[0].content[0].prompt_cache_breakpoint.evil"],
      [{ messages: [{ role: "assistant", content: "x", audio: { id: "a", evil: 1 } }] }, "messages[0].audio.evil"],
      [{ messages: [{ role: "assistant", content: "x", function_call: { name: "f", arguments: "{}", evil: 1 } }] }, "messages[0].function_call.evil"],
      [
        { messages: [{ role: "assistant", content: "x", annotations: [{ type: "url_citation", url_citation: { start_index: 0, end_index: 1, title: "t", url: "https://x", evil: 1 } }] }] },
        "messages[0].annotations[0].url_citation.evil",
      ],
    ];
    for (const [extra, param] of cases) {
      const res = await chat({ ...base, ...extra });
      await expectInvalid(res, param, `Unrecognized request argument supplied: ${param}`);
    }
    expect(sim.stats.requests).toBe(0);
  });

  test("every nested field the openai SDK 7.x types declare is accepted and forwarded unchanged", async () => {
    const sent = {
      model: "svc-fast",
      messages: [
        {
          role: "user",
          content: [
            { type: "text", text: "look", prompt_cache_breakpoint: { mode: "explicit", ttl: "30m" } },
            { type: "image_url", image_url: { url: "data:image/png;base64,AA==", detail: "original" }, prompt_cache_breakpoint: { mode: "explicit" } },
          ],
        },
        {
          role: "assistant",
          content: "earlier",
          refusal: null,
          audio: { id: "aud_1" },
          function_call: { name: "f", arguments: "{}" },
          annotations: [{ type: "url_citation", url_citation: { start_index: 0, end_index: 3, title: "t", url: "https://example.com" } }],
        },
        { role: "user", content: "go on" },
      ],
      prediction: { type: "content", content: [{ type: "text", text: "x" }] },
      audio: { format: "wav", voice: { id: "voice_1" } },
      web_search_options: { search_context_size: "low", user_location: { type: "approximate", approximate: { city: "Paris", country: "FR", region: "IDF", timezone: "Europe/Paris" } } },
      moderation: { model: "omni-moderation-latest", policy: { input: { mode: "score" }, output: { mode: "block" } } },
      prompt_cache_options: { mode: "explicit", ttl: "30m" },
      functions: [{ name: "f", description: "d", parameters: { type: "object" } }],
      function_call: { name: "f" },
    };
    const res = await chat(sent);
    expect(res.status).toBe(200);
    expect(sim.stats.lastBody).toEqual({ ...sent, model: CHAT_MODEL });
    for (const fc of ["auto", "none"]) expect((await chat({ model: "svc-fast", messages: userMessages(), function_call: fc })).status).toBe(200);
  });

  test("images to an alias without the images capability, tools to one without tools", async () => {
    const image = [{ type: "image_url", image_url: { url: "https://example.com/a.png" } }];
    const imgRes = await chat({ model: "svc-text", messages: [{ role: "user", content: image }] });
    await expectInvalid(imgRes, "messages[0].content[0]", "image");
    const tools = [{ type: "function", function: { name: "f" } }];
    await expectInvalid(await chat({ model: "svc-text", messages: userMessages(), tools }), "tools", "tools");
    expect(sim.stats.requests).toBe(0);
  });

  test("body: invalid JSON, wrong content type, empty, not an object, over the limit", async () => {
    await expectInvalid(await chat("{nope"), null, "not valid JSON");
    await expectInvalid(await chat("[1,2]"), null, "JSON object");
    await expectInvalid(await chat(JSON.stringify({ model: "svc-fast", messages: userMessages() }), org.personalKey, { headers: { "content-type": "text/plain" } }), null, "Content-Type");
    await expectInvalid(await chat(""), null);
    const big = { model: "svc-fast", messages: userMessages("x".repeat(BODY_LIMIT)) };
    await expectInvalid(await chat(big), null, "too large");
    // Without Content-Length (chunked), the limit applies as the body streams in.
    const bytes = new TextEncoder().encode(JSON.stringify(big));
    const chunked = new ReadableStream<Uint8Array>({
      start(c) {
        for (let i = 0; i < bytes.length; i += 8192) c.enqueue(bytes.subarray(i, i + 8192));
        c.close();
      },
    });
    await expectInvalid(await chat(JSON.stringify(big), org.personalKey, { body: chunked }), null, "too large");
  });

  test("authentication precedes parsing: no key and a broken body get 401", async () => {
    const res = await fetch(`${gw.url}/v1/chat/completions`, { method: "POST", headers: { "content-type": "application/json" }, body: "{nope" });
    expect(res.status).toBe(401);
    expect((await errorOf(res)).code).toBe("unauthorized");
  });
});

describe("404 model_not_found", () => {
  test("unknown alias, an embedding alias on chat, a chat alias on embeddings", async () => {
    for (const res of [
      await chat({ model: "gpt-4o", messages: userMessages() }),
      await chat({ model: "svc-embed", messages: userMessages() }),
      await chat({ model: CHAT_MODEL, messages: userMessages() }),
      await embed({ model: "svc-fast", input: "x" }),
      await embed({ model: "nope", input: "x" }),
    ]) {
      expect(res.status).toBe(404);
      const err = await errorOf(res);
      expect(err.code).toBe("model_not_found");
      expect(err.param).toBe("model");
    }
    expect(sim.stats.requests).toBe(0);
  });

  test("a model name of 50,000 characters is not echoed back whole: the message shows its first 128", async () => {
    const name = `m${"x".repeat(50_000)}`;
    const err = await errorOf(await chat({ model: name, messages: userMessages() }));
    expect([err.code, err.message.slice(0, 200)]).toEqual(["model_not_found", expect.any(String)]);
    expect(err.message).toContain(`'${name.slice(0, 128)}…'`);
    expect(err.message.length).toBeLessThan(400);
  });

  test("an alias outside the key's model list", async () => {
    const limited = await seedTestOrg(gw.database, { models: ["svc-fast"] });
    expect((await chat({ model: "svc-fast", messages: userMessages() }, limited.personalKey)).status).toBe(200);
    const res = await chat({ model: "svc-smart", messages: userMessages() }, limited.personalKey);
    expect(res.status).toBe(404);
    expect((await errorOf(res)).code).toBe("model_not_found");
    const e = await embed({ model: "svc-embed", input: "x" }, limited.personalKey);
    expect(e.status).toBe(404);
  });
});

describe("GET /v1/models", () => {
  test("lists every alias for an unrestricted key, in the spec 2.2 shape", async () => {
    const res = await fetch(`${gw.url}/v1/models`, { headers: { authorization: `Bearer ${org.serviceKey}` } });
    expect(res.status).toBe(200);
    const body = rec(await res.json());
    expect(body.object).toBe("list");
    const data = arr(body.data).map(rec);
    expect(data.map((d) => d.id).sort()).toEqual(["svc-embed", "svc-fast", "svc-smart", "svc-text"]);
    for (const d of data) {
      expect(d.object).toBe("model");
      expect(d.owned_by).toBe("gateway");
    }
  });

  test("lists only the aliases a restricted key may call", async () => {
    const limited = await seedTestOrg(gw.database, { models: ["svc-fast", "svc-embed"] });
    const body = rec(await (await fetch(`${gw.url}/v1/models`, { headers: { authorization: `Bearer ${limited.personalKey}` } })).json());
    expect(arr(body.data).map((d) => rec(d).id)).toEqual(["svc-fast", "svc-embed"]);
  });

  test("401 without a key", async () => {
    const res = await fetch(`${gw.url}/v1/models`);
    expect(res.status).toBe(401);
    expect((await errorOf(res)).code).toBe("unauthorized");
  });
});

describe("POST /v1/embeddings", () => {
  test("a string input: spec 2.4 with 1024 floats and model = alias", async () => {
    const res = await embed({ model: "svc-embed", input: "hello", encoding_format: "float" });
    expect(res.status).toBe(200);
    const body = rec(await res.json());
    expect(Object.keys(body).sort()).toEqual(["data", "model", "object", "usage"]);
    expect(body.object).toBe("list");
    expect(body.model).toBe("svc-embed");
    const d = rec(arr(body.data)[0]);
    expect(d.object).toBe("embedding");
    expect(d.index).toBe(0);
    expect(arr(d.embedding).length).toBe(1024);
    expect(typeof arr(d.embedding)[0]).toBe("number");
    const usage = rec(body.usage);
    expect(Object.keys(usage).sort()).toEqual(["prompt_tokens", "total_tokens"]);
    expect(usage.total_tokens).toBe(usage.prompt_tokens);
    expect(rec(sim.stats.lastBody).model).toBe(EMBED_MODEL);
  });

  test("arrays of strings and token arrays, base64, dimensions and user pass through", async () => {
    const many = rec(await (await embed({ model: "svc-embed", input: ["a", "b", "c"] })).json());
    expect(arr(many.data).map((d) => rec(d).index)).toEqual([0, 1, 2]);
    const tokens = rec(await (await embed({ model: "svc-embed", input: [[1, 2, 3], [4]] })).json());
    expect(rec(tokens.usage).prompt_tokens).toBe(4);
    const b64 = rec(await (await embed({ model: "svc-embed", input: "a", encoding_format: "base64" })).json());
    const s = rec(arr(b64.data)[0]).embedding;
    expect(typeof s).toBe("string");
    expect(Buffer.from(String(s), "base64").length).toBe(1024 * 4);
    const small = rec(await (await embed({ model: "svc-embed", input: "a", dimensions: 256, user: "u1", encoding_format: "float" })).json());
    expect(arr(rec(arr(small.data)[0]).embedding).length).toBe(256);
    expect(rec(sim.stats.lastBody)).toEqual({ model: EMBED_MODEL, input: "a", dimensions: 256, user: "u1", encoding_format: "float" });
  });

  test("request rules", async () => {
    await expectInvalid(await embed({ model: "svc-embed" }), "input");
    await expectInvalid(await embed({ model: "svc-embed", input: 5 }), "input");
    await expectInvalid(await embed({ model: "svc-embed", input: [] }), "input");
    // Each wrong input says what is wrong with it, not only that the union did not match.
    await expectInvalid(await embed({ model: "svc-embed", input: [] }), "input", "empty");
    await expectInvalid(await embed({ model: "svc-embed", input: Array(2049).fill("a") }), "input", "at most 2048");
    await expectInvalid(await embed({ model: "svc-embed", input: Array(2049).fill([1]) }), "input", "at most 2048");
    await expectInvalid(await embed({ model: "svc-embed", input: [1, -2] }), "input[1]", "token ids");
    await expectInvalid(await embed({ model: "svc-embed", input: [1, 2.5] }), "input[1]", "token ids");
    await expectInvalid(await embed({ model: "svc-embed", input: [[1], [2, -1]] }), "input[1][1]", "token ids");
    await expectInvalid(await embed({ model: "svc-embed", input: [[1], []] }), "input[1]", "empty");
    await expectInvalid(await embed({ model: "svc-embed", input: ["a", 1] }), "input", "a list of strings");
    await expectInvalid(await embed({ model: "svc-embed", input: { text: "a" } }), "input", "a list of strings");
    await expectInvalid(await embed({ model: "svc-embed", input: "x", encoding_format: "int8" }), "encoding_format");
    await expectInvalid(await embed({ model: "svc-embed", input: "x", dimensions: 0 }), "dimensions");
    await expectInvalid(await embed({ model: "svc-embed", input: "x", dimensions: 2048 }), "dimensions", "1024");
    await expectInvalid(await embed({ model: "svc-embed", input: "x", foo: true }), "foo");
    await expectInvalid(await embed({ input: "x" }), "model");
    expect(sim.stats.requests).toBe(0);
  });
});

describe("upstream errors become our errors", () => {
  test("an upstream 400 is our 400 with the upstream's message, in both vLLM shapes", async () => {
    for (const errorFormat of ["legacy", "nested"] as const) {
      await fetch(`${sim.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify({ errorFormat }) });
      sim.setFault({ kind: "status", status: 400, message: "This model's maximum context length is 32768 tokens." });
      const res = await chat({ model: "svc-fast", messages: userMessages() });
      expect(res.status).toBe(400);
      const body = rec(await res.json());
      expect(Object.keys(body)).toEqual(["error"]);
      expect(rec(body.error)).toEqual({
        message: "This model's maximum context length is 32768 tokens.",
        type: "invalid_request_error",
        param: null,
        code: "invalid_request_error",
      });
      const e = await embed({ model: "svc-embed", input: "x" });
      expect(e.status).toBe(400);
      expect((await errorOf(e)).message).toContain("maximum context length");
    }
  });

  test("503 service_unavailable when every attempt fails", async () => {
    sim.setFault({ kind: "status", status: 503 });
    for (const res of [await chat({ model: "svc-fast", messages: userMessages() }), await embed({ model: "svc-embed", input: "x" })]) {
      expect(res.status).toBe(503);
      const err = await errorOf(res);
      expect(err.code).toBe("service_unavailable");
      expect(err.message).not.toContain("Simulated");
    }
  });

  test("429 rate_limit_error with retry-after when the upstream is overloaded everywhere", async () => {
    sim.setFault({ kind: "status", status: 429 });
    const res = await chat({ model: "svc-fast", messages: userMessages() });
    expect(res.status).toBe(429);
    expect(Number(res.headers.get("retry-after"))).toBeGreaterThanOrEqual(1);
    const err = await errorOf(res);
    expect(err.code).toBe("rate_limit_error");
    expect(err.message).not.toContain("budget_exceeded");
  });
});

describe("gateway limits on the inference endpoints", () => {
  test("429 rate_limit_error from the organisation's rate limit, with retry-after", async () => {
    const tiny = await seedTestOrg(gw.database, { plan: "Tiny" });
    expect((await chat({ model: "svc-fast", messages: userMessages() }, tiny.personalKey)).status).toBe(200);
    expect((await embed({ model: "svc-embed", input: "x" }, tiny.personalKey)).status).toBe(200);
    const res = await chat({ model: "svc-fast", messages: userMessages() }, tiny.personalKey);
    expect(res.status).toBe(429);
    expect(Number(res.headers.get("retry-after"))).toBeGreaterThan(0);
    expect((await errorOf(res)).code).toBe("rate_limit_error");
    expect((await fetch(`${gw.url}/v1/models`, { headers: { authorization: `Bearer ${tiny.personalKey}` } })).status).toBe(429);
  });

  test("429 budget_exceeded once the organisation's quota is spent", async () => {
    // Exactly one request's reservation: the prompt's bound 530 ("hi": 512 + 16 + 2 bytes) + max_tokens 5 (a request is admitted
    // only on its whole reservation); it is charged its count (8 + 5), and what remains (522) is less than any request's bound.
    const poor = await seedTestOrg(gw.database, { quotaTokens: 535, quotaWindow: "month" });
    expect((await chat({ model: "svc-fast", max_tokens: 5, messages: userMessages() }, poor.personalKey)).status).toBe(200);
    for (const res of [await chat({ model: "svc-fast", messages: userMessages() }, poor.personalKey), await embed({ model: "svc-embed", input: "x".repeat(600) }, poor.personalKey)]) {
      expect(res.status).toBe(429);
      const err = await errorOf(res);
      expect(err.code).toBe("budget_exceeded");
      expect(err.message).toContain("budget_exceeded");
    }
    expect(sim.stats.requests).toBe(1);
  });
});
