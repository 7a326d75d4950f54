import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import type { Socket, TCPSocketListener } from "bun";
import fc from "fast-check";
import { createHttp1Client, UpstreamConnectionError } from "../../src/inference/upstream/http1.ts";

setDefaultTimeout(60_000);

/**
 * Generated responses against the upstream HTTP/1.1 client over real
 * sockets: every framing, chunk sizes, extensions, trailers, interim 1xx,
 * random headers, writes split at generated points, and mutations (bytes
 * flipped, inserted, cut). A well-formed response must come out exactly; any
 * response must end (a result or an UpstreamConnectionError, never another
 * error or a hang) once the server closes; oversized heads and chunk lines
 * are refused at their caps. Replay with FUZZ_SEED=… FUZZ_RUNS=….
 */

const SEED = Number(process.env.FUZZ_SEED ?? Date.now() % 2_147_483_647);
const RUNS = Number(process.env.FUZZ_RUNS ?? 150);
/** Every case must settle within this once the server has written and closed. */
const CASE_DEADLINE_MS = 5_000;
const MAX_HEADER_BYTES = 4 * 1024;

interface Script {
  pieces: Uint8Array[];
  /** Pause between pieces, so that they arrive as separate reads. */
  gapMs: number;
  /** Close the connection after the last piece. */
  end: boolean;
}

let script: Script = { pieces: [], gapMs: 0, end: true };
let written = 0;
interface PeerData {
  buf: string;
  /** Resolves a write waiting for the socket to take more. */
  drained?: () => void;
}
let listener: TCPSocketListener<PeerData>;
let url = "";

beforeAll(() => {
  listener = Bun.listen<PeerData>({
    hostname: "127.0.0.1",
    port: 0,
    socket: {
      open(s) {
        s.data = { buf: "" };
      },
      data(s, d) {
        s.data.buf += d.toString("latin1");
        const end = s.data.buf.indexOf("\r\n\r\n");
        if (end === -1) return;
        const len = Number(/content-length: (\d+)/i.exec(s.data.buf.slice(0, end))?.[1] ?? 0);
        if (s.data.buf.length < end + 4 + len) return;
        s.data.buf = "";
        void play(s, script);
      },
      drain(s) {
        const d = s.data.drained;
        s.data.drained = undefined;
        d?.();
      },
      close(s) {
        s.data.drained?.();
      },
      error() {},
    },
  });
  url = `http://127.0.0.1:${listener.port}`;
  console.log(`http1 fuzz seed=${SEED} runs=${RUNS}`);
});
afterAll(() => listener.stop(true));

/** Writes the pieces in order, waiting for the socket to drain (nothing is dropped), until the client closes. */
async function play(s: Socket<PeerData>, sc: Script) {
  for (const p of sc.pieces) {
    let rest = p;
    while (rest.byteLength > 0) {
      if (s.readyState !== 1) return;
      const n = Math.max(0, s.write(rest));
      written += n;
      rest = rest.subarray(n);
      if (rest.byteLength > 0) await new Promise<void>((resolve) => (s.data.drained = resolve));
    }
    s.flush();
    if (sc.gapMs > 0) await Bun.sleep(sc.gapMs);
  }
  if (sc.end && s.readyState === 1) s.end();
}

type Outcome = { kind: "ok"; status: number; body: Buffer } | { kind: "error"; error: unknown };

/** One request against the current script, on a fresh client (no pooled connection shared between cases). */
async function exchange(sc: Script): Promise<Outcome> {
  script = sc;
  const client = createHttp1Client({ maxHeaderBytes: MAX_HEADER_BYTES });
  let timer: ReturnType<typeof setTimeout> | undefined;
  const deadline = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`hang: no outcome within ${CASE_DEADLINE_MS} ms`)), CASE_DEADLINE_MS);
  });
  const run = async (): Promise<Outcome> => {
    try {
      const res = await client.endpoint(url).request({ method: "POST", path: "/v1/x", headers: {}, body: "{}", signal: new AbortController().signal });
      const parts: Uint8Array[] = [];
      for (;;) {
        const r = await res.body.read();
        if (r.done) break;
        parts.push(r.value);
      }
      return { kind: "ok", status: res.status, body: Buffer.concat(parts) };
    } catch (error) {
      return { kind: "error", error };
    }
  };
  try {
    return await Promise.race([run(), deadline]);
  } finally {
    clearTimeout(timer);
    client.close();
  }
}

/** Cuts `bytes` at the given offsets (taken modulo its length). */
function split(bytes: Uint8Array, at: number[]): Uint8Array[] {
  const cuts = [...new Set(at.map((a) => a % Math.max(1, bytes.byteLength)))].filter((a) => a > 0).sort((a, b) => a - b);
  const out: Uint8Array[] = [];
  let from = 0;
  for (const c of cuts) {
    out.push(bytes.subarray(from, c));
    from = c;
  }
  out.push(bytes.subarray(from));
  return out;
}

const FRAMING_HEADERS = new Set(["content-length", "transfer-encoding", "connection", "content-encoding"]);
const headerName = fc.stringMatching(/^[A-Za-z][A-Za-z0-9-]{0,15}$/).filter((n) => !FRAMING_HEADERS.has(n.toLowerCase()));
const headerValue = fc.stringMatching(/^[!-~]([ -~]{0,30}[!-~])?$/);

const response = fc.record({
  version: fc.constantFrom("1.1", "1.1", "1.0"),
  status: fc.constantFrom(200, 200, 201, 204, 400, 404, 429, 500, 503),
  framing: fc.constantFrom("length", "chunked", "close"),
  body: fc.uint8Array({ maxLength: 300 }),
  chunkSizes: fc.array(fc.integer({ min: 1, max: 80 }), { maxLength: 8 }),
  upperHex: fc.boolean(),
  extensions: fc.boolean(),
  trailers: fc.array(fc.tuple(headerName, headerValue), { maxLength: 3 }),
  headers: fc.array(fc.tuple(headerName, headerValue), { maxLength: 12 }),
  interim: fc.constantFrom(0, 0, 1, 2),
  /** Line ends: CRLF, or the bare LF RFC 9112 2.2 lets a recipient accept. */
  eol: fc.constantFrom("\r\n", "\r\n", "\n"),
  /** Leading zeros on chunk sizes (legal: chunk-size = 1*HEXDIG). */
  zeros: fc.constantFrom(0, 0, 1, 12),
});
type Generated = typeof response extends fc.Arbitrary<infer T> ? T : never;

/** The wire bytes of a generated response, and the body a correct client reads from them. */
function render(r: Generated): { wire: Buffer; body: Buffer } {
  const body = r.status === 204 ? Buffer.alloc(0) : Buffer.from(r.body);
  const e = r.eol;
  let head = "";
  for (let i = 0; i < r.interim; i++) head += i === 0 ? `HTTP/1.1 100 Continue${e}${e}` : `HTTP/1.1 103 Early Hints${e}link: </x>${e}${e}`;
  head += `HTTP/${r.version} ${r.status} Whatever${e}`;
  for (const [k, v] of r.headers) head += `${k}: ${v}${e}`;
  const framing = r.status === 204 ? "none" : r.framing;
  if (framing === "length") head += `content-length: ${body.byteLength}${e}`;
  if (framing === "chunked") head += `transfer-encoding: chunked${e}`;
  head += e;
  const parts: Buffer[] = [Buffer.from(head, "latin1")];
  if (framing === "length" || framing === "close") parts.push(body);
  if (framing === "chunked") {
    let at = 0;
    let k = 0;
    while (at < body.byteLength) {
      const n = Math.min(r.chunkSizes[k++ % Math.max(1, r.chunkSizes.length)] ?? body.byteLength, body.byteLength - at);
      const hex = "0".repeat(r.zeros) + n.toString(16);
      parts.push(Buffer.from(`${r.upperHex ? hex.toUpperCase() : hex}${r.extensions ? ';name="v"' : ""}${e}`), body.subarray(at, at + n), Buffer.from(e));
      at += n;
    }
    let end = `0${e}`;
    for (const [k2, v] of r.trailers) end += `${k2}: ${v}${e}`;
    parts.push(Buffer.from(`${end}${e}`, "latin1"));
  }
  return { wire: Buffer.concat(parts), body };
}

function expectConnectionError(o: Outcome) {
  if (o.kind === "error" && !(o.error instanceof UpstreamConnectionError)) throw o.error;
}

describe("fuzz: the upstream HTTP/1.1 parser", () => {
  test("well-formed responses, split at generated points, come out exactly", async () => {
    await fc.assert(
      fc.asyncProperty(response, fc.array(fc.nat(), { maxLength: 10 }), async (r, cuts) => {
        const { wire, body } = render(r);
        const o = await exchange({ pieces: split(wire, cuts), gapMs: 1, end: true });
        expectConnectionError(o);
        expect(o.kind).toBe("ok");
        if (o.kind !== "ok") return;
        expect(o.status).toBe(r.status);
        expect(o.body.equals(body)).toBe(true);
      }),
      { seed: SEED, numRuns: RUNS },
    );
  });

  test("one response split in two at every byte comes out exactly", async () => {
    const r: Generated = {
      version: "1.1",
      status: 200,
      framing: "chunked",
      body: new Uint8Array(Buffer.from("hello, chunked world\r\n0\r\n\r\n")),
      chunkSizes: [5, 1, 9],
      upperHex: true,
      extensions: true,
      trailers: [["x-t", "1"]],
      headers: [["content-type", "text/plain"]],
      interim: 1,
      eol: "\r\n",
      zeros: 1,
    };
    for (const [framing, eol] of [["chunked", "\r\n"], ["length", "\r\n"], ["chunked", "\n"]] as const) {
      const { wire, body } = render({ ...r, framing, eol });
      for (let at = 1; at < wire.byteLength; at++) {
        const o = await exchange({ pieces: [wire.subarray(0, at), wire.subarray(at)], gapMs: 2, end: true });
        expectConnectionError(o);
        expect(o.kind === "ok" && o.body.equals(body)).toBe(true);
      }
    }
  });

  test("mutated responses (bytes flipped, inserted, cut) end in a result or an UpstreamConnectionError, never a crash or a hang", async () => {
    const mutation = fc.oneof(
      fc.record({ kind: fc.constant("flip" as const), at: fc.nat(), byte: fc.integer({ min: 0, max: 255 }) }),
      fc.record({ kind: fc.constant("insert" as const), at: fc.nat(), bytes: fc.uint8Array({ minLength: 1, maxLength: 12 }) }),
      fc.record({ kind: fc.constant("insert-text" as const), at: fc.nat(), text: fc.constantFrom("\r\n", "\r\n\r\n", "0\r\n\r\n", "ffffffff\r\n", ";", ":", " ", "transfer-encoding: chunked\r\n", "content-length: 99\r\n") }),
      fc.record({ kind: fc.constant("cut" as const), at: fc.nat() }),
    );
    await fc.assert(
      fc.asyncProperty(response, fc.array(mutation, { minLength: 1, maxLength: 3 }), fc.array(fc.nat(), { maxLength: 6 }), async (r, muts, cuts) => {
        let wire = render(r).wire;
        for (const m of muts) {
          const at = m.at % (wire.byteLength + 1);
          if (m.kind === "flip" && at < wire.byteLength) {
            wire = Buffer.from(wire);
            wire[at] = m.byte;
          } else if (m.kind === "insert") wire = Buffer.concat([wire.subarray(0, at), m.bytes, wire.subarray(at)]);
          else if (m.kind === "insert-text") wire = Buffer.concat([wire.subarray(0, at), Buffer.from(m.text), wire.subarray(at)]);
          else if (m.kind === "cut") wire = wire.subarray(0, at);
        }
        expectConnectionError(await exchange({ pieces: split(wire, cuts), gapMs: 1, end: true }));
      }),
      { seed: SEED, numRuns: RUNS },
    );
  });

  test("floods are refused at their caps, and reading stops there: a head without end, one endless header, a chunk-size line without end, endless 1xx answers, endless trailers", async () => {
    const floods: { name: string; prefix: string; fill: string; reason: string }[] = [
      { name: "head without end", prefix: "HTTP/1.1 200 OK\r\n", fill: "x-a: b\r\n", reason: "response head too large" },
      { name: "one endless header", prefix: "HTTP/1.1 200 OK\r\nx-long: ", fill: "v", reason: "response head too large" },
      { name: "endless chunk-size line", prefix: "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1", fill: ";e=1", reason: "chunk header too long" },
      { name: "endless interim answers", prefix: "", fill: "HTTP/1.1 100 Continue\r\n\r\n", reason: "too many interim" },
      { name: "endless trailers", prefix: "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n0\r\n", fill: "x-t: 1\r\n", reason: "response trailers too large" },
    ];
    for (const f of floods) {
      // 16 MB offered in 64 KB writes; the client must close long before it is all taken.
      const block = Buffer.from(f.fill.repeat(Math.ceil((64 * 1024) / f.fill.length)), "latin1");
      const pieces = [Buffer.from(f.prefix, "latin1"), ...Array.from({ length: 256 }, () => block)];
      written = 0;
      const o = await exchange({ pieces, gapMs: 0, end: true });
      const e = o.kind === "error" ? o.error : undefined;
      expect(e).toBeInstanceOf(UpstreamConnectionError);
      expect(`${f.name}: ${e instanceof Error ? e.message : ""}`).toContain(`${f.name}: ${f.reason}`);
      expect(written).toBeLessThan(8 * 1024 * 1024);
    }
  });
});
