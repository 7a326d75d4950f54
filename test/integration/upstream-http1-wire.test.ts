import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import type { Gateway } from "../../src/server.ts";
import type { SeededOrg } from "../helpers/harness.ts";
import { HELLO_COMPLETION, type HostileConn, gatewayWithStandby, helloAnswer } from "../helpers/hostile-upstream.ts";
import { until } from "../helpers/poll.ts";
import { CHAT_MODEL, post, rec, sseData, userMessages } from "./inference-fixtures.ts";

setDefaultTimeout(60_000);

/**
 * Unusual but legal, and hostile, HTTP/1.1 answers (RFC 9112, RFC 9110) from
 * an upstream written byte for byte on a raw socket, through the whole
 * gateway: what an operator's nginx, envoy, HAProxy or cloud load balancer in
 * front of vLLM may send. A legal answer is read (the model id swapped, as
 * always); a broken one is refused as a failed attempt (failover, then 503),
 * never relayed; a connection whose framing is in doubt is never reused.
 */

let gw: Gateway;
let org: SeededOrg;
let stop = async () => {};
/** What the upstream answers; each test sets it. */
let respond: (c: HostileConn, request: string) => void = () => {};
const requests: string[] = [];
/** The connection each request came on, in order. */
const served: HostileConn[] = [];

const completion = HELLO_COMPLETION;
const chunkEvent = (content: string) =>
  `data: ${JSON.stringify({ id: "chatcmpl-1", object: "chat.completion.chunk", created: 1, model: CHAT_MODEL, choices: [{ index: 0, delta: { content }, finish_reason: null }] })}\n\n`;
const sse = `${chunkEvent("hel")}${chunkEvent("lo")}data: [DONE]\n\n`;
const json = helloAnswer;

beforeAll(async () => {
  ({ gw, org, stop } = await gatewayWithStandby((c, req) => {
    requests.push(req);
    served.push(c);
    respond(c, req);
  }));
});
afterAll(() => stop());

const chat = (extra: Record<string, unknown> = {}, model = "svc-fast", signal: AbortSignal = AbortSignal.timeout(30_000)) =>
  post(gw, "/v1/chat/completions", org.personalKey, { model, messages: userMessages(), ...extra }, { signal });

/** A 200 non-streamed answer, read whole: the upstream's text, under the alias. */
async function expectAnswer(res: Response) {
  const text = await res.text();
  expect({ status: res.status, text: res.status === 200 ? "" : text }).toEqual({ status: 200, text: "" });
  const body = rec(JSON.parse(text));
  expect(body.model).toBe("svc-fast");
  expect(rec(rec((body.choices as unknown[])[0]).message).content).toBe("hello");
}

/** A 503 service_unavailable: the attempt failed, nothing of the upstream's answer passed on. */
async function expectRefused(res: Response) {
  const text = await res.text();
  expect({ status: res.status, text: res.status === 503 ? "" : text }).toEqual({ status: 503, text: "" });
  expect(rec(rec(JSON.parse(text)).error).code).toBe("service_unavailable");
}

/** Answers each request with the next of `answers` (the last one repeated). */
function answer(...answers: string[]) {
  let i = 0;
  respond = (c) => c.write(answers[Math.min(i++, answers.length - 1)] ?? "");
}

/** Whether the last two requests came on one connection. */
const reused = () => served.at(-1) === served.at(-2);

describe("legal answers are read", () => {
  test("interim 100 Continue and 103 Early Hints (with headers) before the answer are skipped", async () => {
    answer(`HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\nlink: </x.js>\r\n\r\n${json()}`);
    await expectAnswer(await chat());
    answer(`HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n${sse.length.toString(16)}\r\n${sse}\r\n0\r\n\r\n`);
    const res = await chat({ stream: true });
    expect(res.status).toBe(200);
    expect(sseData(await res.text()).at(-1)).toBe("[DONE]");
  });

  test("a status line without a reason phrase, header names in odd case", async () => {
    answer(`HTTP/1.1 200\r\nCONTENT-TYPE: application/json\r\ncOnTeNt-LeNgTh: ${completion.length}\r\n\r\n${completion}`);
    await expectAnswer(await chat());
    answer(`HTTP/1.1 200 \r\nContent-Type: application/json\r\nTRANSFER-ENCODING: Chunked\r\n\r\n${completion.length.toString(16).toUpperCase()}\r\n${completion}\r\n0\r\n\r\n`);
    await expectAnswer(await chat());
  });

  test("chunked: extensions, uppercase hex, leading zeros, trailers after the last chunk; the connection is reused", async () => {
    const a = completion.slice(0, 26);
    const b = completion.slice(26);
    answer(
      `HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\ntrailer: x-checksum\r\n\r\n` +
        `1a;foo=bar;q="a b"\r\n${a}\r\n` +
        `${b.length.toString(16).toUpperCase().padStart(20, "0")} ; ext\r\n${b}\r\n` +
        `0000;last\r\nx-checksum: abc\r\nx-more: 1\r\n\r\n`,
    );
    expect(a.length).toBe(0x1a);
    await expectAnswer(await chat());
    await expectAnswer(await chat());
    expect(reused()).toBe(true);
  });

  test("LF-only line endings (RFC 9112 2.2 lets a recipient take a bare LF as a line end)", async () => {
    answer(`HTTP/1.1 200 OK\ncontent-type: application/json\ncontent-length: ${completion.length}\n\n${completion}`);
    await expectAnswer(await chat());
    answer(`HTTP/1.1 200 OK\ncontent-type: application/json\ntransfer-encoding: chunked\n\n${completion.length.toString(16)}\n${completion}\n0\n\n`);
    await expectAnswer(await chat());
    answer(`HTTP/1.1 200 OK\r\ncontent-type: application/json\ncontent-length: ${completion.length}\r\n\n${completion}`);
    await expectAnswer(await chat());
  });

  test("Content-Length as a list of one value repeated (`N, N`, or the field twice)", async () => {
    const n = completion.length;
    answer(`HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${n}, ${n}\r\n\r\n${completion}`);
    await expectAnswer(await chat());
    answer(`HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${n}\r\nContent-Length: ${n}\r\n\r\n${completion}`);
    await expectAnswer(await chat());
  });

  test("an empty Content-Encoding (an empty list: no coding) or `identity`", async () => {
    answer(json("content-encoding: \r\n"));
    await expectAnswer(await chat());
    answer(json("Content-Encoding: Identity\r\n"));
    await expectAnswer(await chat());
  });
});

describe("framing in doubt: read, and the connection is not reused", () => {
  test("Transfer-Encoding chunked and Content-Length: chunked wins (RFC 9112 6.3); the connection is closed", async () => {
    answer(`HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n${completion.length.toString(16)}\r\n${completion}\r\n0\r\n\r\n`);
    await expectAnswer(await chat());
    await until(() => served.at(-1)?.closed === true, "the connection closed");
    await expectAnswer(await chat());
    expect(reused()).toBe(false);
  });

  test("an HTTP/1.0 answer with Transfer-Encoding (RFC 9112 6.1: faulty framing) is read, and its connection closed even with keep-alive", async () => {
    answer(`HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n${completion.length.toString(16)}\r\n${completion}\r\n0\r\n\r\n`);
    await expectAnswer(await chat());
    await expectAnswer(await chat());
    expect(reused()).toBe(false);
  });

  test("HTTP/1.0 and `connection: close` answers without a length end at the close; the connection is not reused", async () => {
    respond = (c) => {
      c.write(`HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n${completion}`);
      c.socket.end();
    };
    await expectAnswer(await chat());
    respond = (c) => {
      c.write(`HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: text/event-stream\r\n\r\n${sse}`);
      c.socket.end();
    };
    const res = await chat({ stream: true });
    expect(sseData(await res.text()).at(-1)).toBe("[DONE]");
    expect(reused()).toBe(false);
    expect(served.at(-2)?.closed).toBe(true);
  });

  test("a client that leaves mid-stream: the upstream connection is closed, never reused with the rest of the body in it", async () => {
    let held: HostileConn | undefined;
    respond = (c) => {
      held = c;
      c.write(`HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n`);
      const e = chunkEvent("hel");
      c.write(`${e.length.toString(16)}\r\n${e}\r\n`);
    };
    const ac = new AbortController();
    const res = await chat({ stream: true }, "svc-fast", ac.signal);
    const reader = res.body?.getReader();
    await reader?.read();
    ac.abort();
    await until(() => held?.closed === true, "the upstream connection closed");
    answer(json());
    await expectAnswer(await chat());
    expect(served.at(-1)).not.toBe(held);
  });
});

describe("broken answers are refused: failover, then 503", () => {
  const n = completion.length;
  const refused: [string, string][] = [
    ["two different Content-Length values", `HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${n}, ${n + 1}\r\n\r\n${completion}`],
    ["two Content-Length fields that differ", `HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${n}\r\ncontent-length: ${n - 1}\r\n\r\n${completion}`],
    ["a Content-Length past 2^53", `HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: ${"9".repeat(400)}\r\n\r\n${completion}`],
    ["obs-fold (a header continued on the next line)", `HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-note: a\r\n\tx-other: b\r\ncontent-length: ${n}\r\n\r\n${completion}`],
    ["obs-fold of the first header line", `HTTP/1.1 200 OK\r\n content-type: application/json\r\ncontent-length: ${n}\r\n\r\n${completion}`],
    ["a gzip-compressed answer", `HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\ncontent-length: ${Bun.gzipSync(completion).length}\r\n\r\n`],
    ["a chunk size that overflows", `HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n1${"0".repeat(16)}\r\n${completion}\r\n0\r\n\r\n`],
    ["an absurdly long chunk-size line in one read", `HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n${n.toString(16)};${"x".repeat(30_000)}\r\n${completion}\r\n0\r\n\r\n`],
    ["a head over the size cap", `HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-big: ${"a".repeat(70 * 1024)}\r\ncontent-length: ${n}\r\n\r\n${completion}`],
  ];
  for (const [name, wire] of refused) {
    test(`${name}: 503, and the standby answers when there is one`, async () => {
      answer(wire);
      await expectRefused(await chat());
      answer(wire);
      await expectAnswer(await chat({}, "svc-fo").then((r) => patchModel(r, "svc-fo")));
    });
  }

  test("the gateway asks for no content coding (accept-encoding: identity)", async () => {
    answer(json());
    await expectAnswer(await chat());
    expect(requests.at(-1)?.toLowerCase()).toContain("\r\naccept-encoding: identity\r\n");
  });
});

/** The failover alias answers under its own name: checked, then shown as svc-fast for expectAnswer. */
async function patchModel(res: Response, alias: string): Promise<Response> {
  const text = await res.text();
  if (res.status !== 200) return new Response(text, { status: res.status, headers: res.headers });
  const body = rec(JSON.parse(text));
  expect(body.model).toBe(alias);
  return new Response(JSON.stringify({ ...body, model: "svc-fast" }), { status: 200 });
}
