import { describe, expect, test } from "bun:test";
import fc from "fast-check";
import { type DeltaScan, deltaTextBytes } from "../../src/inference/chunk-bytes.ts";

/**
 * The completion estimate of a stream counts each delta string's text as
 * UTF-8 bytes, whatever escapes the upstream wrote it with: a server that
 * writes non-ASCII as `\uXXXX` (Python's json.dumps default) is charged what
 * one that writes UTF-8 is (docs/decisions.md, Token estimates).
 */

const scan = (): DeltaScan => ({ structuredArguments: false, sentBytes: 0 });

/** An event whose delta carries `fields`, its JSON written by `serialise` (JSON.stringify by default). */
function event(fields: Record<string, unknown>, serialise: (v: unknown) => string = JSON.stringify): Buffer {
  const chunk = { id: "c1", object: "chat.completion.chunk", created: 1, model: "m", choices: [{ index: 0, delta: fields, finish_reason: null }] };
  return Buffer.from(`data: ${serialise(chunk)}\n\n`);
}

/** JSON as Python's json.dumps writes it by default: every UTF-16 unit outside ASCII as `\uXXXX`, `", "` and `": "` separators. */
function asciiJson(v: unknown): string {
  if (Array.isArray(v)) return `[${v.map(asciiJson).join(", ")}]`;
  if (v !== null && typeof v === "object") return `{${Object.entries(v).map(([k, x]) => `${asciiJson(k)}: ${asciiJson(x)}`).join(", ")}}`;
  return JSON.stringify(v).replace(/[\u0080-\uffff]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`);
}

/** The event's delta text as written: `"content":"<raw>"` with `raw` put in exactly as given (escapes and all). */
const rawEvent = (raw: string, field = "content") =>
  Buffer.from(`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"${field}":"${raw}"},"finish_reason":null}]}\n\n`);

describe("deltaTextBytes counts the UTF-8 bytes of the decoded text", () => {
  test("each escape is the bytes of what it stands for", () => {
    const cases: [string, number][] = [
      ["abc", 3],
      // Two CJK characters, 3 bytes each: as UTF-8 and as escapes alike (before: 12 for the escapes).
      ["你好", 6],
      ["\\u4f60\\u597d", 6],
      ["\\u4F60\\u597D", 6],
      // One byte each: \n \" \\ \/ \b \f \r \t (before: 2 each).
      ["\\n", 1],
      ['\\"', 1],
      ["\\\\", 1],
      ["\\/", 1],
      ["\\b\\f\\r\\t", 4],
      // By code point: 1, 2, 2, 3, 3 bytes.
      ["\\u0041", 1],
      ["\\u00e9", 2],
      ["\\u07ff", 2],
      ["\\u0800", 3],
      ["\\uffff", 3],
      // A surrogate pair is one code point of 4 bytes (😀); a lone surrogate is U+FFFD, 3 bytes, as TextEncoder makes it.
      ["\\uD83D\\uDE00", 4],
      ["\\ud83d\\ude00", 4],
      ["\\uD83D", 3],
      ["\\uDE00", 3],
      ["\\uD83Dx", 4],
      ["\\uD83D\\u0041", 4],
      ["\\uD83D\\uD83D\\uDE00", 7],
      ["\\uDE00\\uD83D", 6],
      // Escapes mixed with raw UTF-8 and ASCII.
      ["h\\u00e9llo 😀 \\n", 1 + 2 + 3 + 1 + 4 + 1 + 1],
    ];
    expect(cases.map(([raw]) => [raw, deltaTextBytes(rawEvent(raw), scan())])).toEqual(cases);
    // The bytes as sent are noted too (the Responses API's bound on what it holds counts them).
    for (const [raw] of cases) {
      const s = scan();
      deltaTextBytes(rawEvent(raw), s);
      expect([raw, s.sentBytes]).toEqual([raw, Buffer.byteLength(raw)]);
    }
  });

  test("a malformed escape counts at least a byte, and never throws", () => {
    for (const raw of ["\\u", "\\u12", "\\uzzzz", "\\x", "\\uD83D\\u", "\\uD83D\\uzz00"]) {
      const n = deltaTextBytes(rawEvent(raw), scan());
      expect(n).toBeGreaterThan(0);
      expect(n).toBeLessThanOrEqual(Buffer.byteLength(raw));
    }
    // A string the event ends inside (no closing quote): counted to the end, as before.
    expect(deltaTextBytes(Buffer.from('data: {"choices":[{"delta":{"content":"ab\\'), scan())).toBeGreaterThan(0);
  });

  test("every text field, each choice and each tool call, reasoning once under either name", () => {
    const e = Buffer.from(
      `data: {"choices":[{"index":0,"delta":{"content":"\\u00e9","refusal":"\\n","reasoning_content":"\\u4f60","reasoning":"\\u4f60","tool_calls":[{"index":0,"function":{"arguments":"{\\"q\\":1}"}},{"index":1,"function":{"arguments":"\\u4f60"}}]}},{"index":1,"delta":{"content":"\\ud83d\\ude00"}}]}\n\n`,
    );
    const s = scan();
    // é 2 + \n 1 + reasoning 你 3 (once) + {"q":1} 7 + 你 3 + 😀 4.
    expect(deltaTextBytes(e, s)).toBe(2 + 1 + 3 + 7 + 3 + 4);
    expect(s.sentBytes).toBe(6 + 2 + 6 + 9 + 6 + 12);
  });

  test("any text: escaped as Python writes it or as JSON.stringify does, its count is its UTF-8 bytes", () => {
    fc.assert(
      fc.property(fc.string({ unit: "binary", maxLength: 60 }), fc.string({ unit: "grapheme", maxLength: 60 }), (a, b) => {
        for (const text of [a, b]) {
          // Buffer.byteLength is TextEncoder's count: a lone surrogate is U+FFFD, 3 bytes.
          const want = Buffer.byteLength(text, "utf8");
          expect(deltaTextBytes(event({ content: text }), scan())).toBe(want);
          expect(deltaTextBytes(event({ content: text }, asciiJson), scan())).toBe(want);
          expect(deltaTextBytes(event({ tool_calls: [{ index: 0, function: { arguments: text } }] }, asciiJson), scan())).toBe(want);
        }
      }),
      { numRuns: 1_000 },
    );
  });
});
