import type { Socket, TCPSocketListener } from "bun";
import type { Gateway } from "../../src/server.ts";
import { CHAT_MODEL, TEST_PLANS, chatAlias, seedTestOrg, upstreamSettings } from "../integration/inference-fixtures.ts";
import { type SeededOrg, startTestGateway } from "./harness.ts";

/**
 * A deliberately misbehaving upstream on a raw TCP socket: each request gets
 * whatever `respond` writes, byte for byte (huge bodies, trickles, broken
 * framing). Each connection counts the bytes the kernel accepted from it, so
 * a test can tell how much the gateway let it send before closing.
 */

interface SocketData {
  conn: HostileConn;
  onData(d: Buffer): void;
  drained(): void;
}

export interface HostileConn {
  socket: Socket<SocketData>;
  /** Bytes accepted by the socket so far. */
  written: number;
  closed: boolean;
  /** Writes `s` (what fits now; the rest is dropped: use `pump` for large bodies). */
  write(s: string | Uint8Array): void;
  /** Writes the blocks `next` returns, as fast as the peer reads, until it returns undefined. */
  pump(next: () => Uint8Array | undefined): void;
  /** Calls `tick` every `ms` until it returns false or the connection closes. */
  every(ms: number, tick: () => boolean): void;
}

export interface HostileUpstream {
  url: string;
  conns: HostileConn[];
  stop(): void;
}

export function hostileUpstream(respond: (conn: HostileConn, request: string) => void): HostileUpstream {
  const conns: HostileConn[] = [];
  const listener: TCPSocketListener<SocketData> = Bun.listen<SocketData>({
    hostname: "127.0.0.1",
    port: 0,
    socket: {
      open(s) {
        let pending: Uint8Array | undefined;
        let source: (() => Uint8Array | undefined) | undefined;
        const flushPending = () => {
          while (!conn.closed) {
            if (!pending) {
              pending = source?.();
              if (!pending) return;
            }
            const n = s.write(pending);
            if (n > 0) conn.written += n;
            if (n < pending.byteLength) {
              pending = pending.subarray(Math.max(0, n));
              return; // kernel buffers full: wait for drain
            }
            pending = undefined;
          }
        };
        let received = "";
        const conn: HostileConn = {
          socket: s,
          written: 0,
          closed: false,
          write(d) {
            if (conn.closed) return;
            const n = s.write(d);
            if (n > 0) conn.written += n;
          },
          pump(next) {
            source = next;
            flushPending();
          },
          every(ms, tick) {
            const t = setInterval(() => {
              if (conn.closed || !tick()) clearInterval(t);
            }, ms);
          },
        };
        conns.push(conn);
        // The request: its head and content-length body, then `respond` (one request per connection is enough here).
        const onData = (d: Buffer) => {
          received += d.toString("latin1");
          const end = received.indexOf("\r\n\r\n");
          if (end === -1) return;
          const len = Number(/content-length: (\d+)/i.exec(received.slice(0, end))?.[1] ?? 0);
          if (received.length < end + 4 + len) return;
          const req = received.slice(0, end + 4 + len);
          received = received.slice(end + 4 + len);
          respond(conn, req);
        };
        s.data = { conn, onData, drained: flushPending };
      },
      data(s, d) {
        s.data.onData(d);
      },
      drain(s) {
        s.data.drained();
      },
      close(s) {
        s.data.conn.closed = true;
      },
      error() {},
    },
  });
  return { url: `http://127.0.0.1:${listener.port}/v1`, conns, stop: () => listener.stop(true) };
}

/** `total` bytes of `fill`, in 64 KB blocks, each passed through `frame` (e.g. chunked coding). */
export function blocks(total: number, frame: (b: Uint8Array) => Uint8Array = (b) => b, fill = 0x61): () => Uint8Array | undefined {
  const block = new Uint8Array(64 * 1024).fill(fill);
  let sent = 0;
  return () => {
    if (sent >= total) return undefined;
    const n = Math.min(block.byteLength, total - sent);
    sent += n;
    return frame(n === block.byteLength ? block : block.subarray(0, n));
  };
}

/** Chunked transfer coding of one block. */
export function chunk(b: Uint8Array): Uint8Array {
  return Buffer.concat([Buffer.from(`${b.byteLength.toString(16)}\r\n`), b, Buffer.from("\r\n")]);
}

/** A whole chat completion ("hello", 3 + 1 tokens), as the upstream's JSON body. */
export const HELLO_COMPLETION = JSON.stringify({
  id: "chatcmpl-1",
  object: "chat.completion",
  created: 1,
  model: CHAT_MODEL,
  choices: [{ index: 0, message: { role: "assistant", content: "hello" }, finish_reason: "stop" }],
  usage: { prompt_tokens: 3, completion_tokens: 1, total_tokens: 4 },
});

/** The 200 answer carrying HELLO_COMPLETION with its content-length; `extra`: header lines (each ending CRLF) before it. */
export const helloAnswer = (extra = "") =>
  `HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n${extra}content-length: ${HELLO_COMPLETION.length}\r\n\r\n${HELLO_COMPLETION}`;

/**
 * A gateway in front of a hostile upstream that answers with `respond`:
 * "svc-fast" is that upstream alone; "svc-fo" tries it first and then a
 * standby that always answers helloAnswer() (weight 0: tried only once the
 * first target failed). Two attempts, a breaker that never opens, 5 s
 * first-byte and idle timeouts; an organisation seeded. stop() ends all three.
 */
export async function gatewayWithStandby(
  respond: (conn: HostileConn, request: string) => void,
): Promise<{ gw: Gateway; org: SeededOrg; stop(): Promise<void> }> {
  const up = hostileUpstream(respond);
  const standby = hostileUpstream((c) => c.write(helloAnswer()));
  const gw = await startTestGateway({
    aliases: {
      "svc-fast": chatAlias([{ baseUrl: up.url }]),
      "svc-fo": chatAlias([{ baseUrl: up.url }, { baseUrl: standby.url, weight: 0 }]),
    },
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 2, breakerFailures: 1_000_000 }, { firstByteMs: 5_000, idleMs: 5_000 }),
  });
  const org = await seedTestOrg(gw.database);
  return {
    gw,
    org,
    async stop() {
      await gw.stop();
      up.stop();
      standby.stop();
    },
  };
}
