import { AppError, type ErrorCode } from "../lib/errors.ts";

/**
 * Read a JSON request body ourselves (routes use `parse: "none"`), after
 * authentication, so that an anonymous caller gets 401 before any 400, and so
 * that the size limit answers 400 in the spec's shape instead of Bun's 413.
 * Memory never holds more than `limit` bytes of one body. A body that stops
 * arriving gets a 400 saying so (the caller keeps Bun's own idle timer, which
 * would only drop the connection, behind this one):
 *
 * - a declared body of at most WHOLE_BODY_MAX bytes (nearly every request) is
 *   read whole by Bun (`request.bytes()`) and must be complete within `idleMs`;
 * - a larger or chunked body is counted as it streams in, cut off at the
 *   limit, and may take as long as it needs while it is never silent for `idleMs`.
 *
 * Why two paths: reading a body through its ReadableStream makes Bun allocate
 * a 256 KiB buffer per request, and at thousands of requests a second those
 * buffers drove a garbage collection every ~100 requests (about a fifth of the
 * request thread's CPU; docs/benchmarks.md). `bytes()` shows no progress, so
 * the small-body path bounds the whole body instead of each silence: a client
 * would have to send slower than WHOLE_BODY_MAX / idleMs (17 KB/s at the
 * default 60 s) to be cut off while still sending.
 */
export async function readJsonBody(request: Request, limit: number, code: ErrorCode = "invalid_request_error", idleMs?: number): Promise<unknown> {
  const type = request.headers.get("content-type") ?? "";
  if (!/^application\/json\s*(;|$)/i.test(type)) {
    throw new AppError(code, "Content-Type must be application/json.");
  }
  const declared = request.headers.get("content-length");
  if (declared !== null && Number(declared) > limit) throw tooLarge(code, limit);
  let bytes: Uint8Array;
  const whole = declared !== null && Number(declared) <= WHOLE_BODY_MAX && idleMs !== undefined ? new WholeRead(code, idleMs) : undefined;
  try {
    bytes = whole ? await whole.read(request) : await readCounted(request, limit, code, idleMs);
  } catch (e) {
    if (e instanceof AppError) throw e;
    // The client went away mid-body (or Bun's idle timer cut it): a client error, not ours.
    throw new AppError(code, "The request body could not be read: the connection closed before it was complete.");
  } finally {
    whole?.clear();
  }
  if (bytes.byteLength === 0) throw new AppError(code, "Request body is empty; a JSON object is required.");
  let text: string;
  try {
    text = decoder.decode(bytes);
  } catch {
    throw new AppError(code, `Request body is not valid UTF-8.${sentAs(request.headers)}`);
  }
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new AppError(code, `Request body is not valid JSON: ${(e as Error).message}${sentAs(request.headers)}`);
  }
}

/**
 * Why a body that is not UTF-8 JSON may be so, from its headers: compressed
 * (the body is read as sent; no Content-Encoding is decoded), or in another
 * charset (JSON is UTF-8, RFC 8259). Only a body that failed is asked: the
 * bytes decide, so a plain body is read whatever those headers say.
 */
function sentAs(headers: Headers): string {
  const encoding = headers.get("content-encoding")?.trim().toLowerCase();
  if (encoding && encoding !== "identity") return ` It was sent with Content-Encoding ${encoding}, which is not accepted: send the JSON uncompressed.`;
  const charset = /;\s*charset\s*=\s*"?([^";\s]+)/i.exec(headers.get("content-type") ?? "")?.[1];
  if (charset && !/^utf-?8$/i.test(charset)) return ` The Content-Type names charset=${charset}: JSON bodies must be UTF-8.`;
  return "";
}

/**
 * The rest of the body is never read: the answer closes the connection (Bun
 * does so for a response carrying `connection: close`), so a client cannot
 * make us receive and discard gigabytes to keep the connection alive.
 */
function tooLarge(code: ErrorCode, limit: number): AppError {
  return new AppError(code, `Request body too large: the limit is ${limit} bytes.`, null, { connection: "close" });
}

const decoder = new TextDecoder("utf-8", { fatal: true });

/** Declared bodies up to this size are read whole by Bun, within `idleMs` in all (see readJsonBody). */
export const WHOLE_BODY_MAX = 1024 * 1024;

/** `new Promise(takeSettlers)` leaves the promise's resolve and reject functions here: a promise made with no closure. */
let takenResolve: ((b: Uint8Array) => void) | undefined;
let takenReject: ((e: unknown) => void) | undefined;
function takeSettlers(resolve: (b: Uint8Array) => void, reject: (e: unknown) => void): void {
  takenResolve = resolve;
  takenReject = reject;
}

/**
 * A declared, small body, read by Bun in one piece; 400 if it is not complete
 * within `idleMs`. Bun's promise settles the read's through the read's own
 * resolve and reject, and the read is the stall timer's argument: no closure
 * a request (there were five). The caller clears the timer (`clear`).
 */
class WholeRead {
  private reject: ((e: unknown) => void) | undefined;
  private timer: ReturnType<typeof setTimeout> | undefined;

  constructor(
    readonly code: ErrorCode,
    readonly idleMs: number,
  ) {}

  read(request: Request): Promise<Uint8Array> {
    const whole = new Promise<Uint8Array>(takeSettlers);
    const resolve = takenResolve as (b: Uint8Array) => void;
    this.reject = takenReject;
    takenResolve = takenReject = undefined;
    this.timer = setTimeout(wholeStalled, this.idleMs, this);
    request.bytes().then(resolve, this.reject);
    return whole;
  }

  stalled(): void {
    this.reject?.(stoppedArriving(this.code, this.idleMs, true));
  }

  clear(): void {
    clearTimeout(this.timer);
    this.reject = undefined;
  }
}

function wholeStalled(read: WholeRead): void {
  read.stalled();
}

/** Read the body as it streams in, stopping at the limit, and (with `idleMs`) when it stops arriving. */
async function readCounted(request: Request, limit: number, code: ErrorCode, idleMs: number | undefined): Promise<Uint8Array> {
  const body = request.body;
  if (!body) return new Uint8Array(0);
  const chunks: Uint8Array[] = [];
  let size = 0;
  const reader = body.getReader();
  let lastData = performance.now();
  let timer: ReturnType<typeof setTimeout> | undefined;
  // Rejects once nothing has arrived for idleMs; one timer, re-armed only when it fires early.
  const stalled =
    idleMs === undefined
      ? undefined
      : new Promise<never>((_, reject) => {
          const arm = (ms: number) => {
            timer = setTimeout(() => {
              const quiet = performance.now() - lastData;
              if (quiet >= idleMs) reject(stoppedArriving(code, idleMs));
              else arm(idleMs - quiet);
            }, ms);
          };
          arm(idleMs);
        });
  try {
    for (;;) {
      const { done, value } = await (stalled ? Promise.race([reader.read(), stalled]) : reader.read());
      if (done) break;
      lastData = performance.now();
      size += value.byteLength;
      if (size > limit) throw tooLarge(code, limit);
      chunks.push(value);
    }
  } catch (e) {
    await reader.cancel().catch(() => {});
    throw e;
  } finally {
    clearTimeout(timer);
  }
  return chunks.length === 1 ? (chunks[0] as Uint8Array) : Buffer.concat(chunks);
}

function stoppedArriving(code: ErrorCode, idleMs: number, whole = false): AppError {
  const why = whole ? `not complete after ${idleMs / 1000} s` : `nothing for ${idleMs / 1000} s`;
  return new AppError(code, `The request body stopped arriving: ${why}.`, null, { connection: "close" });
}
