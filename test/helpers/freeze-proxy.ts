import type { Socket, TCPSocketListener } from "bun";

/**
 * A TCP proxy in front of Postgres that can stop answering without closing
 * anything: what a network partition or a paused database host looks like to
 * the gateway (no RST, no FIN; bytes sent are never answered). `freeze()`
 * drops every byte in both directions on the connections open and on new
 * ones (which then connect but never get the server's greeting); `thaw()`
 * closes the frozen connections, as the kernel would once the partition
 * heals, and forwards again. `freezeListening()` freezes only the
 * connections that sent LISTEN: a NAT or firewall dropping an idle flow.
 */
export interface FreezeProxy {
  url: string;
  freeze(): void;
  /** Freeze only the connections open now that sent LISTEN. */
  freezeListening(): number;
  thaw(): void;
  stop(): void;
}

interface Pair {
  client: Socket<Pair>;
  server?: Socket<{ pair: Pair }>;
  /** Client bytes that arrived before the server connection opened. */
  early: Uint8Array[];
  frozen: boolean;
  /** The client sent a LISTEN on this connection. */
  listens: boolean;
}

export async function startFreezeProxy(targetUrl: string, port: number): Promise<FreezeProxy> {
  const target = new URL(targetUrl);
  const host = target.hostname;
  const targetPort = Number(target.port || 5432);
  let frozen = false;
  const pairs = new Set<Pair>();

  const listener: TCPSocketListener<Pair> = Bun.listen<Pair>({
    hostname: "127.0.0.1",
    port,
    socket: {
      open(client) {
        const pair: Pair = { client, early: [], frozen, listens: false };
        client.data = pair;
        pairs.add(pair);
        void Bun.connect<{ pair: Pair }>({
          hostname: host,
          port: targetPort,
          data: { pair },
          socket: {
            open(server) {
              pair.server = server;
              for (const b of pair.early.splice(0)) server.write(b);
            },
            data(_server, bytes) {
              if (!pair.frozen) pair.client.write(bytes);
            },
            close() {
              if (!pair.frozen) pair.client.end();
              pairs.delete(pair);
            },
            error() {},
          },
        }).catch(() => client.end());
      },
      data(client, bytes) {
        const pair = client.data;
        if (pair.frozen) return;
        if (!pair.listens && /\blisten\b/i.test(Buffer.from(bytes).toString("latin1"))) pair.listens = true;
        if (pair.server) pair.server.write(bytes);
        else pair.early.push(new Uint8Array(bytes));
      },
      close(client) {
        const pair = client.data;
        if (!pair.frozen) pair.server?.end();
        pairs.delete(pair);
      },
      error() {},
    },
  });

  const u = new URL(targetUrl);
  u.hostname = "127.0.0.1";
  u.port = String(listener.port);
  return {
    url: u.toString(),
    freeze() {
      frozen = true;
      for (const p of pairs) p.frozen = true;
    },
    freezeListening() {
      let n = 0;
      for (const p of pairs) {
        if (!p.listens) continue;
        p.frozen = true;
        n++;
      }
      return n;
    },
    thaw() {
      frozen = false;
      for (const p of [...pairs]) {
        if (!p.frozen) continue;
        pairs.delete(p);
        p.client.end();
        p.server?.end();
      }
    },
    stop() {
      listener.stop(true);
      for (const p of pairs) {
        p.client.end();
        p.server?.end();
      }
    },
  };
}
