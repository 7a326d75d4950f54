import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import type { TCPSocketListener } from "bun";
import fc from "fast-check";
import { createHttp1Client, type Http1Client, type RequestOptions } from "../../src/inference/upstream/http1.ts";

setDefaultTimeout(120_000);

/**
 * The request the pool writes (one Buffer: a head start cached per
 * fixedHeaders object, the request's own headers, content-length, the body),
 * byte for byte against the request as it was written before ae97cfa (one
 * string, TextEncoder), over a real socket: random paths, header names and
 * values, bodies (non-ASCII, lone surrogates, empty, GET without one), and
 * the same refusals (a CR or LF in any header, a colon in a name, a space in
 * the path). Replay with FUZZ_SEED=… FUZZ_RUNS=….
 */
const SEED = Number(process.env.FUZZ_SEED ?? Date.now() % 2_147_483_647);
const RUNS = Number(process.env.FUZZ_RUNS ?? 300);

let listener: TCPSocketListener<{ buf: Buffer }>;
let http: Http1Client;
let url = "";
let host = "";
/** Every complete request the upstream received, as bytes. */
const received: Buffer[] = [];

const HEAD_END = Buffer.from("\r\n\r\n");

beforeAll(() => {
  listener = Bun.listen<{ buf: Buffer }>({
    hostname: "127.0.0.1",
    port: 0,
    socket: {
      open(s) {
        s.data = { buf: Buffer.alloc(0) };
      },
      data(s, d) {
        s.data.buf = Buffer.concat([s.data.buf, d]);
        for (;;) {
          const end = s.data.buf.indexOf(HEAD_END);
          if (end === -1) return;
          const head = s.data.buf.subarray(0, end).toString("latin1");
          // The last content-length line is the pool's own (a request header could be named so too).
          const at = head.lastIndexOf("\r\ncontent-length: ");
          const len = at === -1 ? 0 : Number(/^\d+/.exec(head.slice(at + 18))?.[0] ?? 0);
          const total = end + 4 + len;
          if (s.data.buf.length < total) return;
          received.push(Buffer.from(s.data.buf.subarray(0, total)));
          s.data.buf = s.data.buf.subarray(total);
          s.write("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
        }
      },
      error() {},
    },
  });
  url = `http://127.0.0.1:${listener.port}`;
  host = `127.0.0.1:${listener.port}`;
  http = createHttp1Client();
  console.log(`request bytes fuzz seed=${SEED} runs=${RUNS}`);
});
afterAll(() => {
  http.close();
  listener.stop(true);
});

type Sent = Pick<RequestOptions, "method" | "path" | "headers" | "fixedHeaders" | "body">;

/** The request as the pool wrote it before ae97cfa (fixed headers first, as one object would have had them), or its refusal. */
function oracle(o: Sent): Uint8Array | string {
  if (/[\s]/.test(o.path)) return `invalid upstream request path ${JSON.stringify(o.path)}`;
  const body = o.body ?? "";
  let head = `${o.method} ${o.path} HTTP/1.1\r\nhost: ${host}\r\n`;
  for (const headers of [o.fixedHeaders ?? {}, o.headers]) {
    for (const k in headers) {
      const v = headers[k] as string;
      if (/[\r\n]/.test(v) || /[\r\n:]/.test(k)) return `invalid upstream request header ${JSON.stringify(k)}`;
      head += `${k}: ${v}\r\n`;
    }
  }
  if (o.method === "POST" || body !== "") head += `content-length: ${Buffer.byteLength(body)}\r\n`;
  return new TextEncoder().encode(`${head}\r\n${body}`);
}

/** What the pool sent for `o` (its bytes, as the upstream got them), or the message it refused it with. */
async function sent(o: Sent): Promise<Uint8Array | string> {
  const before = received.length;
  try {
    const res = await http.endpoint(url).request({ ...o, signal: new AbortController().signal });
    expect(await res.text()).toBe("ok");
  } catch (e) {
    expect(received.length).toBe(before);
    return (e as Error).message;
  }
  expect(received.length).toBe(before + 1);
  return new Uint8Array(received[before] as Buffer);
}

const odd = fc.constantFrom("\uD800", "\uDC00", "\uD83D\uDE00", "é", "\u2028", "\r", "\n", "\r\n", ":", " ", "\t", "\u0000", "\u00ff", "\u0100");
const text = (max: number) =>
  fc.array(fc.oneof(fc.string({ maxLength: 4 }), fc.string({ unit: "binary", maxLength: 3 }), odd), { maxLength: max }).map((a) => a.join(""));
const headers = fc.dictionary(
  fc.oneof(fc.constantFrom("x-request-id", "authorization", "accept", "x-a"), text(3)),
  fc.oneof(fc.constantFrom("req-1", "Bearer sk-1", ""), text(4)),
  { maxKeys: 4 },
);
const SHARED: Readonly<Record<string, string>>[] = [
  Object.freeze({ "content-type": "application/json", accept: "application/json", "accept-encoding": "identity", authorization: "Bearer sk-é\uD800" }),
  Object.freeze({ "content-type": "application/json", accept: "text/event-stream" }),
  Object.freeze({ accept: "x", "x-bad": "a\r\nx-injected: 1" }),
  Object.freeze({}),
];
const request: fc.Arbitrary<Sent> = fc.record(
  {
    method: fc.constantFrom("POST" as const, "GET" as const),
    path: fc.oneof(fc.constantFrom("/v1/chat/completions", "/v1/embeddings", "/é/ü?q=1"), text(3).map((p) => `/${p}`)),
    headers,
    // Fresh objects, frozen ones (whose head the pool keeps), and a few frozen ones shared by many requests.
    fixedHeaders: fc.oneof(headers, headers.map((h) => Object.freeze(h)), fc.constantFrom(...SHARED)),
    body: fc.oneof(fc.constant(""), fc.constant('{"model":"m"}'), text(20)),
  },
  { requiredKeys: ["method", "path", "headers"] },
);

describe("the upstream request, byte for byte", () => {
  test("the same bytes (or refusal) as the one-string writer, on random requests", async () => {
    await fc.assert(
      fc.asyncProperty(request, async (o) => {
        expect(await sent(o)).toEqual(oracle(o));
      }),
      { seed: SEED, numRuns: RUNS },
    );
  });

  test("one fixedHeaders object sent many times, with other methods and paths in between, and with other request headers", async () => {
    const fixed = Object.freeze({ "content-type": "application/json", accept: "application/json", authorization: "Bearer é" });
    const plan: Sent[] = [
      { method: "POST", path: "/v1/chat/completions", fixedHeaders: fixed, headers: { "x-request-id": "a" }, body: "{}" },
      { method: "POST", path: "/v1/chat/completions", fixedHeaders: fixed, headers: { "x-request-id": "b" }, body: "" },
      { method: "GET", path: "/v1/chat/completions", fixedHeaders: fixed, headers: {} },
      { method: "POST", path: "/v1/embeddings", fixedHeaders: fixed, headers: { "x-request-id": "c" }, body: "ü" },
      { method: "POST", path: "/v1/chat/completions", fixedHeaders: fixed, headers: { "x-request-id": "d\r\nx-evil: 1" }, body: "{}" },
      { method: "POST", path: "/v1 /chat", fixedHeaders: fixed, headers: {}, body: "{}" },
      { method: "POST", path: "/v1/chat/completions", fixedHeaders: fixed, headers: { "x-request-id": "e" }, body: "{}" },
    ];
    for (const o of plan) expect(await sent(o)).toEqual(oracle(o));
  });

  test("a fixedHeaders object (not frozen) changed after it was sent: the next request sends it as it is now (never a head written for it before), and a CR/LF put in it is refused", async () => {
    const fixed: Record<string, string> = { accept: "application/json", authorization: "Bearer old" };
    const o = (): Sent => ({ method: "POST", path: "/v1/chat/completions", fixedHeaders: fixed, headers: { "x-request-id": "r" }, body: "{}" });
    expect(await sent(o())).toEqual(oracle(o()));
    fixed.authorization = "Bearer new";
    fixed["x-added"] = "1";
    expect(new TextDecoder().decode((await sent(o())) as Uint8Array)).toBe(new TextDecoder().decode(oracle(o()) as Uint8Array));
    fixed["x-evil"] = "1\r\nx-injected: 1";
    expect(await sent(o())).toBe('invalid upstream request header "x-evil"');
  });
});
