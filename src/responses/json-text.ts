/**
 * Text kept as JSON string content (UTF-8 bytes, escaped), so a text delta can
 * go from the upstream's chunk to the Responses event without being decoded
 * and re-escaped (docs/decisions.md, "Text deltas as bytes").
 *
 * The upstream's escaping is taken only when it is byte for byte what
 * `JSON.stringify` would write for the same text (`isStringifiedText`): the
 * event then carries exactly the bytes the decode + re-escape path would have
 * written, and nothing the upstream wrote can end the string early or carry
 * bytes that are not UTF-8. Any other spelling of the same text (`\u0041`,
 * `\/`, escaped non-ASCII, a surrogate pair written as two escapes, upper-case
 * hex) is read the slow way, decoded and escaped again.
 */

const QUOTE = 0x22;
const BACKSLASH = 0x5c;

/** 0-15 for a lower-case hex digit, else -1 (JSON.stringify writes lower case). */
function lowerHex(c: number | undefined): number {
  if (c === undefined) return -1;
  if (c >= 0x30 && c <= 0x39) return c - 0x30;
  if (c >= 0x61 && c <= 0x66) return c - 0x61 + 10;
  return -1;
}

/** Whether b[i..i+n) are continuation bytes (0x80-0xBF), all within `to`. */
function continuations(b: Uint8Array, i: number, n: number, to: number): boolean {
  if (i + n > to) return false;
  for (let k = i; k < i + n; k++) {
    const c = b[k] as number;
    if (c < 0x80 || c > 0xbf) return false;
  }
  return true;
}

/**
 * Whether b[from..to) is the content of a JSON string (between its quotes)
 * exactly as `JSON.stringify` writes it, as UTF-8: printable ASCII but `"`
 * and `\` as they are; `\"`, `\\`, `\b`, `\f`, `\n`, `\r`, `\t`; the other
 * control characters as `\u00xx` in lower-case hex; every other character
 * as its well-formed UTF-8 (no overlong form, no surrogate, nothing past
 * U+10FFFF: the Unicode standard's table 3-7). No unescaped quote, so the
 * bytes cannot end the string they are put in.
 */
export function isStringifiedText(b: Uint8Array, from: number, to: number): boolean {
  let i = from;
  while (i < to) {
    const c = b[i] as number;
    if (c < 0x20) return false;
    if (c < 0x80) {
      if (c === QUOTE) return false;
      if (c !== BACKSLASH) {
        i++;
        continue;
      }
      const e = b[i + 1];
      if (i + 1 >= to) return false;
      // \" \\ \b \f \n \r \t
      if (e === 0x22 || e === 0x5c || e === 0x62 || e === 0x66 || e === 0x6e || e === 0x72 || e === 0x74) {
        i += 2;
        continue;
      }
      // \u00xx: a control character that has no short escape.
      if (e !== 0x75 || i + 6 > to || b[i + 2] !== 0x30 || b[i + 3] !== 0x30) return false;
      const hi = b[i + 4];
      const lo = lowerHex(b[i + 5]);
      if ((hi !== 0x30 && hi !== 0x31) || lo === -1) return false;
      const code = (hi - 0x30) * 16 + lo;
      if (code === 0x08 || code === 0x09 || code === 0x0a || code === 0x0c || code === 0x0d) return false;
      i += 6;
      continue;
    }
    const c1 = b[i + 1] as number;
    if (c >= 0xc2 && c <= 0xdf) {
      if (!continuations(b, i + 1, 1, to)) return false;
      i += 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      if (!continuations(b, i + 1, 2, to)) return false;
      // No overlong form (E0 80-9F), no surrogate (ED A0-BF).
      if ((c === 0xe0 && c1 < 0xa0) || (c === 0xed && c1 > 0x9f)) return false;
      i += 3;
    } else if (c >= 0xf0 && c <= 0xf4) {
      if (!continuations(b, i + 1, 3, to)) return false;
      // No overlong form (F0 80-8F), nothing past U+10FFFF (F4 90-BF).
      if ((c === 0xf0 && c1 < 0x90) || (c === 0xf4 && c1 > 0x8f)) return false;
      i += 4;
    } else return false;
  }
  return true;
}

/** Starting room of a JsonText (it doubles as the text grows). */
const START_BYTES = 256;

/**
 * A text being received a delta at a time, held as the content of one JSON
 * string (UTF-8, escaped) in a buffer that doubles when full, rather than as
 * a string per delta joined into a rope: a delta costs no allocation, and the
 * text is decoded once, when it is needed (`text()`). Each piece appended is
 * JSON string content on its own (no escape cut in two), so the decoded text
 * is the pieces' texts joined, a surrogate pair split between two pieces
 * included.
 */
export class JsonText {
  /** b[0] is the opening quote; the content is b[1..1+len). */
  private b: Buffer | undefined;
  private len = 0;

  /** Bytes of content held. */
  get byteLength(): number {
    return this.len;
  }

  private room(n: number): Buffer {
    const need = 1 + this.len + n + 1;
    const b = this.b;
    if (b && b.length >= need) return b;
    let size = b ? b.length * 2 : START_BYTES;
    while (size < need) size *= 2;
    const grown = Buffer.allocUnsafe(size);
    if (b) b.copy(grown, 0, 0, 1 + this.len);
    else grown[0] = QUOTE;
    this.b = grown;
    return grown;
  }

  /** Appends src[from..to), JSON string content as `isStringifiedText` accepts it. */
  appendContent(src: Buffer, from: number, to: number): void {
    if (to <= from) return;
    const b = this.room(to - from);
    src.copy(b, 1 + this.len, from, to);
    this.len += to - from;
  }

  /** Appends the content of `quoted`, a JSON string as JSON.stringify writes it (quotes included). */
  appendQuoted(quoted: string): void {
    const n = Buffer.byteLength(quoted);
    if (n <= 2) return;
    const b = this.room(n);
    const at = 1 + this.len;
    // Written whole (its opening quote at `at`), then moved over its own opening quote.
    b.write(quoted, at);
    b.copyWithin(at, at + 1, at + n - 1);
    this.len += n - 2;
  }

  /** The text, decoded. */
  text(): string {
    const b = this.b;
    if (!b || this.len === 0) return "";
    b[1 + this.len] = QUOTE;
    return JSON.parse(b.toString("utf8", 0, this.len + 2)) as string;
  }
}
