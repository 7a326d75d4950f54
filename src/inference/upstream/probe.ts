/**
 * Connect timeout for upstream requests: a TCP connect to the target's host
 * and port, raced against `connectMs`, run beside the real request. A target
 * that does not accept a connection in time (dropped SYNs, or a dead host
 * behind a pooled keep-alive connection, where the request itself has no
 * connect phase to time) fails over after connectMs instead of waiting out
 * firstByteMs, which is minutes for slow models.
 *
 * Any sign of life from an origin (a probe or an upstream response) is
 * remembered for `freshMs`, so under load probes are rare: at most about one
 * per origin per `freshMs`, none on the steady-state hot path. A probe that
 * times out while the origin answers other requests does not count, and a
 * verdict only stops attempts still waiting for response headers.
 */

import type { Origin } from "./origin.ts";

export type Connector = (hostname: string, port: number) => Promise<void>;

/** A TCP connect that is closed as soon as it opens; rejects when the connection fails. */
export const tcpConnect: Connector = async (hostname, port) => {
  await Bun.connect({
    hostname,
    port,
    socket: {
      open(s) {
        s.end();
      },
      data() {},
      error() {},
    },
  });
};

export interface ConnectProbe {
  /**
   * Resolves "ok", or "timeout"/"refused" when the origin cannot be reached
   * within `ms`; returns undefined at once (no promise, no timer) when the
   * origin was seen alive lately, which is the hot path.
   */
  check(origin: Origin, ms: number): Promise<"ok" | "timeout" | "refused"> | undefined;
  /** Records that the origin answered. */
  alive(origin: Origin): void;
}

export function createConnectProbe(opts: { freshMs?: number; connect?: Connector; now?: () => number } = {}): ConnectProbe {
  const freshMs = opts.freshMs ?? 1_000;
  const connect = opts.connect ?? tcpConnect;
  const now = opts.now ?? performance.now.bind(performance);
  const seen = new Map<string, number>();
  const inflight = new Map<string, Promise<"ok" | "timeout" | "refused">>();

  function alive(origin: Origin): void {
    seen.set(origin.key, now());
  }

  function check(origin: Origin, ms: number): Promise<"ok" | "timeout" | "refused"> | undefined {
    const last = seen.get(origin.key);
    if (last !== undefined && now() - last < freshMs) return undefined;
    // Concurrent requests to a cold origin share one probe.
    let p = inflight.get(origin.key);
    if (p) return p;
    const startedAt = now();
    p = new Promise<"ok" | "timeout" | "refused">((resolve) => {
      // A slow probe alone proves little: under a burst of new connections the
      // upstream's accept queue overflows and SYNs are retried, for the probe
      // as for everyone. Any response from the origin meanwhile means it is up.
      const timer = setTimeout(() => resolve((seen.get(origin.key) ?? -1) > startedAt ? "ok" : "timeout"), ms);
      connect(origin.hostname, origin.port).then(
        () => {
          clearTimeout(timer);
          alive(origin);
          resolve("ok");
        },
        () => {
          clearTimeout(timer);
          resolve("refused");
        },
      );
    }).finally(() => inflight.delete(origin.key));
    inflight.set(origin.key, p);
    return p;
  }

  return { check, alive };
}
