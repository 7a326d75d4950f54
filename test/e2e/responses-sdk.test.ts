import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { copyFileSync } from "node:fs";
import { join } from "node:path";
import { Agent, run, setDefaultOpenAIClient, setTracingDisabled, tool } from "@openai/agents";
import OpenAI from "openai";
import { z } from "zod";
import { ensureBinary } from "../helpers/binary.ts";
import { type Proc, cleanEnv, exitWithin, listeningUrl, removeScratch, scratchDir, start } from "../helpers/process.ts";

// Building the binary, a cold PGlite start and an agent's several model turns on a busy 2-core machine.
setDefaultTimeout(60_000);

/**
 * The Responses API of the COMPILED binary (`serve --demo` turns it on),
 * driven by the unmodified official `openai` SDK (responses.create JSON and
 * stream, responses.stream().finalResponse(), retrieve, delete,
 * inputItems.list, inputTokens.count; cancel and compact refused) and by the
 * OpenAI Agents SDK running an agent with one function tool to a final
 * answer on its default transport (Responses). Only the base URL and the key
 * are set. The demo's simulated upstream speaks chat
 * completions only: it calls the first tool when the last user message says
 * "weather", and answers in text once the tool's result is in.
 */

let server: Proc;
let client: OpenAI;

beforeAll(async () => {
  const bin = await ensureBinary();
  const dir = scratchDir("gw-e2e-responses-");
  const gw = join(dir, "gateway");
  copyFileSync(bin, gw);
  server = start([gw, "serve", "--demo", "--port", "0"], { cwd: dir, env: cleanEnv() });
  const base = await listeningUrl(server);
  const line = await server.waitForLine(/personal key \(inference\):\s+sk-gw-/, 60_000);
  const key = /(sk-gw-[0-9A-Za-z]+)/.exec(line)?.[1];
  if (!key) throw new Error(`no key in: ${line}`);
  client = new OpenAI({ baseURL: `${base}/v1`, apiKey: key, maxRetries: 0 });
  setTracingDisabled(true);
  setDefaultOpenAIClient(client);
}, 240_000);
afterAll(async () => {
  server?.kill("SIGTERM");
  if (server) expect(await exitWithin(server, 15_000)).toBe(0);
  removeScratch();
});

describe("openai SDK: client.responses", () => {
  test("create (JSON), retrieve, inputItems.list, delete", async () => {
    const r = await client.responses.create({ model: "svc-fast", instructions: "Be brief.", input: "Say hi", max_output_tokens: 64, metadata: { run: "e2e" } });
    expect(r.object).toBe("response");
    expect(r.id).toMatch(/^resp_/);
    expect(r.status).toBe("completed");
    expect(r.model).toBe("svc-fast");
    expect(r.output_text.length).toBeGreaterThan(0);
    expect(r.usage?.output_tokens).toBeGreaterThan(0);
    expect(r.usage?.total_tokens).toBe((r.usage?.input_tokens ?? 0) + (r.usage?.output_tokens ?? 0));
    expect(r.metadata).toEqual({ run: "e2e" });

    const back = await client.responses.retrieve(r.id);
    expect(back.id).toBe(r.id);
    expect(back.output_text).toBe(r.output_text);

    const items = [];
    for await (const item of client.responses.inputItems.list(r.id)) items.push(item);
    expect(items.length).toBe(1);
    expect(items[0]?.type).toBe("message");

    const next = await client.responses.create({ model: "svc-fast", previous_response_id: r.id, input: "And again?" });
    expect(next.previous_response_id).toBe(r.id);

    await client.responses.delete(r.id);
    const gone = await client.responses.retrieve(r.id).then(
      () => null,
      (e: unknown) => e,
    );
    expect(gone).toBeInstanceOf(OpenAI.NotFoundError);
  });

  test("create with stream: true: the events as they come, ending in response.completed", async () => {
    const stream = await client.responses.create({ model: "svc-fast", input: "Say hi", stream: true });
    const types: string[] = [];
    let text = "";
    let final: OpenAI.Responses.Response | undefined;
    for await (const event of stream) {
      types.push(event.type);
      if (event.type === "response.output_text.delta") text += event.delta;
      if (event.type === "response.completed") final = event.response;
    }
    expect(types[0]).toBe("response.created");
    expect(types).toContain("response.output_text.delta");
    expect(types.at(-1)).toBe("response.completed");
    // output_text is the SDK's convenience on whole answers; in a raw event the text is in the output message.
    const message = final?.output.find((o) => o.type === "message");
    const part = message?.type === "message" ? message.content[0] : undefined;
    expect(part?.type === "output_text" ? part.text : undefined).toBe(text);
    expect(text.length).toBeGreaterThan(0);
    expect(final?.usage?.output_tokens).toBeGreaterThan(0);
    // Stored: readable as soon as the stream has ended.
    if (final) expect((await client.responses.retrieve(final.id)).status).toBe("completed");
  });

  test("responses.stream().finalResponse()", async () => {
    const final = await client.responses.stream({ model: "svc-fast", input: "Say hi" }).finalResponse();
    expect(final.status).toBe("completed");
    expect(final.output_text.length).toBeGreaterThan(0);
  });

  test("inputTokens.count (the gateway's estimate), cancel and compact (400: nothing runs in background, no compaction)", async () => {
    const counted = await client.responses.inputTokens.count({ model: "svc-fast", instructions: "Be brief.", input: "Say hi" });
    expect(counted.object).toBe("response.input_tokens");
    const r = await client.responses.create({ model: "svc-fast", instructions: "Be brief.", input: "Say hi" });
    // The demo's simulated upstream counts a prompt as the gateway estimates one.
    expect(counted.input_tokens).toBe(r.usage?.input_tokens ?? -1);
    const refused = (p: Promise<unknown>) => p.then(() => null, (e: unknown) => e);
    expect(await refused(client.responses.cancel(r.id))).toBeInstanceOf(OpenAI.BadRequestError);
    expect(await refused(client.responses.cancel("resp_doesnotexist"))).toBeInstanceOf(OpenAI.NotFoundError);
    expect(await refused(client.responses.compact({ model: "svc-fast", input: "Say hi" }))).toBeInstanceOf(OpenAI.BadRequestError);
  });

  test("errors map to the SDK's classes", async () => {
    const unknown = await client.responses.create({ model: "nope", input: "x" }).then(
      () => null,
      (e: unknown) => e,
    );
    expect(unknown).toBeInstanceOf(OpenAI.NotFoundError);
    const hosted = await client.responses.create({ model: "svc-fast", input: "x", tools: [{ type: "file_search", vector_store_ids: ["vs_1"] }] }).then(
      () => null,
      (e: unknown) => e,
    );
    expect(hosted).toBeInstanceOf(OpenAI.BadRequestError);
    expect((hosted as InstanceType<typeof OpenAI.BadRequestError>).param).toBe("tools[0].type");
  });
});

describe("OpenAI Agents SDK", () => {
  const calls: string[] = [];
  const getWeather = tool({
    name: "get_weather",
    description: "The current weather in a city",
    parameters: z.object({ location: z.string() }),
    execute: async ({ location }) => {
      calls.push(location);
      return `It is sunny in ${location}.`;
    },
  });
  const agent = new Agent({ name: "Forecaster", instructions: "Answer weather questions with the tool.", model: "svc-fast", tools: [getWeather] });

  test("an agent with a function tool runs to a final answer", async () => {
    calls.length = 0;
    const result = await run(agent, "What is the weather in Paris?");
    expect(calls).toEqual(["Paris"]);
    expect(typeof result.finalOutput).toBe("string");
    expect(String(result.finalOutput).length).toBeGreaterThan(0);
    const kinds = result.newItems.map((i) => i.type);
    expect(kinds).toEqual(["tool_call_item", "tool_call_output_item", "message_output_item"]);
    // Two model turns, both on the Responses transport (a chat completions turn would carry a chatcmpl- id).
    expect(result.rawResponses.map((r) => r.responseId?.slice(0, 5))).toEqual(["resp_", "resp_"]);

    // The next turn continues server-side: the gateway replays the stored run (message, tool call and its output).
    const next = await run(agent, "And tomorrow?", { previousResponseId: result.lastResponseId });
    expect(String(next.finalOutput).length).toBeGreaterThan(0);
    expect(calls).toEqual(["Paris"]);
  });

  test("the same agent, streamed", async () => {
    calls.length = 0;
    const result = await run(agent, "What is the weather in Paris?", { stream: true });
    for await (const _event of result) {
      // Consumed to the end; the run completes with it.
    }
    await result.completed;
    expect(calls).toEqual(["Paris"]);
    expect(String(result.finalOutput).length).toBeGreaterThan(0);
  });
});
