import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { eq } from "drizzle-orm";
import fc from "fast-check";
import type { Database } from "../../src/db/client.ts";
import { usageCounters } from "../../src/db/schema.ts";
import type { Gateway } from "../../src/server.ts";
import { errorOf, seedOrg, sharedDatabase, startTestGateway } from "../helpers/harness.ts";
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
 * UTF-8 byte of every text, 8 per message for the template, and each image
 * at IMAGE_COST (a VLM that counts an image far above OpenAI's 85).
 */

const IMAGE_COST = 900;
const utf8 = (s: string) => Buffer.byteLength(s, "utf8");

function countPrompt(messages: unknown[]): number {
  let n = 0;
  for (const m of messages as { content?: unknown }[]) {
    n += 8;
    const c = m.content;
    if (typeof c === "string") n += utf8(c);
    else if (Array.isArray(c)) {
      for (const p of c as { type: string; text?: string }[]) n += p.type === "image_url" ? IMAGE_COST : utf8(p.text ?? "");
    }
  }
  return n;
}

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
      const completion = Math.min(Number(body.max_tokens ?? 5), 5);
      const prompt = countPrompt(body.messages as unknown[]);
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
