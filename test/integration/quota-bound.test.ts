import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { eq } from "drizzle-orm";
import fc from "fast-check";
import type { Database } from "../../src/db/client.ts";
import { usageCounters } from "../../src/db/schema.ts";
import type { Gateway } from "../../src/server.ts";
import { createLogger } from "../../src/lib/log.ts";
import { startGateway } from "../../src/server.ts";
import { errorOf, seedOrg, sharedDatabase, startTestGateway, testConfig } from "../helpers/harness.ts";
import { until } from "../helpers/poll.ts";
import { TEST_PLANS, chatAlias, embedAlias, upstreamSettings } from "./inference-fixtures.ts";

setDefaultTimeout(60_000);

/**
 * No single request overshoots an organisation's quota, whatever its text
 * tokenizes to (docs/decisions.md, Quota): the prompt is reserved at the most
 * it can be, not at the ~4-characters-a-token estimate. Before, a prompt that
 * tokenizes densely (CJK, emoji, code) was admitted against its estimate and
 * charged what the upstream counted: 2,000 CJK characters were reserved as
 * ~510 tokens and charged 6,000+ against a quota of 5,000.
 *
 * The upstream here is the worst tokenizer the bound allows: one token per
 * UTF-8 byte of every text, 8 per message for the template, each image at
 * IMAGE_COST (a VLM that counts an image far above OpenAI's 85), and tools,
 * legacy functions, a response format's schema and tool call arguments
 * rendered as real chat templates render them (countPrompt).
 */

const IMAGE_COST = 900;
const utf8 = (s: string) => Buffer.byteLength(s, "utf8");

/** Python's json.dumps with its default separators (", ", ": "): how HF's `tojson` renders a value without indent. */
function pyDumps(v: unknown): string {
  if (Array.isArray(v)) return `[${v.map(pyDumps).join(", ")}]`;
  if (v !== null && typeof v === "object") return `{${Object.entries(v).map(([k, x]) => `${JSON.stringify(k)}: ${pyDumps(x)}`).join(", ")}}`;
  return JSON.stringify(v);
}

/**
 * Structured text as real templates render it: each tool (and legacy function)
 * as Llama 3.1's `t | tojson(indent=4)`; a json_schema response format injected
 * into the prompt the same way (gpt-oss's harmony format has a "# Response
 * Formats" section); a tool call's arguments parsed into a dict (as vLLM does
 * for the template) and re-serialised by `tojson`; a tool result through
 * `tojson` too (Llama 3.1).
 */
function countPrompt(body: Record<string, unknown>): number {
  let n = 0;
  for (const m of body.messages as { role: string; content?: unknown; tool_calls?: { function: { name: string; arguments: string } }[] }[]) {
    n += 8;
    const c = m.content;
    // Llama 3.1 renders a tool result with `tojson` (a string is iterable in Jinja): quoted and escaped.
    if (m.role === "tool") n += utf8(JSON.stringify(c));
    else if (typeof c === "string") n += utf8(c);
    else if (Array.isArray(c)) {
      for (const p of c as { type: string; text?: string }[]) n += p.type === "image_url" ? IMAGE_COST : utf8(p.text ?? "");
    }
    for (const t of m.tool_calls ?? []) n += utf8(t.function.name) + utf8(pyDumps(JSON.parse(t.function.arguments)));
  }
  for (const t of [...((body.tools as unknown[]) ?? []), ...((body.functions as unknown[]) ?? [])]) n += utf8(JSON.stringify(t, null, 4));
  const format = body.response_format as { type: string; json_schema?: { schema?: unknown } } | undefined;
  if (format?.type === "json_schema") n += utf8(JSON.stringify(format.json_schema?.schema ?? {}, null, 4));
  return n;
}

let releaseSlow: () => void = () => {};
let slowArrived = false;
let upstream: ReturnType<typeof Bun.serve>;
let gw: Gateway;
let db: Database;

beforeAll(async () => {
  upstream = Bun.serve({
    port: 0,
    hostname: "127.0.0.1",
    async fetch(req) {
      const url = new URL(req.url);
      const body = (await req.json()) as Record<string, unknown>;
      if (url.pathname.endsWith("/embeddings")) {
        const inputs = Array.isArray(body.input) ? (body.input as string[]) : [String(body.input)];
        const prompt = inputs.reduce((n, s) => n + utf8(s), 0);
        return Response.json({
          object: "list",
          model: body.model,
          data: inputs.map((_, i) => ({ object: "embedding", index: i, embedding: [0.1, 0.2] })),
          usage: { prompt_tokens: prompt, total_tokens: prompt },
        });
      }
      // A request held until the test lets it go: a reservation in flight.
      if ((body.messages as { content?: unknown }[])[0]?.content === "slow") {
        const held = new Promise<void>((resolve) => (releaseSlow = resolve));
        slowArrived = true;
        await held;
      }
      const completion = Math.min(Number(body.max_tokens ?? 5), 5);
      // An upstream whose prompt count is made up (a bug, a proxy counting a whole session): 10^9, still "plausible".
      const prompt = (body.messages as { content?: unknown }[])[0]?.content === "made-up count" ? 1_000_000_000 : countPrompt(body);
      if (body.stream === true) {
        const chunk = (o: Record<string, unknown>) => `data: ${JSON.stringify({ id: "chatcmpl-x", object: "chat.completion.chunk", created: 1, model: body.model, ...o })}\n\n`;
        return new Response(
          chunk({ choices: [{ index: 0, delta: { role: "assistant", content: "hello" }, finish_reason: null }] }) +
            chunk({ choices: [{ index: 0, delta: {}, finish_reason: "length" }] }) +
            chunk({ choices: [], usage: { prompt_tokens: prompt, completion_tokens: completion, total_tokens: prompt + completion } }) +
            "data: [DONE]\n\n",
          { headers: { "content-type": "text/event-stream" } },
        );
      }
      return Response.json({
        id: "chatcmpl-x",
        object: "chat.completion",
        created: 1,
        model: body.model,
        choices: [{ index: 0, message: { role: "assistant", content: "hello" }, finish_reason: "length" }],
        usage: { prompt_tokens: prompt, completion_tokens: completion, total_tokens: prompt + completion },
      });
    },
  });
  const base = `http://127.0.0.1:${upstream.port}/v1`;
  db = await sharedDatabase();
  gw = await startTestGateway({
    aliases: {
      "svc-fast": chatAlias([{ baseUrl: base }]),
      "svc-vision": chatAlias([{ baseUrl: base }], { imageTokens: 1_000 }),
      "svc-embed": embedAlias([{ baseUrl: base }]),
    },
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 1 }),
    quota: { leaseTokens: 20_000, flushMs: 100, maxBuffered: 100_000 },
    responses: { enabled: true },
  });
});
afterAll(async () => {
  await gw?.stop();
  upstream?.stop(true);
});

const UNLIMITED_RATE = { plan: "Test", plans: Object.keys(TEST_PLANS) };

async function used(orgId: string): Promise<number> {
  for (let i = 0; i < 2; i++) await gw.quota.flush();
  const rows = await db.db.select().from(usageCounters).where(eq(usageCounters.orgId, orgId));
  return rows.reduce((a, r) => a + r.used, 0);
}

function post(path: string, key: string, body: unknown): Promise<Response> {
  return fetch(`${gw.url}${path}`, {
    method: "POST",
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
    body: JSON.stringify(body),
  });
}

describe("a prompt that tokenizes denser than the estimate", () => {
  test("2,000 CJK characters under a quota of 5,000: refused, not charged 6,000", async () => {
    const content = "漢".repeat(2_000);
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 5_000, quotaWindow: "day" });
    const res = await post("/v1/chat/completions", org.serviceKey, { model: "svc-fast", messages: [{ role: "user", content }], max_tokens: 5 });
    // Before: 200, and 6,013 tokens used of 5,000.
    expect(res.status).toBe(429);
    expect((await errorOf(res)).code).toBe("budget_exceeded");
    expect(await used(org.orgId)).toBe(0);

    // With room for its bound it is served, and charged what the upstream counted.
    const roomy = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 7_000, quotaWindow: "day" });
    const ok = await post("/v1/chat/completions", roomy.serviceKey, { model: "svc-fast", messages: [{ role: "user", content }], max_tokens: 5 });
    expect(ok.status).toBe(200);
    const body = (await ok.json()) as { usage: { total_tokens: number } };
    expect(body.usage.total_tokens).toBe(6_000 + 8 + 5);
    expect(await used(roomy.orgId)).toBe(6_013);
  });

  test("images are reserved at the alias's imageTokens: three 900-token images under a quota of 2,000 are refused", async () => {
    const content = [
      { type: "text", text: "Compare these." },
      ...[1, 2, 3].map((i) => ({ type: "image_url", image_url: { url: `data:image/png;base64,AAAA${i}` } })),
    ];
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 2_000, quotaWindow: "day" });
    const res = await post("/v1/chat/completions", org.serviceKey, { model: "svc-vision", messages: [{ role: "user", content }], max_tokens: 5 });
    // Before: 200 (reserved at 85 an image), and 2,736 tokens used of 2,000.
    expect(res.status).toBe(429);
    expect(await used(org.orgId)).toBe(0);

    const roomy = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 4_000, quotaWindow: "day" });
    const ok = await post("/v1/chat/completions", roomy.serviceKey, { model: "svc-vision", messages: [{ role: "user", content }], max_tokens: 5 });
    expect(ok.status).toBe(200);
    await ok.arrayBuffer();
    expect(await used(roomy.orgId)).toBe(3 * IMAGE_COST + 8 + utf8("Compare these.") + 5);
  });

  // decisions.md, Quota: "each image at the alias's `imageTokens` (default 2,048 …)". svc-fast sets none.
  test("an image on an alias without imageTokens is reserved at 2,048: a quota one short of that reservation refuses it", async () => {
    const content = [
      { type: "text", text: "x" },
      { type: "image_url", image_url: { url: "data:image/png;base64,AAAA" } },
    ];
    // 512 a request, 16 a message, 1 byte of text, 2,048 for the image, and max_tokens.
    const reservation = 512 + 16 + 1 + 2_048 + 5;
    const short = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: reservation - 1, quotaWindow: "day" });
    const res = await post("/v1/chat/completions", short.serviceKey, { model: "svc-fast", messages: [{ role: "user", content }], max_tokens: 5 });
    expect(res.status).toBe(429);
    expect((await errorOf(res)).code).toBe("budget_exceeded");
    const enough = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: reservation, quotaWindow: "day" });
    const ok = await post("/v1/chat/completions", enough.serviceKey, { model: "svc-fast", messages: [{ role: "user", content }], max_tokens: 5 });
    expect(ok.status).toBe(200);
    await ok.arrayBuffer();
  });

  test("embeddings: 1,000 CJK characters under a quota of 2,000 are refused, not charged 3,000", async () => {
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 2_000, quotaWindow: "day" });
    const res = await post("/v1/embeddings", org.serviceKey, { model: "svc-embed", input: "漢".repeat(1_000) });
    // Before: 200, and 3,000 tokens used of 2,000.
    expect(res.status).toBe(429);
    expect((await errorOf(res)).code).toBe("budget_exceeded");
    expect(await used(org.orgId)).toBe(0);
  });

  test("any mix of scripts, sent until refused: usage never passes the quota", async () => {
    const text = fc.array(fc.constantFrom("a", "hello ", "漢字", "😀", "é", "{\"k\":1}", "\n"), { minLength: 1, maxLength: 400 }).map((a) => a.join(""));
    await fc.assert(
      fc.asyncProperty(fc.array(text, { minLength: 1, maxLength: 3 }), fc.integer({ min: 800, max: 4_000 }), async (prompts, quota) => {
        const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: quota, quotaWindow: "day" });
        for (let i = 0; i < 40; i++) {
          const res = await post("/v1/chat/completions", org.serviceKey, {
            model: "svc-fast",
            messages: prompts.map((content) => ({ role: "user", content })),
            max_tokens: 5,
          });
          await res.arrayBuffer();
          if (res.status === 429) break;
          expect(res.status).toBe(200);
        }
        expect(await used(org.orgId)).toBeLessThanOrEqual(quota);
      }),
      { numRuns: 15, seed: 17 },
    );
  });
});

/**
 * What a chat template renders from the request's structured fields, as real
 * templates render it. Before, tools were reserved at twice their compact
 * JSON (Llama 3.1 indents them: an enum of 1,000 numbers five levels deep
 * renders at 27 bytes a number, not 2), legacy `functions` and a json_schema
 * `response_format` not at all, and tool call arguments at their own bytes
 * (re-serialised with Python's separators they grow by half).
 */
describe("structured fields as templates render them", () => {
  async function overshoot(quota: number, roomy: number, body: Record<string, unknown>, before: string) {
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: quota, quotaWindow: "day" });
    const res = await post("/v1/chat/completions", org.serviceKey, { model: "svc-fast", max_tokens: 5, ...body });
    const text = await res.text();
    // `before` says what the old code did.
    expect({ status: res.status, used: await used(org.orgId), before }).toEqual({ status: 429, used: 0, before });
    expect(text).toContain("budget_exceeded");

    // With room for its bound it is served and charged what the upstream counted.
    const big = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: roomy, quotaWindow: "day" });
    const ok = await post("/v1/chat/completions", big.serviceKey, { model: "svc-fast", max_tokens: 5, ...body });
    expect(ok.status).toBe(200);
    const usage = ((await ok.json()) as { usage: { prompt_tokens: number; total_tokens: number } }).usage;
    expect(usage.prompt_tokens).toBeGreaterThan(quota);
    expect(await used(big.orgId)).toBe(usage.total_tokens);
  }

  const ask = [{ role: "user", content: "Which?" }];

  test("tools rendered with indentation (Llama 3.1's tojson(indent=4))", async () => {
    const tools = [
      {
        type: "function",
        function: { name: "pick", parameters: { type: "object", properties: { x: { type: "integer", enum: new Array(1_000).fill(0) } } } },
      },
    ];
    // Compact, the tools are 2,100 bytes: reserved at ~5,300. Rendered, 27,000+.
    await overshoot(20_000, 60_000, { messages: ask, tools }, "200, used 27,1xx of 20,000");
  });

  test("legacy functions are rendered like tools", async () => {
    const functions = [{ name: "pick", parameters: { type: "object", description: "d".repeat(5_000) } }];
    await overshoot(4_000, 30_000, { messages: ask, functions }, "200, used 5,1xx of 4,000 (functions not counted)");
  });

  test("a json_schema response format, injected into the prompt", async () => {
    const response_format = { type: "json_schema", json_schema: { name: "answer", schema: { type: "object", description: "d".repeat(5_000) } } };
    await overshoot(4_000, 30_000, { messages: ask, response_format }, "200, used 5,1xx of 4,000 (response_format not counted)");
  });

  test("tool call arguments re-serialised with Python's separators", async () => {
    const args = JSON.stringify({ v: new Array(3_000).fill(0) });
    const messages = [
      ...ask,
      { role: "assistant", content: null, tool_calls: [{ id: "c1", type: "function", function: { name: "pick", arguments: args } }] },
      { role: "tool", tool_call_id: "c1", content: "ok" },
    ];
    // The arguments are 6,008 bytes, reserved as such; rendered, 9,006.
    await overshoot(8_000, 30_000, { messages }, "200, used 9,0xx of 8,000");
  });

  test("the Responses API goes through the same reservation: instructions, tools, function calls and outputs, text.format", async () => {
    const enumOf = new Array(300).fill(0);
    const input = [
      { role: "user", content: "Which?" },
      { type: "function_call", call_id: "c1", name: "pick", arguments: JSON.stringify({ v: enumOf }) },
      { type: "function_call_output", call_id: "c1", output: "\n".repeat(1_000) },
    ];
    const body = {
      model: "svc-fast",
      max_output_tokens: 16,
      instructions: "Be brief.",
      input,
      tools: [{ type: "function", name: "pick", parameters: { type: "object", properties: { x: { type: "integer", enum: enumOf } } } }],
      text: { format: { type: "json_schema", name: "answer", schema: { type: "object", properties: { x: { enum: enumOf } } } } },
    };
    // Rendered: the tool ~8,100 bytes, the schema ~6,900, the arguments 903, the output 2,002: ~18,000.
    const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 15_000, quotaWindow: "day" });
    const res = await post("/v1/responses", org.serviceKey, body);
    expect(res.status).toBe(429);
    expect(await res.text()).toContain("budget_exceeded");
    expect(await used(org.orgId)).toBe(0);

    const big = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 100_000, quotaWindow: "day" });
    const ok = await post("/v1/responses", big.serviceKey, body);
    expect(ok.status).toBe(200);
    const usage = ((await ok.json()) as { usage: { input_tokens: number; total_tokens: number } }).usage;
    expect(usage.input_tokens).toBeGreaterThan(15_000);
    expect(await used(big.orgId)).toBe(usage.total_tokens);
  });

  test("a tool result rendered by tojson (Llama 3.1): quoted, each newline escaped", async () => {
    const messages = [
      ...ask,
      { role: "assistant", content: null, tool_calls: [{ id: "c1", type: "function", function: { name: "pick", arguments: "{}" } }] },
      { role: "tool", tool_call_id: "c1", content: "\n".repeat(5_000) },
    ];
    // 5,000 bytes, reserved as such; rendered, 10,002.
    await overshoot(8_000, 30_000, { messages }, "200, used 10,0xx of 8,000");
  });
});

/**
 * Reservations are several times what requests use, so a request that finds
 * too little waits (up to the share wait) for the instance's own requests in
 * flight to settle; one that would not fit even if all of them came free is
 * refused at once (docs/decisions.md, Quota: sharing between instances).
 */
describe("waiting for the instance's own requests in flight", () => {
  test("a request that fits once they settle waits and is served; one that never could is refused at once", async () => {
    // The default flush interval: a share wait of 3,250 ms, far from "at once".
    const slowGw = await startTestGateway({
      aliases: { "svc-fast": chatAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }]) },
      plans: TEST_PLANS,
      upstream: upstreamSettings({ attempts: 1 }),
      quota: { leaseTokens: 20_000, flushMs: 1_000, maxBuffered: 100_000 },
    });
    try {
      const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 10_000, quotaWindow: "day" });
      const send = (content: string, max_tokens: number) =>
        fetch(`${slowGw.url}/v1/chat/completions`, {
          method: "POST",
          headers: { authorization: `Bearer ${org.serviceKey}`, "content-type": "application/json" },
          body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content }], max_tokens }),
        });
      // 14 used (8 + 1 + 5).
      expect((await send("x", 5)).status).toBe(200);
      // In flight: reserved 512 + 16 + 4 + 4,000 = 4,532; it will use 17.
      slowArrived = false;
      const slow = send("slow", 4_000);
      await until(() => slowArrived, "the slow request at the upstream");

      // 529 + 9,461 = 9,990 > the 9,986 left even if the slow request used nothing: refused at once.
      let t = performance.now();
      const never = await send("x", 9_461);
      expect(never.status).toBe(429);
      expect((await errorOf(never)).code).toBe("budget_exceeded");
      expect(performance.now() - t).toBeLessThan(1_500);

      // 529 + 9,400 = 9,929 fits once the slow request settles at 17: it waits for that.
      t = performance.now();
      const waiting = send("x", 9_400);
      await Bun.sleep(300);
      releaseSlow();
      expect((await slow).status).toBe(200);
      const served = await waiting;
      expect(served.status).toBe(200);
      await served.arrayBuffer();
      expect(performance.now() - t).toBeGreaterThanOrEqual(300);

      // Held past the share wait (3.25 s here): the quota is not spent, so a 503 to retry, not budget_exceeded
      // ("retrying does not help"). Before: 429 budget_exceeded with x-should-retry false while 4,500 tokens remained.
      const org2 = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 10_000, quotaWindow: "day" });
      const send2 = (max_tokens: number) =>
        fetch(`${slowGw.url}/v1/chat/completions`, {
          method: "POST",
          headers: { authorization: `Bearer ${org2.serviceKey}`, "content-type": "application/json" },
          body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: max_tokens === 4_000 ? "slow" : "x" }], max_tokens }),
        });
      slowArrived = false;
      const slow2 = send2(4_000);
      await until(() => slowArrived, "the second slow request at the upstream");
      t = performance.now();
      const heldOut = await send2(5_000);
      expect(heldOut.status).toBe(503);
      expect((await errorOf(heldOut)).code).toBe("service_unavailable");
      expect(heldOut.headers.get("retry-after")).toBe("1");
      expect(performance.now() - t).toBeGreaterThanOrEqual(3_000);
      releaseSlow();
      expect((await slow2).status).toBe(200);
      // Now it fits: served.
      const after = await send2(5_000);
      expect(after.status).toBe(200);
      await after.arrayBuffer();
    } finally {
      releaseSlow();
      await slowGw.stop();
    }
  });
});

describe("a prompt counted above what was reserved", () => {
  test("is charged in full, and the operator is told once per alias to raise imageTokens", async () => {
    const lines: string[] = [];
    const gw2 = await startGateway({
      config: await testConfig({
        aliases: { "svc-lowimg": chatAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }], { imageTokens: 100 }) },
        plans: TEST_PLANS,
        upstream: upstreamSettings({ attempts: 1 }),
        quota: { leaseTokens: 20_000, flushMs: 100, maxBuffered: 100_000 },
      }),
      database: db,
      log: createLogger("warn", (l) => lines.push(l)),
    });
    try {
      const content = [{ type: "image_url", image_url: { url: "data:image/png;base64,AAAA" } }];
      // Without a quota nothing is reserved, so nothing is said.
      const free = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: null });
      const unmetered = await fetch(`${gw2.url}/v1/chat/completions`, {
        method: "POST",
        headers: { authorization: `Bearer ${free.serviceKey}`, "content-type": "application/json" },
        body: JSON.stringify({ model: "svc-lowimg", messages: [{ role: "user", content }], max_tokens: 5 }),
      });
      expect(unmetered.status).toBe(200);
      await unmetered.arrayBuffer();
      expect(lines.filter((l) => l.includes("above what was reserved"))).toHaveLength(0);
      const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 100_000, quotaWindow: "day" });
      for (const stream of [false, true, false]) {
        const res = await fetch(`${gw2.url}/v1/chat/completions`, {
          method: "POST",
          headers: { authorization: `Bearer ${org.serviceKey}`, "content-type": "application/json" },
          body: JSON.stringify({ model: "svc-lowimg", messages: [{ role: "user", content }], max_tokens: 5, stream }),
        });
        expect(res.status).toBe(200);
        await res.arrayBuffer();
      }
      for (let i = 0; i < 2; i++) await gw2.quota.flush();
      const rows = await db.db.select().from(usageCounters).where(eq(usageCounters.orgId, org.orgId));
      // The upstream's 908 prompt tokens each time, not the 100 + 528 reserved.
      expect(rows.reduce((a, r) => a + r.used, 0)).toBe(3 * (IMAGE_COST + 8 + 5));
      const warned = lines.map((l) => JSON.parse(l) as Record<string, unknown>).filter((l) => String(l.msg).includes("above what was reserved"));
      // Before: nothing said (the overshoot went unnoticed).
      expect(warned).toHaveLength(1);
      expect(warned[0]).toMatchObject({ alias: "svc-lowimg", prompt_tokens: IMAGE_COST + 8, reserved_prompt_tokens: 512 + 16 + 100 });
    } finally {
      await gw2.stop();
    }
  });

  test("on an alias without a context window, under a quota: charged at most what was reserved, so no count passes the quota", async () => {
    const lines: string[] = [];
    const gw2 = await startGateway({
      config: await testConfig({
        aliases: { "svc-nowindow": chatAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }], { contextWindow: undefined, imageTokens: 100 }) },
        plans: TEST_PLANS,
        upstream: upstreamSettings({ attempts: 1 }),
        quota: { leaseTokens: 20_000, flushMs: 100, maxBuffered: 100_000 },
      }),
      database: db,
      log: createLogger("warn", (l) => lines.push(l)),
    });
    try {
      const image = [{ type: "image_url", image_url: { url: "data:image/png;base64,AAAA" } }];
      const org = await seedOrg(db, { ...UNLIMITED_RATE, quotaTokens: 100_000, quotaWindow: "day" });
      const ask = (content: unknown, stream: boolean) =>
        fetch(`${gw2.url}/v1/chat/completions`, {
          method: "POST",
          headers: { authorization: `Bearer ${org.serviceKey}`, "content-type": "application/json" },
          body: JSON.stringify({ model: "svc-nowindow", messages: [{ role: "user", content }], max_tokens: 5, stream, ...(stream ? { stream_options: { include_usage: true } } : {}) }),
        });
      // The prompt's bound: 512 for the template, 16 for the message, the text's bytes (or imageTokens).
      const claim = 512 + 16 + utf8("made-up count");
      const imaged = 512 + 16 + 100;
      for (const stream of [false, true]) {
        const res = await ask("made-up count", stream);
        expect(res.status).toBe(200);
        const text = await res.text();
        // What the client is told is what is charged.
        const told = stream ? JSON.parse(text.split("\n\n").filter((e) => e.includes('"usage"')).at(-1)?.slice(6) ?? "null") : JSON.parse(text);
        expect(told.usage).toEqual({ prompt_tokens: claim, completion_tokens: 5, total_tokens: claim + 5 });
        const img = await ask(image, stream);
        expect(img.status).toBe(200);
        await img.arrayBuffer();
      }
      // Before: 2 × 10^9 + … tokens charged against a quota of 100,000 (nothing but a window bounded the count).
      expect(await usedOn(gw2, org.orgId)).toBe(2 * (claim + 5) + 2 * (imaged + 5));
      const next = await ask("hi", false);
      expect(next.status).toBe(200);
      await next.arrayBuffer();
      const warned = lines.map((l) => JSON.parse(l) as Record<string, unknown>).filter((l) => String(l.msg).includes("above what was reserved"));
      expect(warned).toHaveLength(1);
      expect(warned[0]).toMatchObject({ alias: "svc-nowindow", prompt_tokens: 1_000_000_000, reserved_prompt_tokens: claim });
    } finally {
      await gw2.stop();
    }
  });
});

async function usedOn(g: Gateway, orgId: string): Promise<number> {
  for (let i = 0; i < 2; i++) await g.quota.flush();
  const rows = await db.db.select().from(usageCounters).where(eq(usageCounters.orgId, orgId));
  return rows.reduce((a, r) => a + r.used, 0);
}
