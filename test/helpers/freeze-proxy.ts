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
 * `holdWhen()` holds one connection from a given statement on, keeping its
 * bytes instead of dropping them, and lets them through later: a partition
 * that heals before TCP gives up, delivering a write its client abandoned.
 */
export interface FreezeProxy {
  url: string;
  freeze(): void;
  /** Freeze only the connections open now that sent LISTEN. */
  freezeListening(): number;
  /**
   * Holds the first connection whose client then sends bytes matching
   * `pattern` (with `after`: the first to send `after`, once it then sends
   * `pattern`), until `release()` forwards what was kept, in order.
   * `"statement"`: from the matching bytes on, both directions are kept, so
   * the server never sees the statement; `"answer"`: the client's bytes go
   * through and the server's are kept, so it runs the statement and its
   * answer is lost until the release.
   */
  holdWhen(pattern: RegExp, what: "statement" | "answer", after?: RegExp): Hold;
  /**
   * What each connection sent while frozen (dropped bytes, as text, a bound
   * statement's text added), one entry per connection that sent anything:
   * the connections the gateway put work on that will get no answer.
   */
  sentWhileFrozen(): string[];
  thaw(): void;
  stop(): void;
}

export interface Hold {
  /** Resolves when a connection sent the pattern and is held. */
  held: Promise<void>;
  release(): void;
}

interface Pair {
  client: Socket<Pair>;
  server?: Socket<{ pair: Pair }>;
  /** Client bytes that arrived before the server connection opened. */
  early: Uint8Array[];
  frozen: boolean;
  /** The client sent a LISTEN on this connection. */
  listens: boolean;
  /** Prepared statements' text by name (a Bind names the statement only): what holdWhen() matches. */
  statements: Map<string, string>;
  /** What the client sent while frozen (dropped). */
  dropped: string;
  /** Bytes kept while the connection is held (holdWhen), each direction in order. */
  hold?: { what: "statement" | "answer"; toServer: Uint8Array[]; toClient: Uint8Array[]; serverClosed: boolean };
}

/** A holdWhen() waiting for its statement (`pair` unset), or holding its connection. */
interface Trigger {
  pattern: RegExp;
  what: "statement" | "answer";
  after?: RegExp;
  /** The connection that sent `after`. */
  primed?: Pair;
  pair?: Pair;
  onHeld(): void;
}

/**
 * What a chunk of the client's bytes runs: its own text, and the text of each
 * prepared statement it binds (postgres.js parses a statement once per
 * connection and afterwards sends only its name).
 */
function sentText(pair: Pair, text: string): string {
  for (const m of text.matchAll(/P[\s\S]{4}([^\0]+)\0([^\0]*)\0/g)) pair.statements.set(m[1] as string, m[2] as string);
  let out = text;
  for (const m of text.matchAll(/B[\s\S]{4}\0([^\0]+)\0/g)) out += `\n${pair.statements.get(m[1] as string) ?? ""}`;
  return out;
}

export async function startFreezeProxy(targetUrl: string, port: number): Promise<FreezeProxy> {
  const target = new URL(targetUrl);
  const host = target.hostname;
  const targetPort = Number(target.port || 5432);
  let frozen = false;
  const pairs = new Set<Pair>();
  let armed: Trigger | undefined;

  const listener: TCPSocketListener<Pair> = Bun.listen<Pair>({
    hostname: "127.0.0.1",
    port,
    socket: {
      open(client) {
        const pair: Pair = { client, early: [], frozen, listens: false, statements: new Map(), dropped: "" };
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
              if (pair.hold) pair.hold.toClient.push(new Uint8Array(bytes));
              else if (!pair.frozen) pair.client.write(bytes);
            },
            close() {
              // A held connection's end reaches the client after what was kept, at the release.
              if (pair.hold) pair.hold.serverClosed = true;
              else if (!pair.frozen) pair.client.end();
              pairs.delete(pair);
            },
            error() {},
          },
        }).catch(() => client.end());
      },
      data(client, bytes) {
        const pair = client.data;
        if (pair.frozen) {
          pair.dropped += sentText(pair, Buffer.from(bytes).toString("latin1"));
          return;
        }
        if (pair.hold?.what === "statement") {
          pair.hold.toServer.push(new Uint8Array(bytes));
          return;
        }
        const text = sentText(pair, Buffer.from(bytes).toString("latin1"));
        if (!pair.listens && /\blisten\b/i.test(text)) pair.listens = true;
        if (armed && !armed.pair) {
          if (armed.after && !armed.primed && armed.after.test(text)) armed.primed = pair;
          else if ((!armed.after || armed.primed === pair) && armed.pattern.test(text)) {
            armed.pair = pair;
            pair.hold = { what: armed.what, toServer: [], toClient: [], serverClosed: false };
            armed.onHeld();
            if (armed.what === "statement") {
              pair.hold.toServer.push(new Uint8Array(bytes));
              return;
            }
          }
        }
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
    holdWhen(pattern, what, after) {
      let onHeld = () => {};
      const held = new Promise<void>((r) => {
        onHeld = r;
      });
      const hold: Trigger = { pattern, what, onHeld, ...(after ? { after } : {}) };
      armed = hold;
      return {
        held,
        release() {
          const pair = hold.pair;
          if (armed === hold) armed = undefined;
          const kept = pair?.hold;
          if (!pair || !kept) return;
          pair.hold = undefined;
          for (const b of kept.toServer) pair.server?.write(b);
          for (const b of kept.toClient) pair.client.write(b);
          if (kept.serverClosed) pair.client.end();
        },
      };
    },
    sentWhileFrozen() {
      return [...pairs].filter((p) => p.frozen && p.dropped !== "").map((p) => p.dropped);
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
