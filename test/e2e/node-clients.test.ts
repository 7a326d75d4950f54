import { afterAll, beforeAll, expect, setDefaultTimeout, test } from "bun:test";
import { copyFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";
import { ensureBinary } from "../helpers/binary.ts";
import { type Proc, cleanEnv, exitWithin, listeningUrl, removeScratch, scratchDir, start } from "../helpers/process.ts";

// Building the binary, a cold PGlite start, and Node loading four SDKs on a busy 2-core machine.
setDefaultTimeout(120_000);

/**
 * The customers' clients on the runtime most of them use: Node.js. The
 * unmodified openai SDK (chat streamed with usage, the chat stream helper,
 * embeddings, responses.stream().finalResponse() with retrieve,
 * inputItems.list and delete, an error's class), the OpenAI Agents SDK (an
 * agent with a function tool, plain and streamed), the Vercel AI SDK
 * (generateText on its default Responses transport, streamText on chat) and
 * LangChain (invoke, stream), in one `node` process against the COMPILED
 * binary's demo. Node's fetch differs from Bun's (it sends
 * `Sec-Fetch-Mode: cors` on every request, which once got every call 403), so
 * the Bun-run suites cannot stand in for this. Skipped where `node` is not
 * installed.
 */

const node = Bun.which("node");
let server: Proc | undefined;
let base = "";
let key = "";

beforeAll(async () => {
  if (!node) return;
  const bin = await ensureBinary();
  const dir = scratchDir("gw-e2e-node-");
  const gw = join(dir, "gateway");
  copyFileSync(bin, gw);
  server = start([gw, "serve", "--demo", "--port", "0"], { cwd: dir, env: cleanEnv() });
  base = await listeningUrl(server);
  const line = await server.waitForLine(/personal key \(inference\):\s+sk-gw-/, 60_000);
  key = /(sk-gw-[0-9A-Za-z]+)/.exec(line)?.[1] ?? "";
  if (!key) throw new Error(`no key in: ${line}`);
}, 240_000);
afterAll(async () => {
  server?.kill("SIGTERM");
  if (server) expect(await exitWithin(server, 15_000)).toBe(0);
  removeScratch();
});

test.skipIf(!node)("the openai SDK, the Agents SDK, the Vercel AI SDK and LangChain under Node.js, unmodified but for base URL and key", async () => {
  const entry = (m: string) => pathToFileURL(Bun.resolveSync(m, import.meta.dir)).href;
  const modules = { openai: entry("openai"), agents: entry("@openai/agents"), zod: entry("zod"), ai: entry("ai"), aiOpenai: entry("@ai-sdk/openai"), langchain: entry("@langchain/openai") };
  const p = Bun.spawn([node ?? "node", join(import.meta.dir, "node-clients.mjs"), base, key, JSON.stringify(modules)], {
    stdout: "pipe",
    stderr: "inherit",
    env: { PATH: process.env.PATH ?? "" },
    timeout: 110_000,
  });
  const out = await new Response(p.stdout).text();
  expect(await p.exited).toBe(0);
  expect(JSON.parse(out)).toEqual({
    "openai.chat.stream": { text: true, usage: true },
    "openai.chat.streamHelper": "chat.completion",
    "openai.embeddings": 2,
    "openai.responses.stream": { status: "completed", text: true, back: true, items: ["message"] },
    "openai.error": "NotFoundError 404 model_not_found",
    agents: { calls: ["Paris", "Paris"], final: true, items: ["tool_call_item", "tool_call_output_item", "message_output_item"], streamed: true },
    "ai-sdk": { responses: true, chat: true, usage: true },
    langchain: { invoke: true, stream: true },
  });
});
