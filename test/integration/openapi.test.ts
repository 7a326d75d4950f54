import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import type { Ajv2020 } from "ajv/dist/2020.js";
import { createKey } from "../../src/admin/service.ts";
import { upstreamAliases } from "../../src/config/load.ts";
import { DEFAULT_PLANS } from "../../src/config/schema.ts";
import type { Database } from "../../src/db/client.ts";
import { isRecord } from "../../src/lib/guards.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { bearer, freshDatabase, type SeededOrg, seedOrg, startTestGateway } from "../helpers/harness.ts";
import { componentValidator, withAbsoluteRefs } from "../helpers/openapi.ts";

// Two gateways, a simulator and a database of its own on a busy machine.
setDefaultTimeout(60_000);

/**
 * The OpenAPI document cannot drift from the service: real answers of every
 * operation, at every status the document declares, are validated against it
 * (JSON Schema draft 2020-12, the dialect of OpenAPI 3.1): the body against
 * the declared schema of its media type, each declared header against its
 * schema, required headers present, and none of the headers the gateway sets
 * on purpose left undeclared.
 */

/** Headers the gateway sets on purpose; each one an answer carries must be declared for its status. */
const OURS = [
  "x-request-id",
  "x-ratelimit-limit-requests",
  "x-ratelimit-remaining-requests",
  "x-ratelimit-reset-requests",
  "retry-after",
  "retry-after-ms",
  "x-should-retry",
  "cache-control",
  "x-accel-buffering",
];

type Json = Record<string, unknown>;
let sim: Simulator;
let gw: Gateway;
let doc: Json;
let ajv: Ajv2020;
const covered = new Set<string>();

const DEAD = "http://127.0.0.1:9/v1";

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 3 });
  const aliases = {
    ...upstreamAliases(sim.url),
    "dead-chat": { kind: "chat", capabilities: [], ownedBy: "gateway", targets: [{ baseUrl: DEAD, model: "m", weight: 1 }] },
    "dead-embed": { kind: "embedding", capabilities: [], ownedBy: "gateway", targets: [{ baseUrl: DEAD, model: "m", weight: 1 }] },
  };
  gw = await startTestGateway({
    aliases,
    plans: { ...DEFAULT_PLANS, Tiny: { requestsPerMinute: 1 } },
    upstream: { attempts: 1, backoffMs: 0, breakerFailures: 100, breakerCooldownMs: 1_000, timeouts: { connectMs: 2_000, firstByteMs: 5_000, idleMs: 5_000 } },
  });
  const res = await fetch(`${gw.url}/openapi.json`);
  doc = (await res.json()) as Json;
  // Each component schema under an id of its own; the document's local refs point there.
  ajv = componentValidator(doc);
}, 120_000);
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

function at(path: string[]): unknown {
  let node: unknown = doc;
  for (const p of path) node = isRecord(node) ? node[p] : undefined;
  return node;
}

const compiled = new Map<string, ReturnType<Ajv2020["compile"]>>();
function check(where: string[], value: unknown, label: string) {
  const key = where.join("\u0000");
  let validate = compiled.get(key);
  if (!validate) {
    const schema = at(where);
    if (!isRecord(schema)) throw new Error(`no schema at ${where.join("/")}`);
    validate = ajv.compile(withAbsoluteRefs(schema) as Json);
    compiled.set(key, validate);
  }
  if (!validate(value)) throw new Error(`${label}: ${ajv.errorsText(validate.errors)}\n${JSON.stringify(value).slice(0, 500)}`);
}

/** Validate one real answer against the operation's declared response; returns the parsed body. */
async function conforms(op: { path: string; method: string } | "unknown-route", res: Response): Promise<unknown> {
  const status = String(res.status);
  const base = op === "unknown-route" ? ["components", "responses", "NotFound"] : ["paths", op.path, op.method, "responses", status];
  const label = op === "unknown-route" ? `unknown route ${status}` : `${op.method.toUpperCase()} ${op.path} ${status}`;
  const declared = at(base);
  if (!isRecord(declared)) throw new Error(`${label}: status not declared`);
  if (op === "unknown-route") expect(res.status).toBe(404);
  // Headers: required ones present, every present one valid, none of ours undeclared.
  const hs = isRecord(declared.headers) ? declared.headers : {};
  for (const [name, h] of Object.entries(hs)) {
    const value = res.headers.get(name);
    if (isRecord(h) && h.required === true && value === null) throw new Error(`${label}: header ${name} is required but missing`);
    if (value !== null) check([...base, "headers", name, "schema"], value, `${label} header ${name}`);
  }
  for (const name of OURS) {
    if (res.headers.has(name) && !(name in hs)) throw new Error(`${label}: carries ${name}: ${res.headers.get(name)}, which is not declared`);
  }
  // Body: the media type must be declared, the body valid against its schema.
  const type = (res.headers.get("content-type") ?? "").split(";")[0]?.trim() ?? "";
  const content = isRecord(declared.content) ? declared.content : {};
  if (!(type in content)) throw new Error(`${label}: media type ${type} not declared (${Object.keys(content).join(", ")})`);
  const text = await res.text();
  let body: unknown = text;
  if (type === "application/json") body = JSON.parse(text);
  check([...base, "content", type, "schema"], body, `${label} body`);
  if (type === "text/event-stream") {
    const events = text.split("\n\n").filter((e) => e.trim() !== "");
    expect(events.at(-1)).toBe("data: [DONE]");
    for (const e of events.slice(0, -1)) {
      expect(e.startsWith("data: ")).toBe(true);
      check([...base, "content", type, "x-event-schema"], JSON.parse(e.slice(6)), `${label} event`);
    }
  }
  covered.add(op === "unknown-route" ? "unknown-route 404" : `${op.method} ${op.path} ${status}`);
  return body;
}

const CHAT = { path: "/v1/chat/completions", method: "post" };
const EMBED = { path: "/v1/embeddings", method: "post" };
const MODELS = { path: "/v1/models", method: "get" };
const ME = { path: "/v1/me", method: "get" };
const AUDIT = { path: "/v1/audit-events", method: "get" };

function call(op: { path: string; method: string }, key: string | null, body?: unknown, extra: Record<string, string> = {}, query = ""): Promise<Response> {
  const headers: Record<string, string> = { ...(key ? bearer(key) : {}), ...extra };
  if (body !== undefined) headers["content-type"] = "application/json";
  return fetch(`${gw.url}${op.path}${query}`, {
    method: op.method.toUpperCase(),
    headers,
    ...(body !== undefined ? { body: typeof body === "string" ? body : JSON.stringify(body) } : {}),
  });
}

const chatBody = (model = "svc-fast", stream = false) => ({ model, stream, messages: [{ role: "user", content: "hi" }] });
const embedBody = (model = "svc-embed") => ({ model, input: "hi" });
const BROWSER = { origin: "https://app.example" };

describe("real answers conform to the OpenAPI document", () => {
  let org: SeededOrg;
  let noInference: string;
  beforeAll(async () => {
    org = await seedOrg(gw.database);
    noInference = (await createKey(gw.database, { orgId: org.orgId, kind: "service", scopes: ["audit:read"], knownModels: [], tag: "gw" })).key;
  });

  test("the version label is v1; the build is x-gateway-version", () => {
    const info = doc.info as Json;
    expect(info.version).toBe("v1");
    expect(typeof info["x-gateway-version"]).toBe("string");
  });

  test("chat completions: 200 JSON and stream, 400, 401, 403, 404, 503", async () => {
    await conforms(CHAT, await call(CHAT, org.serviceKey, chatBody()));
    await conforms(CHAT, await call(CHAT, org.serviceKey, chatBody("svc-fast", true)));
    await conforms(CHAT, await call(CHAT, org.serviceKey, { ...chatBody(), bogus: 1 }));
    await conforms(CHAT, await call(CHAT, org.serviceKey, "{nope"));
    await conforms(CHAT, await call(CHAT, null, chatBody()));
    await conforms(CHAT, await call(CHAT, noInference, chatBody()));
    await conforms(CHAT, await call(CHAT, org.serviceKey, chatBody(), BROWSER));
    await conforms(CHAT, await call(CHAT, org.serviceKey, chatBody("no-such-model")));
    await conforms(CHAT, await call(CHAT, org.serviceKey, chatBody("dead-chat")));
    await conforms(CHAT, await call(CHAT, org.serviceKey, chatBody("dead-chat", true)));
  });

  test("embeddings: 200, 400, 401, 403, 404, 503", async () => {
    await conforms(EMBED, await call(EMBED, org.personalKey, embedBody()));
    await conforms(EMBED, await call(EMBED, org.personalKey, { input: "no model" }));
    await conforms(EMBED, await call(EMBED, `sk-gw-${"Z".repeat(43)}`, embedBody()));
    await conforms(EMBED, await call(EMBED, noInference, embedBody()));
    await conforms(EMBED, await call(EMBED, org.personalKey, embedBody("svc-fast")));
    await conforms(EMBED, await call(EMBED, org.personalKey, embedBody("dead-embed")));
  });

  test("models, me, audit events: 200, 400, 401, 403", async () => {
    for (const op of [MODELS, ME]) {
      await conforms(op, await call(op, org.personalKey));
      await conforms(op, await call(op, null));
      await conforms(op, await call(op, org.personalKey, undefined, BROWSER));
    }
    await conforms(MODELS, await call(MODELS, noInference));
    await conforms(AUDIT, await call(AUDIT, org.serviceKey));
    await conforms(AUDIT, await call(AUDIT, org.serviceKey, undefined, {}, "?limit=0"));
    await conforms(AUDIT, await call(AUDIT, org.serviceKey, undefined, {}, "?bogus=1"));
    await conforms(AUDIT, await call(AUDIT, "sk-gw-short"));
    await conforms(AUDIT, await call(AUDIT, org.personalKey));
  });

  test("429 rate_limit_error on every operation behind a key", async () => {
    const tiny = await seedOrg(gw.database, { plan: "Tiny", plans: ["Standard", "Tiny"] });
    expect((await call(ME, tiny.serviceKey)).status).toBe(200);
    for (const [op, body] of [[CHAT, chatBody()], [EMBED, embedBody()], [MODELS, undefined], [ME, undefined], [AUDIT, undefined]] as const) {
      const res = await call(op, tiny.serviceKey, body);
      expect(res.status).toBe(429);
      expect(res.headers.get("retry-after-ms")).not.toBeNull();
      await conforms(op, res);
    }
  });

  test("429 budget_exceeded on chat and embeddings", async () => {
    const broke = await seedOrg(gw.database, { quotaTokens: 1 });
    let seen: Response | undefined;
    for (let i = 0; i < 5 && !seen; i++) {
      const res = await call(CHAT, broke.serviceKey, chatBody());
      if (res.status === 429) seen = res;
      else await res.text();
      await gw.quota.flush();
    }
    if (!seen) throw new Error("no budget_exceeded after 5 requests on a 1-token quota");
    expect(seen.headers.get("x-should-retry")).toBe("false");
    expect(((await conforms(CHAT, seen)) as { error: { code: string } }).error.code).toBe("budget_exceeded");
    // More than the 1-token quota holds (an input of ~10 tokens): refused too.
    const embed = await call(EMBED, broke.serviceKey, { model: "svc-embed", input: "a".repeat(40) });
    expect(embed.status).toBe(429);
    await conforms(EMBED, embed);
  });

  test("public endpoints: /healthz, /readyz, /openapi.json (200, 403) and the metrics listener", async () => {
    for (const path of ["/healthz", "/readyz", "/openapi.json"]) {
      const op = { path, method: "get" };
      await conforms(op, await fetch(`${gw.url}${path}`));
      await conforms(op, await fetch(`${gw.url}${path}`, { headers: BROWSER }));
    }
    if (!gw.metricsUrl) throw new Error("metrics not served");
    await conforms({ path: "/metrics", method: "get" }, await fetch(gw.metricsUrl));
  });

  test("unknown routes and methods: the declared 404", async () => {
    await conforms("unknown-route", await fetch(`${gw.url}/v1/nope`));
    await conforms("unknown-route", await fetch(`${gw.url}/v1/models`, { method: "DELETE", headers: bearer(org.serviceKey) }));
    await conforms("unknown-route", await fetch(`${gw.url}/metrics`));
  });

  test("database and key store unreachable: /readyz 503, and 503 before the key check on every operation", async () => {
    const database: Database = await freshDatabase();
    const cut = await startTestGateway({ aliases: upstreamAliases(sim.url) }, database);
    try {
      await database.close();
      const unknownKey = `sk-gw-${"Q".repeat(43)}`;
      await conforms({ path: "/readyz", method: "get" }, await fetch(`${cut.url}/readyz`));
      for (const [op, body] of [[CHAT, chatBody()], [EMBED, embedBody()], [MODELS, undefined], [ME, undefined], [AUDIT, undefined]] as const) {
        const res = await fetch(`${cut.url}${op.path}`, {
          method: op.method.toUpperCase(),
          headers: { ...bearer(unknownKey), ...(body ? { "content-type": "application/json" } : {}) },
          ...(body ? { body: JSON.stringify(body) } : {}),
        });
        expect(res.status).toBe(503);
        await conforms(op, res);
      }
    } finally {
      await cut.stop().catch(() => {});
    }
  });

  test("request schemas are the validators' own: what an endpoint refuses, the document refuses", async () => {
    const requestSchema = (op: { path: string; method: string }) => ["paths", op.path, op.method, "requestBody", "content", "application/json", "schema"];
    const cases: [op: { path: string; method: string }, body: Json, ok: boolean][] = [
      [CHAT, chatBody(), true],
      [CHAT, { ...chatBody(), temperature: 1.5, max_tokens: 5 }, true],
      [CHAT, { ...chatBody(), bogus: 1 }, false],
      [CHAT, { ...chatBody(), temperature: 3 }, false],
      [CHAT, { messages: [{ role: "user", content: "hi" }] }, false],
      [CHAT, { ...chatBody(), messages: [{ role: "wizard", content: "hi" }] }, false],
      [EMBED, embedBody(), true],
      [EMBED, { ...embedBody(), input: ["a", "b"] }, true],
      [EMBED, { ...embedBody(), bogus: 1 }, false],
      [EMBED, { model: "svc-embed" }, false],
    ];
    for (const [op, body, ok] of cases) {
      const res = await call(op, org.serviceKey, body);
      await res.text();
      expect({ body, status: res.status }).toEqual({ body, status: ok ? 200 : 400 });
      let valid = true;
      try {
        check(requestSchema(op), body, `${op.path} request`);
      } catch {
        valid = false;
      }
      expect({ body, valid }).toEqual({ body, valid: ok });
    }
  });

  test("every declared operation and status was seen (500 is a defect, never produced on purpose)", () => {
    const missing: string[] = [];
    for (const [path, item] of Object.entries(doc.paths as Json)) {
      for (const [method, op] of Object.entries(item as Json)) {
        for (const status of Object.keys((op as { responses: Json }).responses)) {
          if (status !== "500" && !covered.has(`${method} ${path} ${status}`)) missing.push(`${method} ${path} ${status}`);
        }
      }
    }
    expect(covered.has("unknown-route 404")).toBe(true);
    expect(missing).toEqual([]);
  });
});
