import { afterAll, afterEach, describe, expect, setDefaultTimeout, test } from "bun:test";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { sql } from "drizzle-orm";
import type { Config } from "../../src/config/schema.ts";
import type { Gateway } from "../../src/server.ts";
import { errorOf, type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { until } from "../helpers/poll.ts";
import { blocks, chunk, type HostileConn, type HostileUpstream, hostileUpstream } from "../helpers/hostile-upstream.ts";
import { CHAT_MODEL, chatAlias, embedAlias, eventually, post, rec, seedTestOrg, sseData, TEST_PLANS, upstreamSettings, userMessages } from "./inference-fixtures.ts";

setDefaultTimeout(60_000);

/**
 * A hostile upstream against the whole gateway: huge answers and error
 * bodies, trickled error bodies, slow but steady answers, and an SSE stream
 * without event separators. What the gateway may hold is bounded by the
 * bytes it lets the upstream send before closing the connection: kernel
 * socket buffers on loopback hold a few MB, so "the upstream wrote less than
 * the cap plus SLACK" means the gateway stopped reading near the cap.
 */

const MB = 1024 * 1024;
const HUGE = 300 * MB;
const SLACK = 32 * MB;

const gateways: Gateway[] = [];
const upstreams: HostileUpstream[] = [];
let org: SeededOrg | undefined;

afterEach(() => {
  for (const u of upstreams.splice(0)) u.stop();
});
afterAll(async () => {
  for (const g of gateways) await g.stop();
});

async function setup(
  respond: (conn: HostileConn, request: string) => void,
  over: Partial<Config["upstream"]> = {},
  timeouts: Partial<Config["upstream"]["timeouts"]> = {},
): Promise<{ up: HostileUpstream; gw: Gateway; chat: (extra?: Record<string, unknown>) => Promise<Response>; embed: (input: string[]) => Promise<Response> }> {
  const up = hostileUpstream(respond);
  upstreams.push(up);
  const gw = await startTestGateway({
    aliases: { "svc-fast": chatAlias([{ baseUrl: up.url }]), "svc-embed": embedAlias([{ baseUrl: up.url }]) },
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 1, ...over }, timeouts),
  });
  gateways.push(gw);
  org ??= await seedTestOrg(gw.database);
  const key = org.personalKey;
  return {
    up,
    gw,
    chat: (extra = {}) =>
      post(gw, "/v1/chat/completions", key, { model: "svc-fast", messages: userMessages(), ...extra }, { signal: AbortSignal.timeout(30_000) }),
    embed: (input) => post(gw, "/v1/embeddings", key, { model: "svc-embed", input }, { signal: AbortSignal.timeout(30_000) }),
  };
}

function completion(content: string): string {
  return JSON.stringify({
    id: "chatcmpl-1",
    object: "chat.completion",
    created: 1,
    model: CHAT_MODEL,
    choices: [{ index: 0, message: { role: "assistant", content }, finish_reason: "stop" }],
    usage: { prompt_tokens: 3, completion_tokens: 5, total_tokens: 8 },
  });
}

describe("upstream answers larger than upstream.maxResponseBytes", () => {
  test("a 300 MB content-length answer: 503 naming the limit; the connection is closed long before the body is sent", async () => {
    const { up, chat } = await setup(
      (c) => {
        c.write(`HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${HUGE}\r\n\r\n`);
        c.pump(blocks(HUGE));
      },
      { maxResponseBytes: 1 * MB },
    );
    const res = await chat();
    expect(res.status).toBe(503);
    const err = await errorOf(res);
    expect(err.code).toBe("service_unavailable");
    expect(err.message).toContain("larger than");
    await eventually(() => up.conns[0]?.closed === true, 10_000);
    expect(up.conns[0]?.written ?? 0).toBeLessThan(1 * MB + SLACK);
  });

  test("a 300 MB chunked answer without a length: the same, reading stops at the limit", async () => {
    const { up, chat } = await setup(
      (c) => {
        c.write("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n");
        c.pump(blocks(HUGE, chunk));
      },
      { maxResponseBytes: 1 * MB },
    );
    const res = await chat();
    expect(res.status).toBe(503);
    expect((await errorOf(res)).message).toContain("larger than");
    await eventually(() => up.conns[0]?.closed === true, 10_000);
    expect(up.conns[0]?.written ?? 0).toBeLessThan(1 * MB + SLACK);
  });

  test("a 300 MB chunked error body: 500 becomes the usual 503, 400 the caller's 400; reading stops at the limit", async () => {
    for (const [status, want] of [
      [500, 503],
      [400, 400],
    ] as const) {
      const { up, chat } = await setup(
        (c) => {
          c.write(`HTTP/1.1 ${status} Oops\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n`);
          c.write(chunk(Buffer.from("the upstream is upset ")));
          c.pump(blocks(HUGE, chunk));
        },
        { maxResponseBytes: 1 * MB },
      );
      for (const stream of [false, true]) {
        const res = await chat({ stream });
        expect(res.status).toBe(want);
        const err = await errorOf(res);
        expect(err.code).toBe(want === 400 ? "invalid_request_error" : "service_unavailable");
        if (want === 400) expect(err.message).toStartWith("the upstream is upset");
        const conn = up.conns.at(-1);
        await eventually(() => conn?.closed === true, 10_000);
        expect(conn?.written ?? 0).toBeLessThan(1 * MB + SLACK);
      }
    }
  });

  test("an embedding answer gets the room its inputs need, above the configured limit", async () => {
    // 64 inputs of 1,024 dimensions: ~1.4 MB of JSON floats, over a 1 MiB limit but within 64 × 1,024 × 24 bytes.
    const vector = Array.from({ length: 1024 }, (_, i) => -0.012345678901234 * (i + 1));
    const body = Buffer.from(JSON.stringify({ object: "list", data: Array.from({ length: 64 }, (_, index) => ({ object: "embedding", index, embedding: vector })), usage: { prompt_tokens: 64, total_tokens: 64 } }));
    expect(body.byteLength).toBeGreaterThan(1 * MB);
    const { embed } = await setup(
      (c) => {
        c.write(`HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${body.byteLength}\r\n\r\n`);
        let at = 0;
        c.pump(() => {
          if (at >= body.byteLength) return undefined;
          at += 64 * 1024;
          return body.subarray(at - 64 * 1024, at);
        });
      },
      { maxResponseBytes: 1 * MB },
    );
    const res = await embed(Array.from({ length: 64 }, () => "x"));
    expect(res.status).toBe(200);
    expect((rec(await res.json()).data as unknown[]).length).toBe(64);
  });

  test("an answer within the limit is passed on whole", async () => {
    const content = "y".repeat(600 * 1024);
    const { chat } = await setup(
      (c) => {
        const body = completion(content);
        c.write(`HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${Buffer.byteLength(body)}\r\n\r\n`);
        const bytes = Buffer.from(body);
        let at = 0;
        c.pump(() => {
          if (at >= bytes.byteLength) return undefined;
          at += 64 * 1024;
          return bytes.subarray(at - 64 * 1024, at);
        });
      },
      { maxResponseBytes: 1 * MB },
    );
    const res = await chat();
    expect(res.status).toBe(200);
    const choice = rec((rec(await res.json()).choices as unknown[])[0]);
    expect(rec(choice.message).content).toBe(content);
  });
});

describe("peak memory of a separate process", () => {
  test("300 MB answers and error bodies at the default 8 MiB cap: peak RSS grows by less than 64 MB", async () => {
    let n = 0;
    const up = hostileUpstream((c) => {
      const i = n++;
      if (i === 0) {
        const body = completion("warm-up");
        c.write(`HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${Buffer.byteLength(body)}\r\nconnection: close\r\n\r\n${body}`);
        c.socket.end();
      } else if (i === 1) {
        c.write(`HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${HUGE}\r\n\r\n`);
        c.pump(blocks(HUGE));
      } else {
        c.write(`HTTP/1.1 ${i === 2 ? 500 : 400} Oops\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n`);
        c.pump(blocks(HUGE, chunk));
      }
    });
    upstreams.push(up);
    const dir = mkdtempSync(join(tmpdir(), "hostile-rss-"));
    const script = join(dir, "rss.ts");
    const src = (f: string) => JSON.stringify(join(import.meta.dir, f));
    // The gateway's upstream layer alone (no database): what holds the body is exactly the code under test.
    writeFileSync(
      script,
      `import { createUpstream } from ${src("../../src/inference/upstream/index.ts")};
import { createLogger } from ${src("../../src/lib/log.ts")};
import { statusOf } from ${src("../../src/http/errors.ts")};
import { testConfig } from ${src("../helpers/harness.ts")};
import { chatAlias, upstreamSettings } from ${src("./inference-fixtures.ts")};
const alias = chatAlias([{ baseUrl: ${JSON.stringify(up.url)} }]);
const config = await testConfig({ aliases: { "svc-fast": alias }, upstream: upstreamSettings({ attempts: 1 }) });
const upstream = createUpstream({ config, log: createLogger("silent") });
const call = () => upstream.complete("svc-fast", alias, "/chat/completions", () => "{}", { signal: new AbortController().signal, requestId: "r" })
  .then((r) => "ok " + r.body.length, (e) => String(e.code ? statusOf(e.code) : e));
const warm = await call();
Bun.gc(true);
const baseline = process.resourceUsage().maxRSS;
const outcomes = [await call(), await call(), await call()];
console.log(JSON.stringify({ warm, outcomes, growthKB: process.resourceUsage().maxRSS - baseline }));
process.exit(0);`,
    );
    try {
      // Killed if it runs long (reading 300 MB bodies whole, as before the cap, takes a minute on a busy machine).
      const p = Bun.spawn([process.execPath, script], { stdout: "pipe", stderr: "inherit", timeout: 40_000 });
      const out = await new Response(p.stdout).text();
      expect(await p.exited).toBe(0);
      const r = JSON.parse(out.trim().split("\n").at(-1) ?? "{}") as { warm: string; outcomes: string[]; growthKB: number };
      expect(r.warm).toStartWith("ok ");
      expect(r.outcomes).toEqual(["503", "503", "400"]);
      expect(r.growthKB).toBeLessThan(64 * 1024);
      for (const c of up.conns.slice(1)) expect(c.written).toBeLessThan(8 * MB + SLACK);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe("upstream body timers", () => {
  test("an error body trickling one byte a second: answered within about the first-byte timeout, with what arrived", async () => {
    const { chat } = await setup(
      (c) => {
        c.write("HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: 1000\r\n\r\nmaximum context length exceeded");
        c.every(1_000, () => {
          c.write(".");
          return true;
        });
      },
      {},
      { firstByteMs: 1_000, idleMs: 1_000 },
    );
    const t0 = performance.now();
    const res = await chat();
    const took = performance.now() - t0;
    expect(res.status).toBe(400);
    expect((await errorOf(res)).message).toStartWith("maximum context length exceeded");
    expect(took).toBeLessThan(1_000 + 4_000);
  });

  test("a large answer arriving slowly but steadily, longer than idleMs in all and never idle that long, succeeds", async () => {
    const content = "z".repeat(160 * 1024);
    const body = Buffer.from(completion(content));
    const pieces = 16;
    const size = Math.ceil(body.byteLength / pieces);
    const { chat } = await setup(
      (c) => {
        c.write(`HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${body.byteLength}\r\n\r\n`);
        let i = 0;
        c.every(150, () => {
          c.write(body.subarray(i * size, (i + 1) * size));
          return ++i < pieces;
        });
      },
      {},
      { firstByteMs: 2_000, idleMs: 1_000 },
    );
    const t0 = performance.now();
    const res = await chat();
    expect(res.status).toBe(200);
    expect(performance.now() - t0).toBeGreaterThan(1_000);
    const choice = rec((rec(await res.json()).choices as unknown[])[0]);
    expect(rec(choice.message).content).toBe(content);
  });

  test("a non-streamed answer that stops arriving fails after idleMs", async () => {
    const { chat } = await setup(
      (c) => c.write("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"id\":"),
      {},
      { firstByteMs: 2_000, idleMs: 500 },
    );
    const t0 = performance.now();
    const res = await chat();
    expect(res.status).toBe(503);
    expect(performance.now() - t0).toBeLessThan(500 + 4_000);
  });
});

describe("SSE stream without event separators", () => {
  test("ends with the stream's error event after the 8 MiB event cap; the stream is not buffered whole", async () => {
    const { up, chat } = await setup((c) => {
      c.write("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n");
      c.write(chunk(Buffer.from("data: ")));
      c.pump(blocks(HUGE, chunk));
    });
    const t0 = performance.now();
    const res = await chat({ stream: true });
    expect(res.status).toBe(200);
    const events = sseData(await res.text());
    const last = rec(JSON.parse(events.at(-1) ?? "{}"));
    expect(rec(last.error).code).toBe("service_unavailable");
    expect(String(rec(last.error).message)).toContain("oversized SSE event");
    await eventually(() => up.conns[0]?.closed === true, 10_000);
    expect(up.conns[0]?.written ?? 0).toBeLessThan(8 * MB + SLACK);
    // Linear work: 8 MiB held in pieces is quick even on a busy machine (re-copying it on each read is not).
    expect(performance.now() - t0).toBeLessThan(15_000);
  });
});

describe("answers nested past JSON.stringify's stack", () => {
  // JSON.parse reads 50,000 nested arrays; serialising them again overflows the stack.
  const DEEP = `${"[".repeat(50_000)}${"]".repeat(50_000)}`;
  const answer = (c: HostileConn, body: string) => c.write(`HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${Buffer.byteLength(body)}\r\n\r\n${body}`);
  const choice = (message: string, extra = "") =>
    `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"${CHAT_MODEL}","choices":[{"index":0,"message":${message},"finish_reason":"stop"${extra}}],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}`;

  // What the answer sends on as the upstream wrote it: a tool call's arguments sent as JSON (their text is
  // sent), and the fields of a call the gateway does not read. (A call that is no object, and logprobs entries
  // that are no token, are left out, so nothing of them is serialised: below.)
  for (const [name, body] of [
    ["tool call arguments", choice(`{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"f","arguments":${DEEP}}}]}`)],
    ["a tool call's own fields", choice(`{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"f","arguments":"{}"},"x":${DEEP}}]}`)],
    ["a tool call's function fields", choice(`{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"f","arguments":"{}","x":${DEEP}}}]}`)],
  ]) {
    test(`a chat answer with such ${name} is the usual 503 for an unreadable answer, not a 500, and is not charged`, async () => {
      const { gw, chat } = await setup((c) => answer(c, body ?? ""));
      const res = await chat({ logprobs: true });
      const err = await errorOf(res);
      expect({ status: res.status, code: err.code }).toEqual({ status: 503, code: "service_unavailable" });
      expect(err.message).toContain("unreadable answer");
      // Settled once, as the failure the client saw: none of the answer's 5 completion tokens counted.
      const metrics = await (await fetch(`${gw.metricsUrl}`)).text();
      expect(Number(/^gateway_tokens_total\{alias="svc-fast",direction="completion"\} (\d+)$/m.exec(metrics)?.[1] ?? 0)).toBe(0);
    });
  }
  test("a streamed request answered whole (one JSON document) with such tool call arguments: the stream ends with its error event, settled once as a failure, not charged", async () => {
    const body = choice(`{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"f","arguments":${DEEP}}}]}`);
    const { gw, chat } = await setup((c) => answer(c, body));
    const failed = async () => {
      await gw.quota.flush();
      const rows = await gw.database.rows<{ n: number }>(sql`select coalesce(sum(requests), 0)::int as n from usage_events where status = 503 and streamed`);
      return Number(rows[0]?.n);
    };
    const before = await failed();
    const res = await chat({ stream: true });
    expect(res.status).toBe(200);
    const text = await res.text().catch((e: unknown) => `read failed: ${String(e)}`);
    const events = sseData(text);
    const last = rec(JSON.parse(events.at(-1) ?? "{}"));
    expect({ code: rec(last.error).code, message: String(rec(last.error).message).includes("unreadable") }).toEqual({ code: "service_unavailable", message: true });
    // Settled once, as the failure the client saw (its record written), not left open: none of the answer's 5 completion tokens counted.
    await until(async () => (await failed()) === before + 1, "the stream's usage record (503)", 5_000, 50);
    const metrics = await (await fetch(`${gw.metricsUrl}`)).text();
    expect(Number(/^gateway_tokens_total\{alias="svc-fast",direction="completion"\} (\d+)$/m.exec(metrics)?.[1] ?? 0)).toBe(0);
  });

  test("a tool call that is no object, and logprobs entries that are no token, are left out: the answer is served", async () => {
    const body = choice(
      `{"role":"assistant","content":"hi","tool_calls":[${DEEP}]}`,
      `,"logprobs":{"content":[{"token":"hi","logprob":-1,"bytes":null,"top_logprobs":${DEEP}}]}`,
    );
    const { chat } = await setup((c) => answer(c, body));
    const res = await chat({ logprobs: true });
    expect(res.status).toBe(200);
    const out = (await res.json()) as { choices: { message: Record<string, unknown>; logprobs: unknown }[] };
    expect(out.choices[0]?.message.tool_calls).toBeUndefined();
    expect(out.choices[0]?.message.content).toBe("hi");
    expect(out.choices[0]?.logprobs).toEqual({ content: [{ token: "hi", logprob: -1, bytes: null, top_logprobs: [] }], refusal: null });
  });

  test("an embedding answer with such a vector: the same", async () => {
    const { gw, embed } = await setup((c) => answer(c, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":${DEEP}}],"model":"m","usage":{"prompt_tokens":7,"total_tokens":7}}`));
    const res = await embed(["x"]);
    const err = await errorOf(res);
    expect({ status: res.status, code: err.code }).toEqual({ status: 503, code: "service_unavailable" });
    expect(err.message).toContain("unreadable answer");
    const metrics = await (await fetch(`${gw.metricsUrl}`)).text();
    expect(Number(/^gateway_tokens_total\{alias="svc-embed",direction="prompt"\} (\d+)$/m.exec(metrics)?.[1] ?? 0)).toBe(0);
  });
});

describe("an upstream's Retry-After on 429 is bounded", () => {
  test("every attempt 429: retry-after and the message's number are the upstream's wait clamped to 1..60 s, whatever it wrote", async () => {
    let value = "";
    const { chat } = await setup((c) => {
      const body = '{"error":{"message":"overloaded"}}';
      c.write(`HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: ${value}\r\ncontent-length: ${body.length}\r\n\r\n${body}`);
    });
    const far = new Date(Date.now() + 86_400_000).toUTCString();
    const soon = new Date(Date.now() + 30_000).toUTCString();
    for (const [sent, lo, hi] of [
      ["7", 7, 7],
      ["86400", 60, 60],
      ["1000000000000", 60, 60],
      ["9".repeat(400), 60, 60],
      [far, 60, 60],
      ["Fri, 31 Dec 9999 23:59:59 GMT", 60, 60],
      [soon, 28, 31],
      ["Thu, 01 Jan 1970 00:00:00 GMT", 1, 1],
      ["0", 1, 1],
      ["soon", 1, 1],
    ] as const) {
      value = sent;
      for (const stream of [false, true]) {
        const res = await chat(stream ? { stream: true } : {});
        const err = await errorOf(res);
        const header = res.headers.get("retry-after") ?? "";
        expect({ sent: sent.slice(0, 40), status: res.status, code: err.code, header: /^\d+$/.test(header) }).toEqual({ sent: sent.slice(0, 40), status: 429, code: "rate_limit_error", header: true });
        const wait = Number(header);
        expect(wait).toBeGreaterThanOrEqual(lo);
        expect(wait).toBeLessThanOrEqual(hi);
        expect(err.message).toContain(`retry after ${header} s.`);
      }
    }
  });
});
