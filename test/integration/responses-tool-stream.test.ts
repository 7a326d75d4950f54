import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import OpenAI from "openai";
import type { Gateway } from "../../src/server.ts";
import { type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { TEST_PLANS, arr, chatAlias, post, rec, seedTestOrg, upstreamSettings } from "./inference-fixtures.ts";

setDefaultTimeout(30_000);

/**
 * Streamed Responses built from chat streams whose tool calls come in pieces
 * (a name split across chunks, calls interleaved by index, reasoning, calls
 * and text in one answer), read with the openai SDK's accumulation and raw:
 * every event, the final Response and the stored one agree on each call.
 * The upstream is a scripted chat server: the user's text picks the script.
 */

const CHUNK_HEAD = { id: "chatcmpl-s", object: "chat.completion.chunk", created: 1, model: "m" };
const chunk = (delta: Record<string, unknown>, finish: string | null = null) =>
  `data: ${JSON.stringify({ ...CHUNK_HEAD, choices: [{ index: 0, delta, logprobs: null, finish_reason: finish }] })}\n\n`;
const usage = (completion: number) =>
  `data: ${JSON.stringify({ ...CHUNK_HEAD, choices: [], usage: { prompt_tokens: 5, completion_tokens: completion, total_tokens: 5 + completion } })}\n\ndata: [DONE]\n\n`;

const SCRIPTS: Record<string, string[]> = {
  // The name in two pieces, the second with the arguments (as some OpenAI-compatible servers stream it).
  "split-name": [
    chunk({ role: "assistant", content: "" }),
    chunk({ tool_calls: [{ index: 0, id: "call_1", type: "function", function: { name: "fo" } }] }),
    chunk({ tool_calls: [{ index: 0, function: { name: "o", arguments: "{}" } }] }),
    chunk({}, "tool_calls"),
    usage(3),
  ],
  // The name in three pieces before any argument, then the arguments in two.
  "split-name-3": [
    chunk({ role: "assistant", content: "" }),
    chunk({ tool_calls: [{ index: 0, id: "call_1", type: "function", function: { name: "get_" } }] }),
    chunk({ tool_calls: [{ index: 0, function: { name: "wea" } }] }),
    chunk({ tool_calls: [{ index: 0, function: { name: "ther", arguments: "" } }] }),
    chunk({ tool_calls: [{ index: 0, function: { arguments: '{"city":' } }] }),
    chunk({ tool_calls: [{ index: 0, function: { arguments: '"Paris"}' } }] }),
    chunk({}, "tool_calls"),
    usage(9),
  ],
  // Two calls interleaved by index, the first's name in pieces and held while the second begins.
  parallel: [
    chunk({ role: "assistant", content: "" }),
    chunk({ tool_calls: [{ index: 0, id: "call_A", type: "function", function: { name: "get_" } }] }),
    chunk({ tool_calls: [{ index: 0, function: { name: "weather" } }] }),
    chunk({ tool_calls: [{ index: 1, id: "call_B", type: "function", function: { name: "get_time", arguments: '{"tz"' } }] }),
    chunk({ tool_calls: [{ index: 0, function: { arguments: '{"city":' } }] }),
    chunk({ tool_calls: [{ index: 1, function: { arguments: ':"UTC"}' } }, { index: 0, function: { arguments: '"Oslo"}' } }] }),
    chunk({}, "tool_calls"),
    usage(20),
  ],
  // A piece of the name after the arguments began.
  "late-name": [
    chunk({ role: "assistant", content: "" }),
    chunk({ tool_calls: [{ index: 0, id: "call_1", type: "function", function: { name: "fo", arguments: "{" } }] }),
    chunk({ tool_calls: [{ index: 0, function: { name: "o", arguments: "}" } }] }),
    chunk({}, "tool_calls"),
    usage(3),
  ],
  // Reasoning, text, and a call whose name came in two pieces, in one answer.
  mixed: [
    chunk({ role: "assistant", content: "" }),
    chunk({ reasoning_content: "The user wants " }),
    chunk({ reasoning_content: "the weather." }),
    chunk({ content: "Let me look " }),
    chunk({ content: "that up." }),
    chunk({ tool_calls: [{ index: 0, id: "call_1", type: "function", function: { name: "get_wea" } }] }),
    chunk({ tool_calls: [{ index: 0, function: { name: "ther" } }] }),
    chunk({ tool_calls: [{ index: 0, function: { arguments: '{"city":"Oslo"}' } }] }),
    chunk({}, "tool_calls"),
    usage(12),
  ],
  // The upstream stops between the name and the arguments.
  broken: [chunk({ role: "assistant", content: "" }), chunk({ tool_calls: [{ index: 0, id: "call_1", type: "function", function: { name: "foo" } }] })],
};

let upstream: ReturnType<typeof Bun.serve>;
let gw: Gateway;
let org: SeededOrg;
let client: OpenAI;

beforeAll(async () => {
  upstream = Bun.serve({
    port: 0,
    hostname: "127.0.0.1",
    async fetch(req) {
      const body = rec(await req.json());
      const last = rec(arr(body.messages).at(-1));
      if (last.content === "held") {
        // A call's name, then nothing until the gateway closes the call (its client left).
        const head = [chunk({ role: "assistant", content: "" }), chunk({ tool_calls: [{ index: 0, id: "call_1", type: "function", function: { name: "foo" } }] })].join("");
        return new Response(
          new ReadableStream({
            start(c) {
              c.enqueue(new TextEncoder().encode(head));
            },
          }),
          { headers: { "content-type": "text/event-stream" } },
        );
      }
      const script = SCRIPTS[String(last.content)] ?? SCRIPTS["split-name"] ?? [];
      return new Response(script.join(""), { headers: { "content-type": "text/event-stream" } });
    },
  });
  gw = await startTestGateway({
    aliases: { "svc-tools": chatAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }]) },
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 1 }),
    responses: { enabled: true },
  });
  org = await seedTestOrg(gw.database);
  client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: org.personalKey, maxRetries: 0 });
});
afterAll(async () => {
  await gw.stop();
  upstream.stop(true);
});

function events(text: string): Record<string, unknown>[] {
  return text
    .split("\n\n")
    .filter((e) => e.includes("data: "))
    .map((e) => rec(JSON.parse(e.split("\n").find((l) => l.startsWith("data: "))?.slice(6) ?? "null")));
}

/** The output as sent: the SDK's finalResponse() adds `parsed_arguments` to each call and `parsed` to each output_text (null when it parses nothing). */
function withoutParsed(output: unknown[]): unknown[] {
  return output.map((o) => {
    const { parsed_arguments: _, ...rest } = rec(o);
    if (Array.isArray(rest.content)) {
      rest.content = rest.content.map((p) => {
        const { parsed: _p, ...part } = rec(p);
        return part;
      });
    }
    return rest;
  });
}

const TOOLS = [{ type: "function" as const, name: "foo", parameters: { type: "object", properties: {} }, strict: false }];

describe("a function name streamed in pieces", () => {
  for (const [script, name, args] of [
    ["split-name", "foo", "{}"],
    ["split-name-3", "get_weather", '{"city":"Paris"}'],
  ] as const) {
    test(`${script}: the item's name is whole in every event, in the final Response and in the stored one`, async () => {
      const res = await post(gw, "/v1/responses", org.personalKey, { model: "svc-tools", stream: true, input: script, tools: TOOLS });
      expect(res.status).toBe(200);
      const all = events(await res.text());
      const added = all.filter((e) => e.type === "response.output_item.added").map((e) => rec(e.item));
      const done = all.filter((e) => e.type === "response.output_item.done").map((e) => rec(e.item));
      expect(done.map((i) => [i.type, i.name, i.arguments, i.call_id])).toEqual([["function_call", name, args, "call_1"]]);
      expect(added.map((i) => [i.type, i.name])).toEqual([["function_call", name]]);
      const argsDone = all.filter((e) => e.type === "response.function_call_arguments.done");
      expect(argsDone.map((e) => [e.name, e.arguments])).toEqual([[name, args]]);
      // The deltas add up to the arguments, each after the item was added.
      const addedAt = all.findIndex((e) => e.type === "response.output_item.added");
      const deltas = all.map((e, i) => [e, i] as const).filter(([e]) => e.type === "response.function_call_arguments.delta");
      expect(deltas.map(([e]) => e.delta).join("")).toBe(args);
      for (const [, i] of deltas) expect(i).toBeGreaterThan(addedAt);
      const completed = rec(all.find((e) => e.type === "response.completed")?.response);
      const item = rec(arr(completed.output)[0]);
      expect([item.name, item.arguments]).toEqual([name, args]);
      const stored = rec(await (await fetch(`${gw.url}/v1/responses/${String(completed.id)}`, { headers: { authorization: `Bearer ${org.personalKey}` } })).json());
      expect(stored).toEqual(completed);
    });
  }

  test("not streamed (the upstream answers the JSON request as a stream): the call's name whole", async () => {
    const r = await client.responses.create({ model: "svc-tools", input: "split-name-3", tools: TOOLS });
    const call = r.output.find((o) => o.type === "function_call");
    expect(call?.type === "function_call" ? [call.name, call.arguments] : []).toEqual(["get_weather", '{"city":"Paris"}']);
  });

  test("the openai SDK's responses.stream(): finalResponse() has the whole name, and equals responses.retrieve()", async () => {
    const stream = client.responses.stream({ model: "svc-tools", input: "split-name", tools: TOOLS });
    const names: string[] = [];
    stream.on("response.output_item.added", (e) => {
      if (e.item.type === "function_call") names.push(e.item.name);
    });
    const final = await stream.finalResponse();
    expect(names).toEqual(["foo"]);
    const call = final.output.find((o) => o.type === "function_call");
    expect(call?.type === "function_call" ? [call.name, call.arguments] : []).toEqual(["foo", "{}"]);
    const back = await client.responses.retrieve(final.id);
    expect(back.output as unknown[]).toEqual(withoutParsed(final.output));
  });

  test("two calls interleaved, the first's name in pieces: each added whole, in the order they began, and finalResponse() equals retrieve()", async () => {
    const res = await post(gw, "/v1/responses", org.personalKey, { model: "svc-tools", stream: true, input: "parallel", tools: TOOLS });
    const all = events(await res.text());
    const added = all.filter((e) => e.type === "response.output_item.added").map((e) => [e.output_index, rec(e.item).name, rec(e.item).call_id]);
    expect(added).toEqual([
      [0, "get_weather", "call_A"],
      [1, "get_time", "call_B"],
    ]);
    const deltas = all.filter((e) => e.type === "response.function_call_arguments.delta").map((e) => [e.output_index, e.delta]);
    expect(deltas).toEqual([
      [1, '{"tz"'],
      [0, '{"city":'],
      [1, ':"UTC"}'],
      [0, '"Oslo"}'],
    ]);
    const completed = rec(all.find((e) => e.type === "response.completed")?.response);
    expect(arr(completed.output).map((o) => [rec(o).name, rec(o).arguments])).toEqual([
      ["get_weather", '{"city":"Oslo"}'],
      ["get_time", '{"tz":"UTC"}'],
    ]);

    const final = await client.responses.stream({ model: "svc-tools", input: "parallel", tools: TOOLS }).finalResponse();
    expect(final.output.map((o) => (o.type === "function_call" ? [o.name, o.arguments] : [o.type]))).toEqual([
      ["get_weather", '{"city":"Oslo"}'],
      ["get_time", '{"tz":"UTC"}'],
    ]);
    expect((await client.responses.retrieve(final.id)).output as unknown[]).toEqual(withoutParsed(final.output));
  });

  test("a piece of the name after the arguments began: added has the name as it stood, the done events and the Response have it whole", async () => {
    const res = await post(gw, "/v1/responses", org.personalKey, { model: "svc-tools", stream: true, input: "late-name", tools: TOOLS });
    const all = events(await res.text());
    expect(all.filter((e) => e.type === "response.output_item.added").map((e) => rec(e.item).name)).toEqual(["fo"]);
    expect(all.filter((e) => e.type === "response.output_item.done").map((e) => [rec(e.item).name, rec(e.item).arguments])).toEqual([["foo", "{}"]]);
    expect(all.filter((e) => e.type === "response.function_call_arguments.done").map((e) => e.name)).toEqual(["foo"]);
    const completed = rec(all.find((e) => e.type === "response.completed")?.response);
    expect(arr(completed.output).map((o) => rec(o).name)).toEqual(["foo"]);
    const final = await client.responses.stream({ model: "svc-tools", input: "late-name", tools: TOOLS }).finalResponse();
    const call = final.output[0];
    expect(call?.type === "function_call" ? call.name : undefined).toBe("foo");
    expect((await client.responses.retrieve(final.id)).output as unknown[]).toEqual(withoutParsed(final.output));
  });

  test("reasoning, text and a call in one answer: the SDK's finalResponse() equals retrieve(), the call's name whole", async () => {
    const stream = client.responses.stream({ model: "svc-tools", input: "mixed", tools: TOOLS });
    const added: string[] = [];
    stream.on("response.output_item.added", (e) => added.push(e.item.type === "function_call" ? `function_call:${e.item.name}` : e.item.type));
    const final = await stream.finalResponse();
    expect(added).toEqual(["reasoning", "message", "function_call:get_weather"]);
    expect(final.output.map((o) => o.type)).toEqual(["reasoning", "message", "function_call"]);
    expect(final.output_text).toBe("Let me look that up.");
    const [rs, , call] = final.output;
    expect(rs?.type === "reasoning" ? rs.content?.[0]?.text : undefined).toBe("The user wants the weather.");
    expect(call?.type === "function_call" ? [call.name, call.arguments, call.call_id] : []).toEqual(["get_weather", '{"city":"Oslo"}', "call_1"]);
    expect(final.usage?.output_tokens).toBe(12);
    const back = await client.responses.retrieve(final.id);
    expect(back.output as unknown[]).toEqual(withoutParsed(final.output));
    expect(back.output_text).toBe(final.output_text);
    expect(back.usage).toEqual(final.usage);
  });

  test("the upstream stops between a call's name and its arguments: the failed Response still has the call, incomplete", async () => {
    const res = await post(gw, "/v1/responses", org.personalKey, { model: "svc-tools", stream: true, input: "broken", tools: TOOLS });
    const all = events(await res.text());
    expect(all.slice(-2).map((e) => e.type)).toEqual(["response.failed", "error"]);
    const failed = rec(all.at(-2)?.response);
    expect(arr(failed.output).map((o) => [rec(o).type, rec(o).name, rec(o).call_id, rec(o).status])).toEqual([["function_call", "foo", "call_1", "incomplete"]]);
    const stored = rec(await (await fetch(`${gw.url}/v1/responses/${String(failed.id)}`, { headers: { authorization: `Bearer ${org.personalKey}` } })).json());
    expect(stored).toEqual(failed);
  });

  test("the client leaves while a call's name has come and its arguments have not: the stored Response (cancelled) has the call, incomplete", async () => {
    const ac = new AbortController();
    const res = await post(gw, "/v1/responses", org.personalKey, { model: "svc-tools", stream: true, input: "held", tools: TOOLS }, { signal: ac.signal });
    const reader = (res.body as ReadableStream<Uint8Array>).getReader();
    let text = "";
    while (!text.includes("response.in_progress")) {
      const r = await reader.read();
      if (r.done) break;
      text += new TextDecoder().decode(r.value);
    }
    const id = String(rec(events(text).find((e) => e.type === "response.created")?.response).id);
    await Bun.sleep(100);
    ac.abort();
    let stored: Record<string, unknown> = {};
    for (let i = 0; i < 100; i++) {
      const got = await fetch(`${gw.url}/v1/responses/${id}`, { headers: { authorization: `Bearer ${org.personalKey}` } });
      if (got.status === 200) {
        stored = rec(await got.json());
        break;
      }
      await Bun.sleep(50);
    }
    expect(stored.status).toBe("cancelled");
    expect(arr(stored.output).map((o) => [rec(o).type, rec(o).name, rec(o).call_id, rec(o).arguments, rec(o).status])).toEqual([["function_call", "foo", "call_1", "", "incomplete"]]);
  });
});
