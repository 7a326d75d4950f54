import { AppError, type ErrorCode } from "./errors.ts";

/**
 * Read a JSON request body ourselves (routes use `parse: "none"`), after
 * authentication, so that an anonymous caller gets 401 before any 400, and so
 * that the size limit answers 400 in the spec's shape instead of Bun's 413.
 * Bodies without Content-Length are counted as they stream in and cut off at
 * the limit: memory never holds more than `limit` bytes of one body.
 */
export async function readJsonBody(request: Request, limit: number, code: ErrorCode = "invalid_request_error"): Promise<unknown> {
  const type = request.headers.get("content-type") ?? "";
  if (!/^application\/json\s*(;|$)/i.test(type)) {
    throw new AppError(code, "Content-Type must be application/json.");
  }
  const declared = request.headers.get("content-length");
  if (declared !== null && Number(declared) > limit) throw tooLarge(code, limit);
  let bytes: Uint8Array;
  try {
    // Fast path: the length is known and within the limit (Bun enforces it), so one read suffices.
    bytes = declared !== null && /^\d+$/.test(declared) ? new Uint8Array(await request.arrayBuffer()) : await readCounted(request, limit, code);
  } catch (e) {
    if (e instanceof AppError) throw e;
    // The client stopped sending (idle timeout) or went away mid-body: a client error, not ours.
    throw new AppError(code, "The request body could not be read: the connection closed before it was complete.");
  }
  if (bytes.byteLength === 0) throw new AppError(code, "Request body is empty; a JSON object is required.");
  let text: string;
  try {
    text = decoder.decode(bytes);
  } catch {
    throw new AppError(code, "Request body is not valid UTF-8.");
  }
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new AppError(code, `Request body is not valid JSON: ${(e as Error).message}`);
  }
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

/** A body of unknown length (chunked): count as it streams in and stop at the limit. */
async function readCounted(request: Request, limit: number, code: ErrorCode): Promise<Uint8Array> {
  const body = request.body;
  if (!body) return new Uint8Array(0);
  const chunks: Uint8Array[] = [];
  let size = 0;
  const reader = body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    size += value.byteLength;
    if (size > limit) {
      await reader.cancel().catch(() => {});
      throw tooLarge(code, limit);
    }
    chunks.push(value);
  }
  return chunks.length === 1 ? (chunks[0] as Uint8Array) : Buffer.concat(chunks);
}
