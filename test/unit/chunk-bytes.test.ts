import { describe, expect, test } from "bun:test";
import fc from "fast-check";
import { choiceIndexOf, chunkIdOf, type DeltaScan, dataAt, deltaTextBytes, swapFields, withAlias } from "../../src/inference/chunk-bytes.ts";
import type { Target } from "../../src/inference/upstream/index.ts";

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

/** JSON with `colon` (white space around it: `" :\t"`) between each key and its value, a space after each comma. */
const spacedJson =
  (colon: string) =>
  (v: unknown): string => {
    if (Array.isArray(v)) return `[${v.map(spacedJson(colon)).join(", ")}]`;
    if (v !== null && typeof v === "object") return `{${Object.entries(v).map(([k, x]) => `${JSON.stringify(k)}${colon}${spacedJson(colon)(x)}`).join(", ")}}`;
    return JSON.stringify(v);
  };
/** The ways an upstream may write its JSON: compact, as Python does, white space before and after the colon. */
const SERIALISERS = [JSON.stringify, asciiJson, spacedJson(" : "), spacedJson("\t:\t"), spacedJson(" :")];

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

  test("white space before or after a key's colon (`\"content\" : …`, tabs): every field counted as in compact JSON; a key in the text is text", () => {
    const delta = {
      content: 'say "content" : "x"',
      refusal: "no",
      reasoning_content: "hmm",
      tool_calls: [{ index: 0, function: { arguments: '{"arguments" :\t"y"}' } }],
    };
    const want = deltaTextBytes(event(delta), scan());
    expect(want).toBe(19 + 2 + 3 + 19);
    for (const serialise of SERIALISERS) expect(deltaTextBytes(event(delta, serialise), scan())).toBe(want);
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

describe("withAlias: the model an event names, whatever it is, becomes the alias", () => {
  const UP = "meta-llama/Llama-3.1-8B-Instruct";
  const target = { modelField: Buffer.from(`"model":${JSON.stringify(UP)}`), label: "t" } as unknown as Target;
  const AT = "data: ".length;
  /** A chunk naming `model`, its keys in the usual order (model before choices) or with choices first. */
  const chunkOf = (model: unknown, content: string, choicesFirst = false) => {
    const choices = [{ index: 0, delta: { content }, finish_reason: null }];
    return choicesFirst
      ? { id: "c1", choices, object: "chat.completion.chunk", model, created: 1 }
      : { id: "c1", object: "chat.completion.chunk", created: 1, model, choices };
  };
  const eventOf = (v: unknown, serialise: (v: unknown) => string) => Buffer.from(`data: ${serialise(v)}\n\n`);
  const swapped = (e: Buffer, alias: string) => withAlias(e, AT, swapFields(target, alias));
  const parsed = (e: Buffer) => {
    const text = e.toString("utf8");
    expect(text.startsWith("data: ")).toBe(true);
    expect(text.endsWith("\n\n")).toBe(true);
    return JSON.parse(text.slice(AT, -2)) as unknown;
  };

  /** Text full of what could fool a byte search: quotes, backslashes, the key itself, JSON punctuation. */
  const tricky = fc.string({ unit: fc.constantFrom('"', "\\", "\\\"", "a", "é", "😀", "/", "\n", ":", ",", "}", "]", " ", '"model":', '"model": "x"', "\u0000") });
  const modelValue = fc.oneof(
    tricky,
    fc.string({ unit: "binary" }),
    fc.constant(UP),
    fc.constant(null),
    fc.integer(),
    fc.double({ noNaN: true, noDefaultInfinity: true }),
    fc.boolean(),
    fc.array(tricky, { maxLength: 3 }),
    fc.dictionary(fc.constantFrom("a", "model", 'x"model'), tricky, { maxKeys: 3 }),
  );

  test("any value (a string with escapes, null, a number, an object), compact or spaced (around the colon too), before or after choices: the alias, the rest as sent", () => {
    fc.assert(
      fc.property(modelValue, tricky, fc.constantFrom("svc-fast", "svc-smart", UP, 'a"b\\c', "é"), fc.boolean(), fc.constantFrom(...SERIALISERS), (model, content, alias, choicesFirst, serialise) => {
        const chunk = chunkOf(model, content, choicesFirst);
        const out = swapped(eventOf(chunk, serialise), alias);
        expect(parsed(out)).toEqual({ ...chunk, model: alias });
      }),
      { numRuns: 2_000 },
    );
  });

  test("the configured id (vLLM's answer): only the value's bytes change, the spaced form too", () => {
    for (const serialise of [JSON.stringify, asciiJson]) {
      const e = eventOf(chunkOf(UP, 'say "model":"x"'), serialise);
      const text = e.toString();
      const field = serialise === JSON.stringify ? `"model":"${UP}"` : `"model": "${UP}"`;
      expect(swapped(e, "svc-fast").toString()).toBe(text.replace(field, '"model":"svc-fast"'));
    }
  });

  test("a value that is the alias already, an event without a model, a value that never ends: the same bytes, not a copy", () => {
    const same = eventOf(chunkOf("svc-fast", "hi"), JSON.stringify);
    expect(swapped(same, "svc-fast")).toBe(same);
    const spacedSame = eventOf(chunkOf("svc-fast", "hi"), asciiJson);
    expect(swapped(spacedSame, "svc-fast")).toBe(spacedSame);
    const none = eventOf({ id: "c1", choices: [{ index: 0, delta: { content: '"model":"x"' } }] }, JSON.stringify);
    expect(swapped(none, "svc-fast")).toBe(none);
    for (const cut of ['data: {"id":"c1","model":"abc\n\n', 'data: {"id":"c1","model":"ab\\"\n\n', 'data: {"id":"c1","model":{"a":[1\n\n']) {
      const e = Buffer.from(cut);
      expect(swapped(e, "svc-fast")).toBe(e);
    }
  });

  test("an alias equal to the configured id: another name is still swapped", () => {
    const e = eventOf(chunkOf("some-other-name", "hi"), JSON.stringify);
    expect(parsed(swapped(e, UP))).toEqual(chunkOf(UP, "hi"));
  });
});

describe("chunkIdOf: the id the gateway's own chunks carry (usage at [DONE], the cut at max_tokens)", () => {
  const idOf = (line: string) => {
    const event = Buffer.from(`${line}\n\n`);
    return chunkIdOf(event, dataAt(event));
  };
  test("read with any JSON white space before the brace, inside it and around the colon", () => {
    for (const line of [
      'data: {"id":"chatcmpl-1","object":"chat.completion.chunk"}',
      'data:{"id":"chatcmpl-1"}',
      'data:  {"id":"chatcmpl-1"}',
      'data:\t{"id":"chatcmpl-1"}',
      'data: \t {\n "id" : "chatcmpl-1" }',
      'data: {\r\n\t"id":\t"chatcmpl-1"}',
    ]) {
      expect({ line, id: idOf(line) }).toEqual({ line, id: "chatcmpl-1" });
    }
  });
  test("escapes decoded; no id, a non-string id, an id after 256 characters or not first: empty", () => {
    expect(idOf('data: {"id":"a\\"b\\u00e9"}')).toBe('a"b\u00e9');
    expect(idOf('data: {"object":"chat.completion.chunk","id":"x"}')).toBe("");
    expect(idOf('data: {"id":5}')).toBe("");
    expect(idOf(`data: {"id":"${"x".repeat(300)}"}`)).toBe("");
    expect(idOf("data: [DONE]")).toBe("");
  });
});

describe("choiceIndexOf: the one choice an event carries, read from its bytes only when written as a plain integer", () => {
  const withIndex = (index: string) => Buffer.from(`data: {"id":"c1","choices":[{"index":${index},"delta":{"content":"x"}}]}\n\n`);
  test("digits then a comma, a brace or white space: that number", () => {
    for (const [written, k] of [["0", 0], ["1", 1], ["9999", 9999], ["1 ", 1], ["1\t", 1], ["\n2\n", 2]] as const) expect(choiceIndexOf(withIndex(written), 6)).toBe(k);
    expect(choiceIndexOf(Buffer.from('data: {"choices":[{"delta":{},"index":0}, {"index":1}]}\n\n'), 6)).toBe(-1);
    expect(choiceIndexOf(Buffer.from('data: {"choices":[{"index":3}'.concat(',"delta":{}}]}\n\n')), 6)).toBe(3);
  });
  test("anything else (a fraction, an exponent, a sign, a string, a leading zero, five digits): -1, the event is parsed", () => {
    for (const written of ["1.5", "1e0", "1E0", "1.0", "-1", '"1"', "01", "00", "12345", "null", "true", "[1]"]) expect([written, choiceIndexOf(withIndex(written), 6)]).toEqual([written, -1]);
  });
});
