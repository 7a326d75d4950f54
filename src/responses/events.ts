/**
 * The gateway's chat SSE answer -> the Responses API's event stream.
 *
 * The chat stream is read as it arrives and every read is translated and
 * written before the next read (stream-state.ts holds the state machine), so the
 * translation adds no waiting, only the parse and the re-serialisation of
 * one read's events. The events are read as the SSE standard reads them
 * (lib/sse.ts; a read may end anywhere). An event of comments only (an
 * upstream's `: ping`) is passed on as `: keep-alive`; one with empty data is
 * no chunk and passed over, as the chat relay passes it over.
 */
import { ByteWriter } from "../lib/byte-writer.ts";
import type { RelayTransform } from "../lib/relay-transform.ts";
import { asBuffer, COMMENT, SseReader } from "../lib/sse.ts";
import { ChatToResponses } from "./stream-state.ts";
import { type ResponseMeta, type ResponseObject, usageFromChat } from "./output.ts";

/** The Responses translation as the chat relay applies it (`RelayTransform`), plus what a reader of a chat stream needs. */
export interface ResponsesTransform extends RelayTransform {
  /** Ends the response as failed (a chat stream that broke off without its error event); "" once final. */
  fail(message: string): string;
  /** The final Response once produced. */
  readonly final: ResponseObject | undefined;
}

/**
 * The chat SSE events -> the Responses events, for the chat relay to apply
 * on the writes it makes (inference/stream.ts): `response.created` and
 * `response.in_progress` before the first upstream event, then each read's
 * events translated as they come. `onFinal` is called exactly once with the
 * final Response object (completed, incomplete, failed, or `cancelled` when
 * the client went away first); when it returns a promise (storing the
 * response), the relay closes the stream only once it settles, so a client
 * that has read to the end can use the id at once.
 */
export function responsesTransform(meta: ResponseMeta, onFinal: (r: ResponseObject) => void | Promise<void>): ResponsesTransform {
  return new ResponsesRelayTransform(meta, onFinal);
}

const ignore = (): void => {};
const isThenable = (v: unknown): v is PromiseLike<void> => typeof v === "object" && v !== null && typeof (v as { then?: unknown }).then === "function";

/** Where a read's events are put together: one for every stream (each `events` call fills and empties it). */
const written = new ByteWriter();

/** A class, not an object of closures: an open stream holds one object and its state, with the methods shared. */
class ResponsesRelayTransform implements ResponsesTransform {
  private readonly t: ChatToResponses;
  private readonly sse = new SseReader();
  /** onFinal was called: what it returned when that was a promise (settled, never rejected), else true. */
  private reported: Promise<void> | true | undefined;

  constructor(
    private readonly meta: ResponseMeta,
    private readonly onFinal: (r: ResponseObject) => void | Promise<void>,
  ) {
    this.t = new ChatToResponses(meta);
  }

  get final(): ResponseObject | undefined {
    return this.t.final;
  }

  /**
   * Calls onFinal once; its promise (storing the response), caught, for the
   * relay to wait for, or undefined when it returned none (store: false): no
   * promise is made for a hook that has nothing to wait for.
   */
  private report(r: ResponseObject): Promise<void> | undefined {
    if (this.reported !== undefined) return this.reported === true ? undefined : this.reported;
    this.reported = true;
    let done: void | Promise<void>;
    try {
      done = this.onFinal(r);
    } catch {
      // The caller's hook failed; the stream still ends cleanly.
      return undefined;
    }
    if (done instanceof Promise) this.reported = done.catch(ignore);
    else if (isThenable(done)) this.reported = Promise.resolve(done).catch(ignore);
    return this.reported === true ? undefined : this.reported;
  }

  start(): string {
    return this.t.start();
  }

  /**
   * The events of a read as text, or as bytes once a plain text delta went
   * from the upstream's bytes to its event's (`ChatToResponses.plainText`):
   * what was written so far is `written`'s bytes, then `text`.
   */
  events(events: readonly Uint8Array[]): string | Uint8Array {
    const t = this.t;
    // After the final event the chat stream still runs to its end (it ends right after [DONE]).
    if (t.final) return "";
    const out = written;
    out.reset();
    let text = "";
    try {
      for (const e of events) {
        const b = asBuffer(e);
        const at = this.sse.wholeDataAt(b);
        if (at === -1) {
          for (const data of this.sse.push(b)) text += data === COMMENT ? t.comment() : data === "" ? "" : t.data(data);
          continue;
        }
        out.string(text);
        text = "";
        if (t.plainText(b, at, b.length - 2, out)) continue;
        const data = b.toString("utf8", at, b.length - 2);
        if (data !== "") text = t.data(data);
      }
    } catch (e) {
      text += t.fail(`The model '${this.meta.model}' sent an unreadable stream: ${(e as Error).message}`, null);
    }
    if (t.final) void this.report(t.final);
    if (out.length === 0) return text;
    out.string(text);
    return out.take();
  }

  failed(): string | undefined {
    const r = this.t.final;
    return r?.status === "failed" ? (r.error?.message ?? "") : undefined;
  }

  fail(message: string): string {
    const t = this.t;
    if (t.final) return "";
    const text = t.fail(message, null);
    if (t.final) void this.report(t.final);
    return text;
  }

  finish(): Promise<void> | undefined {
    return this.t.final ? this.report(this.t.final) : undefined;
  }

  cancel(usage?: Record<string, unknown>): void {
    void this.report(this.t.cancel(usageFromChat(usage)));
  }
}

/**
 * A chat SSE stream read in JavaScript -> the Responses event stream, with
 * the same translation (`responsesTransform`). The gateway's own route does
 * not use it (the transform runs inside the chat relay, one stream layer
 * fewer); it translates a chat stream that arrives as a ReadableStream, and
 * the translation's unit tests drive it. Cancelling the returned stream
 * cancels `chatSse`.
 */
export function responseEventStream(
  chatSse: ReadableStream<Uint8Array>,
  meta: ResponseMeta,
  onFinal: (r: ResponseObject) => void | Promise<void>,
): ReadableStream<Uint8Array> {
  const tf = responsesTransform(meta, onFinal);
  const reader = chatSse.getReader();
  let gone = false;

  const clientGone = () => {
    if (gone) return;
    gone = true;
    tf.cancel();
    reader.cancel("client disconnected").catch(() => {});
  };

  const write = async (c: ReadableStreamDirectController, text: string | Uint8Array): Promise<boolean> => {
    if (text === "") return true;
    try {
      const w = c.write(text);
      if (typeof w !== "number") await w;
      const f = c.flush();
      if (typeof f !== "number") await f;
      return true;
    } catch {
      clientGone();
      return false;
    }
  };

  async function pull(c: ReadableStreamDirectController): Promise<void> {
    if (!(await write(c, tf.start()))) return;
    for (;;) {
      let r: Awaited<ReturnType<typeof reader.read>>;
      try {
        r = await reader.read();
      } catch {
        if (gone) return;
        r = { done: true, value: undefined };
        if (!(await write(c, tf.fail(`The connection to the model '${meta.model}' was lost mid-stream.`)))) return;
      }
      if (gone) return;
      if (r.done) {
        // The chat relay always ends with [DONE] or its error event; anything else broke off.
        if (!(await write(c, tf.fail(`The model '${meta.model}' ended the stream early.`)))) return;
        const f = tf.finish();
        if (f) await f;
        if (!gone) c.close();
        return;
      }
      if (!(await write(c, tf.events([r.value])))) return;
    }
  }

  return new ReadableStream<Uint8Array>({
    type: "direct",
    pull,
    cancel: clientGone,
  } satisfies import("bun").DirectUnderlyingSource<Uint8Array>);
}
