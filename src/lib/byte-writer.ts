/**
 * Bytes put together within one synchronous call and handed out as one
 * Uint8Array at its end: bytes, ASCII integers and strings written into a
 * buffer that is kept between calls, so putting an event together allocates
 * nothing but the copy handed out (one cell). One writer can serve every
 * stream of the process: JavaScript runs one call at a time, and each call
 * starts with `reset()` and ends with `take()`.
 */

/** Room kept between calls; a writer that grew past it (a whole answer in one event) goes back to it. */
const KEEP_BYTES = 64 * 1024;

export class ByteWriter {
  private b = Buffer.allocUnsafe(16 * 1024);
  private n = 0;

  get length(): number {
    return this.n;
  }

  reset(): void {
    this.n = 0;
  }

  private room(more: number): Buffer {
    const need = this.n + more;
    if (need <= this.b.length) return this.b;
    let size = this.b.length * 2;
    while (size < need) size *= 2;
    const grown = Buffer.allocUnsafe(size);
    this.b.copy(grown, 0, 0, this.n);
    this.b = grown;
    return grown;
  }

  /** src[from..to) (all of it by default). */
  bytes(src: Buffer, from = 0, to = src.length): void {
    if (to <= from) return;
    src.copy(this.room(to - from), this.n, from, to);
    this.n += to - from;
  }

  /** A non-negative safe integer in decimal, as `String(v)` writes it. */
  int(v: number): void {
    let digits = 1;
    for (let x = v; x >= 10; x = Math.floor(x / 10)) digits++;
    const b = this.room(digits);
    for (let i = this.n + digits - 1, x = v; i >= this.n; i--, x = Math.floor(x / 10)) b[i] = 0x30 + (x % 10);
    this.n += digits;
  }

  /** A string, as UTF-8. */
  string(s: string): void {
    if (s === "") return;
    const b = this.room(Buffer.byteLength(s));
    this.n += b.write(s, this.n);
  }

  /** What was written since `reset()`, as a Uint8Array of its own; the writer is empty after. */
  take(): Uint8Array {
    const out = Buffer.allocUnsafe(this.n);
    this.b.copy(out, 0, 0, this.n);
    this.n = 0;
    if (this.b.length > KEEP_BYTES) this.b = Buffer.allocUnsafe(16 * 1024);
    return out;
  }
}
