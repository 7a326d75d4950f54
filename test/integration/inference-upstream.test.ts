import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { createLogger } from "../../src/lib/log.ts";
import type { Config } from "../../src/config/schema.ts";
import { ConnectTimeout, createHttp1Client } from "../../src/inference/upstream/http1.ts";
import { ClientGone, createUpstream } from "../../src/inference/upstream/index.ts";
import { createConnectProbe } from "../../src/inference/upstream/probe.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { startGateway } from "../../src/server.ts";
import { errorOf, type SeededOrg, sharedDatabase, testConfig } from "../helpers/harness.ts";
import { CHAT_MODEL, TEST_PLANS, chatAlias, eventually, post, rec, seedTestOrg, sseData, upstreamSettings, userMessages } from "./inference-fixtures.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Upstream routing through real HTTP: failover between two simulators,
 * circuit breaking, attempts, timeouts, and what reaches the upstream.
 * Target A has weight 1 and B weight 0 (a standby), so the order is fixed:
 * A first, B only when A fails.
 */

let a: Simulator;
let b: Simulator;
let org: SeededOrg;
const gateways: Gateway[] = [];

beforeAll(async () => {
  a = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 3 });
  b = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 3 });
});
afterEach(() => {
  a.reset();
  b.reset();
  logged.length = 0;
});
afterAll(async () => {
  for (const g of gateways) await g.stop();
  await a.stop();
  await b.stop();
});

/** Lines the gateways below log at warn and above. */
const logged: Record<string, unknown>[] = [];

async function gateway(upstream: Config["upstream"], aliases?: Config["aliases"]): Promise<Gateway> {
  const config = await testConfig({
    aliases: aliases ?? {
      "svc-fast": chatAlias([
        { baseUrl: a.url, weight: 1 },
        { baseUrl: b.url, weight: 0 },
      ]),
    },
    plans: TEST_PLANS,
    upstream,
  });
  const gw = await startGateway({ config, database: await sharedDatabase(), log: createLogger("warn", (l) => logged.push(JSON.parse(l) as Record<string, unknown>)) });
  gateways.push(gw);
  org ??= await seedTestOrg(gw.database);
  return gw;
}

const chat = (gw: Gateway, extra: Record<string, unknown> = {}) => post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-fast", messages: userMessages(), ...extra });

describe("failover", () => {
  let gw: Gateway;
  beforeAll(async () => {
    // A high breaker threshold: these tests fail A over and over on purpose.
    gw = await gateway(upstreamSettings({ attempts: 3, breakerFailures: 1_000 }, { firstByteMs: 300 }));
  });

  test("429, 500, 502, 503 and 504 from A: B answers, the client sees one success", async () => {
    for (const status of [429, 500, 502, 503, 504] as const) {
      a.reset();
      b.reset();
      a.setFault({ kind: "status", status, count: 1 });
      const res = await chat(gw);
      expect(res.status).toBe(200);
      expect(rec(await res.json()).model).toBe("svc-fast");
      expect(a.stats.requests).toBe(1);
      expect(b.stats.requests).toBe(1);
    }
  });

  test("A refuses connections: B answers", async () => {
    a.setFault({ kind: "refuse" });
    const res = await chat(gw);
    expect(res.status).toBe(200);
    expect(b.stats.requests).toBe(1);
  });

  test("A never answers: after the first-byte timeout B answers, and A's request is aborted", async () => {
    a.setFault({ kind: "hang" });
    const t0 = performance.now();
    const res = await chat(gw);
    expect(res.status).toBe(200);
    expect(performance.now() - t0).toBeGreaterThanOrEqual(290);
    expect(b.stats.requests).toBe(1);
    await eventually(() => a.stats.aborts === 1);
  });

  test("a non-streamed answer cut off mid-body fails over (nothing reached the client yet)", async () => {
    a.setFault({ kind: "drop-mid-stream", afterChunks: 1 });
    const res = await chat(gw);
    expect(res.status).toBe(200);
    expect(rec(await res.json()).object).toBe("chat.completion");
    expect(b.stats.requests).toBe(1);
  });

  test("an unreadable 200 answer is a 503, never passed on", async () => {
    a.setFault({ kind: "malformed-sse" });
    const res = await chat(gw);
    expect(res.status).toBe(503);
    expect((await errorOf(res)).code).toBe("service_unavailable");
  });

  test("slow headers within the first-byte timeout are fine", async () => {
    a.setFault({ kind: "slow-headers", ms: 100 });
    expect((await chat(gw)).status).toBe(200);
    expect(b.stats.requests).toBe(0);
  });

  test("a streamed request fails over too while nothing reached the client", async () => {
    a.setFault({ kind: "status", status: 503, count: 1 });
    const res = await chat(gw, { stream: true });
    expect(res.status).toBe(200);
    expect(sseData(await res.text()).at(-1)).toBe("[DONE]");
    expect(b.stats.requests).toBe(1);
  });

  test("401, 403, 404 and 405 from A (a misconfigured target): B answers, and A is logged as an error", async () => {
    for (const status of [401, 403, 404, 405] as const) {
      a.reset();
      b.reset();
      logged.length = 0;
      a.setFault({ kind: "status", status, count: 1, message: `simulated ${status}` });
      const res = await chat(gw);
      expect(res.status).toBe(200);
      expect(rec(await res.json()).object).toBe("chat.completion");
      expect(a.stats.requests).toBe(1);
      expect(b.stats.requests).toBe(1);
      const errors = logged.filter((l) => l.level === "error");
      expect(errors.length).toBe(1);
      expect(errors[0]).toMatchObject({ target: `${a.url}|${CHAT_MODEL}`, status, message: `simulated ${status}` });
    }
  });

  test("401/403/404/405 everywhere: 503 service_unavailable, never the caller's own 401 or 404", async () => {
    for (const status of [401, 403, 404, 405] as const) {
      a.setFault({ kind: "status", status });
      b.setFault({ kind: "status", status });
      const res = await chat(gw);
      expect(res.status).toBe(503);
      const err = await errorOf(res);
      expect(err.code).toBe("service_unavailable");
      expect(err.message).not.toContain(String(status));
    }
  });

  test("an upstream 400 is the caller's fault: no failover", async () => {
    a.setFault({ kind: "status", status: 400, message: "bad value for top_p" });
    const res = await chat(gw);
    expect(res.status).toBe(400);
    expect((await errorOf(res)).message).toBe("bad value for top_p");
    expect(b.stats.requests).toBe(0);
  });

  test("every target failing: 503 service_unavailable; every target overloaded: 429 with retry-after", async () => {
    a.setFault({ kind: "status", status: 503 });
    b.setFault({ kind: "status", status: 503 });
    let res = await chat(gw);
    expect(res.status).toBe(503);
    expect((await errorOf(res)).code).toBe("service_unavailable");
    a.setFault({ kind: "status", status: 429 });
    b.setFault({ kind: "status", status: 429 });
    res = await chat(gw);
    expect(res.status).toBe(429);
    expect(res.headers.get("retry-after")).toBe("1");
    expect((await errorOf(res)).code).toBe("rate_limit_error");
    // Mixed: not all back-pressure, so unavailable.
    a.setFault({ kind: "status", status: 429 });
    b.setFault({ kind: "status", status: 502 });
    res = await chat(gw);
    expect(res.status).toBe(503);
  });
});

describe("attempts and weights", () => {
  test("at most upstream.attempts requests in all", async () => {
    const gw = await gateway(upstreamSettings({ attempts: 2 }), {
      "svc-fast": chatAlias([{ baseUrl: a.url }, { baseUrl: b.url }, { baseUrl: a.url, model: "other" }]),
    });
    a.setFault({ kind: "status", status: 503 });
    b.setFault({ kind: "status", status: 503 });
    expect((await chat(gw)).status).toBe(503);
    expect(a.stats.requests + b.stats.requests).toBe(2);
  });

  test("a single-target alias retries its one target", async () => {
    const gw = await gateway(upstreamSettings({ attempts: 3 }), { "svc-fast": chatAlias([{ baseUrl: a.url }]) });
    a.setFault({ kind: "status", status: 503, count: 2 });
    expect((await chat(gw)).status).toBe(200);
    expect(a.stats.requests).toBe(3);
  });

  test("traffic splits by weight", async () => {
    const gw = await gateway(upstreamSettings(), {
      "svc-fast": chatAlias([
        { baseUrl: a.url, weight: 3 },
        { baseUrl: b.url, weight: 1 },
      ]),
    });
    await Promise.all(Array.from({ length: 200 }, () => chat(gw).then((r) => r.arrayBuffer())));
    expect(a.stats.requests + b.stats.requests).toBe(200);
    const share = a.stats.requests / 200;
    expect(share).toBeGreaterThan(0.6);
    expect(share).toBeLessThan(0.9);
  });
});

describe("circuit breaker", () => {
  test("opens after breakerFailures, skips the target, probes it after the cool-down, closes on success", async () => {
    // A cool-down far longer than a few local requests take even on a busy machine: the "still open"
    // steps below must happen inside it. Waiting it out is a lower bound, which load cannot break.
    const COOLDOWN = 2_000;
    const gw = await gateway(upstreamSettings({ attempts: 2, breakerFailures: 2, breakerCooldownMs: COOLDOWN }));
    a.setFault({ kind: "status", status: 503 });
    for (let i = 0; i < 2; i++) expect((await chat(gw)).status).toBe(200);
    expect(a.stats.requests).toBe(2);
    // Open: A is not tried at all.
    for (let i = 0; i < 3; i++) expect((await chat(gw)).status).toBe(200);
    expect(a.stats.requests).toBe(2);
    expect(b.stats.requests).toBe(5);
    // Half-open after the cool-down: one probe, which fails and re-opens it.
    await Bun.sleep(COOLDOWN + 50);
    expect((await chat(gw)).status).toBe(200);
    expect(a.stats.requests).toBe(3);
    expect((await chat(gw)).status).toBe(200);
    expect(a.stats.requests).toBe(3);
    // A recovers; the next probe succeeds and closes the breaker.
    a.setFault(null);
    await Bun.sleep(COOLDOWN + 50);
    expect((await chat(gw)).status).toBe(200);
    expect(a.stats.requests).toBe(4);
    expect((await chat(gw)).status).toBe(200);
    expect(a.stats.requests).toBe(5);
    expect(b.stats.requests).toBe(7);
  });

  test("429s do not count toward the breaker; 503s from the same target do", async () => {
    const gw = await gateway(upstreamSettings({ attempts: 2, breakerFailures: 2, breakerCooldownMs: 60_000 }));
    a.setFault({ kind: "status", status: 429 });
    for (let i = 1; i <= 5; i++) {
      expect((await chat(gw)).status).toBe(200);
      // A is asked every time: five 429s in a row did not open its breaker.
      expect(a.stats.requests).toBe(i);
    }
    expect(b.stats.requests).toBe(5);
    a.setFault({ kind: "status", status: 503 });
    for (let i = 0; i < 3; i++) expect((await chat(gw)).status).toBe(200);
    // Two 503s open it: the third request goes to B alone.
    expect(a.stats.requests).toBe(7);
    expect(b.stats.requests).toBe(8);
  });

  test("every breaker open: 503 at once, without calling anyone", async () => {
    const gw = await gateway(upstreamSettings({ attempts: 1, breakerFailures: 1, breakerCooldownMs: 60_000 }), {
      "svc-fast": chatAlias([{ baseUrl: a.url }]),
    });
    a.setFault({ kind: "status", status: 502 });
    expect((await chat(gw)).status).toBe(503);
    a.setFault(null);
    const res = await chat(gw);
    expect(res.status).toBe(503);
    expect((await errorOf(res)).code).toBe("service_unavailable");
    expect(a.stats.requests).toBe(1);
  });
});

describe("timeouts", () => {
  test("first-byte timeout with no other target: 503 after about firstByteMs", async () => {
    const gw = await gateway(upstreamSettings({ attempts: 1 }, { firstByteMs: 200 }), { "svc-fast": chatAlias([{ baseUrl: a.url }]) });
    a.setFault({ kind: "hang" });
    const t0 = performance.now();
    const res = await chat(gw);
    const took = performance.now() - t0;
    expect(res.status).toBe(503);
    expect(took).toBeGreaterThanOrEqual(190);
    // Far below the 10 s the other settings would allow, far above what load adds to 200 ms.
    expect(took).toBeLessThan(5_000);
    await eventually(() => a.stats.aborts === 1);
  });

  test("per-alias timeouts override the global ones", async () => {
    const gw = await gateway(upstreamSettings({ attempts: 1 }, { firstByteMs: 100 }), {
      "svc-fast": chatAlias([{ baseUrl: a.url }], { timeouts: { connectMs: 1_000, firstByteMs: 2_000, idleMs: 2_000 } }),
    });
    a.setFault({ kind: "slow-headers", ms: 300 });
    expect((await chat(gw)).status).toBe(200);
  });

  test("connect timeout: a target that accepts no connection in connectMs fails over without waiting for firstByteMs", async () => {
    const config = await testConfig({
      aliases: { "svc-fast": chatAlias([{ baseUrl: a.url, weight: 1 }, { baseUrl: b.url, weight: 0 }]) },
      upstream: upstreamSettings({ attempts: 2 }, { connectMs: 100, firstByteMs: 30_000 }),
    });
    // A connect that never completes for A stands in for dropped SYNs (the sandbox answers every address).
    const http = createHttp1Client({ connect: (o) => (o.port === a.port ? new Promise(() => {}) : Bun.connect(o)) });
    const upstream = createUpstream({ config, log: createLogger("silent"), http });
    a.setFault({ kind: "hang" });
    const t0 = performance.now();
    const res = await upstream.complete("svc-fast", config.aliases["svc-fast"] as NonNullable<Config["aliases"][string]>, "/chat/completions", () => JSON.stringify({ model: "m", messages: userMessages() }), {
      signal: new AbortController().signal,
      requestId: "t",
    });
    // Far below firstByteMs (30 s), far above what load adds to connectMs (100 ms).
    expect(performance.now() - t0).toBeLessThan(10_000);
    expect(res.target.cfg.baseUrl).toBe(b.url);
    expect(rec(JSON.parse(res.body)).object).toBe("chat.completion");
  });

  test("connect timeout on a kept-alive connection: an origin gone silent is probed, and the request fails within connectMs", async () => {
    // A probe that never connects stands in for a host that vanished behind a pooled connection; freshMs 0 probes at every reuse.
    const probe = createConnectProbe({ freshMs: 0, connect: () => new Promise(() => {}) });
    const http = createHttp1Client({ probe });
    const endpoint = http.endpoint(a.url);
    const request = () =>
      endpoint.request({
        method: "POST",
        path: "/v1/chat/completions",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ model: "m", messages: userMessages() }),
        signal: new AbortController().signal,
        connectMs: 100,
      });
    try {
      // The first request opens the connection (timed by the client's connect) and leaves it in the pool.
      expect((await (await request()).text()).length).toBeGreaterThan(0);
      a.setFault({ kind: "hang" });
      const t0 = performance.now();
      const err = await request().catch((e: unknown) => e);
      expect(err).toBeInstanceOf(ConnectTimeout);
      expect(performance.now() - t0).toBeLessThan(1_000);
    } finally {
      http.close();
    }
  });

  test("connect timeout under a burst: a slow connect is not given up while the origin answers on other connections", async () => {
    // The second connection never opens (its SYNs lost in a full accept queue); the first opens and answers meanwhile.
    let opened = 0;
    const http = createHttp1Client({ connect: (o) => (++opened === 2 ? new Promise(() => {}) : Bun.connect(o)) });
    const endpoint = http.endpoint(a.url);
    const request = (signal: AbortSignal) =>
      endpoint.request({ method: "POST", path: "/v1/chat/completions", headers: { "content-type": "application/json" }, body: JSON.stringify({ model: "m", messages: userMessages() }), signal, connectMs: 50 });
    const slow = new AbortController();
    try {
      const [first, second] = [request(new AbortController().signal), request(slow.signal).catch((e: unknown) => e)];
      expect((await (await first).text()).length).toBeGreaterThan(0);
      const settled = await Promise.race([second.then(() => "settled"), Bun.sleep(300).then(() => "waiting")]);
      expect(settled).toBe("waiting");
      slow.abort(new Error("test over"));
      expect(await second).not.toBeInstanceOf(ConnectTimeout);
    } finally {
      http.close();
    }
  });

  test("a client that leaves during the backoff stops the attempts", async () => {
    const config = await testConfig({
      aliases: { "svc-fast": chatAlias([{ baseUrl: a.url }]) },
      upstream: upstreamSettings({ attempts: 5, backoffMs: 2_000 }),
    });
    // Jitter pinned to its top: the first backoff is 3 s.
    const upstream = createUpstream({ config, log: createLogger("silent"), random: () => 1 });
    a.setFault({ kind: "status", status: 503 });
    const ac = new AbortController();
    const pending = upstream
      .complete("svc-fast", config.aliases["svc-fast"] as NonNullable<Config["aliases"][string]>, "/chat/completions", () => "{}", { signal: ac.signal, requestId: "t" })
      .catch((e: unknown) => e);
    // The first attempt has been answered: the client leaves during the backoff.
    await eventually(() => a.stats.requests === 1 && a.stats.inFlight === 0, 10_000);
    const leftAt = performance.now();
    ac.abort();
    const err = await pending;
    expect(err).toBeInstanceOf(ClientGone);
    // At once, not at the end of the 3 s backoff.
    expect(performance.now() - leftAt).toBeLessThan(2_000);
    expect(a.stats.requests).toBe(1);
  });
});

describe("what reaches the upstream", () => {
  test("only the gateway's own headers: none of the client's, its key least of all", async () => {
    const gw = await gateway(upstreamSettings(), { "svc-fast": chatAlias([{ baseUrl: a.url }]) });
    const clientHeaders = {
      "x-request-id": "client-req-1",
      "user-agent": "OpenAI/JS 7.57.0",
      "x-api-key": "secret-1",
      "api-key": "secret-2",
      "proxy-authorization": "Basic c2VjcmV0",
      "x-forwarded-for": "10.0.0.1",
      "x-real-ip": "10.0.0.1",
      forwarded: "for=10.0.0.1",
      "openai-organization": "org-x",
      "openai-project": "proj-x",
      "x-stainless-lang": "js",
      "accept-language": "fr",
      "x-custom": "1",
      "accept-encoding": "gzip",
      connection: "keep-alive",
    };
    for (const stream of [false, true]) {
      const body = JSON.stringify({ model: "svc-fast", messages: userMessages(), ...(stream ? { stream: true } : {}) });
      const res = await fetch(`${gw.url}/v1/chat/completions`, {
        method: "POST",
        headers: { ...clientHeaders, authorization: `Bearer ${org.personalKey}`, "content-type": "application/json; charset=utf-8", accept: "*/*" },
        body,
      });
      expect(res.status).toBe(200);
      await res.text();
      const seen = Object.fromEntries([...(a.stats.lastHeaders?.entries() ?? [])]);
      const forwarded = JSON.stringify(rec(a.stats.lastBody));
      expect(seen).toEqual({
        host: `127.0.0.1:${a.port}`,
        "content-type": "application/json",
        accept: stream ? "text/event-stream" : "application/json",
        "accept-encoding": "identity",
        "x-request-id": "client-req-1",
        "content-length": String(Buffer.byteLength(forwarded)),
      });
    }
  });

  test("the target's API key from its env variable, never the client's key", async () => {
    process.env.TEST_UPSTREAM_KEY = "upstream-secret";
    const locked = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, apiKey: "upstream-secret" });
    try {
      const withKey = chatAlias([{ baseUrl: locked.url }]);
      const first = withKey.targets[0];
      if (first) first.apiKeyEnv = "TEST_UPSTREAM_KEY";
      const gw = await gateway(upstreamSettings(), { "svc-fast": withKey, "svc-smart": chatAlias([{ baseUrl: locked.url }]) });
      expect((await chat(gw)).status).toBe(200);
      expect([...(locked.stats.lastHeaders?.keys() ?? [])].sort()).toEqual(["accept", "accept-encoding", "authorization", "content-length", "content-type", "host", "x-request-id"]);
      expect(locked.stats.lastHeaders?.get("authorization")).toBe("Bearer upstream-secret");
      // Without a key the target refuses the gateway (401): an operator problem, reported as 503, never as the caller's 401.
      const res = await post(gw, "/v1/chat/completions", org.personalKey, { model: "svc-smart", messages: userMessages() });
      expect(res.status).toBe(503);
      expect((await errorOf(res)).code).toBe("service_unavailable");
    } finally {
      await locked.stop();
      delete process.env.TEST_UPSTREAM_KEY;
    }
  });
});

describe("upstream connections", () => {
  test("sequential requests, streamed or not, reuse one kept-alive connection to the upstream", async () => {
    // A minimal OpenAI-compatible upstream that records the client port of each request.
    const ports = new Set<number>();
    const sse = (obj: unknown) => `data: ${JSON.stringify(obj)}\n\n`;
    const chunk = { id: "c", object: "chat.completion.chunk", created: 1, model: "m", choices: [{ index: 0, delta: { content: "hi" }, finish_reason: null }] };
    const usage = { ...chunk, choices: [], usage: { prompt_tokens: 3, completion_tokens: 1, total_tokens: 4 } };
    const upstream = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      async fetch(req, srv) {
        ports.add(srv.requestIP(req)?.port ?? -1);
        const body = (await req.json()) as { stream?: boolean };
        if (body.stream) return new Response(`${sse(chunk)}${sse(usage)}data: [DONE]\n\n`, { headers: { "content-type": "text/event-stream" } });
        return Response.json({ id: "c", object: "chat.completion", created: 1, model: "m", choices: [{ index: 0, message: { role: "assistant", content: "hi" }, finish_reason: "stop" }], usage: { prompt_tokens: 3, completion_tokens: 1, total_tokens: 4 } });
      },
    });
    try {
      const gw = await gateway(upstreamSettings(), { "svc-fast": chatAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }]) });
      for (let i = 0; i < 10; i++) {
        const res = await chat(gw, i % 2 === 0 ? {} : { stream: true });
        expect(res.status).toBe(200);
        expect(await res.text()).toContain("hi");
      }
      expect(ports.size).toBe(1);
    } finally {
      upstream.stop(true);
    }
  });
});
