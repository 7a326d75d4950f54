/**
 * Server-sent events read as the HTML standard reads them (its "event stream
 * interpretation": https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation).
 * The one reader of the SSE an upstream sends: the chat relay's
 * (inference/stream.ts), a non-streamed request answered with SSE
 * (inference/whole-answer.ts) and the Responses translation (responses/events.ts).
 *
 * What it accepts (docs/decisions.md, "SSE framing"):
 *  - lines end in CRLF, LF or CR, mixed in any way from line to line;
 *  - a blank line ends an event; blank lines with no event before them are nothing;
 *  - one byte order mark at the very start of the stream is dropped (as UTF-8 decoding does);
 *  - `name:value` has one leading space taken off its value (a space, not a tab); a line
 *    without a colon is a field with an empty value (a bare `data` adds an empty line to the
 *    data); a line starting with `:` is a comment; field names are case-sensitive;
 *  - an event's data is its `data` values joined with LF; an event without a `data` field
 *    has no data (the standard dispatches nothing for it);
 *  - an event the stream ends before its blank line is no event;
 *  - text is UTF-8, decoded a line at a time: CR and LF never occur inside a UTF-8 sequence,
 *    so a read may end anywhere (inside a character, or between a CRLF's two bytes).
 * Bounded: an event that grows past MAX_EVENT_BYTES without its end is an error (`SseTooLarge`).
 */

/** One event larger than this without its end is not SSE we understand. */
export const MAX_EVENT_BYTES = 8 * 1024 * 1024;

const LF = 0x0a;
const CR = 0x0d;
const SPACE = 0x20;
const COLON = 0x3a;
const BOM = Buffer.from([0xef, 0xbb, 0xbf]);

export class SseTooLarge extends Error {
  constructor() {
    super(`an oversized SSE event (over ${MAX_EVENT_BYTES / 1024 / 1024} MiB without its end)`);
  }
}

export const asBuffer = (u: Uint8Array): Buffer => (Buffer.isBuffer(u) ? u : Buffer.from(u.buffer, u.byteOffset, u.byteLength));

/** `data:` at the start (d a t a :) with something after it. */
export const startsWithData = (b: Uint8Array): boolean => b.length > 5 && b[0] === 0x64 && b[1] === 0x61 && b[2] === 0x74 && b[3] === 0x61 && b[4] === COLON;

/**
 * Where a framer hands its events: an object with a method rather than a
 * function, so a reader that is one object (the chat relay, SseReader) is its
 * own sink, with no closure per stream.
 */
export interface EventSink {
  /**
   * Takes one complete event's bytes (its blank line included). Return false to
   * stop reading the current read: the rest of it is dropped.
   */
  onEvent(event: Buffer): boolean | undefined;
}

/**
 * Splits a byte stream into its events, read by read, without decoding it:
 * each complete event is handed over as its bytes (a view into the read when
 * it lies within one, so an event relayed as it came costs no copy). A
 * partial event is held as the pieces it arrived in (copied: a read's buffer
 * may be reused), joined once when its end arrives; each read is searched
 * only for its own line ends, once.
 */
export class SseFramer {
  private held: Buffer[] = [];
  private heldBytes = 0;
  /** The held bytes end inside a line (its end is still to come). */
  private midLine = false;
  /** The last byte read was a CR ending a line: an LF first in the next read is the rest of that line end. */
  private afterCr = false;
  /** Bytes of a byte order mark seen at the stream's start so far (held aside); -1 once past the start. */
  private bom = 0;

  /** Bytes of the event still without its end. */
  get pendingBytes(): number {
    return this.heldBytes;
  }

  /** Those bytes, joined (a stream that turned out not to be SSE: inference/whole-answer.ts). */
  pending(): Buffer {
    return Buffer.concat(this.held, this.heldBytes);
  }

  /** Drops anything held; what follows is read as a stream of its own, but for a byte order mark. */
  reset(): void {
    this.held = [];
    this.heldBytes = 0;
    this.midLine = false;
    this.afterCr = false;
    this.bom = -1;
  }

  /**
   * Whether a read whose first byte is `first` starts an event: nothing held,
   * no line end to finish, no byte order mark to drop. A caller that then
   * finds the read to be exactly one event ending in LF (its fast path) may
   * take it without `push`: the state after it is the same.
   */
  atEventStart(first: number | undefined): boolean {
    if (this.heldBytes !== 0 || this.afterCr) return false;
    if (this.bom !== -1) {
      if (this.bom > 0 || first === BOM[0]) return false;
      this.bom = -1;
    }
    return true;
  }

  /**
   * Reads `chunk`, calling `sink.onEvent` for each event it completes. With
   * `last`, the stream ends with it: what has no end is dropped, not held.
   * Throws SseTooLarge when an event without its end would hold more than
   * MAX_EVENT_BYTES.
   */
  push(chunk: Uint8Array, sink: EventSink, last = false): void {
    if (chunk.byteLength === 0) {
      if (last) this.stop();
      return;
    }
    let buf = asBuffer(chunk);
    if (this.bom !== -1) {
      let k = this.bom;
      let i = 0;
      while (k < BOM.length && i < buf.length && buf[i] === BOM[k]) {
        k++;
        i++;
      }
      if (k === BOM.length) {
        buf = buf.subarray(i);
        this.bom = -1;
      } else if (i === buf.length && !last) {
        // So far a byte order mark, split between reads: wait for the rest.
        this.bom = k;
        return;
      } else {
        // Not one: the bytes set aside for it are the stream's.
        if (this.bom > 0) buf = Buffer.concat([BOM.subarray(0, this.bom), buf]);
        this.bom = -1;
      }
    }
    const n = buf.length;
    /** Where the next line starts. */
    let pos = 0;
    /** Where the current event starts in this read, when none is held. */
    let start = 0;
    if (this.afterCr) {
      this.afterCr = false;
      if (buf[0] === LF) {
        pos = 1;
        // The LF of an event's last CRLF, the event already handed over: no part of the next one.
        if (this.heldBytes === 0) start = 1;
      }
    }
    let midLine = this.midLine;
    let lf = buf.indexOf(LF, pos);
    let cr = buf.indexOf(CR, pos);
    for (;;) {
      if (lf !== -1 && lf < pos) lf = buf.indexOf(LF, pos);
      if (cr !== -1 && cr < pos) cr = buf.indexOf(CR, pos);
      const end = lf === -1 ? cr : cr === -1 || lf < cr ? lf : cr;
      if (end === -1) break;
      let next = end + 1;
      if (end === cr) {
        if (next < n) {
          if (buf[next] === LF) next++;
        } else this.afterCr = true;
      }
      if (end === pos && !midLine) {
        // A blank line: the event ends with it (or, with nothing before it, there is no event).
        if (this.heldBytes > 0) {
          this.held.push(buf.subarray(0, next));
          const event = Buffer.concat(this.held, this.heldBytes + next);
          this.held = [];
          this.heldBytes = 0;
          if (sink.onEvent(event) === false) {
            this.stop();
            return;
          }
        } else if (pos > start && sink.onEvent(buf.subarray(start, next)) === false) {
          this.stop();
          return;
        }
        start = next;
      }
      midLine = false;
      pos = next;
    }
    this.midLine = pos < n;
    const from = this.heldBytes > 0 ? 0 : start;
    if (from >= n) return;
    if (last) {
      this.stop();
      return;
    }
    if (this.heldBytes + n - from > MAX_EVENT_BYTES) throw new SseTooLarge();
    // Copied: the rest may be a view into a read the runtime reuses.
    const piece = Buffer.from(buf.subarray(from));
    this.held.push(piece);
    this.heldBytes += piece.length;
  }

  private stop(): void {
    this.held = [];
    this.heldBytes = 0;
    this.midLine = false;
  }
}

/** What one event carries. */
export interface SseEvent {
  /** Its `data` values joined with LF; undefined when it has no `data` field (the standard dispatches nothing for it). */
  data: string | undefined;
  /** Its comment lines. */
  comments: number;
  /** Its fields other than `data` (`event`, `id`, `retry`, or any other name). */
  others: number;
}

/** Reads one complete event (its bytes as SseFramer hands them over). */
export function readEvent(event: Buffer): SseEvent {
  let data: string | undefined;
  let comments = 0;
  let others = 0;
  for (const line of event.toString("utf8").split(/\r\n|\r|\n/)) {
    if (line === "") continue; // the blank line that ends the event
    const colon = line.indexOf(":");
    if (colon === 0) comments++;
    else if (colon === 4 || (colon === -1 && line.length === 4)) {
      if (!line.startsWith("data")) others++;
      else {
        const value = colon === -1 ? "" : line.slice(line.charCodeAt(5) === SPACE ? 6 : 5);
        data = data === undefined ? value : `${data}\n${value}`;
      }
    } else others++;
  }
  return { data, comments, others };
}

/** What SseReader gives for an event of comments without data (an upstream's keep-alive). */
export const COMMENT = Symbol("comment");
export type SseMessage = string | typeof COMMENT;

/**
 * Incremental reader of events' data: each read -> the data of each event it
 * completes, or COMMENT for one with comment lines and no data (other events
 * without data give nothing).
 */
export class SseReader {
  private readonly framer = new SseFramer();
  /** The messages of the read being framed (set by push). */
  private out: SseMessage[] = [];

  /**
   * Where the data of `buf` starts when it is the common case, and what the
   * chat relay hands over: one whole event of one `data:` line ending in
   * `\n\n`, read where an event starts. Its data is then buf[at, length - 2),
   * and the read is taken without `push` (the state after it is the same).
   * -1 for any other read.
   */
  wholeDataAt(buf: Buffer): number {
    if (!startsWithData(buf) || !this.framer.atEventStart(buf[0])) return -1;
    const lf = buf.indexOf(LF);
    if (lf !== buf.length - 2 || buf[lf + 1] !== LF || buf.indexOf(CR) !== -1) return -1;
    return buf[5] === SPACE ? 6 : 5;
  }

  /** The framer's sink (EventSink). */
  onEvent(event: Buffer): undefined {
    const e = readEvent(event);
    if (e.data !== undefined) this.out.push(e.data);
    else if (e.comments > 0) this.out.push(COMMENT);
  }

  /** With `last`, the stream ends with this read: an event without its end is dropped. */
  push(bytes: Uint8Array, last = false): SseMessage[] {
    const buf = asBuffer(bytes);
    // The common case: its data is decoded once, with no line splitting.
    const at = this.wholeDataAt(buf);
    if (at !== -1) return [buf.toString("utf8", at, buf.length - 2)];
    const out: SseMessage[] = [];
    this.out = out;
    this.framer.push(buf, this, last);
    return out;
  }
}

/** The data of each event in a whole stream (a body read to its end), in order; events without data give nothing. */
export function sseDataOf(whole: string | Uint8Array): string[] {
  const out: string[] = [];
  for (const m of new SseReader().push(typeof whole === "string" ? Buffer.from(whole) : whole, true)) if (m !== COMMENT) out.push(m);
  return out;
}
