import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import fc from "fast-check";
import { upstreamAliases } from "../../src/config/load.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { type SeededOrg, seedOrg, startTestGateway } from "../helpers/harness.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Generated and mutated requests against every endpoint: each answer is a
 * 2xx/4xx in the wire shape, never a 5xx, a hang or a crash. The seed is
 * printed so a failure can be replayed (FUZZ_SEED=… FUZZ_RUNS=… bun test test/integration/fuzz.test.ts).
 */

const SEED = Number(process.env.FUZZ_SEED ?? Date.now() % 2_147_483_647);
const RUNS = Number(process.env.FUZZ_RUNS ?? 300);

let gw: Gateway;
let sim: Simulator;
let org: SeededOrg;
let tried = 0;

beforeAll(async () => {
  // A plan that never binds, so every generated request reaches the code under test.
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 4 });
  gw = await startTestGateway({ aliases: upstreamAliases(sim.url), plans: { Standard: { requestsPerMinute: 1_000_000 }, Ultra: { requestsPerMinute: 1_000_000 } } });
  org = await seedOrg(gw.database);
  console.log(`fuzz seed=${SEED} runs=${RUNS} per property`);
});
afterAll(async () => {
  console.log(`fuzz: ${tried} requests tried`);
  await gw.stop();
  await sim.stop();
});

const PATHS = ["/v1/chat/completions", "/v1/embeddings", "/v1/models", "/v1/me", "/v1/audit-events", "/healthz", "/readyz", "/v1/nope", "/", "/v1/chat/completions/x"];
const METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"];

async function expectWireShape(res: Response, method: string) {
  tried++;
  expect(res.status).toBeLessThan(500);
  if (res.status >= 400 && method !== "HEAD") {
    const body = (await res.json()) as { error?: { message?: unknown; code?: unknown; type?: unknown } };
    expect(typeof body.error?.message).toBe("string");
    expect(typeof body.error?.code).toBe("string");
    expect(typeof body.error?.type).toBe("string");
  } else {
    await res.arrayBuffer();
  }
}

const jsonValue = fc.jsonValue({ maxDepth: 4 });
const chatish = fc.record(
  {
    model: fc.oneof(fc.constantFrom("svc-fast", "svc-embed", "nope", ""), fc.string(), fc.integer()),
    messages: fc.oneof(
      fc.array(
        fc.record(
          { role: fc.oneof(fc.constantFrom("system", "user", "assistant", "tool", "x"), fc.string()), content: fc.oneof(fc.string(), fc.constant(null), jsonValue) },
          { requiredKeys: [] },
        ),
        { maxLength: 4 },
      ),
      jsonValue,
    ),
    temperature: fc.oneof(fc.double(), fc.integer(), fc.string()),
    max_tokens: fc.oneof(fc.integer(), fc.double(), fc.string()),
    stream: fc.oneof(fc.boolean(), fc.string()),
    tools: jsonValue,
    input: fc.oneof(fc.string(), fc.array(fc.string(), { maxLength: 3 }), jsonValue),
    unknown_field: jsonValue,
  },
  { requiredKeys: [] },
);

describe("fuzz: every endpoint answers 2xx/4xx in the wire shape", () => {
  test("random methods, paths and JSON-ish bodies, with and without a valid key", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.constantFrom(...PATHS),
        fc.constantFrom(...METHODS),
        fc.oneof(chatish.map((v) => JSON.stringify(v)), fc.string(), fc.constant("{"), fc.constant("")),
        fc.boolean(),
        fc.constantFrom("application/json", "text/plain", "application/json; charset=utf-8", "multipart/form-data", ""),
        async (path, method, body, authed, ctype) => {
          const headers: Record<string, string> = {};
          if (authed) headers.authorization = `Bearer ${org.serviceKey}`;
          if (ctype) headers["content-type"] = ctype;
          const withBody = method !== "GET" && method !== "HEAD";
          const res = await fetch(`${gw.url}${path}`, { method, headers, ...(withBody ? { body } : {}), signal: AbortSignal.timeout(15_000) });
          await expectWireShape(res, method);
        },
      ),
      { seed: SEED, numRuns: RUNS },
    );
  });

  test("random query strings on the audit log", async () => {
    const key = fc.oneof(fc.constantFrom("from", "to", "actor_id", "category", "action", "q", "cursor", "limit"), fc.string({ maxLength: 8 }));
    await fc.assert(
      fc.asyncProperty(fc.array(fc.tuple(key, fc.string({ maxLength: 300 })), { maxLength: 5 }), async (pairs) => {
        const qs = new URLSearchParams(pairs).toString();
        const res = await fetch(`${gw.url}/v1/audit-events?${qs}`, { headers: { authorization: `Bearer ${org.serviceKey}` } });
        await expectWireShape(res, "GET");
      }),
      { seed: SEED, numRuns: RUNS },
    );
  });

  test("odd authorization headers never pass and never 5xx", async () => {
    await fc.assert(
      fc.asyncProperty(fc.oneof(fc.string(), fc.string().map((s) => `Bearer ${s}`), fc.string().map((s) => `Bearer sk-gw-${s}`)), async (authz) => {
        let headers: Headers;
        try {
          headers = new Headers({ authorization: authz });
        } catch {
          return; // not a legal header value: no client can send it
        }
        const res = await fetch(`${gw.url}/v1/me`, { headers });
        expect([401]).toContain(res.status);
        await expectWireShape(res, "GET");
      }),
      { seed: SEED, numRuns: RUNS },
    );
  });

  test("nasty corpus", async () => {
    const auth = { authorization: `Bearer ${org.serviceKey}`, "content-type": "application/json" };
    const nested = `${"[".repeat(100_000)}${"]".repeat(100_000)}`;
    const cases: { path: string; body: string | Uint8Array; headers?: Record<string, string> }[] = [
      { path: "/v1/chat/completions", body: nested },
      { path: "/v1/chat/completions", body: '{"model":"svc-fast","model":"svc-embed","messages":[{"role":"user","content":"dup keys"}]}' },
      { path: "/v1/chat/completions", body: new Uint8Array([0x7b, 0xff, 0xfe, 0x7d]) }, // invalid UTF-8
      { path: "/v1/chat/completions", body: '{"model":"svc-fast","messages":[{"role":"user","content":"nul \\u0000 byte"}],"max_tokens":1e308}' },
      { path: "/v1/chat/completions", body: '{"model":"svc-fast","messages":[],"temperature":-1}' },
      { path: "/v1/chat/completions", body: '{"__proto__":{"admin":true},"model":"svc-fast","messages":[{"role":"user","content":"x"}]}' },
      { path: "/v1/embeddings", body: JSON.stringify({ model: "svc-embed", input: Array(10_000).fill("x") }) },
      { path: "/v1/embeddings", body: "null" },
      { path: "/v1/embeddings", body: "[]" },
      { path: "/v1/chat/completions", body: "x".repeat(17 * 1024 * 1024) }, // over the 16 MiB limit
    ];
    for (const c of cases) {
      const res = await fetch(`${gw.url}${c.path}`, { method: "POST", headers: { ...auth, ...c.headers }, body: c.body, signal: AbortSignal.timeout(20_000) });
      await expectWireShape(res, "POST");
      expect(res.status).not.toBe(413);
    }
    // Header flood and an oversized header: Bun refuses these itself (431) or we answer 4xx; never 5xx.
    const many: Record<string, string> = { authorization: `Bearer ${org.serviceKey}` };
    for (let i = 0; i < 200; i++) many[`x-h-${i}`] = "v".repeat(50);
    const flood = await fetch(`${gw.url}/v1/me`, { headers: many });
    expect(flood.status).toBeLessThan(500);
    const big = await fetch(`${gw.url}/v1/me`, { headers: { authorization: `Bearer ${org.serviceKey}`, "x-big": "v".repeat(64 * 1024) } });
    expect(big.status).toBeLessThan(500);
  });
});
