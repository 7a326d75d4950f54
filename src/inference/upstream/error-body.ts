/**
 * Upstream error answers: reading their body (bounded in size and time),
 * finding the message in it whichever server wrote it, and `retry-after`.
 */

import type { UpstreamResponse } from "./http1.ts";

const MAX_UPSTREAM_MESSAGE = 1_000;
/**
 * An error body is only read to word our answer, and a server writes it at
 * once: its whole read gets this long (or the first-byte timeout, if shorter),
 * then we answer with what arrived.
 */
export const ERROR_BODY_MS = 5_000;

/**
 * The message inside an upstream error body, whichever shape it has: current
 * vLLM's `{error:{message}}`, older vLLM's `{object:"error",message}`,
 * FastAPI's `{detail}`, or plain text. The shape itself never reaches the client.
 */
export function upstreamMessage(text: string, cut = false): { message: string; param: string | null } {
  let message: unknown;
  let param: unknown = null;
  try {
    const v: unknown = JSON.parse(text);
    if (typeof v === "object" && v !== null) {
      const o = v as Record<string, unknown>;
      const inner = typeof o.error === "object" && o.error !== null ? (o.error as Record<string, unknown>) : o;
      message = inner.message ?? (typeof o.error === "string" ? o.error : undefined);
      param = inner.param;
      if (message === undefined && o.detail !== undefined) {
        message = Array.isArray(o.detail)
          ? o.detail.map((d) => (typeof d === "object" && d !== null && "msg" in d ? String(d.msg) : String(d))).join("; ")
          : String(o.detail);
      }
    }
  } catch {
    // Plain text is passed on; the front of a JSON body cut short is not a message.
    message = cut && text.trimStart().startsWith("{") ? undefined : text.trim();
  }
  const s = typeof message === "string" && message !== "" ? message : "The upstream model server rejected the request.";
  return { message: s.length > MAX_UPSTREAM_MESSAGE ? `${s.slice(0, MAX_UPSTREAM_MESSAGE)}…` : s, param: typeof param === "string" ? param : null };
}

/** The longest wait an upstream's `retry-after` can give our client (decisions.md, Failover). */
export const MAX_UPSTREAM_RETRY_AFTER_S = 60;

/**
 * An upstream's `retry-after` (delta-seconds or an HTTP date, read against our
 * clock) in whole seconds, at most MAX_UPSTREAM_RETRY_AFTER_S: the upstream is
 * not trusted to make our clients wait a day. Unreadable: undefined.
 */
export function retryAfterSeconds(h: string | null, now: number): number | undefined {
  if (!h) return undefined;
  const t = h.trim();
  const at = /^\d+$/.test(t) ? undefined : Date.parse(t);
  const s = at === undefined ? Number(t) : Number.isNaN(at) ? undefined : Math.ceil((at - now) / 1000);
  return s === undefined ? undefined : Math.min(MAX_UPSTREAM_RETRY_AFTER_S, Math.max(0, s));
}

/**
 * An error body, read for at most `ms` and `max` bytes (then the connection is
 * closed): what arrived, and whether that was all of it.
 */
export async function readErrorBody(res: UpstreamResponse, max: number, ms: number): Promise<{ text: string; cut: boolean }> {
  const parts: Uint8Array[] = [];
  let n = 0;
  let cut = true;
  const timer = setTimeout(() => void res.body.cancel(), ms);
  try {
    for (;;) {
      const r = await res.body.read();
      if (r.done) {
        cut = false;
        break;
      }
      if (n + r.value.byteLength > max) {
        parts.push(r.value.subarray(0, max - n));
        n = max;
        await res.body.cancel();
        break;
      }
      parts.push(r.value);
      n += r.value.byteLength;
    }
  } catch {
    // Cut short (deadline, connection lost): what arrived is all we have.
  } finally {
    clearTimeout(timer);
  }
  return { text: Buffer.concat(parts, n).toString("utf8"), cut };
}
