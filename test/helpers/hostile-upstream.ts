import type { Socket, TCPSocketListener } from "bun";

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
