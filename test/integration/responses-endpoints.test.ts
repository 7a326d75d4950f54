import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import OpenAI from "openai";
import { createKey, createUser } from "../../src/admin/service.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { errorOf, type SeededOrg, seedOrg, startTestGateway } from "../helpers/harness.ts";
import { SCHEMAS, componentValidator, expectSchema, validOpenApi } from "../helpers/openapi.ts";
import { SAY_HI_PROMPT_TOKENS, TEST_PLANS, post, rec, seedTestOrg, testAliases, upstreamSettings } from "./inference-fixtures.ts";

setDefaultTimeout(30_000);

/**
 * The Responses API's other endpoints, through real HTTP and the unmodified
 * openai SDK: POST /v1/responses/{id}/cancel (no response here was created in
 * background, so an owned one is 400, any other 404), POST
 * /v1/responses/input_tokens (the gateway's estimate of the prompt, the
 * request validated as POST /v1/responses validates it) and POST
 * /v1/responses/compact (refused: it cannot be served on chat upstreams).
 * With responses off, all three are unknown routes.
 */

let sim: Simulator;
let gw: Gateway;
let off: Gateway;
let noStore: Gateway;
let org: SeededOrg;
let auditOnly: string;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 4 });
  const common = { aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: upstreamSettings({ attempts: 2 }) };
  gw = await startTestGateway({ ...common, responses: { enabled: true } });
  off = await startTestGateway(common);
  noStore = await startTestGateway({ ...common, responses: { enabled: true, store: false } });
  org = await seedTestOrg(gw.database);
  auditOnly = (await createKey(gw.database, { orgId: org.orgId, kind: "service", scopes: ["audit:read"], knownModels: [], tag: "gw" })).key;
});
afterEach(() => sim.reset());
afterAll(async () => {
  await gw.stop();
  await off.stop();
  await noStore.stop();
  await sim.stop();
});

const sdk = (key = org.personalKey, g = gw) => new OpenAI({ baseURL: `${g.url}/v1`, apiKey: key, maxRetries: 0 });
/** `key` null: no authorization header. */
const cancel = (id: string, key: string | null = org.personalKey, g = gw, init: RequestInit = {}) =>
  fetch(`${g.url}/v1/responses/${id}/cancel`, { method: "POST", ...init, headers: { ...(key ? { authorization: `Bearer ${key}` } : {}), ...(init.headers as Record<string, string>) } });
const count = (body: unknown, key: string | null = org.personalKey, g = gw, init: RequestInit = {}) => post(g, "/v1/responses/input_tokens", key ?? undefined, body, init);
const compact = (body: unknown, key: string | null = org.personalKey, g = gw, init: RequestInit = {}) => post(g, "/v1/responses/compact", key ?? undefined, body, init);

async function made(body: Record<string, unknown>, key = org.personalKey): Promise<Record<string, unknown>> {
  const res = await post(gw, "/v1/responses", key, { model: "svc-fast", ...body });
  expect(res.status).toBe(200);
  return rec(await res.json());
}

async function expectError(res: Response, status: number, code: string, param: string | null = null): Promise<string> {
  const err = await errorOf(res);
  expect({ status: res.status, code: err.code, param: err.param }).toEqual({ status, code, param });
  return err.message;
}

/** What the SDK threw: its status and the error body's code, param and message. */
async function sdkError(p: Promise<unknown>): Promise<{ status: unknown; code: unknown; param: unknown; message: string }> {
  try {
    await p;
  } catch (e) {
    if (!(e instanceof OpenAI.APIError)) throw e;
    return { status: e.status, code: e.code, param: e.param, message: e.message };
  }
  throw new Error("expected the SDK to throw");
}

describe("off by default", () => {
  test("the three paths answer 404 exactly like an unknown route", async () => {
    for (const path of ["/v1/responses/resp_1/cancel", "/v1/responses/input_tokens", "/v1/responses/compact"]) {
      const res = await post(off, path, org.personalKey, { model: "svc-fast", input: "hi" });
      const err = await errorOf(res);
      expect({ status: res.status, code: err.code, message: err.message }).toEqual({ status: 404, code: "not_found", message: `No route for POST ${path}.` });
    }
  });
});

describe("POST /v1/responses/{id}/cancel", () => {
  test("a stored response of the caller's: 400, only background responses can be cancelled (none is, here); the response is left as it was", async () => {
    const r = await made({ input: "hello" });
    const id = String(r.id);
    const message = await expectError(await cancel(id), 400, "invalid_request_error");
    expect(message).toContain("Cannot cancel a synchronous response");
    expect(message).toContain("background");
    // The SDK's own call, on the path and method it uses.
    const thrown = await sdkError(sdk().responses.cancel(id));
    expect({ status: thrown.status, code: thrown.code }).toEqual({ status: 400, code: "invalid_request_error" });
    const back = await fetch(`${gw.url}/v1/responses/${id}`, { headers: { authorization: `Bearer ${org.personalKey}` } });
    expect(rec(await back.json())).toEqual(r);
    // A body (some clients send {}) changes nothing.
    await expectError(await cancel(id, org.personalKey, gw, { body: "{}", headers: { "content-type": "application/json" } }), 400, "invalid_request_error");
    expect(sim.stats.requests).toBe(1);
  });

  test("unknown, malformed, deleted, store: false and another owner's: 404 as retrieve answers", async () => {
    const notFound = async (res: Response) => expect(await expectError(res, 404, "not_found")).toContain("No response with id");
    await notFound(await cancel("resp_doesnotexist"));
    await notFound(await cancel("not-an-id"));
    await notFound(await cancel(`resp_${"x".repeat(500)}`));
    const unstored = await made({ input: "hello", store: false });
    await notFound(await cancel(String(unstored.id)));
    const gone = String((await made({ input: "hello" })).id);
    expect((await fetch(`${gw.url}/v1/responses/${gone}`, { method: "DELETE", headers: { authorization: `Bearer ${org.personalKey}` } })).status).toBe(200);
    await notFound(await cancel(gone));
    const mine = String((await made({ input: "mine" })).id);
    const other = await seedTestOrg(gw.database);
    const person = await createUser(gw.database, { orgId: org.orgId, name: "Colleague", email: `c-${crypto.randomUUID().slice(0, 8)}@example.com` });
    const colleague = await createKey(gw.database, { orgId: org.orgId, userId: person.id, kind: "personal", scopes: ["inference"], knownModels: ["svc-fast"], tag: "gw" });
    for (const key of [other.personalKey, other.serviceKey, org.serviceKey, colleague.key]) await notFound(await cancel(mine, key));
    const thrown = await sdkError(sdk(other.personalKey).responses.cancel(mine));
    expect(thrown.status).toBe(404);
    // Without a response store nothing is stored: every id is unknown.
    await notFound(await cancel(mine, org.personalKey, noStore));
  });

  test("401 without a key or with a bad one, 403 for a key without inference and for a browser", async () => {
    const id = String((await made({ input: "hello" })).id);
    await expectError(await cancel(id, null), 401, "unauthorized");
    await expectError(await cancel(id, `sk-gw-${"x".repeat(43)}`), 401, "unauthorized");
    await expectError(await cancel(id, auditOnly), 403, "scope_missing");
    await expectError(await cancel(id, org.personalKey, gw, { headers: { origin: "https://app.example" } }), 403, "browser_request_rejected");
  });
});

describe("POST /v1/responses/input_tokens", () => {
  test("the prompt's estimate, as the simulator counts it for the same request: nothing goes upstream", async () => {
    const r = rec(await (await count({ model: "svc-fast", input: "Say hi" })).json());
    expect(r).toEqual({ object: "response.input_tokens", input_tokens: SAY_HI_PROMPT_TOKENS });
    const body = {
      model: "svc-fast",
      instructions: "Be brief.",
      input: [
        { role: "developer", content: "Answer in French." },
        { role: "user", content: [{ type: "input_text", text: "What is this?" }, { type: "input_image", image_url: "data:image/png;base64,iVBORw0KGgo=" }] },
      ],
      tools: [{ type: "function", name: "lookup", description: "Look it up", parameters: { type: "object", properties: { q: { type: "string" } } } }],
    };
    const counted = rec(await (await count(body)).json());
    expect(sim.stats.requests).toBe(0);
    // The simulator counts a prompt as the gateway estimates one (~4 bytes a token, 4 a message, 85 an image, the tools' JSON).
    const created = await made({ ...body, store: false });
    expect(counted.input_tokens).toBe(rec(created.usage).input_tokens);
    // The SDK's call and answer type.
    const viaSdk = await sdk().responses.inputTokens.count({ model: "svc-fast", input: "Say hi" });
    expect(viaSdk).toEqual({ object: "response.input_tokens", input_tokens: SAY_HI_PROMPT_TOKENS });
  });

  test("previous_response_id and item references count the stored conversation, as create sends it", async () => {
    const first = await made({ input: "Say hi" });
    const id = String(first.id);
    const next = { model: "svc-fast", input: "And again", previous_response_id: id };
    const counted = rec(await (await count(next)).json());
    const created = await made({ ...next, store: false });
    expect(counted.input_tokens).toBe(rec(created.usage).input_tokens);
    expect(Number(counted.input_tokens)).toBeGreaterThan(SAY_HI_PROMPT_TOKENS);
    const message = (first.output as Record<string, unknown>[]).find((o) => o.type === "message");
    const referenced = rec(await (await count({ model: "svc-fast", input: [{ role: "user", content: "Say hi" }, { type: "item_reference", id: message?.id }, { role: "user", content: "And again" }] })).json());
    expect(referenced.input_tokens).toBe(counted.input_tokens);
    await expectError(await count({ ...next, previous_response_id: "resp_doesnotexist" }), 404, "not_found", "previous_response_id");
    await expectError(await count(next, org.personalKey, noStore), 400, "invalid_request_error", "previous_response_id");
  });

  test("validated as POST /v1/responses: unknown and create-only parameters, the Responses param of each refusal", async () => {
    const base = { model: "svc-fast", input: "hi" };
    const cases: [body: Record<string, unknown>, param: string, messageHas?: string][] = [
      [{ ...base, evil: 1 }, "evil", "Unrecognized request argument"],
      // Parameters of create that a count does not take (the SDK's InputTokenCountParams).
      [{ ...base, stream: true }, "stream", "Unrecognized request argument"],
      [{ ...base, max_output_tokens: 100 }, "max_output_tokens", "Unrecognized request argument"],
      [{ ...base, store: false }, "store", "Unrecognized request argument"],
      [{ ...base, reasoning: { effort: "low", evil: 1 } }, "reasoning.evil"],
      [{ ...base, tools: [{ type: "file_search" }] }, "tools[0].type", "file_search"],
      [{ ...base, tools: [{ type: "web_search" }] }, "tools[0].type", "web search"],
      [{ ...base, tools: [{ type: "function", name: "get weather" }] }, "tools[0].name", "letters, digits"],
      [{ ...base, tool_choice: { type: "function", name: "g" }, tools: [{ type: "function", name: "f" }] }, "tool_choice.name", "'g'"],
      [{ ...base, input: [{ role: "user", content: [{ type: "input_file", file_id: "file-1" }] }] }, "input[0].content[0]", "files API"],
      [{ ...base, input: [{ type: "function_call_output", call_id: "call_x", output: "42" }] }, "input[0]", "No tool call found"],
      [{ ...base, conversation: "conv_1" }, "conversation", "previous_response_id"],
      [{ ...base, personality: "p".repeat(65) }, "personality", "64"],
      [{ model: "svc-fast" }, "input", "Missing required parameter"],
      [{ input: "hi" }, "model"],
      // The alias's capabilities, as chat checks them (svc-text: no images, no tools).
      [{ model: "svc-text", input: [{ role: "user", content: [{ type: "input_image", image_url: "https://img.example/a.png" }] }] }, "input[0].content[0]", "image"],
      [{ model: "svc-text", input: "hi", tools: [{ type: "function", name: "f" }] }, "tools", "tools"],
    ];
    for (const [body, param, messageHas] of cases) {
      const message = await expectError(await count(body), 400, "invalid_request_error", param);
      if (messageHas) expect({ body, message }).toEqual({ body, message: expect.stringContaining(messageHas) });
    }
    await expectError(await count("{nope"), 400, "invalid_request_error");
    // What the SDK's count params declare passes: personality, truncation, text, reasoning, parallel_tool_calls, conversation null.
    const ok = await count({
      ...base,
      personality: "friendly",
      truncation: "auto",
      text: { format: { type: "json_object" }, verbosity: "low" },
      reasoning: { effort: "low" },
      parallel_tool_calls: false,
      conversation: null,
      tool_choice: "auto",
    });
    expect(ok.status).toBe(200);
    expect(sim.stats.requests).toBe(0);
  });

  test("404 model_not_found for an unknown alias, an embedding alias and one outside the key's list", async () => {
    await expectError(await count({ model: "nope", input: "hi" }), 404, "model_not_found", "model");
    await expectError(await count({ model: "svc-embed", input: "hi" }), 404, "model_not_found", "model");
    const limited = await seedTestOrg(gw.database, { models: ["svc-smart"] });
    await expectError(await count({ model: "svc-fast", input: "hi" }, limited.personalKey), 404, "model_not_found", "model");
    expect((await count({ model: "svc-smart", input: "hi" }, limited.personalKey)).status).toBe(200);
  });

  test("401, 403 scope and browser; rate limited as every keyed request; not metered: counted under an exhausted quota", async () => {
    const body = { model: "svc-fast", input: "hi" };
    await expectError(await count(body, null), 401, "unauthorized");
    await expectError(await count("{not json", `sk-gw-${"x".repeat(43)}`), 401, "unauthorized");
    await expectError(await count(body, auditOnly), 403, "scope_missing");
    await expectError(await count(body, org.personalKey, gw, { headers: { origin: "https://app.example" } }), 403, "browser_request_rejected");
    const tiny = await seedOrg(gw.database, { plan: "Tiny", plans: Object.keys(TEST_PLANS) });
    for (let i = 0; i < 2; i++) expect((await count(body, tiny.personalKey)).status).toBe(200);
    const limited = await count(body, tiny.personalKey);
    await expectError(limited, 429, "rate_limit_error");
    expect(limited.headers.get("retry-after")).not.toBeNull();
    const broke = await seedTestOrg(gw.database, { quotaTokens: 1 });
    for (let i = 0; i < 3; i++) expect((await count(body, broke.personalKey)).status).toBe(200);
  });
});

describe("POST /v1/responses/compact", () => {
  test("400 saying compaction is not served here (not an unknown route), whatever the body; the SDK's call gets it", async () => {
    for (const body of [{ model: "svc-fast", input: "hi" }, {}, "{nope"]) {
      const message = await expectError(await compact(body), 400, "invalid_request_error");
      expect(message).toContain("compact");
      expect(message).not.toContain("No route");
    }
    const thrown = await sdkError(sdk().responses.compact({ model: "svc-fast", input: "hi" }));
    expect({ status: thrown.status, code: thrown.code }).toEqual({ status: 400, code: "invalid_request_error" });
    expect(sim.stats.requests).toBe(0);
  });

  test("401 and 403 first, as every keyed route", async () => {
    await expectError(await compact({}, null), 401, "unauthorized");
    await expectError(await compact({}, auditOnly), 403, "scope_missing");
    await expectError(await compact({}, org.personalKey, gw, { headers: { origin: "https://app.example" } }), 403, "browser_request_rejected");
  });
});

describe("the OpenAPI document", () => {
  test("lists the three operations with the statuses and bodies they really answer", async () => {
    const doc = await validOpenApi(gw.url);
    const ajv = componentValidator(doc);
    /** The answer's status is declared for the operation, and its body is valid against the declared schema. */
    const conforms = async (path: string, res: Response) => {
      const declared = rec(rec(rec(rec(doc.paths)[path]).post).responses)[String(res.status)];
      if (declared === undefined) throw new Error(`POST ${path}: status ${res.status} not declared`);
      const name = String(rec(rec(rec(rec(declared).content)["application/json"]).schema).$ref).replace("#/components/schemas/", "");
      expectSchema(ajv, name, await res.json(), `POST ${path} ${res.status}`);
    };
    const id = String((await made({ input: "hello" })).id);
    const request = { model: "svc-fast", input: "hi" };
    const count = (body: unknown, key: string | undefined = org.personalKey) => post(gw, "/v1/responses/input_tokens", key, body);
    for (const res of [
      await count(request),
      await count({ ...request, evil: 1 }),
      await count(request, undefined),
      await count(request, auditOnly),
      await count({ ...request, model: "nope" }),
      await count({ ...request, previous_response_id: "resp_doesnotexist" }),
    ]) {
      await conforms("/v1/responses/input_tokens", res);
    }
    for (const res of [await cancel(id), await cancel("resp_doesnotexist"), await cancel(id, null), await cancel(id, auditOnly)]) await conforms("/v1/responses/{id}/cancel", res);
    for (const res of [await compact(request), await compact(request, null), await compact(request, auditOnly)]) await conforms("/v1/responses/compact", res);
    // The request schema is the validator's: what the endpoint refuses, the document refuses.
    const requestSchema = ajv.getSchema(`${SCHEMAS}ResponsesInputTokensRequest`);
    expect(requestSchema?.({ ...request, personality: "friendly" })).toBe(true);
    expect(requestSchema?.({ ...request, stream: true })).toBe(false);
    expect(requestSchema?.({ ...request, personality: "p".repeat(65) })).toBe(false);
  });
});
