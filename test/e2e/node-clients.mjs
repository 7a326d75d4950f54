/**
 * The clients of test/e2e/node-clients.test.ts, run under Node.js (not Bun):
 * `node node-clients.mjs BASE_URL KEY MODULES_JSON`, MODULES_JSON naming each
 * package's entry as a file URL (this file imports nothing by name, so it
 * runs from anywhere). Prints one JSON object: each step's result, or its
 * error. Only the base URL and the key are set on any client.
 */
const [base, key, modsJson] = process.argv.slice(2);
const mods = JSON.parse(modsJson);
const out = {};
const step = async (name, f) => {
  try { out[name] = await f(); } catch (e) { out[name] = { error: String(e?.message ?? e).slice(0, 300), status: e?.status }; }
};
const { default: OpenAI } = await import(mods.openai);
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: key, maxRetries: 0 });
await step("openai.chat.stream", async () => {
  const s = await client.chat.completions.create({ model: "svc-fast", messages: [{ role: "user", content: "Say hi" }], stream: true, stream_options: { include_usage: true } });
  let text = "", usage;
  for await (const c of s) { text += c.choices[0]?.delta?.content ?? ""; if (c.usage) usage = c.usage; }
  return { text: text.length > 0, usage: usage?.total_tokens > 0 };
});
await step("openai.chat.streamHelper", async () => {
  const r = await client.chat.completions.stream({ model: "svc-fast", messages: [{ role: "user", content: "Say hi" }] }).finalChatCompletion();
  return r.object;
});
await step("openai.embeddings", async () => (await client.embeddings.create({ model: "svc-embed", input: ["a", "b"] })).data.length);
await step("openai.responses.stream", async () => {
  const r = await client.responses.stream({ model: "svc-fast", input: "Say hi" }).finalResponse();
  const back = await client.responses.retrieve(r.id);
  const items = [];
  for await (const i of client.responses.inputItems.list(r.id)) items.push(i.type);
  await client.responses.delete(r.id);
  return { status: r.status, text: r.output_text.length > 0, back: back.id === r.id, items };
});
await step("openai.error", async () => client.chat.completions.create({ model: "nope", messages: [{ role: "user", content: "x" }] }).then(() => "no error", (e) => `${e.constructor.name} ${e.status} ${e.code}`));
await step("agents", async () => {
  const { Agent, run, setDefaultOpenAIClient, setTracingDisabled, tool } = await import(mods.agents);
  const { z } = await import(mods.zod);
  setTracingDisabled(true);
  setDefaultOpenAIClient(client);
  const calls = [];
  const getWeather = tool({ name: "get_weather", description: "The current weather in a city", parameters: z.object({ location: z.string() }), execute: async ({ location }) => { calls.push(location); return `It is sunny in ${location}.`; } });
  const agent = new Agent({ name: "Forecaster", instructions: "Answer weather questions with the tool.", model: "svc-fast", tools: [getWeather] });
  const result = await run(agent, "What is the weather in Paris?");
  const streamed = await run(agent, "What is the weather in Paris?", { stream: true });
  for await (const _ of streamed) {}
  await streamed.completed;
  return { calls, final: typeof result.finalOutput === "string" && result.finalOutput.length > 0, items: result.newItems.map((i) => i.type), streamed: String(streamed.finalOutput).length > 0 };
});
await step("ai-sdk", async () => {
  const { generateText, streamText } = await import(mods.ai);
  const { createOpenAI } = await import(mods.aiOpenai);
  const openai = createOpenAI({ baseURL: `${base}/v1`, apiKey: key });
  const a = await generateText({ model: openai("svc-fast"), prompt: "Say hi", maxRetries: 0 });
  const b = streamText({ model: openai.chat("svc-fast"), prompt: "Say hi", maxRetries: 0 });
  let t = ""; for await (const d of b.textStream) t += d;
  const usage = await b.usage;
  return { responses: a.text.length > 0, chat: t.length > 0, usage: (usage.totalTokens ?? 0) > 0 };
});
await step("langchain", async () => {
  const { ChatOpenAI } = await import(mods.langchain);
  const llm = new ChatOpenAI({ model: "svc-fast", apiKey: key, configuration: { baseURL: `${base}/v1` }, maxRetries: 0 });
  const m = await llm.invoke("Say hi");
  let t = ""; for await (const c of await llm.stream("Say hi")) t += c.content;
  return { invoke: String(m.content).length > 0, stream: t.length > 0 };
});
console.log(JSON.stringify(out));
