/**
 * The connect timeout for a request sent on a kept-alive connection, which
 * has no connect phase of its own to time: a TCP connect to the origin's host
 * and port, raced against `connectMs`. A server that died behind a pooled
 * connection (its host gone, no reset) fails over after connectMs instead of
 * waiting out firstByteMs, which is minutes for slow models. New connections
 * are timed by the HTTP client's own connect (http1.ts, Pool.connectDeadline).
 *
 * Any sign of life from an origin (a probe, a connection opened, a response)
 * is remembered for `freshMs`, so under load probes are rare: at most about
 * one per origin per `freshMs`, none on the steady-state hot path. A probe
 * that times out while the origin answers other requests does not count, and
 * a verdict only stops requests still waiting for response headers.
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
