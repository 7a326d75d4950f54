/**
 * The gateway's chat SSE answer -> the Responses API's event stream.
 *
 * The chat stream is read as it arrives and every read is translated and
 * written before the next read (stream-state.ts holds the state machine), so the
 * translation adds no waiting, only the parse and the re-serialisation of
 * one read's events. SSE framing follows the spec's rules: `\n`, `\r\n` or
 * `\r` line ends, `data:` with or without its space, and a read may end
 * anywhere, inside an event, a line end or a UTF-8 character. An event of
 * comments only (an upstream's `: ping`) is passed on as `: keep-alive`.
 */
import type { RelayTransform } from "../lib/relay-transform.ts";
import { ChatToResponses } from "./stream-state.ts";
import type { ResponseMeta, ResponseObject } from "./output.ts";

/** One event larger than this without an end is not SSE we understand (as in inference/stream.ts). */
const MAX_EVENT_BYTES = 8 * 1024 * 1024;
const LF = 0x0a;
const CR = 0x0d;
const SPACE = 0x20;

/** `data:` at the start (d a t a :). */
const startsWithData = (b: Buffer): boolean => b.length > 5 && b[0] === 0x64 && b[1] === 0x61 && b[2] === 0x74 && b[3] === 0x61 && b[4] === 0x3a;

/** What SseData gives for an event of comment lines only (a keep-alive), rather than its data. */
export const COMMENT = Symbol("comment");

const asBuffer = (u: Uint8Array): Buffer => (Buffer.isBuffer(u) ? u : Buffer.from(u.buffer, u.byteOffset, u.byteLength));

/**
 * Incremental SSE `data` reader: returns the data of each event a read
 * completes, or COMMENT for an event with comment lines and no data (other
 * events without data are not events, as in the SSE spec). It works on bytes and decodes whole lines only (a line end byte
 * never occurs inside a UTF-8 sequence), so it needs no per-stream decoder,
 * and a partial line is held as the pieces it arrived in, joined once.
 */
export class SseData {
  private held: Buffer[] = [];
  private heldBytes = 0;
  private data: string[] = [];
  private dataChars = 0;
  /** The event being read has a comment line. */
  private comment = false;

  push(bytes: Uint8Array): (string | typeof COMMENT)[] {
    let buf = asBuffer(bytes);
    // The common case, and what the chat relay hands over: one whole event of one `data:` line
    // ending in `\n\n`, with nothing held. Its data is decoded once, with no line splitting.
    if (this.heldBytes === 0 && this.data.length === 0 && startsWithData(buf)) {
      const lf = buf.indexOf(LF);
      if (lf === buf.length - 2 && buf[lf + 1] === LF && buf.indexOf(CR) === -1) return [buf.toString("utf8", buf[5] === SPACE ? 6 : 5, lf)];
    }
    if (this.heldBytes > 0) {
      const last = this.held[this.held.length - 1];
      // No line end in this read (and none pending as a last `\r`): the held line just grows.
      if (last?.[last.length - 1] !== CR && buf.indexOf(LF) === -1 && buf.indexOf(CR) === -1) {
        this.hold(buf);
        return [];
      }
      buf = Buffer.concat([...this.held, buf]);
      this.held = [];
      this.heldBytes = 0;
    }
    const events: (string | typeof COMMENT)[] = [];
    let pos = 0;
    let lf = buf.indexOf(LF);
    let cr = buf.indexOf(CR);
    for (;;) {
      if (lf !== -1 && lf < pos) lf = buf.indexOf(LF, pos);
      if (cr !== -1 && cr < pos) cr = buf.indexOf(CR, pos);
      const end = lf === -1 ? cr : cr === -1 ? lf : Math.min(lf, cr);
      if (end === -1) break;
      let next = end + 1;
      if (end === cr) {
        // A `\r` at the end of the read may be the first half of `\r\n`: wait for the next read.
        if (next === buf.length) break;
        if (buf[next] === LF) next++;
      }
      this.line(buf.toString("utf8", pos, end), events);
      pos = next;
    }
    if (pos < buf.length) this.hold(buf.subarray(pos));
    return events;
  }

  /** Keeps a partial line, copied: it may be a view into a read the runtime reuses. */
  private hold(piece: Buffer): void {
    this.held.push(Buffer.from(piece));
    this.heldBytes += piece.length;
    if (this.heldBytes + this.dataChars > MAX_EVENT_BYTES) throw new Error("an oversized SSE event");
  }

  private line(line: string, events: (string | typeof COMMENT)[]): void {
    if (line === "") {
      if (this.data.length > 0) events.push(this.data.length === 1 ? (this.data[0] ?? "") : this.data.join("\n"));
      else if (this.comment) events.push(COMMENT);
      this.data = [];
      this.dataChars = 0;
      this.comment = false;
    } else if (line.startsWith("data:")) {
      const value = line.charCodeAt(5) === 32 ? line.slice(6) : line.slice(5);
      this.data.push(value);
      this.dataChars += value.length;
    } else if (line.charCodeAt(0) === 0x3a) this.comment = true;
    // Other fields (`event:`, `id:`, `retry:`) carry nothing for us; a comment's text neither.
  }
}

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

/** A class, not an object of closures: an open stream holds one object and its state, with the methods shared. */
class ResponsesRelayTransform implements ResponsesTransform {
  private readonly t: ChatToResponses;
  private readonly sse = new SseData();
  private reported: Promise<void> | undefined;

  constructor(
    private readonly meta: ResponseMeta,
    private readonly onFinal: (r: ResponseObject) => void | Promise<void>,
  ) {
    this.t = new ChatToResponses(meta);
  }

  get final(): ResponseObject | undefined {
    return this.t.final;
  }

  private report(r: ResponseObject): Promise<void> {
    if (this.reported) return this.reported;
    try {
      this.reported = Promise.resolve(this.onFinal(r)).catch(() => {});
    } catch {
      // The caller's hook failed; the stream still ends cleanly.
      this.reported = Promise.resolve();
    }
    return this.reported;
  }

  start(): string {
    return this.t.start();
  }

  events(events: readonly Uint8Array[]): string {
    const t = this.t;
    // After the final event the chat stream still runs to its end (it ends right after [DONE]).
    if (t.final) return "";
    let text = "";
    try {
      for (const e of events) for (const data of this.sse.push(e)) text += data === COMMENT ? t.comment() : t.data(data);
    } catch (e) {
      text += t.fail(`The model '${this.meta.model}' sent an unreadable stream: ${(e as Error).message}`, null);
    }
    if (t.final) void this.report(t.final);
    return text;
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

  cancel(): void {
    void this.report(this.t.cancel());
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

  const write = async (c: ReadableStreamDirectController, text: string): Promise<boolean> => {
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
