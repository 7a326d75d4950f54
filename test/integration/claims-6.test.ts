import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { createKey } from "../../src/admin/service.ts";
import { SYSTEM_ACTOR_ID } from "../../src/lib/ids.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { bearer, errorOf, type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { TEST_PLANS, chatAlias, seedTestOrg, testAliases, upstreamSettings, userMessages } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(90_000);

/**
 * Claims of README.md, docs/operations.md and docs/decisions.md that the
 * earlier rounds (claims-*.test.ts) left without a test able to fail on them.
 * Each test names the claim it holds; each was shown failing against a
 * mutation of src/ that breaks its claim (see the commit messages).
 */

let sim: Simulator;
let gw: Gateway;
let org: SeededOrg;
const stops: (() => unknown)[] = [];

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 5 });
  gw = await startTestGateway({ aliases: testAliases(sim.url), plans: TEST_PLANS, quota: { flushMs: 600_000 } });
  org = await seedTestOrg(gw.database);
});
afterAll(async () => {
  for (const stop of stops.reverse()) await stop();
  await gw.stop();
  await sim.stop();
});

const chat = (g: Gateway, key: string, headers: Record<string, string> = {}, body: Record<string, unknown> = { model: "svc-fast", messages: userMessages() }) =>
  fetch(`${g.url}/v1/chat/completions`, {
    method: "POST",
    headers: bearer(key, { "content-type": "application/json", ...headers }),
    body: JSON.stringify(body),
    signal: AbortSignal.timeout(30_000),
  });

/** The error of a refusal; an answer (200) has none: compared as its status rather than thrown on. */
async function errorOrNone(res: Response): Promise<{ code: string | null; param: string | null }> {
  if (res.status !== 200) return errorOf(res);
  await res.arrayBuffer();
  return { code: null, param: null };
}

describe("the caller's x-request-id (docs/decisions.md, A key sent as the x-request-id: 1 to 128 of [A-Za-z0-9_.:-])", () => {
  test("128 such characters are the caller's id, answered and sent upstream; 129, or any other character, get a generated req_ id instead", async () => {
    const generated = /^req_[0-9a-f]{32}$/;
    const taken = ["A".repeat(128), "a", "Zz09_.:-", `${"x".repeat(100)}:${"9".repeat(27)}`];
    const refused = ["A".repeat(129), "trace/1", "trace 1", "trace=1", "trace%201", "<b>", "a,b", "trace;1", "{x}", "a\tb", "#1", "a+b", "a~b"];
    for (const id of taken) {
      const res = await chat(gw, org.serviceKey, { "x-request-id": id });
      expect(res.status).toBe(200);
      await res.arrayBuffer();
      expect({ id: id.slice(0, 20), answered: res.headers.get("x-request-id") === id, upstream: sim.stats.lastHeaders?.get("x-request-id") === id }).toEqual({
        id: id.slice(0, 20),
        answered: true,
        upstream: true,
      });
    }
    for (const id of refused) {
      const res = await chat(gw, org.serviceKey, { "x-request-id": id });
      expect(res.status).toBe(200);
      await res.arrayBuffer();
      const answered = String(res.headers.get("x-request-id"));
      expect({ id: id.slice(0, 20), generated: generated.test(answered) }).toEqual({ id: id.slice(0, 20), generated: true });
      expect(sim.stats.lastHeaders?.get("x-request-id")).toBe(answered);
    }
  });
});

describe("every attempt answered 429 (docs/decisions.md, Failover: the shortest wait the upstreams' own Retry-After headers gave)", () => {
  test("two targets asking for 40 s and 3 s: the client is told 3 s, in retry-after and in the message, whichever target was tried first", async () => {
    const upstreams = [40, 3].map((wait) =>
      Bun.serve({
        hostname: "127.0.0.1",
        port: 0,
        fetch: () => Response.json({ error: { message: "overloaded" } }, { status: 429, headers: { "retry-after": String(wait) } }),
      }),
    );
    for (const u of upstreams) stops.push(() => u.stop(true));
    const two = await startTestGateway({
      aliases: { "svc-fast": chatAlias(upstreams.map((u) => ({ baseUrl: `http://127.0.0.1:${u.port}/v1` }))) },
      plans: TEST_PLANS,
      upstream: upstreamSettings({ attempts: 2, breakerFailures: 1_000 }),
    });
    stops.push(() => two.stop());
    const o = await seedTestOrg(two.database);
    // Targets are chosen at random: enough requests that both orders are seen (2^-12 that one is not).
    for (let i = 0; i < 12; i++) {
      const res = await chat(two, o.serviceKey);
      const err = await errorOf(res);
      expect({ status: res.status, code: err.code, retryAfter: res.headers.get("retry-after") }).toEqual({ status: 429, code: "rate_limit_error", retryAfter: "3" });
      expect(err.message).toContain("retry after 3 s.");
    }
  });
});

describe("image parts (docs/decisions.md, Roles: image parts only in user messages)", () => {
  test("an image in an assistant or a tool message is 400 on that part's type, whatever its URL; nothing goes upstream; the same image from the user passes", async () => {
    const call = { id: "c1", type: "function", function: { name: "look", arguments: "{}" } };
    const ask = { role: "user", content: "look" };
    const parts = (url: string) => [
      { type: "text", text: "here" },
      { type: "image_url", image_url: { url } },
    ];
    for (const url of ["https://example.com/cat.png", "http://169.254.169.254/latest/meta-data/x.png", "data:image/png;base64,iVBORw0KGgo="]) {
      const cases: [unknown[], string][] = [
        [[ask, { role: "assistant", content: parts(url) }, ask], "messages[1].content[1].type"],
        [[ask, { role: "assistant", content: null, tool_calls: [call] }, { role: "tool", tool_call_id: "c1", content: parts(url) }], "messages[2].content[1].type"],
      ];
      for (const [messages, param] of cases) {
        const before = sim.stats.requests;
        const res = await chat(gw, org.serviceKey, {}, { model: "svc-fast", messages });
        const err = await errorOrNone(res);
        expect({ url: url.slice(0, 30), status: res.status, code: err.code, param: err.param }).toEqual({ url: url.slice(0, 30), status: 400, code: "invalid_request_error", param });
        expect(sim.stats.requests).toBe(before);
      }
    }
    const fromUser = await chat(gw, org.serviceKey, {}, { model: "svc-fast", messages: [{ role: "user", content: parts("data:image/png;base64,iVBORw0KGgo=") }] });
    expect(fromUser.status).toBe(200);
    await fromUser.arrayBuffer();
  });
});

describe("image URL schemes (docs/decisions.md, Roles: image URLs must be `http(s)://` or `data:image/`)", () => {
  test("data: URLs of other media types, file:, javascript: and gopher: are 400 on the URL; http(s) and data:image/ pass", async () => {
    const withImage = (url: string) => ({ model: "svc-fast", messages: [{ role: "user", content: [{ type: "text", text: "what is it?" }, { type: "image_url", image_url: { url } }] }] });
    const refused = [
      "data:text/html;base64,PHNjcmlwdD4=",
      "data:application/octet-stream;base64,AAAA",
      "data:,hello",
      "data:;base64,iVBORw0KGgo=",
      "file:///etc/passwd",
      "javascript:alert(1)",
      "gopher://93.184.215.14/x.png",
    ];
    for (const url of refused) {
      const before = sim.stats.requests;
      const res = await chat(gw, org.serviceKey, {}, withImage(url));
      const err = await errorOrNone(res);
      expect({ url, status: res.status, code: err.code, param: err.param }).toEqual({ url, status: 400, code: "invalid_request_error", param: "messages[0].content[1].image_url.url" });
      expect(sim.stats.requests).toBe(before);
    }
    // Public address literals: no DNS lookup is needed to pass them.
    for (const url of ["http://93.184.215.14/cat.png", "https://93.184.215.14/cat.png", "data:image/png;base64,iVBORw0KGgo="]) {
      const res = await chat(gw, org.serviceKey, {}, withImage(url));
      expect({ url, status: res.status }).toEqual({ url, status: 200 });
      await res.arrayBuffer();
    }
  });
});

describe("audit cursors are bound to every filter (docs/decisions.md, Audit cursors: one reused with different filters gets 400 invalid_body, param cursor)", () => {
  test("`to` and `actor_id` too: a cursor minted under one value of either, or without it, is refused under another, or without it; the same filters take it", async () => {
    const o = await seedTestOrg(gw.database);
    // seedOrg's org, member and key events, and three more: each written by the host's actor.
    for (let i = 0; i < 3; i++) await createKey(gw.database, { orgId: o.orgId, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" });
    const audit = (params: Record<string, string>) => fetch(`${gw.url}/v1/audit-events?${new URLSearchParams(params)}`, { headers: bearer(o.serviceKey) });
    const cursorOf = async (params: Record<string, string>) => {
      const res = await audit({ ...params, limit: "1" });
      expect(res.status).toBe(200);
      const next = ((await res.json()) as { next_cursor: string }).next_cursor;
      expect(next).not.toBe("");
      return next;
    };
    const refused = async (params: Record<string, string>) => {
      const res = await audit(params);
      const err = await errorOrNone(res);
      return { status: res.status, code: err.code, param: err.param };
    };
    const REFUSED = { status: 400, code: "invalid_body", param: "cursor" };
    const to = "2999-01-01T00:00:00Z";
    const otherActor = "6f1c2a4e-8b3d-4c5e-9f70-112233445566";

    const plain = await cursorOf({});
    const byTo = await cursorOf({ to });
    const byActor = await cursorOf({ actor_id: SYSTEM_ACTOR_ID });
    for (const [cursor, params] of [
      [plain, { to }],
      [plain, { actor_id: SYSTEM_ACTOR_ID }],
      [byTo, {}],
      [byTo, { to: "2998-01-01T00:00:00Z" }],
      [byActor, {}],
      [byActor, { actor_id: otherActor }],
    ] as const) {
      expect({ params, got: await refused({ ...params, cursor }) }).toEqual({ params, got: REFUSED });
    }
    // The filters it was minted under (another spelling of the same instant is the same filter).
    for (const [cursor, params] of [
      [plain, {}],
      [byTo, { to: "2999-01-01T01:00:00+01:00" }],
      [byActor, { actor_id: SYSTEM_ACTOR_ID }],
    ] as const) {
      const res = await audit({ ...params, cursor });
      expect({ params, status: res.status }).toEqual({ params, status: 200 });
      await res.arrayBuffer();
    }
  });
});
