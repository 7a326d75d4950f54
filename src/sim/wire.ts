/** Wire helpers shared by the endpoints: ids, headers, error bodies, and the ways a response ends. */

import type { Job } from "./job.ts";
import type { Fault, SimConfig } from "./types.ts";

export const enc = new TextEncoder();

export function nonNegInt(v: unknown): number | undefined {
  return typeof v === "number" && Number.isFinite(v) && v >= 0 ? Math.floor(v) : undefined;
}

export const JSON_HEADERS = { "content-type": "application/json" };
export const SSE_HEADERS = { "content-type": "text/event-stream; charset=utf-8" };

// Ids only need to be unique per process; a random stem plus a counter avoids
// a UUID allocation per request.
const idStem = Math.random().toString(16).slice(2, 10);
let idSeq = 0;
export function newId(prefix: string): string {
  return `${prefix}${idStem}${(++idSeq).toString(16).padStart(8, "0")}`;
}

const ERROR_TYPES: Record<number, string> = {
  400: "BadRequestError",
  401: "AuthenticationError",
  403: "PermissionDeniedError",
  404: "NotFoundError",
  405: "MethodNotAllowedError",
  429: "RateLimitError",
  500: "InternalServerError",
  502: "BadGatewayError",
  503: "ServiceUnavailableError",
  504: "GatewayTimeoutError",
};

export function errorResponse(cfg: SimConfig, status: number, message: string): Response {
  const type = ERROR_TYPES[status] ?? "InternalServerError";
  const body =
    cfg.errorFormat === "nested"
      ? { error: { message, type, param: null, code: status } }
      : { object: "error", message, type, param: null, code: status };
  return Response.json(body, { status });
}

export type Usage = { prompt_tokens: number; completion_tokens: number; total_tokens: number };

/** The prompt is counted once however many choices (`n`) were generated from it, as vLLM and OpenAI count it. */
export function usageOf(plan: { promptTokens: number; completionTokens: number }, choices = 1): Usage {
  const completion = plan.completionTokens * choices;
  return {
    prompt_tokens: plan.promptTokens,
    completion_tokens: completion,
    total_tokens: plan.promptTokens + completion,
  };
}

// A response for a client that is already gone; Bun discards it.
export const GONE = (): Response => new Response(null, { status: 499 });

// FastAPI's wording, which is what vLLM returns for routing misses.
export const notAllowed = (): Response => Response.json({ detail: "Method Not Allowed" }, { status: 405 });

/** The request body as JSON, or a failure (unreadable or not JSON). */
export async function readJson(req: Request): Promise<{ ok: true; value: unknown } | { ok: false }> {
  try {
    return { ok: true, value: JSON.parse(await req.text()) };
  } catch {
    return { ok: false };
  }
}

/** Grace period between the last bytes of a dropped response and the reset. */
export const DROP_FLUSH_MS = 10;

/** Aborts the HTTP response abruptly (TCP reset, no terminating chunk). */
export function resetStream(c: ReadableStreamDefaultController<Uint8Array>): void {
  try {
    // An undefined reason makes Bun reset the connection without logging it.
    c.error(undefined);
  } catch {
    // Already closed or cancelled by the client.
  }
}

/** Non-streamed body that is cut off part-way, for drop-mid-stream on JSON endpoints. */
function truncatedBody(job: Job, json: string): Response {
  const part = enc.encode(json.slice(0, Math.max(1, Math.floor(json.length / 2))));
  const body = new ReadableStream<Uint8Array>({
    start(c) {
      c.enqueue(part);
      job.onCancel = () => resetStream(c);
      job.setTimeout(() => {
        job.finish();
        resetStream(c);
      }, DROP_FLUSH_MS);
    },
    cancel() {
      job.abort();
    },
  });
  return new Response(body, { headers: JSON_HEADERS });
}

export function finishJson(job: Job, fault: Fault | null, payload: unknown): Response {
  if (fault?.kind === "malformed-sse") {
    job.finish();
    return new Response("{not json", { headers: JSON_HEADERS });
  }
  const json = JSON.stringify(payload);
  if (fault?.kind === "drop-mid-stream") return truncatedBody(job, json);
  job.finish();
  return new Response(json, { headers: JSON_HEADERS });
}
