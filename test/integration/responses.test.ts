import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { createKey } from "../../src/admin/service.ts";
import type { Gateway } from "../../src/server.ts";
import type { Simulator } from "../../src/sim/index.ts";
import { errorOf, type SeededOrg, seedOrg, startTestGateway } from "../helpers/harness.ts";
import { SCHEMAS, componentValidator, expectSchema, validOpenApi } from "../helpers/openapi.ts";
import { until } from "../helpers/poll.ts";
import { CHAT_MODEL, type SimulatorPair, TEST_PLANS, arr, eventually, post, rec, seedTestOrg, startSimulatorPair, upstreamSettings } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * POST /v1/responses through real HTTP against the simulator (which speaks
 * chat completions only): what the upstream receives for a Responses request,
 * what the client gets back, every validation refusal with its Responses
 * `param`, and every error path of chat applying unchanged.
 */

let sims: SimulatorPair;
let sim: Simulator;
let slow: Simulator;
let gw: Gateway;
let off: Gateway;
/** Responses on with the default web search policy (refuse); `gw` ignores web search tools, as Codex needs. */
let strict: Gateway;
let org: SeededOrg;

beforeAll(async () => {
  // svc-slow's second token a minute after the first: a stream that stays open until the client leaves.
  sims = await startSimulatorPair({ ttftMs: 0, interTokenMs: 60_000, completionTokens: 2 });
  ({ sim, slow } = sims);
  const common = { aliases: sims.aliases, plans: TEST_PLANS, upstream: upstreamSettings({ attempts: 2 }, { idleMs: 120_000 }) };
  gw = await startTestGateway({ ...common, responses: { enabled: true, webSearch: "ignore" } });
  off = await startTestGateway(common);
  strict = await startTestGateway({ ...common, responses: { enabled: true } });
  org = await seedTestOrg(gw.database);
});
afterEach(() => sims.reset());
afterAll(async () => {
  await gw.stop();
  await off.stop();
  await strict.stop();
  await sims.stop();
});

const create = (body: unknown, key: string | undefined = org.personalKey, init?: RequestInit) => post(gw, "/v1/responses", key, body, init);
const upstreamBody = () => rec(sim.stats.lastBody);

async function expectError(res: Response, status: number, code: string, param: string | null = null): Promise<string> {
  const err = await errorOf(res);
  expect({ status: res.status, code: err.code, param: err.param }).toEqual({ status, code, param });
  return err.message;
}

describe("off by default", () => {
  test("/v1/responses answers 404 exactly like an unknown route, and /openapi.json does not list it", async () => {
    for (const [method, path] of [
      ["POST", "/v1/responses"],
      ["GET", "/v1/responses/resp_1"],
      ["DELETE", "/v1/responses/resp_1"],
      ["GET", "/v1/responses/resp_1/input_items"],
      ["POST", "/v1/responses/resp_1/cancel"],
      ["POST", "/v1/responses/input_tokens"],
      ["POST", "/v1/responses/compact"],
    ] as const) {
      const res = await fetch(`${off.url}${path}`, { method, headers: { authorization: `Bearer ${org.personalKey}` } });
      const unknown = await fetch(`${off.url}/v1/nope`, { method, headers: { authorization: `Bearer ${org.personalKey}` } });
      const [a, b] = [await errorOf(res), await errorOf(unknown)];
      expect({ status: res.status, code: a.code, type: a.type, param: a.param }).toEqual({ status: unknown.status, code: b.code, type: b.type, param: b.param });
      expect(res.status).toBe(404);
      expect(a.message).toBe(`No route for ${method} ${path}.`);
    }
    const doc = rec(await (await fetch(`${off.url}/openapi.json`)).json());
    expect(Object.keys(rec(doc.paths)).filter((p) => p.includes("responses"))).toEqual([]);
    const on = rec(await (await fetch(`${gw.url}/openapi.json`)).json());
    expect(Object.keys(rec(on.paths)).filter((p) => p.includes("responses"))).toEqual([
      "/v1/responses",
      "/v1/responses/{id}",
      "/v1/responses/input_tokens",
      "/v1/responses/compact",
      "/v1/responses/{id}/cancel",
      "/v1/responses/{id}/input_items",
    ]);
  });
});

describe("request translation (what the chat upstream receives)", () => {
  test("a string input: one user message, the alias swapped for the upstream model, the answer a Response", async () => {
    const res = await create({ model: "svc-fast", input: "Say hi", store: false });
    expect(res.status).toBe(200);
    const r = rec(await res.json());
    expect(r.object).toBe("response");
    expect(String(r.id)).toMatch(/^resp_/);
    expect(r.model).toBe("svc-fast");
    expect(r.status).toBe("completed");
    const message = rec(arr(r.output).find((o) => rec(o).type === "message"));
    expect(rec(arr(message.content)[0]).text).toBe("token0 token1 token2 token3 token4 ");
    expect(rec(r.usage).output_tokens).toBe(5);
    expect(upstreamBody()).toEqual({ model: CHAT_MODEL, messages: [{ role: "user", content: "Say hi" }] });
  });

  test("instructions, developer/system messages, parts, images, tool history and every forwarded parameter", async () => {
    const res = await create({
      model: "svc-fast",
      instructions: "Be brief.",
      input: [
        { role: "developer", content: "Answer in French." },
        { type: "message", role: "system", content: [{ type: "input_text", text: "No emojis." }] },
        {
          type: "message",
          role: "user",
          content: [
            { type: "input_text", text: "What is this?" },
            { type: "input_image", image_url: "data:image/png;base64,iVBORw0KGgo=", detail: "low" },
          ],
        },
        { type: "reasoning", id: "rs_1", summary: [] },
        { id: "msg_1", type: "message", role: "assistant", status: "completed", content: [{ type: "output_text", text: "Let me check.", annotations: [] }] },
        { id: "fc_1", type: "function_call", call_id: "call_1", name: "lookup", arguments: '{"q":"x"}', status: "completed" },
        { id: "fc_2", type: "function_call", call_id: "call_2", name: "lookup", arguments: '{"q":"y"}', status: "completed" },
        { type: "function_call_output", call_id: "call_1", output: "a cat", status: "completed" },
        { type: "function_call_output", call_id: "call_2", output: [{ type: "input_text", text: "a dog" }] },
      ],
      tools: [
        {
          type: "function",
          name: "lookup",
          description: "Look up",
          strict: true,
          parameters: { $schema: "http://json-schema.org/draft-07/schema#", type: "object", properties: { q: { type: "string" } }, required: ["q"], additionalProperties: false },
        },
      ],
      tool_choice: { type: "function", name: "lookup" },
      parallel_tool_calls: false,
      text: { format: { type: "json_schema", name: "answer", schema: { type: "object", properties: { a: { type: "string" } } }, strict: true }, verbosity: "low" },
      max_output_tokens: 50,
      temperature: 0.5,
      top_p: 0.9,
      reasoning: { effort: "whatever-the-upstream-takes", summary: "auto" },
      user: "u-1",
      metadata: { ticket: "42" },
      include: [],
      store: false,
      prompt_cache_key: "k",
      service_tier: "auto",
      truncation: "disabled",
    });
    expect(res.status).toBe(200);
    const r = rec(await res.json());
    expect(r.metadata).toEqual({ ticket: "42" });
    expect(r.instructions).toBe("Be brief.");
    expect(upstreamBody()).toEqual({
      model: CHAT_MODEL,
      messages: [
        { role: "system", content: "Be brief." },
        { role: "system", content: "Answer in French." },
        { role: "system", content: [{ type: "text", text: "No emojis." }] },
        {
          role: "user",
          content: [
            { type: "text", text: "What is this?" },
            { type: "image_url", image_url: { url: "data:image/png;base64,iVBORw0KGgo=", detail: "low" } },
          ],
        },
        {
          role: "assistant",
          content: "Let me check.",
          tool_calls: [
            { id: "call_1", type: "function", function: { name: "lookup", arguments: '{"q":"x"}' } },
            { id: "call_2", type: "function", function: { name: "lookup", arguments: '{"q":"y"}' } },
          ],
        },
        { role: "tool", tool_call_id: "call_1", content: "a cat" },
        { role: "tool", tool_call_id: "call_2", content: [{ type: "text", text: "a dog" }] },
      ],
      tools: [
        {
          type: "function",
          function: {
            name: "lookup",
            description: "Look up",
            parameters: { $schema: "http://json-schema.org/draft-07/schema#", type: "object", properties: { q: { type: "string" } }, required: ["q"], additionalProperties: false },
            strict: true,
          },
        },
      ],
      tool_choice: { type: "function", function: { name: "lookup" } },
      parallel_tool_calls: false,
      response_format: { type: "json_schema", json_schema: { name: "answer", schema: { type: "object", properties: { a: { type: "string" } } }, strict: true } },
      max_tokens: 50,
      temperature: 0.5,
      top_p: 0.9,
      reasoning_effort: "whatever-the-upstream-takes",
      user: "u-1",
    });
  });

  test("a stream forces include_usage upstream and answers Responses events ending in response.completed with usage", async () => {
    // stream_options is accepted with stream: true (include_obfuscation is ignored).
    const res = await create({ model: "svc-fast", input: "hi", stream: true, stream_options: { include_obfuscation: false }, store: false });
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toStartWith("text/event-stream");
    const text = await res.text();
    expect(rec(upstreamBody().stream_options)).toEqual({ include_usage: true });
    const events = text
      .split("\n\n")
      .filter((e) => e.trim() !== "")
      .map((e) => rec(JSON.parse(e.split("\n").find((l) => l.startsWith("data: "))?.slice(6) ?? "null")));
    expect(events[0]?.type).toBe("response.created");
    const last = events.at(-1);
    expect(last?.type).toBe("response.completed");
    expect(rec(rec(last?.response).usage).output_tokens).toBe(5);
    const seq = events.map((e) => Number(e.sequence_number));
    expect(seq).toEqual([...seq].sort((a, b) => a - b));
  });

  test("events arrive as the upstream generates them, and a client that leaves aborts the upstream call", async () => {
    const ac = new AbortController();
    const res = await create({ model: "svc-slow", input: "hi", stream: true }, org.personalKey, { signal: ac.signal });
    const reader = res.body?.getReader();
    if (!reader) throw new Error("no body");
    let text = "";
    while (!text.includes("response.output_text.delta")) {
      const { value, done } = await reader.read();
      if (done) throw new Error(`stream ended early: ${text}`);
      text += new TextDecoder().decode(value);
    }
    expect(text).toContain("token0");
    expect(text).not.toContain("response.completed");
    expect(slow.stats.inFlight).toBe(1);
    ac.abort();
    await eventually(() => slow.stats.aborts === 1, 10_000);
  });

  test("logprobs: asked with include, forwarded as chat logprobs, and translated into the output_text part", async () => {
    const res = await create({ model: "svc-fast", input: "hi", include: ["message.output_text.logprobs"], top_logprobs: 2, store: false });
    expect(res.status).toBe(200);
    const r = rec(await res.json());
    expect(upstreamBody().logprobs).toBe(true);
    expect(upstreamBody().top_logprobs).toBe(2);
    const part = rec(arr(rec(arr(r.output)[0]).content)[0]);
    const lps = arr(part.logprobs).map(rec);
    expect(lps).toHaveLength(5);
    // One entry per generated token: the tokens spell the text, each with its bytes and two alternatives.
    expect(lps.map((l) => l.token).join("")).toBe(String(part.text));
    for (const l of lps) {
      expect(l.bytes).toEqual(Array.from(new TextEncoder().encode(String(l.token))));
      expect(typeof l.logprob).toBe("number");
      expect(arr(l.top_logprobs).map((t) => Object.keys(rec(t)).sort())).toEqual([
        ["bytes", "logprob", "token"],
        ["bytes", "logprob", "token"],
      ]);
    }
    // Not asked: nothing forwarded, and the part's logprobs stay [].
    const plain = rec(await (await create({ model: "svc-fast", input: "hi", top_logprobs: 2, store: false })).json());
    expect(upstreamBody().logprobs).toBeUndefined();
    expect(rec(arr(rec(arr(plain.output)[0]).content)[0]).logprobs).toEqual([]);
  });

  test("logprobs in a stream: each text delta carries its tokens', the done event and the final response all of them", async () => {
    const res = await create({ model: "svc-fast", input: "hi", stream: true, include: ["message.output_text.logprobs"], top_logprobs: 1, store: false });
    const events = (await res.text())
      .split("\n\n")
      .filter((e) => e.trim() !== "")
      .map((e) => rec(JSON.parse(e.split("\n").find((l) => l.startsWith("data: "))?.slice(6) ?? "null")));
    const deltas = events.filter((e) => e.type === "response.output_text.delta");
    expect(deltas.length).toBeGreaterThan(0);
    const fromDeltas = deltas.flatMap((d) => arr(d.logprobs).map(rec));
    expect(fromDeltas.map((l) => l.token).join("")).toBe(deltas.map((d) => String(d.delta)).join(""));
    // The events' shape (the SDK's): token, logprob, top_logprobs of token and logprob; no bytes.
    expect(Object.keys(fromDeltas[0] ?? {}).sort()).toEqual(["logprob", "token", "top_logprobs"]);
    expect(arr(fromDeltas[0]?.top_logprobs).map((t) => Object.keys(rec(t)).sort())).toEqual([["logprob", "token"]]);
    const done = events.find((e) => e.type === "response.output_text.done");
    expect(arr(done?.logprobs)).toEqual(fromDeltas);
    const final = rec(events.at(-1)?.response);
    const part = rec(arr(rec(arr(final.output)[0]).content)[0]);
    expect(arr(part.logprobs).map((l) => rec(l).token)).toEqual(fromDeltas.map((l) => l.token));
    expect(rec(arr(part.logprobs)[0]).bytes).toBeDefined();
  });

  test("prompt_cache_breakpoint on input parts (the SDK's types declare it; the Agents SDK sends it) is accepted and not forwarded", async () => {
    const breakpoint = { mode: "explicit", ttl: "30m" };
    const res = await create({
      model: "svc-fast",
      store: false,
      input: [
        {
          role: "user",
          content: [
            { type: "input_text", text: "Look:", prompt_cache_breakpoint: breakpoint },
            { type: "input_image", image_url: "data:image/png;base64,iVBORw0KGgo=", detail: "auto", prompt_cache_breakpoint: { mode: "explicit" } },
          ],
        },
        { type: "function_call", call_id: "call_1", name: "lookup", arguments: "{}" },
        { type: "function_call_output", call_id: "call_1", output: [{ type: "input_text", text: "found", prompt_cache_breakpoint: null }] },
      ],
    });
    expect(res.status).toBe(200);
    await res.text();
    const messages = arr(upstreamBody().messages).map(rec);
    expect(messages[0]?.content).toEqual([
      { type: "text", text: "Look:" },
      { type: "image_url", image_url: { url: "data:image/png;base64,iVBORw0KGgo=", detail: "auto" } },
    ]);
    expect(messages[2]).toEqual({ role: "tool", tool_call_id: "call_1", content: [{ type: "text", text: "found" }] });
    // Still strict inside: an unknown field of the breakpoint is refused by name.
    const bad = await create({ model: "svc-fast", input: [{ role: "user", content: [{ type: "input_text", text: "x", prompt_cache_breakpoint: { mode: "explicit", evil: 1 } }] }] });
    await expectError(bad, 400, "invalid_request_error", "input[0].content[0].prompt_cache_breakpoint.evil");
  });

  test("safety_identifier is forwarded as chat's user when there is no user; a user sent with it wins (decisions: Forwarded)", async () => {
    expect((await create({ model: "svc-fast", input: "hi", store: false, safety_identifier: "sid-9" })).status).toBe(200);
    expect(upstreamBody().user).toBe("sid-9");
    expect((await create({ model: "svc-fast", input: "hi", store: false, safety_identifier: "sid-9", user: "u-1" })).status).toBe(200);
    expect(upstreamBody().user).toBe("u-1");
  });

  test("the Response echoes the request fields the SDK's Response type declares, as sent (JSON, response.created and the final event)", async () => {
    const sent = {
      model: "svc-fast",
      input: "hi",
      store: false,
      max_tool_calls: 3,
      top_logprobs: 2,
      safety_identifier: "sid-1",
      prompt_cache_key: "cache-k",
      prompt_cache_retention: "24h",
      service_tier: "flex",
      text: { verbosity: "low" },
      reasoning: { effort: "low", summary: "concise" },
    };
    const expected = {
      max_tool_calls: 3,
      top_logprobs: 2,
      safety_identifier: "sid-1",
      prompt_cache_key: "cache-k",
      prompt_cache_retention: "24h",
      // The tier that served it (OpenAI's meaning of the echoed field): the gateway has one.
      service_tier: "default",
      text: { format: { type: "text" }, verbosity: "low" },
      reasoning: { effort: "low", summary: "concise" },
    };
    const json = rec(await (await create(sent)).json());
    expect(json).toMatchObject(expected);
    const events = (await (await create({ ...sent, stream: true })).text())
      .split("\n\n")
      .filter((e) => e.trim() !== "")
      .map((e) => rec(JSON.parse(e.split("\n").find((l) => l.startsWith("data: "))?.slice(6) ?? "null")));
    for (const type of ["response.created", "response.in_progress", "response.completed"]) {
      expect(rec(events.find((e) => e.type === type)?.response)).toMatchObject(expected);
    }
    // Not sent: null (the SDK declares them nullable), except the tier, which is the one that served it.
    const plain = rec(await (await create({ model: "svc-fast", input: "hi", store: false })).json());
    expect(plain).toMatchObject({
      max_tool_calls: null,
      top_logprobs: null,
      safety_identifier: null,
      prompt_cache_key: null,
      prompt_cache_retention: null,
      service_tier: "default",
      text: { format: { type: "text" }, verbosity: null },
      reasoning: { effort: null, summary: null },
    });
  });

  test("reasoning.context and reasoning.mode (the SDK's Reasoning type; the Vercel AI SDK sends them) are accepted, echoed and not forwarded", async () => {
    const reasoning = { effort: "low", context: "current_turn", mode: "standard" };
    const json = rec(await (await create({ model: "svc-fast", input: "hi", store: false, reasoning })).json());
    expect(json.status).toBe("completed");
    expect(json.reasoning).toEqual({ effort: "low", summary: null, context: "current_turn", mode: "standard" });
    expect(upstreamBody().reasoning_effort).toBe("low");
    expect(Object.keys(upstreamBody()).filter((k) => k.includes("context") || k.includes("mode"))).toEqual(["model"]);
    // Not sent: left out (mode is not nullable in the SDK's type), as before.
    const plain = rec(await (await create({ model: "svc-fast", input: "hi", store: false, reasoning: { effort: "low" } })).json());
    expect(plain.reasoning).toEqual({ effort: "low", summary: null });
    await expectError(await create({ model: "svc-fast", input: "hi", reasoning: { context: 1 } }), 400, "invalid_request_error", "reasoning.context");
  });

  test("prompt_cache_options and context_management in the SDK's shapes (what the Agents SDK and the Vercel AI SDK send) are accepted and not forwarded", async () => {
    const prompt_cache_options = { mode: "explicit", ttl: "30m", prewarm: false, comparison_response_id: null };
    const context_management = [{ type: "compaction", compact_threshold: 20_000 }, { type: "compaction" }];
    const res = await create({ model: "svc-fast", input: "hi", store: false, prompt_cache_options, context_management });
    expect(res.status).toBe(200);
    await res.text();
    expect(Object.keys(upstreamBody()).filter((k) => k.startsWith("prompt_cache") || k.startsWith("context"))).toEqual([]);
  });

  test("the SDK's moderation, image and access_programs (were 'unknown parameter'): moderation forwarded as chat's, image ignored, access programs other than standard refused by name", async () => {
    // moderation has chat's shape (the SDK's ChatCompletionCreateParams declares it too): forwarded, the upstream judges it as on chat.
    const moderation = { model: "omni-moderation-latest", policy: { input: { mode: "block" }, output: null } };
    const res = await create({ model: "svc-fast", input: "hi", store: false, moderation, image: { context_compression: "auto" }, access_programs: { cyber: "standard" } });
    expect(res.status).toBe(200);
    await res.text();
    const sent = upstreamBody();
    expect(sent.moderation).toEqual(moderation);
    expect({ image: sent.image, access_programs: sent.access_programs }).toEqual({ image: undefined, access_programs: undefined });
    // prompt and conversation when null (what a client that copies the SDK's Response fields sends) are accepted too.
    for (const empty of [{ access_programs: {}, image: {}, moderation: null }, { access_programs: null, image: null, prompt: null, conversation: null }]) {
      const ok = await create({ model: "svc-fast", input: "hi", store: false, ...empty });
      expect(ok.status).toBe(200);
      await ok.text();
    }
    // Closed inside, as every nested object.
    await expectError(await create({ model: "svc-fast", input: "hi", moderation: { model: "m", evil: 1 } }), 400, "invalid_request_error", "moderation.evil");
    await expectError(await create({ model: "svc-fast", input: "hi", image: { context_compression: "auto", evil: 1 } }), 400, "invalid_request_error", "image.evil");
    await expectError(await create({ model: "svc-fast", input: "hi", access_programs: { evil: 1 } }), 400, "invalid_request_error", "access_programs.evil");
    // A Daybreak program is an authorisation the gateway cannot grant: refused by name, not ignored.
    const daybreak = await create({ model: "svc-fast", input: "hi", access_programs: { cyber: "daybreak_red" } });
    expect(await expectError(daybreak, 400, "invalid_request_error", "access_programs.cyber")).toContain("daybreak_red");
    expect(sim.stats.requests).toBe(1 + 2);
  });

  test("the SDK's other function-tool, tool-call and tool-output fields are accepted and not forwarded; an image in a tool's output is refused with why", async () => {
    const tool = {
      type: "function",
      name: "lookup",
      parameters: { type: "object", properties: {} },
      strict: true,
      defer_loading: false,
      allowed_callers: ["direct"],
      async: false,
      output_schema: { type: "object" },
    };
    const input = [
      { role: "user", content: "look it up" },
      // `async` is the SDK's ResponseFunctionToolCall field (an asynchronous tool's call, echoed back): was 400 "input[1].async".
      { type: "function_call", call_id: "call_1", name: "lookup", arguments: "{}", async: false },
      { type: "function_call_output", call_id: "call_1", output: "42", name: "lookup", namespace: null },
    ];
    const res = await create({ model: "svc-fast", input, tools: [tool], store: false });
    expect(res.status).toBe(200);
    await res.text();
    const sent = upstreamBody();
    expect(sent.tools).toEqual([{ type: "function", function: { name: "lookup", parameters: { type: "object", properties: {} }, strict: true } }]);
    expect(arr(sent.messages).slice(1)).toEqual([
      { role: "assistant", content: null, tool_calls: [{ id: "call_1", type: "function", function: { name: "lookup", arguments: "{}" } }] },
      { role: "tool", tool_call_id: "call_1", content: "42" },
    ]);
    // Chat upstreams take text only in a tool result: the refusal says so and names the part.
    const image = [...input.slice(0, 2), { type: "function_call_output", call_id: "call_1", output: [{ type: "input_text", text: "see" }, { type: "input_image", image_url: "data:image/png;base64,AAAA" }] }];
    const refused = await create({ model: "svc-fast", input: image, tools: [tool], store: false });
    expect(await expectError(refused, 400, "invalid_request_error", "input[2].output[1].type")).toContain("only text");
  });

  test("an answer cut short by max_output_tokens after its reasoning: the reasoning item completed, the message incomplete, streamed or not", async () => {
    // 16 is the least max_output_tokens OpenAI (and the gateway) takes: the answer is made longer than that.
    // The reasoning's 4 tokens ("Let me think.") and 12 of the answer's 20: vLLM counts both within the bound.
    await fetch(`${sim.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify({ reasoning: "Let me think.", completionTokens: 20 }) });
    const body = { model: "svc-fast", input: "hi", max_output_tokens: 16, store: false };
    const json = rec(await (await create(body)).json());
    const events = (await (await create({ ...body, stream: true })).text())
      .split("\n\n")
      .filter((e) => e.trim() !== "")
      .map((e) => rec(JSON.parse(e.split("\n").find((l) => l.startsWith("data: "))?.slice(6) ?? "null")));
    const streamed = rec(events.at(-1)?.response);
    const statuses = (r: Record<string, unknown>) => arr(r.output).map((i) => [rec(i).type, rec(i).status]);
    // The reasoning ended when the text began: only the message was cut (as the stream's done events say).
    const expected = [
      ["reasoning", "completed"],
      ["message", "incomplete"],
    ];
    expect({ status: streamed.status, output: statuses(streamed) }).toEqual({ status: "incomplete", output: expected });
    expect({ status: json.status, output: statuses(json) }).toEqual({ status: "incomplete", output: expected });
  });

  test("tool_choice allowed_tools (the Vercel AI SDK's allowedTools): the upstream gets only the allowed function tools and the mode as tool_choice; the Response echoes it as sent", async () => {
    // Seen failing before: 400 "The tool_choice type 'allowed_tools' is not supported" (param tool_choice).
    const fn = (name: string) => ({ type: "function", name, parameters: { type: "object", properties: {} }, strict: false });
    const tools = [fn("get_weather"), fn("get_time"), fn("get_news")];
    for (const mode of ["auto", "required"] as const) {
      // A name that is not among the tools (the Vercel AI SDK sends such a one with a warning) allows nothing more.
      // A web search entry allows nothing (there is no search, as a web search tool is not offered).
      const tool_choice = {
        type: "allowed_tools",
        mode,
        tools: [{ type: "function", name: "get_news" }, { type: "function", name: "get_weather" }, { type: "function", name: "nope" }, { type: "web_search" }],
      };
      const res = await create({ model: "svc-fast", input: "hi", tools: [...tools, { type: "web_search" }], tool_choice, store: false });
      expect(res.status).toBe(200);
      const r = rec(await res.json());
      const sent = upstreamBody();
      // In the request's order; the others are not offered.
      expect(arr(sent.tools).map((t) => rec(rec(t).function).name)).toEqual(["get_weather", "get_news"]);
      expect(sent.tool_choice).toBe(mode);
      expect(r.tool_choice).toEqual(tool_choice);
      expect(arr(r.tools).map((t) => rec(t).name)).toEqual(["get_weather", "get_time", "get_news"]);
    }
  });

  test("json_object format and tool_choice strings pass; the gateway's max_tokens bound under a quota applies", async () => {
    const quoted = await seedTestOrg(gw.database, { quotaTokens: 1_000_000 });
    const res = await create({ model: "svc-fast", input: "hi", text: { format: { type: "json_object" } }, tool_choice: "none", store: false }, quoted.personalKey);
    expect(res.status).toBe(200);
    await res.text();
    const body = upstreamBody();
    expect(body.response_format).toEqual({ type: "json_object" });
    expect(body.tool_choice).toBe("none");
    expect(typeof body.max_tokens).toBe("number");
  });
});

describe("web search tools by default (responses.webSearch: refuse)", () => {
  test("are refused with 400 naming the tool, in every form; accepted where the operator set ignore (below)", async () => {
    for (const search of [{ type: "web_search", external_web_access: false }, { type: "web_search_preview" }, { type: "web_search_2025_08_26" }]) {
      const res = await post(strict, "/v1/responses", org.personalKey, { model: "svc-fast", input: "hi", tools: [{ type: "function", name: "f" }, search] });
      const message = await expectError(res, 400, "invalid_request_error", "tools[1].type");
      expect(message).toContain("runs no web search");
      expect(message).toContain('web_search = "disabled"');
    }
  });
});

describe("Codex CLI's request (codex-rs: ResponsesApiRequest and ResponseItem as serde writes them), web search ignored (responses.webSearch: ignore)", () => {
  // Codex is not installed here: these are the bodies its Rust structs serialize to (codex-rs/codex-api
  // common.rs, codex-rs/protocol models.rs) and the fields its SSE reader (sse/responses.rs) parses.
  const SHELL = {
    type: "function",
    name: "shell",
    description: "Runs a shell command and returns its output.",
    strict: false,
    parameters: { type: "object", properties: { command: { type: "array", items: { type: "string" } }, workdir: { type: "string" } }, required: ["command"], additionalProperties: false },
  };
  const body = (tools: unknown[]) => ({
    model: "svc-fast",
    instructions: "You are Codex, a coding agent.",
    input: [
      { type: "message", role: "developer", content: [{ type: "input_text", text: "<permissions instructions>" }] },
      { type: "message", role: "user", content: [{ type: "input_text", text: "List the files." }] },
      // Ids are skip_serializing; a reasoning item's encrypted_content is null when absent.
      { type: "reasoning", summary: [{ type: "summary_text", text: "Run ls." }], encrypted_content: null },
      { type: "function_call", name: "shell", arguments: '{"command":["ls"]}', call_id: "call_1" },
      { type: "function_call_output", call_id: "call_1", output: "a.txt" },
      { type: "message", role: "assistant", content: [{ type: "output_text", text: "One file." }] },
      { type: "message", role: "user", content: [{ type: "input_text", text: "Say hi" }] },
    ],
    tools,
    tool_choice: "auto",
    parallel_tool_calls: false,
    reasoning: null,
    store: false,
    stream: true,
    include: [],
    prompt_cache_key: "0199a2b3-1c2d-7e8f-9a0b-1c2d3e4f5a6b",
  });

  test("the default tools (function tools and web search in its cached mode): a stream Codex reads to response.completed; web search is not offered upstream", async () => {
    // Seen failing before: 400 "The tool type 'web_search' is not supported" (param tools[1].type). Codex adds
    // {"type": "web_search", "external_web_access": false} by default for every provider but Azure (its web
    // search mode "cached"), so every request of an unchanged Codex was refused.
    const res = await create(body([SHELL, { type: "web_search", external_web_access: false }]));
    expect(res.status).toBe(200);
    const events = (await res.text())
      .split("\n\n")
      .filter((e) => e.trim() !== "")
      .map((e) => rec(JSON.parse(e.split("\n").find((l) => l.startsWith("data: "))?.slice(6) ?? "null")));
    // What Codex's reader needs: response.created, output_text deltas, each output_item.done a ResponseItem it
    // parses (a message of output_text parts), and response.completed with an id and usage (all five counts).
    expect(events[0]?.type).toBe("response.created");
    const text = events.filter((e) => e.type === "response.output_text.delta").map((e) => e.delta);
    expect(text.join("")).toBe("token0 token1 token2 token3 token4 ");
    const done = events.filter((e) => e.type === "response.output_item.done").map((e) => rec(e.item));
    expect(done.map((i) => [i.type, i.role, arr(i.content).map((c) => rec(c).type)])).toEqual([["message", "assistant", ["output_text"]]]);
    const completed = events.at(-1);
    expect(completed?.type).toBe("response.completed");
    const r = rec(completed?.response);
    expect(String(r.id)).toMatch(/^resp_/);
    const usage = rec(r.usage);
    for (const n of [usage.input_tokens, usage.output_tokens, usage.total_tokens, rec(usage.input_tokens_details).cached_tokens, rec(usage.output_tokens_details).reasoning_tokens]) {
      expect(Number.isInteger(n)).toBe(true);
    }
    // Upstream: the function tool only; the conversation as chat messages (the reasoning item dropped).
    const sent = upstreamBody();
    expect(arr(sent.tools).map((t) => rec(rec(t).function).name)).toEqual(["shell"]);
    expect(sent.tool_choice).toBe("auto");
    expect(sent.parallel_tool_calls).toBe(false);
    expect(arr(sent.messages).map((m) => rec(m).role)).toEqual(["system", "system", "user", "assistant", "tool", "assistant", "user"]);
    // The Response lists the tools the model had.
    expect(arr(r.tools).map((t) => rec(t).name)).toEqual(["shell"]);
  });

  test("web search in every form the SDKs send (live, the preview tool, dated names, their settings) is accepted and not offered; other hosted tools are still refused", async () => {
    const searches = [
      { type: "web_search" },
      { type: "web_search", external_web_access: true, search_content_types: ["text", "image"] },
      { type: "web_search_2025_08_26", filters: { allowed_domains: ["example.com"], blocked_domains: ["bad.example"] }, search_context_size: "low" },
      { type: "web_search_preview", user_location: { type: "approximate", city: "Oslo", country: "NO", region: null, timezone: "Europe/Oslo" } },
      { type: "web_search_preview_2025_03_11", search_context_size: "high" },
    ];
    for (const search of searches) {
      const res = await create({ model: "svc-fast", input: "hi", tools: [search], store: false, include: ["web_search_call.action.sources"] });
      expect(res.status).toBe(200);
      const r = rec(await res.json());
      expect(r.tools).toEqual([]);
      expect(upstreamBody().tools).toBeUndefined();
    }
    await expectError(await create({ model: "svc-fast", input: "hi", tools: [SHELL, { type: "file_search", vector_store_ids: ["vs_1"] }] }), 400, "invalid_request_error", "tools[1].type");
    // A search the model must make cannot be made.
    await expectError(await create({ model: "svc-fast", input: "hi", tools: [{ type: "web_search" }], tool_choice: { type: "web_search" } }), 400, "invalid_request_error", "tool_choice");
    // Its settings are bounded JSON like every free-form field.
    const deep = JSON.parse(`${"[".repeat(200)}${"]".repeat(200)}`);
    await expectError(await create({ model: "svc-fast", input: "hi", tools: [{ type: "web_search", filters: deep }] }), 400, "invalid_request_error", "tools[0].filters");
  });
});

describe("validation: 400 with the Responses param", () => {
  const base = { model: "svc-fast", input: "hi" };
  const cases: [name: string, body: Record<string, unknown>, param: string, messageHas?: string][] = [
    ["unknown top-level parameter", { ...base, evil_param: 1 }, "evil_param", "Unrecognized request argument"],
    ["unknown nested parameter", { ...base, reasoning: { effort: "low", evil: 1 } }, "reasoning.evil"],
    ["background", { ...base, background: true }, "background", "Background"],
    ["a hosted tool", { ...base, tools: [{ type: "file_search", vector_store_ids: ["vs_1"] }] }, "tools[0].type", "file_search"],
    ["a hosted tool after a function", { ...base, tools: [{ type: "function", name: "f" }, { type: "code_interpreter", container: { type: "auto" } }] }, "tools[1].type", "code_interpreter"],
    ["a hosted tool_choice", { ...base, tool_choice: { type: "file_search" } }, "tool_choice", "file_search"],
    ["a function name with a space", { ...base, tools: [{ type: "function", name: "get weather" }] }, "tools[0].name", "letters, digits"],
    ["tool_choice required without tools", { ...base, tool_choice: "required" }, "tool_choice", "only allowed when 'tools'"],
    // Web search tools are accepted and not offered (responses.webSearch: ignore): the request had tools, the model none.
    // Was chat's "'tool_choice' is only allowed when 'tools' are specified", untrue of a request that specified them.
    ["tool_choice required with only web search tools", { ...base, tools: [{ type: "web_search" }], tool_choice: "required" }, "tool_choice", "web search tools only"],
    ["tool_choice naming a function not in tools", { ...base, tools: [{ type: "function", name: "f" }], tool_choice: { type: "function", name: "g" } }, "tool_choice.name", "'g'"],
    // allowed_tools: function tools only, in the SDK's shape, and at least one of them among the request's tools.
    [
      "allowed_tools naming a hosted tool",
      { ...base, tools: [{ type: "function", name: "f" }], tool_choice: { type: "allowed_tools", mode: "auto", tools: [{ type: "function", name: "f" }, { type: "code_interpreter" }] } },
      "tool_choice.tools[1].type",
      "code_interpreter",
    ],
    ["allowed_tools with an unknown field", { ...base, tools: [{ type: "function", name: "f" }], tool_choice: { type: "allowed_tools", mode: "auto", tools: [{ type: "function", name: "f" }], evil: 1 } }, "tool_choice.evil"],
    ["allowed_tools with another mode", { ...base, tools: [{ type: "function", name: "f" }], tool_choice: { type: "allowed_tools", mode: "none", tools: [{ type: "function", name: "f" }] } }, "tool_choice.mode"],
    ["allowed_tools with no tools", { ...base, tools: [{ type: "function", name: "f" }], tool_choice: { type: "allowed_tools", mode: "auto", tools: [] } }, "tool_choice.tools"],
    ["allowed_tools naming none of the request's tools", { ...base, tools: [{ type: "function", name: "f" }], tool_choice: { type: "allowed_tools", mode: "required", tools: [{ type: "function", name: "g" }] } }, "tool_choice.tools", "'g'"],
    [
      "allowed_tools naming web search only",
      { ...base, tools: [{ type: "function", name: "f" }, { type: "web_search" }], tool_choice: { type: "allowed_tools", mode: "auto", tools: [{ type: "web_search" }] } },
      "tool_choice.tools",
      "web search is not offered",
    ],
    ["an allowed web search entry with a field", { ...base, tools: [{ type: "function", name: "f" }], tool_choice: { type: "allowed_tools", mode: "auto", tools: [{ type: "function", name: "f" }, { type: "web_search", evil: 1 }] } }, "tool_choice.tools[1].evil"],
    ["allowed_tools without tools", { ...base, tool_choice: { type: "allowed_tools", mode: "auto", tools: [{ type: "function", name: "g" }] } }, "tool_choice.tools"],
    // A chat rule on an allowed tool names its place in the request's tools, not in the ones sent upstream.
    [
      "a chat rule on an allowed tool",
      { ...base, tools: [{ type: "function", name: "f" }, { type: "function", name: "get weather" }], tool_choice: { type: "allowed_tools", mode: "auto", tools: [{ type: "function", name: "get weather" }] } },
      "tools[1].name",
      "letters, digits",
    ],
    ["input_file", { ...base, input: [{ role: "user", content: [{ type: "input_file", file_id: "file-1" }] }] }, "input[0].content[0]", "files API"],
    ["an image by file_id", { ...base, input: [{ role: "user", content: [{ type: "input_image", file_id: "file-1" }] }] }, "input[0].content[0].file_id", "files API"],
    ["an image in a system message", { ...base, input: [{ role: "system", content: [{ type: "input_image", image_url: "https://x.example/a.png" }] }] }, "input[0].content[0].type"],
    ["an unsupported item type", { ...base, input: [{ type: "web_search_call", id: "ws_1" }] }, "input[0].type"],
    ["a function_call without call_id", { ...base, input: [{ type: "function_call", name: "f", arguments: "{}" }] }, "input[0].call_id", "Missing required parameter"],
    ["an unknown field in an item", { ...base, input: [{ role: "user", content: "x", evil: 1 }] }, "input[0].evil"],
    ["an unknown role", { ...base, input: [{ role: "wizard", content: "x" }] }, "input[0].role"],
    ["temperature out of range", { ...base, temperature: 3 }, "temperature"],
    // The SDK's shapes, closed as every nested object: were free-form JSON, accepted whatever they held.
    ["context_management not an array", { ...base, context_management: "compact" }, "context_management"],
    ["an unknown field in context_management", { ...base, context_management: [{ type: "compaction", evil: 1 }] }, "context_management[0].evil"],
    ["an unknown field in prompt_cache_options", { ...base, prompt_cache_options: { mode: "explicit", evil: 1 } }, "prompt_cache_options.evil"],
    ["prompt_cache_options not an object", { ...base, prompt_cache_options: [1] }, "prompt_cache_options"],
    // A prewarm generates nothing on OpenAI: ignored, it became a whole answer, generated and counted.
    ["prompt_cache_options.prewarm true", { ...base, prompt_cache_options: { prewarm: true } }, "prompt_cache_options.prewarm", "without generating"],
    // OpenAI's bounds (0 to 1; at most 128 characters): were accepted, top_p forwarded for the upstream to refuse in its own words.
    ["top_p over 1", { ...base, top_p: 1.5 }, "top_p"],
    ["top_p below 0", { ...base, top_p: -0.1 }, "top_p"],
    ["a safety_identifier over 128 characters", { ...base, safety_identifier: "s".repeat(129) }, "safety_identifier", "128"],
    ["a metadata value over 512 characters", { ...base, metadata: { k: "v".repeat(513) } }, "metadata.k", "512"],
    ["max_output_tokens 0", { ...base, max_output_tokens: 0 }, "max_output_tokens"],
    // OpenAI's least value and wording: 1 to 15 were forwarded as max_tokens.
    ["max_output_tokens 1", { ...base, max_output_tokens: 1 }, "max_output_tokens", "Expected a value >= 16, but got 1 instead."],
    ["max_output_tokens 15", { ...base, max_output_tokens: 15 }, "max_output_tokens", "Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 16, but got 15 instead."],
    // OpenAI's rule, as chat's: was accepted and ignored.
    ["stream_options without stream", { ...base, stream_options: { include_obfuscation: false } }, "stream_options", "only allowed when 'stream' is enabled"],
    ["stream_options with stream: false", { ...base, stream: false, stream_options: {} }, "stream_options", "only allowed when 'stream' is enabled"],
    // OpenAI's bound (and chat's here): was accepted, echoed as sent and silently cut to 20 upstream.
    ["top_logprobs over 20", { ...base, include: ["message.output_text.logprobs"], top_logprobs: 21 }, "top_logprobs"],
    // Said to be unsupported (they were "expected null").
    ["a non-empty prompt", { ...base, prompt: { id: "pmpt_1" } }, "prompt", "Reusable prompts are not supported by this gateway"],
    ["a conversation", { ...base, conversation: "conv_1" }, "conversation", "Conversations are not supported by this gateway"],
    ["a conversation object", { ...base, conversation: { id: "conv_1" } }, "conversation", "previous_response_id"],
    ["no input", { model: "svc-fast" }, "input", "Missing required parameter"],
    ["no model", { input: "hi" }, "model"],
    ["json_schema without a name", { ...base, text: { format: { type: "json_schema", schema: {} } } }, "text.format.name"],
    // OpenAI's rule for the name (chat's response_format.json_schema.name): was forwarded.
    ["a json_schema name with a space", { ...base, text: { format: { type: "json_schema", name: "my answer", schema: {} } } }, "text.format.name", "letters, digits, underscores or dashes"],
    // The key's maxLength in the schema is not checked by TypeBox's Record: seen accepted (200) before the explicit check.
    ["a metadata key over 64 characters", { ...base, metadata: { ["k".repeat(65)]: "v" } }, "metadata", "64"],
    ["more than 16 metadata pairs", { ...base, metadata: Object.fromEntries(Array.from({ length: 17 }, (_, i) => [`k${i}`, "v"])) }, "metadata"],
  ];
  for (const [name, body, param, messageHas] of cases) {
    test(name, async () => {
      const message = await expectError(await create(body), 400, "invalid_request_error", param);
      if (messageHas) expect(message).toContain(messageHas);
      expect(sim.stats.requests).toBe(0);
    });
  }

  test("OpenAI's bounds themselves pass: top_p 0 and 1, a 128-character safety_identifier, 16 metadata pairs at their longest, max_output_tokens 16", async () => {
    const metadata = Object.fromEntries(Array.from({ length: 16 }, (_, i) => [`${i}`.padStart(64, "k"), "v".repeat(512)]));
    for (const top_p of [0, 1]) {
      const res = await create({ ...base, store: false, top_p, safety_identifier: "s".repeat(128), metadata, max_output_tokens: 16 });
      expect(res.status).toBe(200);
      await res.text();
      expect({ top_p: upstreamBody().top_p, max_tokens: upstreamBody().max_tokens }).toEqual({ top_p, max_tokens: 16 });
    }
  });

  test("not JSON, and not an object", async () => {
    await expectError(await create("{nope"), 400, "invalid_request_error");
    await expectError(await create("[1]"), 400, "invalid_request_error");
  });

  test("errors the chat rules raise name the Responses fields they came from", async () => {
    // svc-text: no images, no tools, a 4,096-token window.
    const image = await create({
      model: "svc-text",
      input: [
        { role: "user", content: "first" },
        { role: "user", content: [{ type: "input_text", text: "see" }, { type: "input_image", image_url: "https://img.example/a.png" }] },
      ],
    });
    const msg = await expectError(image, 400, "invalid_request_error", "input[1].content[1]");
    expect(msg).not.toContain("messages");
    await expectError(await create({ model: "svc-text", input: "hi", tools: [{ type: "function", name: "f" }] }), 400, "invalid_request_error", "tools");
    const long = await create({ model: "svc-text", input: "hi", max_output_tokens: 5_000 });
    expect(await expectError(long, 400, "invalid_request_error", "max_output_tokens")).toContain("'max_output_tokens' is 5000");
    const internal = await create({ model: "svc-fast", instructions: "x", input: [{ role: "user", content: [{ type: "input_image", image_url: "http://127.0.0.1/a.png" }] }] });
    expect((await errorOf(internal)).param).toStartWith("input[0].content[0]");
    expect(sim.stats.requests).toBe(0);
  });

  test("a function_call_output must answer a function_call just before it (other calls and outputs between): 400 on the output's input item, in the Responses API's words", async () => {
    const user = { role: "user", content: "look it up" };
    const fc = (id: string) => ({ type: "function_call", call_id: id, name: "lookup", arguments: "{}" });
    const out = (id: string) => ({ type: "function_call_output", call_id: id, output: "42" });
    const tools = [{ type: "function", name: "lookup", parameters: { type: "object", properties: {} } }];
    const cases: [unknown[], string, string][] = [
      [[user, out("call_x")], "input[1]", "No tool call found for function call output with call_id call_x."],
      [[user, fc("call_1"), out("call_2")], "input[2]", "No tool call found for function call output with call_id call_2."],
      [[user, fc("call_1"), { role: "user", content: "wait" }, out("call_1")], "input[3]", "must follow its function_call"],
      // An output answering the calls of an earlier turn.
      [[user, fc("call_1"), out("call_1"), { role: "assistant", content: "ok" }, fc("call_2"), out("call_1")], "input[5]", "must follow its function_call"],
    ];
    for (const [input, param, message] of cases) {
      const msg = await expectError(await create({ model: "svc-fast", input, tools, store: false }), 400, "invalid_request_error", param);
      expect(msg).toContain(message);
      expect(msg).not.toContain("messages");
    }
    expect(sim.stats.requests).toBe(0);
    // What the Agents SDK sends: its previous output echoed (text, reasoning, parallel calls), then the outputs in any order.
    const agents = [
      user,
      { type: "reasoning", id: "rs_1", summary: [] },
      { id: "msg_1", type: "message", role: "assistant", status: "completed", content: [{ type: "output_text", text: "Checking.", annotations: [] }] },
      { id: "fc_1", ...fc("call_1"), status: "completed" },
      { id: "fc_2", ...fc("call_2"), status: "completed" },
      out("call_2"),
      out("call_1"),
    ];
    const res = await create({ model: "svc-fast", input: agents, tools, store: false });
    expect(res.status).toBe(200);
    await res.text();
    expect(arr(upstreamBody().messages).map((m) => rec(m).role)).toEqual(["user", "assistant", "tool", "tool"]);
  });
});

describe("every error path of chat applies", () => {
  const body = { model: "svc-fast", input: "hi", store: false };

  test("401 without a key or with a bad one, before the body is read", async () => {
    await expectError(await post(gw, "/v1/responses", undefined, body), 401, "unauthorized");
    await expectError(await create("{not json", `sk-gw-${"x".repeat(43)}`), 401, "unauthorized");
  });

  test("403 browser, scope and academy", async () => {
    await expectError(await create(body, org.personalKey, { headers: { origin: "https://app.example" } }), 403, "browser_request_rejected");
    const auditOnly = await createKey(gw.database, { orgId: org.orgId, kind: "service", scopes: ["audit:read"], knownModels: [], tag: "gw" });
    await expectError(await create(body, auditOnly.key), 403, "scope_missing");
    for (const [method, path] of [
      ["GET", "/v1/responses/resp_1"],
      ["DELETE", "/v1/responses/resp_1"],
      ["GET", "/v1/responses/resp_1/input_items"],
    ] as const) {
      const res = await fetch(`${gw.url}${path}`, { method, headers: { authorization: `Bearer ${auditOnly.key}` } });
      await expectError(res, 403, "scope_missing");
    }
    const academy = await seedTestOrg(gw.database, { academyOnly: true });
    await expectError(await create(body, academy.personalKey), 403, "academy_only");
  });

  test("404 model_not_found for an unknown alias, an embedding alias and one outside the key's list", async () => {
    await expectError(await create({ ...body, model: "nope" }), 404, "model_not_found", "model");
    await expectError(await create({ ...body, model: "svc-embed" }), 404, "model_not_found", "model");
    const limited = await seedTestOrg(gw.database, { models: ["svc-smart"] });
    await expectError(await create(body, limited.personalKey), 404, "model_not_found", "model");
    expect(sim.stats.requests).toBe(0);
  });

  test("429 rate_limit_error with the same headers as chat", async () => {
    const tiny = await seedOrg(gw.database, { plan: "Tiny", plans: Object.keys(TEST_PLANS) });
    for (let i = 0; i < 2; i++) expect((await create(body, tiny.personalKey)).status).toBe(200);
    const res = await create(body, tiny.personalKey);
    await expectError(res, 429, "rate_limit_error");
    for (const h of ["retry-after", "retry-after-ms", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"]) {
      expect(res.headers.get(h)).not.toBeNull();
    }
    expect(res.headers.get("x-ratelimit-remaining-requests")).toBe("0");
  });

  test("429 budget_exceeded with x-should-retry: false", async () => {
    const broke = await seedTestOrg(gw.database, { quotaTokens: 1 });
    let seen: Response | undefined;
    for (let i = 0; i < 5 && !seen; i++) {
      const res = await create(body, broke.personalKey);
      if (res.status === 429) seen = res;
      else await res.text();
      await gw.quota.flush();
    }
    if (!seen) throw new Error("no budget_exceeded after 5 requests on a 1-token quota");
    await expectError(seen, 429, "budget_exceeded");
    expect(seen.headers.get("x-should-retry")).toBe("false");
  });

  test("an upstream failure is the chat service's 503, and usage is recorded like chat's", async () => {
    sim.setFault({ kind: "status", status: 500, count: 5 });
    await expectError(await create(body), 503, "service_unavailable");
  });
});

describe("the OpenAPI document", () => {
  test("describes the real answers: create, retrieve, input items, delete, and errors", async () => {
    const doc = await validOpenApi(gw.url);
    const ajv = componentValidator(doc);
    const conforms = (name: string, body: unknown) => expectSchema(ajv, name, body);
    const body = { model: "svc-fast", input: "hi" };
    conforms("ResponsesRequest", body);
    expect(ajv.getSchema(`${SCHEMAS}ResponsesRequest`)?.({ ...body, evil: 1 })).toBe(false);
    const r = rec(await (await create(body)).json());
    conforms("Response", r);
    conforms("Response", await (await fetch(`${gw.url}/v1/responses/${String(r.id)}`, { headers: { authorization: `Bearer ${org.personalKey}` } })).json());
    conforms("ResponseItemList", await (await fetch(`${gw.url}/v1/responses/${String(r.id)}/input_items`, { headers: { authorization: `Bearer ${org.personalKey}` } })).json());
    conforms("ResponseDeleted", await (await fetch(`${gw.url}/v1/responses/${String(r.id)}`, { method: "DELETE", headers: { authorization: `Bearer ${org.personalKey}` } })).json());
    conforms("Error", await (await create({ ...body, evil: 1 })).json());
    // A stream the client left is stored as cancelled (a status of OpenAI's Response type too) and reads back so.
    const ac = new AbortController();
    const left = await create({ model: "svc-slow", input: "hi", stream: true }, org.personalKey, { signal: ac.signal });
    const reader = left.body?.getReader();
    const first = reader ? new TextDecoder().decode((await reader.read()).value) : "";
    const leftId = /"id":"(resp_[A-Za-z0-9_-]+)"/.exec(first)?.[1];
    ac.abort();
    let stored: Response | undefined;
    await until(async () => {
      stored = await fetch(`${gw.url}/v1/responses/${String(leftId)}`, { headers: { authorization: `Bearer ${org.personalKey}` } });
      return stored.status === 200;
    }, "the cancelled response stored");
    const cancelled = await stored?.json();
    expect(rec(cancelled).status).toBe("cancelled");
    conforms("Response", cancelled);
    const ops = rec(doc.paths);
    for (const [path, method, status] of [
      ["/v1/responses", "post", "400"],
      ["/v1/responses", "post", "404"],
      ["/v1/responses/{id}", "get", "404"],
      ["/v1/responses/{id}", "delete", "200"],
      ["/v1/responses/{id}/input_items", "get", "400"],
    ] as const) {
      expect(rec(rec(rec(ops[path])[method]).responses)[status]).toBeDefined();
    }
  });
});
