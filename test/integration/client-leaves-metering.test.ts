import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { and, eq } from "drizzle-orm";
import { usageCounters, usageEvents } from "../../src/db/schema.ts";
import { createLogger } from "../../src/lib/log.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import { type SeededOrg, sharedDatabase, testConfig } from "../helpers/harness.ts";
import { until } from "../helpers/poll.ts";
import { sample, scrapeOf } from "../helpers/scrape.ts";
import { CHAT_MODEL, EMBED_MODEL, TEST_PLANS, chatAlias, embedAlias, post, seedTestOrg, upstreamSettings, userMessages, chargesOf } from "./inference-fixtures.ts";

setDefaultTimeout(60_000);

/**
 * docs/decisions.md, "A client that leaves is still charged the prompt
 * estimate": once the request was sent upstream (the upstream has the prompt
 * and works on it), a client that leaves before the first byte of the answer
 * is charged the prompt estimate, as 499, whether it asked for a stream or a
 * whole answer (chat, Responses, embeddings); a client that leaves while its
 * request still waits for quota never reached the upstream and is charged
 * nothing. Before, a non-streamed request (and a stream whose upstream had
 * not answered yet) was charged nothing: the upstream's work was free, and an
 * SDK's timeout and retry got it again.
 */

/** When true the upstream holds every request until its client leaves; else it answers at once, with no usage (charged by estimate). */
let hold = true;
/** Requests the upstream received. */
let received = 0;
/** Requests whose connection the gateway closed while the upstream held them. */
let cancelled = 0;

const upstream = Bun.serve({
  hostname: "127.0.0.1",
  port: 0,
  idleTimeout: 0,
  async fetch(req) {
    const body = (await req.json()) as { stream?: boolean };
    received++;
    if (hold) {
      await new Promise<void>((resolve) => req.signal.addEventListener("abort", () => resolve(), { once: true }));
      cancelled++;
      return new Response(null, { status: 499 });
    }
    const head = { id: "c1", created: 1, model: CHAT_MODEL };
    if (new URL(req.url).pathname.endsWith("/embeddings")) {
      return Response.json({ object: "list", model: EMBED_MODEL, data: [{ object: "embedding", index: 0, embedding: [0.5, 0.5] }] });
    }
    if (!body.stream) return Response.json({ ...head, object: "chat.completion", choices: [{ index: 0, message: { role: "assistant", content: "" }, finish_reason: "stop" }] });
    const last = { ...head, object: "chat.completion.chunk", choices: [{ index: 0, delta: {}, finish_reason: "stop" }] };
    return new Response(`data: ${JSON.stringify(last)}\n\ndata: [DONE]\n\n`, { headers: { "content-type": "text/event-stream" } });
  },
});
const base = `http://127.0.0.1:${upstream.port}/v1`;

let gw: Gateway;
const lines: Record<string, unknown>[] = [];

beforeAll(async () => {
  const config = await testConfig({
    aliases: { "svc-fast": chatAlias([{ baseUrl: base }]), "svc-embed": embedAlias([{ baseUrl: base }]) },
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 1 }, { firstByteMs: 30_000 }),
    responses: { enabled: true },
    accessLog: true,
    quota: { leaseTokens: 100, flushMs: 4_000, maxBuffered: 100_000 },
  });
  gw = await startGateway({ config, database: await sharedDatabase(), log: createLogger("info", (l) => lines.push(JSON.parse(l) as Record<string, unknown>)) });
});
afterEach(() => {
  hold = true;
});
afterAll(async () => {
  await gw?.stop();
  await upstream.stop(true);
});

type Kind = { name: string; path: string; body: Record<string, unknown>; route: string };
const KINDS: Kind[] = [
  { name: "chat", path: "/v1/chat/completions", body: { model: "svc-fast", messages: userMessages() }, route: "/v1/chat/completions" },
  { name: "chat stream", path: "/v1/chat/completions", body: { model: "svc-fast", messages: userMessages(), stream: true }, route: "/v1/chat/completions" },
  { name: "responses", path: "/v1/responses", body: { model: "svc-fast", input: "hi", store: false }, route: "/v1/responses" },
  { name: "responses stream", path: "/v1/responses", body: { model: "svc-fast", input: "hi", store: false, stream: true }, route: "/v1/responses" },
  { name: "embeddings", path: "/v1/embeddings", body: { model: "svc-embed", input: "hi" }, route: "/v1/embeddings" },
];

const eventsOf = (orgId: string) => chargesOf(gw, orgId);

/** What the gateway charges this request by its own estimate: answered at once with no usage, the prompt estimate and no completion. */
async function estimateOf(kind: Kind): Promise<number> {
  hold = false;
  const o = await seedTestOrg(gw.database);
  const res = await post(gw, kind.path, o.personalKey, kind.body);
  expect(res.status).toBe(200);
  await res.text();
  await until(async () => (await eventsOf(o.orgId)).length > 0, `the record of ${kind.name}`, 10_000, 20);
  const [row] = await eventsOf(o.orgId);
  hold = true;
  return row?.prompt ?? -1;
}

/** The access line of the org's one request, once written. */
async function accessLineOf(o: SeededOrg): Promise<Record<string, unknown>> {
  await until(() => lines.some((l) => l.msg === "request" && l.org_id === o.orgId), "the access line", 10_000, 20);
  return lines.find((l) => l.msg === "request" && l.org_id === o.orgId) ?? {};
}

describe("a client that leaves before the upstream's first byte", () => {
  for (const kind of KINDS) {
    test(`${kind.name}: sent upstream, then the client leaves: charged the prompt estimate as 499 (usage, counter, access line, metrics)`, async () => {
      const estimate = await estimateOf(kind);
      expect(estimate).toBeGreaterThan(0);
      const o = await seedTestOrg(gw.database, { quotaTokens: 1_000_000, quotaWindow: "day" });
      const before = received;
      const gone = cancelled;
      const metricsBefore = sample(await scrapeOf(gw), "gateway_http_requests_total", { route: kind.route, status: "499" });
      const ac = new AbortController();
      const res = post(gw, kind.path, o.personalKey, kind.body, { signal: ac.signal }).catch(() => undefined);
      await until(() => received > before, "the request upstream", 10_000, 5);
      ac.abort();
      await res;
      // The upstream call is aborted at once (the GPU stops), as before.
      await until(() => cancelled > gone, "the upstream call aborted", 10_000, 5);
      await until(async () => (await eventsOf(o.orgId)).length > 0, "the usage record", 10_000, 20);
      expect({ kind: kind.name, events: await eventsOf(o.orgId) }).toEqual({ kind: kind.name, events: [{ status: 499, prompt: estimate, completion: 0 }] });
      await gw.quota.flush();
      const [counter] = await gw.database.db.select().from(usageCounters).where(eq(usageCounters.orgId, o.orgId));
      expect({ kind: kind.name, used: counter?.used }).toEqual({ kind: kind.name, used: estimate });
      const line = await accessLineOf(o);
      expect({ kind: kind.name, status: line.status, prompt: line.prompt_tokens, completion: line.completion_tokens }).toEqual({ kind: kind.name, status: 499, prompt: estimate, completion: 0 });
      const metricsAfter = sample(await scrapeOf(gw), "gateway_http_requests_total", { route: kind.route, status: "499" });
      expect({ kind: kind.name, more499: metricsAfter - metricsBefore }).toEqual({ kind: kind.name, more499: 1 });
    });
  }

  test("a client that leaves while its request waits for quota never reached the upstream: charged nothing (499)", async () => {
    // Quota 1,200: the held request reserves its prompt bound (512 + 16 + 2) and 500; the waiter as much again.
    const o = await seedTestOrg(gw.database, { quotaTokens: 1_200, quotaWindow: "day" });
    const before = received;
    const holder = new AbortController();
    const held = post(gw, "/v1/chat/completions", o.serviceKey, { model: "svc-fast", messages: userMessages(), max_tokens: 500 }, { signal: holder.signal }).catch(() => undefined);
    await until(() => received > before, "the held request upstream", 10_000, 5);
    const waiter = new AbortController();
    const waiting = post(gw, "/v1/chat/completions", o.personalKey, { model: "svc-fast", messages: userMessages(), max_tokens: 500 }, { signal: waiter.signal }).catch(() => undefined);
    await Bun.sleep(300);
    waiter.abort();
    await waiting;
    holder.abort();
    await held;
    expect(received).toBe(before + 1);
    await until(async () => (await eventsOf(o.orgId)).length === 2, "both records", 10_000, 20);
    const estimate = await estimateOf(KINDS[0] as Kind);
    const rows = await gw.database.db
      .select({ key: usageEvents.keyId, status: usageEvents.status, prompt: usageEvents.promptTokens, completion: usageEvents.completionTokens })
      .from(usageEvents)
      .where(and(eq(usageEvents.orgId, o.orgId), eq(usageEvents.keyId, o.personalKeyId)));
    expect(rows.map(({ status, prompt, completion }) => ({ status, prompt, completion }))).toEqual([{ status: 499, prompt: 0, completion: 0 }]);
    // Its access line says so too (before, 200: the unread 499 Response's status never reached it).
    await until(() => lines.some((l) => l.msg === "request" && l.key_id === o.personalKeyId), "the waiter's access line", 10_000, 20);
    const line = lines.find((l) => l.msg === "request" && l.key_id === o.personalKeyId) ?? {};
    expect([line.status, line.prompt_tokens ?? 0, line.completion_tokens ?? 0]).toEqual([499, 0, 0]);
    // The held one was sent upstream: charged its prompt estimate.
    const heldRows = (await eventsOf(o.orgId)).filter((r) => r.prompt > 0);
    expect(heldRows).toEqual([{ status: 499, prompt: estimate, completion: 0 }]);
  });
});
