import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { sql } from "drizzle-orm";
import { createKey, createUser, rotateKey } from "../../src/admin/service.ts";
import type { Principal } from "../../src/auth/types.ts";
import { createLogger } from "../../src/lib/log.ts";
import { writeSpacingFor } from "../../src/responses/store-queue.ts";
import { createResponseStore } from "../../src/responses/store.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { errorOf, type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { TEST_PLANS, arr, post, rec, seedTestOrg, testAliases, upstreamSettings } from "./inference-fixtures.ts";

setDefaultTimeout(30_000);

/**
 * Stored responses on the real database (PGlite, or Postgres with
 * TEST_DATABASE_URL): retrieve, delete, input items, previous_response_id
 * replay, ownership (personal key → its user, service key → its rotation
 * lineage), store: false, responses.store: false, and the retention sweep.
 */

let sim: Simulator;
let gw: Gateway;
let noStore: Gateway;
let org: SeededOrg;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 4 });
  const common = { aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: upstreamSettings({ attempts: 2 }) };
  gw = await startTestGateway({ ...common, responses: { enabled: true } });
  noStore = await startTestGateway({ ...common, responses: { enabled: true, store: false } });
  org = await seedTestOrg(gw.database);
});
afterEach(() => sim.reset());
afterAll(async () => {
  await gw.stop();
  await noStore.stop();
  await sim.stop();
});

const create = (body: unknown, key = org.personalKey, g = gw) => post(g, "/v1/responses", key, body);
const get = (path: string, key = org.personalKey, method = "GET", g = gw) => fetch(`${g.url}${path}`, { method, headers: { authorization: `Bearer ${key}` } });

async function made(body: Record<string, unknown>, key = org.personalKey): Promise<Record<string, unknown>> {
  const res = await create({ model: "svc-fast", ...body }, key);
  expect(res.status).toBe(200);
  return rec(await res.json());
}

async function madeStreamed(body: Record<string, unknown>, key = org.personalKey): Promise<string> {
  const res = await create({ model: "svc-fast", stream: true, ...body }, key);
  expect(res.status).toBe(200);
  const text = await res.text();
  const m = /"id":"(resp_[A-Za-z0-9_-]+)"/.exec(text);
  if (!m?.[1]) throw new Error(`no response id in the stream: ${text.slice(0, 300)}`);
  return m[1];
}

async function notFound(res: Response, param: string | null = null): Promise<void> {
  const err = await errorOf(res);
  expect({ status: res.status, code: err.code, param: err.param }).toEqual({ status: 404, code: "not_found", param });
}

const upstreamMessages = () => arr(rec(sim.stats.lastBody).messages);

/** The principal of an organisation's personal key, as the store sees a caller. */
const principalOf = (o: SeededOrg): Principal => ({
  keyId: o.personalKeyId,
  keyRoot: o.personalKeyId,
  orgId: o.orgId,
  userId: o.userId,
  kind: "personal",
  scopes: ["inference"],
  models: null,
  expiresAt: null,
  revokedAt: null,
  academyOnly: false,
  plan: "free",
  quotaTokens: null,
  quotaPeriod: "month",
  actorName: "Test",
  actorEmail: "test@example.com",
});

describe("retrieve, delete, input items", () => {
  test("a stored response reads back as answered; delete removes it; then 404", async () => {
    const r = await made({ input: "hello", metadata: { a: "1" } });
    const id = String(r.id);
    const back = await get(`/v1/responses/${id}`);
    expect(back.status).toBe(200);
    expect(rec(await back.json())).toEqual(r);
    const del = await get(`/v1/responses/${id}`, org.personalKey, "DELETE");
    expect(await del.json()).toEqual({ id, object: "response", deleted: true });
    await notFound(await get(`/v1/responses/${id}`));
    await notFound(await get(`/v1/responses/${id}`, org.personalKey, "DELETE"));
    await notFound(await get(`/v1/responses/${id}/input_items`));
  });

  test("a streamed response is stored by the time its stream has ended", async () => {
    const id = await madeStreamed({ input: "hello" });
    const back = await get(`/v1/responses/${id}`);
    expect(back.status).toBe(200);
    const r = rec(await back.json());
    expect(r.status).toBe("completed");
    expect(rec(r.usage).output_tokens).toBe(4);
  });

  test("store: false is not stored; unknown and malformed ids are 404", async () => {
    const r = await made({ input: "hello", store: false });
    expect(r.store).toBe(false);
    await notFound(await get(`/v1/responses/${String(r.id)}`));
    await notFound(await get("/v1/responses/resp_doesnotexist"));
    await notFound(await get("/v1/responses/not-an-id"));
    await notFound(await get(`/v1/responses/resp_${"x".repeat(500)}`));
  });

  test("retrieve with stream=true (the SDK's retrieve({stream: true}), OpenAI's for background responses) is 400 on stream, not a JSON body the SDK reads as an empty stream", async () => {
    const r = await made({ input: "hello" });
    const id = String(r.id);
    const streamed = await get(`/v1/responses/${id}?stream=true&starting_after=3`);
    const err = await errorOf(streamed);
    expect({ status: streamed.status, code: err.code, param: err.param }).toEqual({ status: 400, code: "invalid_request_error", param: "stream" });
    expect(err.message).toContain("background");
    // stream=false, and the other query parameters the SDK sends (include), read it as before.
    const plain = await get(`/v1/responses/${id}?stream=false&include[]=message.output_text.logprobs`);
    expect(plain.status).toBe(200);
    expect(rec(await plain.json())).toEqual(r);
    // Someone else's or unknown: 404 first, as for any read.
    await notFound(await get("/v1/responses/resp_doesnotexist?stream=true"));
  });

  test("input items are listed in the SDK's item shapes, whatever optional fields the request left out", async () => {
    const image = "data:image/png;base64,iVBORw0KGgo=";
    const input = [
      { role: "user", content: [{ type: "input_image", image_url: image }] },
      { type: "reasoning", id: "rs_1" },
      { role: "assistant", content: [{ type: "output_text", text: "two" }, { type: "input_text", text: " three" }] },
      { role: "user", content: "four" },
    ];
    const r = await made({ input });
    const res = await get(`/v1/responses/${String(r.id)}/input_items?order=asc`);
    const items = arr(rec(await res.json()).data).map(rec);
    // ResponseInputImage.detail, ResponseReasoningItem.summary and ResponseOutputText.annotations are required by the SDK's types;
    // an assistant message lists as ResponseOutputMessage, whose parts are output_text or refusal.
    expect(items[0]).toMatchObject({ role: "user", content: [{ type: "input_image", image_url: image, detail: "auto" }] });
    expect(items[1]).toEqual({ type: "reasoning", id: "rs_1", summary: [], status: "completed" });
    expect(items[2]).toMatchObject({
      role: "assistant",
      content: [
        { type: "output_text", text: "two", annotations: [] },
        { type: "output_text", text: " three", annotations: [] },
      ],
    });
    expect(items[3]).toMatchObject({ role: "user", content: [{ type: "input_text", text: "four" }] });
    // What went upstream is unchanged: the image without a detail, the assistant's text joined.
    expect(upstreamMessages().slice(0, 2)).toEqual([
      { role: "user", content: [{ type: "image_url", image_url: { url: image } }] },
      { role: "assistant", content: "two three" },
    ]);
  });

  test("input items: ids assigned, OpenAI's list shape, order, limit, after, before", async () => {
    const input = [
      { role: "user", content: "one" },
      { type: "message", role: "assistant", content: [{ type: "output_text", text: "two", annotations: [] }] },
      { type: "function_call", call_id: "c1", name: "f", arguments: "{}" },
      { type: "function_call_output", call_id: "c1", output: "three" },
      { role: "user", content: [{ type: "input_text", text: "four" }] },
    ];
    const id = String((await made({ input })).id);
    const page = async (q: string) => {
      const res = await get(`/v1/responses/${id}/input_items${q}`);
      expect(res.status).toBe(200);
      return rec(await res.json());
    };
    const all = await page("?order=asc");
    const items = arr(all.data).map(rec);
    expect(items.map((i) => i.type)).toEqual(["message", "message", "function_call", "function_call_output", "message"]);
    expect(items[0]).toMatchObject({ type: "message", role: "user", content: [{ type: "input_text", text: "one" }], status: "completed" });
    expect(String(items[0]?.id)).toMatch(/^msg_/);
    expect(new Set(items.map((i) => i.id)).size).toBe(5);
    expect(all).toMatchObject({ object: "list", first_id: items[0]?.id, last_id: items[4]?.id, has_more: false });

    const desc = await page("?limit=2");
    expect(arr(desc.data).map((i) => rec(i).id)).toEqual([items[4]?.id, items[3]?.id]);
    expect(desc.has_more).toBe(true);
    const next = await page(`?limit=2&after=${String(desc.last_id)}`);
    expect(arr(next.data).map((i) => rec(i).id)).toEqual([items[2]?.id, items[1]?.id]);
    expect(next.has_more).toBe(true);
    const last = await page(`?limit=2&after=${String(next.last_id)}`);
    expect(arr(last.data).map((i) => rec(i).id)).toEqual([items[0]?.id]);
    expect(last.has_more).toBe(false);
    const back = await page(`?order=asc&limit=2&before=${String(items[4]?.id)}`);
    expect(arr(back.data).map((i) => rec(i).id)).toEqual([items[2]?.id, items[3]?.id]);
    expect(back.has_more).toBe(true);

    for (const [q, param] of [
      ["?limit=0", "limit"],
      ["?limit=101", "limit"],
      ["?limit=x", "limit"],
      ["?order=up", "order"],
      ["?after=msg_nope", "after"],
    ] as const) {
      const res = await get(`/v1/responses/${id}/input_items${q}`);
      expect(res.status).toBe(400);
      expect((await errorOf(res)).param).toBe(param);
    }
  });

  // decisions.md, Input items: "`limit` 1–100 (20)"; limit=100 is allowed.
  test("input items: 20 a page unless limit says otherwise, up to 100", async () => {
    const input = Array.from({ length: 101 }, (_, i) => ({ role: "user", content: `item ${i}` }));
    const id = String((await made({ input })).id);
    const page = async (q: string) => rec(await (await get(`/v1/responses/${id}/input_items${q}`)).json());
    const first = await page("");
    expect({ n: arr(first.data).length, has_more: first.has_more }).toEqual({ n: 20, has_more: true });
    const most = await page("?limit=100");
    expect({ n: arr(most.data).length, has_more: most.has_more }).toEqual({ n: 100, has_more: true });
  });
});

describe("input items with repeated ids", () => {
  // Seen failing before: items sent with the same id (an item repeated inline, the same item referenced
  // twice) were stored under that id, so `after` (the first item with the id) could not move past them:
  // paging by last_id, as the SDK's auto-pagination does, returned the same page forever.
  test("each is listed once: a repeat gets an id of its own, and paging by last_id reaches the end", async () => {
    const first = await made({ input: "Say hi" });
    const msg = rec(arr(first.output).find((o) => rec(o).type === "message"));
    const same = { type: "message", id: "msg_same", role: "user", content: "again" };
    const call = { type: "function_call", id: "fc_same", call_id: "c1", name: "f", arguments: "{}" };
    const input = [same, { ...same, content: "and again" }, { type: "item_reference", id: msg.id }, { id: msg.id }, call, { type: "function_call_output", call_id: "c1", output: "x" }, same];
    const r = await made({ input });
    const seen: Record<string, unknown>[] = [];
    let after = "";
    for (let pages = 0; pages <= input.length; pages++) {
      const res = await get(`/v1/responses/${String(r.id)}/input_items?order=asc&limit=1${after ? `&after=${after}` : ""}`);
      expect(res.status).toBe(200);
      const page = rec(await res.json());
      seen.push(...arr(page.data).map(rec));
      if (!page.has_more) break;
      after = String(page.last_id);
    }
    expect(seen.map((i) => [i.type, i.type === "message" ? rec(arr(i.content)[0]).text : (i.name ?? i.output)])).toEqual([
      ["message", "again"],
      ["message", "and again"],
      ["message", "token0 token1 token2 token3 "],
      ["message", "token0 token1 token2 token3 "],
      ["function_call", "f"],
      ["function_call_output", "x"],
      ["message", "again"],
    ]);
    const ids = seen.map((i) => String(i.id));
    expect(new Set(ids).size).toBe(input.length);
    // The first item with an id keeps it; a repeat gets a new one of its type's prefix.
    expect(ids[0]).toBe("msg_same");
    expect(ids[2]).toBe(String(msg.id));
    for (const k of [1, 3, 6]) expect(ids[k]).toMatch(/^msg_[0-9a-f]{32}$/);
    expect(ids[4]).toBe("fc_same");
    // What goes upstream is unchanged by the ids.
    expect(upstreamMessages().map((m) => rec(m).role)).toEqual(["user", "user", "assistant", "assistant", "tool", "user"]);
  });
});

describe("previous_response_id", () => {
  test("replays the stored conversation, recursively, before the new input; instructions are not carried over", async () => {
    const first = await made({ instructions: "Be brief.", input: "My name is Ada." });
    const second = await made({ previous_response_id: first.id, input: "What is my name?" });
    expect(second.previous_response_id).toBe(first.id);
    // Stored input items hold their text as parts (the form input_items lists), so they are replayed as parts.
    const ada = { role: "user", content: [{ type: "text", text: "My name is Ada." }] };
    expect(upstreamMessages()).toEqual([ada, { role: "assistant", content: "token0 token1 token2 token3 " }, { role: "user", content: "What is my name?" }]);
    const thirdId = await madeStreamed({ previous_response_id: second.id, instructions: "Now in French.", input: [{ role: "user", content: "Again?" }] });
    expect(upstreamMessages()).toEqual([
      { role: "system", content: "Now in French." },
      ada,
      { role: "assistant", content: "token0 token1 token2 token3 " },
      { role: "user", content: [{ type: "text", text: "What is my name?" }] },
      { role: "assistant", content: "token0 token1 token2 token3 " },
      { role: "user", content: "Again?" },
    ]);
    // Input items are the response's own, not the replayed conversation.
    const items = rec(await (await get(`/v1/responses/${thirdId}/input_items`)).json());
    expect(arr(items.data).length).toBe(1);
  });

  test("a function call round trip replays as chat tool calls", async () => {
    const tools = [{ type: "function", name: "get_weather", parameters: { type: "object", properties: { location: { type: "string" } } } }];
    const first = await made({ input: "What is the weather in Paris?", tools });
    const call = rec(arr(first.output).find((o) => rec(o).type === "function_call"));
    expect(call.name).toBe("get_weather");
    await made({ previous_response_id: first.id, tools, input: [{ type: "function_call_output", call_id: call.call_id, output: "sunny" }] });
    const messages = upstreamMessages().map(rec);
    expect(messages.map((m) => m.role)).toEqual(["user", "assistant", "tool"]);
    expect(arr(messages[1]?.tool_calls)).toEqual([{ id: call.call_id, type: "function", function: { name: "get_weather", arguments: call.arguments } }]);
    expect(messages[2]).toEqual({ role: "tool", tool_call_id: call.call_id, content: "sunny" });
  });

  test("a replay that starts after a deleted link leaves out the function_call_outputs whose calls went with it", async () => {
    // A chat upstream refuses a tool message without its call, as the gateway does a client's: the conversation would be stuck.
    const tools = [{ type: "function", name: "get_weather", parameters: { type: "object", properties: { location: { type: "string" } } } }];
    const first = await made({ input: "What is the weather in Paris?", tools });
    const call = rec(arr(first.output).find((o) => rec(o).type === "function_call"));
    const second = await made({ previous_response_id: first.id, tools, input: [{ type: "function_call_output", call_id: call.call_id, output: "sunny" }] });
    await get(`/v1/responses/${String(first.id)}`, org.personalKey, "DELETE");
    await made({ previous_response_id: second.id, tools, input: "Thanks!" });
    expect(upstreamMessages().map((m) => rec(m).role)).toEqual(["assistant", "user"]);
  });

  test("the replay reads at most bodyLimitBytes of stored responses: older ones beyond it are left out", async () => {
    // Seen failing before the bound: all three earlier inputs went upstream (the chain was read whole, however large).
    const small = await startTestGateway({
      aliases: testAliases(sim.url),
      plans: TEST_PLANS,
      upstream: upstreamSettings({ attempts: 2 }),
      responses: { enabled: true },
      bodyLimitBytes: 4096,
    });
    try {
      const at = async (input: string, previous?: unknown) => {
        const res = await post(small, "/v1/responses", org.personalKey, { model: "svc-fast", input, ...(previous ? { previous_response_id: previous } : {}) });
        expect(res.status).toBe(200);
        return rec(await res.json()).id;
      };
      // Each stored response is ~3.5 KB (its input, and the Response echoing nothing of it but its output).
      const one = await at(`one ${"a".repeat(1500)}`);
      const two = await at(`two ${"b".repeat(1500)}`, one);
      const three = await at(`three ${"c".repeat(1500)}`, two);
      await at("four", three);
      const sent = JSON.stringify(upstreamMessages());
      expect(sent).toContain("three ");
      expect(sent).not.toContain("one ");
      expect(sent.length).toBeLessThan(2 * 4096);
    } finally {
      await small.stop();
    }
  });

  test("unknown, deleted and store:false ids are 404 with param previous_response_id; nothing goes upstream", async () => {
    await notFound(await create({ model: "svc-fast", input: "x", previous_response_id: "resp_unknown" }), "previous_response_id");
    const gone = await made({ input: "x" });
    await get(`/v1/responses/${String(gone.id)}`, org.personalKey, "DELETE");
    await notFound(await create({ model: "svc-fast", input: "x", previous_response_id: gone.id }), "previous_response_id");
    const unstored = await made({ input: "x", store: false });
    sim.reset();
    await notFound(await create({ model: "svc-fast", input: "x", previous_response_id: unstored.id }), "previous_response_id");
    expect(sim.stats.requests).toBe(0);
  });

  test("an expired response is 404 everywhere, and the sweep deletes it in batches", async () => {
    const r = await made({ input: "old" });
    const id = String(r.id);
    await gw.database.rows(sql`update responses set expires_at = now() - interval '1 second' where id = ${id}`);
    await notFound(await get(`/v1/responses/${id}`));
    await notFound(await create({ model: "svc-fast", input: "x", previous_response_id: id }), "previous_response_id");
    const keep = String((await made({ input: "new" })).id);
    const store = createResponseStore(gw.database, { retentionDays: 30, log: createLogger("silent"), maxReplayBytes: 1 << 20 });
    expect(await store.sweep()).toBeGreaterThanOrEqual(1);
    expect(await gw.database.rows(sql`select id from responses where id = ${id}`)).toEqual([]);
    expect((await gw.database.rows(sql`select id from responses where id = ${keep}`)).length).toBe(1);
  });

  // decisions.md, previous_response_id: "If an older link of the chain has expired or been deleted, the replay starts after it."
  test("an expired older link ends the replay: it and everything before it are left out", async () => {
    const first = await made({ input: "Turn one." });
    const second = await made({ previous_response_id: first.id, input: "Turn two." });
    const third = await made({ previous_response_id: second.id, input: "Turn three." });
    await gw.database.rows(sql`update responses set expires_at = now() - interval '1 second' where id = ${String(second.id)}`);
    await made({ previous_response_id: third.id, input: "Turn four." });
    expect(upstreamMessages()).toEqual([
      { role: "user", content: [{ type: "text", text: "Turn three." }] },
      { role: "assistant", content: "token0 token1 token2 token3 " },
      { role: "user", content: "Turn four." },
    ]);
  });

  // decisions.md, previous_response_id: "at most 1,000 responses back".
  test("at most 1,000 responses are replayed: the oldest of a chain of 1,001 is left out", async () => {
    const oldest = await made({ input: "The oldest turn." });
    const prefix = `resp_chain${crypto.randomUUID().replaceAll("-", "")}_`;
    // Each row's own input item, "turn g" (g the series' number).
    const item = sql.raw(`'[{"id":"msg_c' || g || '","type":"message","role":"user","content":[{"type":"input_text","text":"turn ' || g || '"}],"status":"completed"}]'`);
    // 1,000 more, each answering the one before: ${prefix}1 follows the oldest, ${prefix}1000 is the newest.
    await gw.database.rows(sql`
      insert into responses (id, org_id, owner_user_id, owner_key_id, previous_response_id, input_items, response, expires_at)
      select ${prefix} || g, org_id, owner_user_id, owner_key_id,
        case when g = 1 then id else ${prefix} || (g - 1) end, ${item}, response, expires_at
      from responses, generate_series(1, 1000) g where id = ${String(oldest.id)}`);
    await made({ previous_response_id: `${prefix}1000`, input: "Now." });
    const messages = upstreamMessages().map(rec);
    expect(messages.length).toBe(2 * 1000 + 1);
    expect(messages[0]).toEqual({ role: "user", content: [{ type: "text", text: "turn 1" }] });
    expect(messages.at(-3)).toEqual({ role: "user", content: [{ type: "text", text: "turn 1000" }] });
    expect(JSON.stringify(messages)).not.toContain("The oldest turn.");
  });

  test("the retention is responses.retentionDays", async () => {
    const id = String((await made({ input: "x" })).id);
    const [row] = await gw.database.rows<{ days: number }>(sql`select round(extract(epoch from expires_at - created_at) / 86400) as days from responses where id = ${id}`);
    expect(Number(row?.days)).toBe(30);
  });
});

describe("item_reference", () => {
  // Seen failing before: every item_reference was 400 on input[j].type ("item_reference is not supported
  // here"), so the Vercel AI SDK's default provider (store: true) could not hold a conversation.
  const outputItem = (r: Record<string, unknown>, type: string) => rec(arr(r.output).find((o) => rec(o).type === type));
  const ANSWER = "token0 token1 token2 token3 ";

  test("an earlier answer's output items, referenced by id (with or without type), go upstream in their place", async () => {
    await fetch(`${sim.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify({ reasoning: "Thinking." }) });
    const first = await made({ input: "Say hi" });
    const msg = outputItem(first, "message");
    const reasoning = outputItem(first, "reasoning");
    expect(String(msg.id)).toMatch(/^msg_/);
    const second = await made({
      input: [{ role: "user", content: "Say hi" }, { type: "item_reference", id: reasoning.id }, { id: msg.id }, { role: "user", content: "Again" }],
    });
    expect(second.status).toBe("completed");
    // The reasoning item is dropped as any reasoning input is; the message becomes the assistant's turn.
    expect(upstreamMessages()).toEqual([
      { role: "user", content: "Say hi" },
      { role: "assistant", content: ANSWER },
      { role: "user", content: "Again" },
    ]);
    // The new response's input items hold the items referenced, not the references.
    const items = arr(rec(await (await get(`/v1/responses/${String(second.id)}/input_items?order=asc`)).json()).data).map(rec);
    expect(items.map((i) => [i.type, i.id])).toEqual([
      ["message", items[0]?.id],
      ["reasoning", reasoning.id],
      ["message", msg.id],
      ["message", items[3]?.id],
    ]);
    expect(items[2]?.content).toEqual(msg.content);
  });

  test("a streamed answer's function call, referenced, replays as the assistant's tool call", async () => {
    const tools = [{ type: "function", name: "get_weather", parameters: { type: "object", properties: { location: { type: "string" } } } }];
    const id = await madeStreamed({ input: "What is the weather in Paris?", tools });
    const first = rec(await (await get(`/v1/responses/${id}`)).json());
    const call = outputItem(first, "function_call");
    await made({
      tools,
      input: [{ role: "user", content: "What is the weather in Paris?" }, { type: "item_reference", id: call.id }, { type: "function_call_output", call_id: call.call_id, output: "sunny" }],
    });
    const messages = upstreamMessages().map(rec);
    expect(messages.map((m) => m.role)).toEqual(["user", "assistant", "tool"]);
    expect(arr(messages[1]?.tool_calls)).toEqual([{ id: call.call_id, type: "function", function: { name: "get_weather", arguments: call.arguments } }]);
  });

  test("unknown, deleted, store:false and foreign items are 404 with param input[j]; nothing goes upstream", async () => {
    const kept = await made({ input: "x" });
    const gone = await made({ input: "x" });
    await get(`/v1/responses/${String(gone.id)}`, org.personalKey, "DELETE");
    const unstored = await made({ input: "x", store: false });
    const other = await seedTestOrg(gw.database);
    const foreign = await made({ input: "x" }, other.personalKey);
    const service = await made({ input: "x" }, org.serviceKey);
    sim.reset();
    for (const r of [gone, unstored, foreign, service]) {
      const res = await create({ model: "svc-fast", input: [{ role: "user", content: "x" }, { type: "item_reference", id: outputItem(r, "message").id }] });
      await notFound(res, "input[1]");
    }
    const res = await create({ model: "svc-fast", input: [{ type: "item_reference", id: outputItem(kept, "message").id }, { type: "item_reference", id: "msg_unknown" }] });
    const err = await errorOf(res);
    expect({ status: res.status, code: err.code, param: err.param }).toEqual({ status: 404, code: "not_found", param: "input[1]" });
    expect(err.message).toContain("'msg_unknown'");
    expect(sim.stats.requests).toBe(0);
  });

  test("a reference is resolved with previous_response_id and is charged like inline input", async () => {
    const first = await made({ input: "My name is Ada." });
    const second = await made({ previous_response_id: first.id, input: [{ type: "item_reference", id: outputItem(first, "message").id }, { role: "user", content: "And?" }] });
    expect(upstreamMessages().map((m) => rec(m).role)).toEqual(["user", "assistant", "assistant", "user"]);
    expect(rec(second.usage).input_tokens).toBeGreaterThan(rec(first.usage).input_tokens as number);
  });

  test("the items referenced are read up to bodyLimitBytes of stored responses; beyond, 400 on the first one left", async () => {
    const small = await startTestGateway({
      aliases: testAliases(sim.url),
      plans: TEST_PLANS,
      upstream: upstreamSettings({ attempts: 2 }),
      responses: { enabled: true },
      bodyLimitBytes: 6000,
    });
    try {
      const ids: unknown[] = [];
      for (let i = 0; i < 3; i++) {
        // Each stored Response is ~2.6 KB (it echoes its instructions): two fit in 6,000 bytes, three do not.
        const res = await post(small, "/v1/responses", org.personalKey, { model: "svc-fast", instructions: "i".repeat(1500), input: "x" });
        ids.push(outputItem(rec(await res.json()), "message").id);
      }
      sim.reset();
      const two = await post(small, "/v1/responses", org.personalKey, { model: "svc-fast", input: ids.slice(0, 2).map((id) => ({ type: "item_reference", id })) });
      expect(two.status).toBe(200);
      const three = await post(small, "/v1/responses", org.personalKey, { model: "svc-fast", input: ids.map((id) => ({ type: "item_reference", id })) });
      const err = await errorOf(three);
      expect({ status: three.status, code: err.code, param: err.param }).toEqual({ status: 400, code: "invalid_request_error", param: "input[2]" });
      expect(err.message).toContain("6000 bytes");
      expect(sim.stats.requests).toBe(1);
    } finally {
      await small.stop();
    }
  });
});

describe("item_reference: many references", () => {
  // Seen failing before: the statement that resolved references compared every referenced id with every
  // id of every stored response it hit, (rows hit) x (ids per row) x (ids referenced): 10,000 references
  // to 1,000 stored responses of 100 items each held the database for 38 s (Postgres) to 51 s (embedded).
  const MAX = 10_000;
  const ROWS = 1_000;
  const PER_ROW = 100;
  // Unique per run: a Postgres test database keeps the rows of earlier runs.
  const run = crypto.randomUUID().slice(0, 8);
  const itemId = (r: number, m: number) => `msg_many${run}x${r}x${m}`;
  let caller: SeededOrg;

  beforeAll(async () => {
    caller = await seedTestOrg(gw.database);
    // Stored as the gateway stores answers (the save queue), each answer of PER_ROW output messages.
    const store = createResponseStore(gw.database, { retentionDays: 30, log: createLogger("silent"), maxReplayBytes: 1 << 24 });
    const saves: Promise<void>[] = [];
    for (let r = 0; r < ROWS; r++) {
      const id = `resp_many${run}x${r}`;
      const output = Array.from({ length: PER_ROW }, (_, m) => ({
        type: "message",
        id: itemId(r, m),
        role: "assistant",
        status: "completed",
        content: [{ type: "output_text", text: "x", annotations: [] }],
      }));
      saves.push(store.save({ id, principal: principalOf(caller), previousResponseId: null, inputItems: [], response: { id, object: "response", output } }));
    }
    await Promise.all(saves);
  }, 300_000);

  /** MAX distinct references: one item of each stored response, the rest unknown ids. */
  const references = (n: number) =>
    Array.from({ length: n }, (_, j) => ({ type: "item_reference", id: j % (MAX / ROWS) === 0 ? itemId(j / (MAX / ROWS), PER_ROW / 2) : `msg_unknown${j}` }));

  test(`${MAX.toLocaleString("en")} different references, ${ROWS.toLocaleString("en")} of them to stored items: answered at once (404 on the first unknown one)`, async () => {
    const res = await fetch(`${gw.url}/v1/responses`, {
      method: "POST",
      headers: { authorization: `Bearer ${caller.personalKey}`, "content-type": "application/json" },
      body: JSON.stringify({ model: "svc-fast", input: references(MAX) }),
      // Generous: the statement takes well under a second on either database; the old one 38 to 51 s.
      signal: AbortSignal.timeout(10_000),
    });
    await notFound(res, "input[1]");
  });

  test(`the references found are all resolved: ${ROWS.toLocaleString("en")} stored items among ${MAX.toLocaleString("en")} references, the same items repeated`, async () => {
    const found = references(MAX).filter((r) => r.id.startsWith("msg_many"));
    const res = await fetch(`${gw.url}/v1/responses`, {
      method: "POST",
      headers: { authorization: `Bearer ${caller.personalKey}`, "content-type": "application/json" },
      // The same ids again: each resolves to its item again.
      body: JSON.stringify({ model: "svc-fast", input: [...found, ...found, { role: "user", content: "go" }] }),
      signal: AbortSignal.timeout(10_000),
    });
    expect(res.status).toBe(200);
    const messages = upstreamMessages();
    expect(messages.length).toBe(2 * ROWS + 1);
    expect(rec(messages[0])).toEqual({ role: "assistant", content: "x" });
  });

  test(`${(MAX + 1).toLocaleString("en")} different references: 400 on the first beyond ${MAX.toLocaleString("en")}; nothing goes upstream`, async () => {
    const input = [{ role: "user", content: "x" }, ...references(MAX / 2), ...references(MAX / 2), ...references(MAX + 1)];
    const res = await create({ model: "svc-fast", input }, caller.personalKey);
    const err = await errorOf(res);
    // Repeated ids count once: the first reference beyond the bound is the last item.
    expect({ status: res.status, code: err.code, param: err.param }).toEqual({ status: 400, code: "invalid_request_error", param: `input[${input.length - 1}]` });
    expect(err.message).toContain(`${MAX}`);
    expect(sim.stats.requests).toBe(0);
  });
});

describe("ownership", () => {
  test("a personal key's responses: any personal key of that user; not another user's, not the org's service key", async () => {
    const r = await made({ input: "mine" });
    const id = String(r.id);
    const sameUser = await createKey(gw.database, { orgId: org.orgId, userId: org.userId, kind: "personal", scopes: ["inference"], knownModels: ["svc-fast"], tag: "gw" });
    expect((await get(`/v1/responses/${id}`, sameUser.key)).status).toBe(200);
    expect((await create({ model: "svc-fast", input: "x", previous_response_id: id, store: false }, sameUser.key)).status).toBe(200);

    const other = await seedTestOrg(gw.database);
    const service = await createKey(gw.database, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: ["svc-fast"], tag: "gw" });
    const person = await createUser(gw.database, { orgId: org.orgId, name: "Colleague", email: `c-${crypto.randomUUID().slice(0, 8)}@example.com` });
    const colleague = await createKey(gw.database, { orgId: org.orgId, userId: person.id, kind: "personal", scopes: ["inference"], knownModels: ["svc-fast"], tag: "gw" });
    for (const key of [other.personalKey, other.serviceKey, org.serviceKey, service.key, colleague.key]) {
      await notFound(await get(`/v1/responses/${id}`, key));
      await notFound(await get(`/v1/responses/${id}/input_items`, key));
      await notFound(await get(`/v1/responses/${id}`, key, "DELETE"));
      await notFound(await create({ model: "svc-fast", input: "x", previous_response_id: id }, key), "previous_response_id");
    }
    expect((await get(`/v1/responses/${id}`)).status).toBe(200);
  });

  test("a service key's responses: that key and the keys rotated from it; not a sibling service key", async () => {
    const svc = await seedTestOrg(gw.database);
    const id = String((await made({ input: "service" }, svc.serviceKey)).id);
    const rotated = await rotateKey(gw.database, { id: svc.serviceKeyId, graceMs: 60_000, tag: "gw" });
    const again = await rotateKey(gw.database, { id: rotated.id, graceMs: 60_000, tag: "gw" });
    expect((await get(`/v1/responses/${id}`, again.key)).status).toBe(200);
    // And what the newest key stores, the original (still in its grace period) reads.
    const newer = String((await made({ input: "from the rotated key" }, again.key)).id);
    expect((await get(`/v1/responses/${newer}`, svc.serviceKey)).status).toBe(200);
    await notFound(await get(`/v1/responses/${id}`, svc.personalKey));
    const sibling = await createKey(gw.database, { orgId: svc.orgId, kind: "service", scopes: ["inference"], knownModels: ["svc-fast"], tag: "gw" });
    await notFound(await get(`/v1/responses/${id}`, sibling.key));
  });
});

describe("damaged rows and database failures", () => {
  // Seen failing before: each of these answered 500 internal_error (JSON.parse of the row, a malformed
  // replayed item reaching the chat translation, the database error thrown as is).
  test("a damaged stored row is never a crash: unreadable items are not replayed, an unreadable response is 404", async () => {
    const first = await made({ input: "kept" });
    const id = String(first.id);
    const bad = JSON.stringify([{ type: "message", role: "user", content: 5 }, { role: "user", content: "kept too" }, "x"]);
    await gw.database.rows(sql`update responses set input_items = ${bad}, response = ${'{"output":[{"type":"message","role":"assistant"}]}'} where id = ${id}`);
    const next = await create({ model: "svc-fast", input: "next", previous_response_id: id });
    expect(next.status).toBe(200);
    expect(upstreamMessages()).toEqual([{ role: "user", content: "kept too" }, { role: "user", content: "next" }]);
    const items = await get(`/v1/responses/${id}/input_items`);
    expect(items.status).toBe(200);

    await gw.database.rows(sql`update responses set response = ${"{not json"}, input_items = ${"nor this"} where id = ${id}`);
    await notFound(await get(`/v1/responses/${id}`));
    const again = await create({ model: "svc-fast", input: "again", previous_response_id: id });
    expect(again.status).toBe(200);
    expect(upstreamMessages()).toEqual([{ role: "user", content: "again" }]);
  });

  test("the database failing is 503 service_unavailable on every read path, never a 500", async () => {
    const id = String((await made({ input: "x" })).id);
    await gw.database.rows(sql`alter table responses rename to responses_away`);
    try {
      for (const res of [
        await get(`/v1/responses/${id}`),
        await get(`/v1/responses/${id}/input_items`),
        await get(`/v1/responses/${id}`, org.personalKey, "DELETE"),
        await create({ model: "svc-fast", input: "x", previous_response_id: id }),
        await create({ model: "svc-fast", input: [{ type: "item_reference", id: "msg_1" }] }),
        await get(`/v1/responses/${id}/cancel`, org.personalKey, "POST"),
        await post(gw, "/v1/responses/input_tokens", org.personalKey, { model: "svc-fast", input: "x", previous_response_id: id }),
      ]) {
        const err = await errorOf(res);
        expect({ status: res.status, code: err.code }).toEqual({ status: 503, code: "service_unavailable" });
      }
      // Storing fails too, after the answer: the answer is still given.
      expect((await create({ model: "svc-fast", input: "y" })).status).toBe(200);
    } finally {
      await gw.database.rows(sql`alter table responses_away rename to responses`);
    }
  });
});

describe("responses.store: false", () => {
  test("nothing is stored; previous_response_id and item_reference are 400 saying so; retrieve is 404", async () => {
    const res = await create({ model: "svc-fast", input: "x" }, org.personalKey, noStore);
    expect(res.status).toBe(200);
    const r = rec(await res.json());
    expect(r.store).toBe(false);
    const [row] = await gw.database.rows(sql`select id from responses where id = ${String(r.id)}`);
    expect(row).toBeUndefined();
    const prev = await create({ model: "svc-fast", input: "x", previous_response_id: "resp_abc" }, org.personalKey, noStore);
    expect(prev.status).toBe(400);
    const err = await errorOf(prev);
    expect(err.param).toBe("previous_response_id");
    expect(err.message).toContain("responses.store");
    const ref = await create({ model: "svc-fast", input: [{ type: "item_reference", id: "msg_abc" }] }, org.personalKey, noStore);
    const refErr = await errorOf(ref);
    expect({ status: ref.status, param: refErr.param }).toEqual({ status: 400, param: "input[0]" });
    expect(refErr.message).toContain("responses.store");
    await notFound(await get(`/v1/responses/${String(r.id)}`, org.personalKey, "GET", noStore));
  });
});

describe("the save queue", () => {
  const principal = (): Principal => principalOf(org);
  const saveInput = (id: string) => ({ id, principal: principal(), previousResponseId: null, inputItems: [], response: { id, object: "response", output: [] } });
  const storeOf = () => createResponseStore(gw.database, { retentionDays: 30, log: createLogger("silent"), maxReplayBytes: 1 << 20 });
  const ids = (n: number) => Array.from({ length: n }, () => `resp_${crypto.randomUUID().replaceAll("-", "")}`);
  const count = async (list: string[]) =>
    Number((await gw.database.rows<{ n: number }>(sql`select count(*)::int as n from responses where id in (${sql.join(list.map((i) => sql`${i}`), sql`, `)})`))[0]?.n);

  test("responses ending together share INSERTs; each save settles once its row is committed", async () => {
    const store = storeOf();
    const list = ids(60);
    const before = gw.database.transactions?.();
    await Promise.all(list.map((id) => store.save(saveInput(id))));
    const after = gw.database.transactions?.();
    expect(await count(list)).toBe(60);
    // The embedded database counts its statements: 60 single inserts were 60 (Postgres does not count).
    if (before !== undefined && after !== undefined) expect(after - before).toBeLessThanOrEqual(2);
    const got = await store.get(principal(), list[0] ?? "");
    expect(got?.response.id).toBe(list[0]);
  });

  test("a row the database refuses fails alone; the rest of its batch is written", async () => {
    const store = storeOf();
    const list = ids(9);
    const taken = list[4] ?? "";
    await store.save(saveInput(taken));
    const results = await Promise.allSettled(list.map((id) => store.save(saveInput(id))));
    expect(results.map((r) => r.status)).toEqual(list.map((id) => (id === taken ? "rejected" : "fulfilled")));
    expect(await count(list)).toBe(9);
  });

  test("with write spacing, saves arriving one by one share statements; the first after a quiet spell is written at once", async () => {
    const spacingMs = 600;
    const store = createResponseStore(gw.database, { retentionDays: 30, log: createLogger("silent"), maxReplayBytes: 1 << 20, writeSpacingMs: spacingMs });
    const list = ids(12);
    const t0 = performance.now();
    const settled: number[] = [];
    const saves: Promise<void>[] = [];
    // One save every 25 ms for 300 ms: without spacing each is its own statement (its own turn of the loop).
    for (const id of list) {
      saves.push(store.save(saveInput(id)).then(() => void settled.push(performance.now() - t0)));
      await Bun.sleep(25);
    }
    await Promise.all(saves);
    expect(await count(list)).toBe(12);
    // The first went out at once, the rest waited for the next slot: two statements (three on a slow machine).
    // Rows of one statement share its transaction's now(); the database's own transaction count would also
    // count the usage writer's and the key cache's writes running meanwhile.
    const [row] = await gw.database.rows<{ n: number }>(
      sql`select count(distinct created_at)::int as n from responses where id in (${sql.join(list.map((i) => sql`${i}`), sql`, `)})`,
    );
    expect(Number(row?.n)).toBeGreaterThanOrEqual(2);
    expect(Number(row?.n)).toBeLessThanOrEqual(3);
    const sorted = [...settled].sort((a, b) => a - b);
    expect(sorted[0]).toBeLessThan(spacingMs / 2);
    expect(sorted[sorted.length - 1]).toBeGreaterThanOrEqual(spacingMs - 50);
    // Quiet again for longer than the spacing: the next save does not wait for it.
    await Bun.sleep(spacingMs + 50);
    const t1 = performance.now();
    await store.save(saveInput(ids(1)[0] ?? ""));
    expect(performance.now() - t1).toBeLessThan(spacingMs / 2);
  });

  test("the embedded database spaces its writes; a Postgres server does not", () => {
    expect(writeSpacingFor("pglite")).toBeGreaterThan(0);
    expect(writeSpacingFor("postgres")).toBe(0);
  });

  test("a response that cannot be written as JSON is a rejected save, never a throw past the caller's catch", async () => {
    const store = storeOf();
    const cyclic: Record<string, unknown> = { id: "x", object: "response", output: [] };
    cyclic.self = cyclic;
    const [id] = ids(1);
    let saved: Promise<void> | undefined;
    expect(() => {
      saved = store.save({ ...saveInput(id ?? ""), response: cyclic });
    }).not.toThrow();
    expect(await saved?.then(() => "written", (e: unknown) => (e instanceof Error ? "rejected" : "odd"))).toBe("rejected");
    expect(await count([id ?? ""])).toBe(0);
  });

  test("stop writes what is still queued", async () => {
    const store = storeOf();
    const list = ids(30);
    const saves = list.map((id) => store.save(saveInput(id)));
    await store.stop();
    expect(await count(list)).toBe(30);
    await Promise.all(saves);
  });
});
