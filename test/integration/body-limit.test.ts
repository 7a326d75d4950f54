import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { upstreamAliases } from "../../src/config/load.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { bearer, type SeededOrg, seedOrg, startTestGateway } from "../helpers/harness.ts";
import { type RawAnswer, rawRequest } from "../helpers/raw-http.ts";

// Servers, PGlite start-up and tens of MB through a socket on a busy machine.
setDefaultTimeout(60_000);

/**
 * Spec 7: a body too large is 400 in the error shape, at every size (Bun's
 * own limit would answer a bare 413 above it). The answer comes as soon as
 * the size is known, the connection is closed (the rest of the body is never
 * read), and memory does not grow with what the client sends.
 */

const MB = 1024 * 1024;
let sim: Simulator;
let gw: Gateway;
let org: SeededOrg;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 3 });
  gw = await startTestGateway({ aliases: upstreamAliases(sim.url) });
  org = await seedOrg(gw.database);
});
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

function post(path: string, framing: string, key: string | null = org.serviceKey): string {
  return [
    `POST ${path} HTTP/1.1`,
    "Host: gw",
    ...(key ? [`Authorization: Bearer ${key}`] : []),
    "Content-Type: application/json",
    framing,
  ].join("\r\n");
}

function expectClosedError(a: RawAnswer, status: number, code: string) {
  expect(a.status).toBe(status);
  expect(a.headers["content-type"]).toContain("application/json");
  expect(a.headers["x-request-id"]).toBeTruthy();
  const body = JSON.parse(a.body) as { error: { code: string; message: string; param: unknown; type: string } };
  expect(body.error.code).toBe(code);
  expect(body.error.param).toBeNull();
  // The rest of the body is not read: the server ends the connection.
  expect(a.headers.connection).toBe("close");
  expect(a.closed).toBe(true);
  return body.error;
}

describe("request bodies over the limit (16 MB)", () => {
  for (const [path, size] of [
    ["/v1/chat/completions", 17 * MB],
    ["/v1/chat/completions", 40 * MB],
    ["/v1/chat/completions", 200 * MB],
    ["/v1/embeddings", 40 * MB],
    ["/v1/embeddings", 4 * 1024 * MB],
    // Above 2^53 (~100 PB, the largest length Bun's parser accepts; 18 digits
    // or more is a malformed request there and gets Bun's own bare 400).
    ["/v1/embeddings", "99999999999999999"],
  ] as const) {
    test(`${path}, Content-Length ${size}: 400 invalid_request_error at once, connection closed`, async () => {
      const a = await rawRequest({ url: gw.url, head: post(path, `Content-Length: ${size}`), bodyBytes: Number(size), stopOnAnswer: true, maxMs: 20_000 });
      expect(expectClosedError(a, 400, "invalid_request_error").message).toContain("too large");
      // Answered from the declared length, long before the body could have arrived.
      expect(a.sent).toBeLessThan(Number(size));
    });
  }

  test("chunked, 40 MB and still sending: 400 once the limit is passed, connection closed", async () => {
    const a = await rawRequest({ url: gw.url, head: post("/v1/chat/completions", "Transfer-Encoding: chunked"), bodyBytes: 40 * MB, chunked: true, stopOnAnswer: true, maxMs: 20_000 });
    expect(expectClosedError(a, 400, "invalid_request_error").message).toContain("too large");
  });

  test("chunked embeddings, 200 MB: the same", async () => {
    const a = await rawRequest({ url: gw.url, head: post("/v1/embeddings", "Transfer-Encoding: chunked"), bodyBytes: 200 * MB, chunked: true, stopOnAnswer: true, maxMs: 20_000 });
    expect(expectClosedError(a, 400, "invalid_request_error").message).toContain("too large");
  });

  test("GET /v1/audit-events with a 40 MB body: 400 invalid_body, connection closed", async () => {
    const head = ["GET /v1/audit-events HTTP/1.1", "Host: gw", `Authorization: Bearer ${org.serviceKey}`, `Content-Length: ${40 * MB}`].join("\r\n");
    const a = await rawRequest({ url: gw.url, head, bodyBytes: 40 * MB, stopOnAnswer: true, maxMs: 20_000 });
    expectClosedError(a, 400, "invalid_body");
  });

  test("without a key, 40 MB: authentication comes first (401), connection closed", async () => {
    const a = await rawRequest({ url: gw.url, head: post("/v1/chat/completions", `Content-Length: ${40 * MB}`, null), bodyBytes: 40 * MB, stopOnAnswer: true, maxMs: 20_000 });
    expectClosedError(a, 401, "unauthorized");
  });

  test("GET endpoints with a 40 MB body: answered, then the connection is closed (the body is never read)", async () => {
    for (const path of ["/v1/me", "/v1/models", "/healthz"]) {
      const head = [`GET ${path} HTTP/1.1`, "Host: gw", `Authorization: Bearer ${org.serviceKey}`, `Content-Length: ${40 * MB}`].join("\r\n");
      const a = await rawRequest({ url: gw.url, head, bodyBytes: 40 * MB, stopOnAnswer: true, maxMs: 20_000 });
      expect(a.status).toBe(200);
      expect(a.headers.connection).toBe("close");
      expect(a.closed).toBe(true);
    }
  });

  test("a client that ignores the answer and keeps sending 200 MB costs no memory and is cut off", async () => {
    const before = process.memoryUsage().rss;
    for (const chunked of [false, true]) {
      const framing = chunked ? "Transfer-Encoding: chunked" : `Content-Length: ${200 * MB}`;
      const a = await rawRequest({ url: gw.url, head: post("/v1/chat/completions", framing), bodyBytes: 200 * MB, chunked, maxMs: 30_000 });
      expect(a.status).toBe(400);
      expect(a.closed).toBe(true);
      expect(a.sent).toBeLessThan(200 * MB);
    }
    // The 16 MB the chunked read may hold, plus noise; not the 200 MB sent.
    expect(process.memoryUsage().rss - before).toBeLessThan(64 * MB);
  });

  test("after all that, the gateway still answers a normal request", async () => {
    const res = await fetch(`${gw.url}/v1/chat/completions`, {
      method: "POST",
      headers: bearer(org.serviceKey, { "content-type": "application/json" }),
      body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }),
    });
    expect(res.status).toBe(200);
    await res.text();
  });
});
