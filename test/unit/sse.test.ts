import { describe, expect, test } from "bun:test";
import fc from "fast-check";
import { COMMENT, MAX_EVENT_BYTES, readEvent, SseFramer, SseReader, type SseMessage, sseDataOf } from "../../src/lib/sse.ts";
import { cut, SPEC_ROWS, specData } from "../helpers/sse-spec.ts";

const enc = new TextEncoder();

/** What an SseReader gives for `parts`, read in turn. */
function read(parts: Uint8Array[]): SseMessage[] {
  const s = new SseReader();
  const out: SseMessage[] = [];
  for (const p of parts) out.push(...s.push(p));
  return out;
}
const dataOnly = (m: SseMessage[]) => m.filter((d): d is string => d !== COMMENT);

describe("SseReader reads SSE as the standard does (test/helpers/sse-spec.ts)", () => {
  for (const row of SPEC_ROWS) {
    test(row.name, () => {
      const bytes = enc.encode(row.input);
      expect(dataOnly(read([bytes])), "whole").toEqual(row.data);
      for (let at = 1; at < bytes.length; at++) expect(dataOnly(read(cut(bytes, [at]))), `cut at ${at}`).toEqual(row.data);
      expect(dataOnly(read(cut(bytes, Array.from(bytes.keys())))), "a byte a read").toEqual(row.data);
      expect(sseDataOf(row.input), "sseDataOf").toEqual(row.data);
      // The oracle agrees with the table too.
      expect(specData(row.input), "specData").toEqual(row.data);
    });
  }
});

describe("SseReader", () => {
  test("multi-line data joins with \\n; an event over the size cap is refused", () => {
    const s = new SseReader();
    expect(s.push(enc.encode("data: a\ndata: b\n\n"))).toEqual(["a\nb"]);
    // A read ending in `\r`: with `\n` first in the next read it is one line end, not two (which would end the event).
    expect(s.push(enc.encode("data: c\r"))).toEqual([]);
    // A blank line ended by `\r` ends the event at once (the SSE standard has no need to wait for a `\n`:
    // CR alone is a line end); an `\n` next is the rest of that line end, not a line of its own.
    expect(s.push(enc.encode("\ndata: d\r\n\r"))).toEqual(["c\nd"]);
    expect(s.push(enc.encode("\n"))).toEqual([]);
    expect(s.push(enc.encode("data: e\n\n"))).toEqual(["e"]);
    expect(() => s.push(new Uint8Array(9 * 1024 * 1024).fill(0x61))).toThrow("oversized");
  });

  test("a whole one-line event (the fast path) gives what the line parser gives for the same bytes", () => {
    // The line parser's answer: the same event sent a byte at a time never takes the fast path.
    const slow = (bytes: Uint8Array) => {
      const s = new SseReader();
      const out: (string | typeof COMMENT)[] = [];
      for (let i = 0; i < bytes.length; i++) out.push(...s.push(bytes.subarray(i, i + 1)));
      return out;
    };
    const cases = [
      'data: {"choices":[{"delta":{"content":"héllo 😀"}}]}\n\n',
      'data:{"a":1}\n\n',
      "data: \n\n",
      "data:\n\n",
      "data: [DONE]\n\n",
      "data: a\ndata: b\n\n",
      "data: a\r\n\r\n",
      "data: a\rb\n\n",
      "data: a\n\ndata: b\n\n",
      "data: a\n\n\n",
      ": comment\n\n",
      ":\r\n\r\n",
      ": a\n: b\n\n",
      ": a\ndata: b\n\n",
      "event: x\ndata: y\n\n",
      "data: partial",
      "data: a\n",
      "datax: a\n\n",
    ];
    for (const c of cases) {
      const bytes = enc.encode(c);
      expect({ c, got: new SseReader().push(bytes) }).toEqual({ c, got: slow(bytes) });
    }
    // After a held partial event the next read is not mistaken for a whole one.
    const s = new SseReader();
    expect(s.push(enc.encode("data: a"))).toEqual([]);
    expect(s.push(enc.encode("data: b\n\n"))).toEqual(["adata: b"]);
  });
});

describe("SseReader: comments", () => {
  test("an event of comment lines only is COMMENT; with data it is its data; other fields alone are nothing", () => {
    const s = new SseReader();
    expect(s.push(enc.encode(": ping\n\n"))).toEqual([COMMENT]);
    expect(s.push(enc.encode(":\n\n: a\n: b\n\n"))).toEqual([COMMENT, COMMENT]);
    expect(s.push(enc.encode(": a\ndata: b\n\n"))).toEqual(["b"]);
    expect(s.push(enc.encode("event: ping\n\nid: 1\n\n"))).toEqual([]);
    // Split anywhere, CRLF framing.
    expect(s.push(enc.encode(": pi"))).toEqual([]);
    expect(s.push(enc.encode("ng\r\n\r"))).toEqual([COMMENT]);
    expect(s.push(enc.encode("\ndata: x\r\n\r\n"))).toEqual(["x"]);
  });
});
describe("SseFramer", () => {
  /** A sink that takes every event and keeps none. */
  const NONE = { onEvent: () => undefined };
  const framed = (parts: Uint8Array[]) => {
    const f = new SseFramer();
    const events: string[] = [];
    for (const p of parts) f.push(p, { onEvent: (e) => void events.push(Buffer.from(e).toString("latin1")) });
    return { events, f };
  };

  test("hands over each event's bytes as they came, its blank line included; blank lines with no event before them are none", () => {
    const { events, f } = framed([enc.encode("\n\r\n: c\r\n\r\nevent: x\rdata: y\r\rdata: z\n\ndata: partial\n")]);
    expect(events).toEqual([": c\r\n\r\n", "event: x\rdata: y\r\r", "data: z\n\n"]);
    expect(f.pendingBytes).toBe("data: partial\n".length);
    expect(f.pending().toString()).toBe("data: partial\n");
  });

  test("a byte order mark split between reads is dropped; bytes that only began like one are kept", () => {
    const bom = [0xef, 0xbb, 0xbf];
    const body = [...enc.encode("data: a\n\n")];
    expect(framed([new Uint8Array([bom[0] ?? 0]), new Uint8Array([bom[1] ?? 0]), new Uint8Array([bom[2] ?? 0, ...body])]).events).toEqual(["data: a\n\n"]);
    // Not a byte order mark: `\xEF\xBB` and then something else are the stream's bytes (the field is not `data`).
    const { events } = framed([new Uint8Array([0xef, 0xbb]), new Uint8Array([0x41, ...body, ...body])]);
    expect(events.map((e) => Buffer.from(e, "latin1").toString("hex").slice(0, 6))).toEqual(["efbb41", "646174"]);
  });

  test("an LF after a read that ended in CR is the rest of its line end: not a line of its own, and not part of the next event", () => {
    const { events } = framed([enc.encode("data: a\r\n\r"), enc.encode("\ndata: b\r"), enc.encode("\n\r"), enc.encode("\n")]);
    expect(events).toEqual(["data: a\r\n\r", "data: b\r\n\r"]);
  });

  test("stops at an event its caller refuses; the rest of that read is dropped", () => {
    const f = new SseFramer();
    const seen: string[] = [];
    f.push(enc.encode("data: 1\n\ndata: 2\n\ndata: 3"), {
      onEvent: (e) => {
        seen.push(e.toString());
        return false;
      },
    });
    expect(seen).toEqual(["data: 1\n\n"]);
    expect(f.pendingBytes).toBe(0);
  });

  test("an event without its end is bounded from its first byte, however it arrives; one event ending within the bound is not", () => {
    const f = new SseFramer();
    const block = new Uint8Array(1024 * 1024).fill(0x61);
    f.push(enc.encode("data: "), NONE);
    expect(() => {
      for (let i = 0; i < 9; i++) f.push(block, NONE);
    }).toThrow("oversized SSE event");
    // Many lines of one event count together.
    const g = new SseFramer();
    const line = enc.encode(`data: ${"x".repeat(1024 * 1024 - 7)}\n`);
    expect(() => {
      for (let i = 0; i < 9; i++) g.push(line, NONE);
    }).toThrow("oversized SSE event");
    // Just under the bound, then its end: one event.
    const h = new SseFramer();
    let got = 0;
    h.push(new Uint8Array(MAX_EVENT_BYTES - 10).fill(0x3a), NONE);
    h.push(enc.encode("\n\n"), {
      onEvent: (e) => {
        got = e.length;
        return undefined;
      },
    });
    expect(got).toBe(MAX_EVENT_BYTES - 8);
    // Read whole (`last`), nothing is held: the tail is dropped, not refused.
    expect(sseDataOf(`data: a\n\ndata: ${"x".repeat(MAX_EVENT_BYTES)}`)).toEqual(["a"]);
  });
});

describe("readEvent", () => {
  test("data, comments and other fields of one event", () => {
    expect(readEvent(Buffer.from(": a\nevent: x\ndata: 1\nid\ndata\n:\n\n"))).toEqual({ data: "1\n", comments: 2, others: 2 });
    expect(readEvent(Buffer.from("event: ping\n\n"))).toEqual({ data: undefined, comments: 0, others: 1 });
    expect(readEvent(Buffer.from("dat\ndata2: x\ndatum: y\n\n"))).toEqual({ data: undefined, comments: 0, others: 3 });
  });
});

describe("any stream read in pieces gives what it gives read whole", () => {
  /** Streams made of the pieces SSE is made of, so that the generated ones hit its edges often. */
  const piece = fc.constantFrom("data", "data:", "data: ", ":", " ", "event: m", "id", "retry: 1", "Data:", "\r", "\n", "\r\n", "\n\n", "\r\r", "\r\n\r\n", "x", "{}", "é", "😀", "\uFEFF", "[DONE]");
  const stream = fc.array(piece, { maxLength: 40 }).map((a) => enc.encode(a.join("")));
  const splits = (max: number) => fc.array(fc.nat({ max }), { maxLength: 12 });

  test("the same events (data and comments), split at any bytes (inside a CRLF, a character, a byte order mark), and the data the standard reads", () => {
    fc.assert(
      fc.property(stream, splits(200), (bytes, at) => {
        const whole = read([bytes]);
        expect(read(cut(bytes, at))).toEqual(whole);
        expect(dataOnly(whole)).toEqual(specData(Buffer.from(bytes).toString("utf8")));
      }),
      { numRuns: 3_000 },
    );
  });

  test("arbitrary bytes: never throws below the bound, and splits change nothing", () => {
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 300 }), splits(300), (bytes, at) => {
        expect(read(cut(bytes, at))).toEqual(read([bytes]));
      }),
      { numRuns: 2_000 },
    );
  });
});
