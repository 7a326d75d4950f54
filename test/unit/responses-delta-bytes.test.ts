/**
 * A plain text delta goes from the upstream's bytes to the Responses event's
 * bytes without being decoded (stream-state.ts `plainText`); every other chunk
 * is decoded, parsed and escaped again (`data`). These tests pin that the two
 * paths write the same bytes, so the byte path cannot drift from the other.
 */
import { describe, expect, test } from "bun:test";
import { ByteWriter } from "../../src/lib/byte-writer.ts";
import { responsesTransform } from "../../src/responses/events.ts";
import { isStringifiedText, JsonText } from "../../src/responses/json-text.ts";
import type { ResponseObject } from "../../src/responses/output.ts";
import { argumentsAt, isRoleChunk, plainTextAt, plainTextDelta, reasoningTextAt } from "../../src/responses/chunk-match.ts";
import { chunk, DONE, meta, ROLE, USAGE } from "../helpers/responses.ts";

/** A small seeded generator, so a failure can be run again (FUZZ_SEED). */
function rng(seed: number) {
  let s = seed >>> 0 || 1;
  const next = () => {
    s ^= s << 13;
    s >>>= 0;
    s ^= s >>> 17;
    s ^= s << 5;
    s >>>= 0;
    return s / 2 ** 32;
  };
  return { next, int: (n: number) => Math.floor(next() * n), pick: <T>(xs: readonly T[]): T => xs[Math.floor(next() * xs.length)] as T };
}
const SEED = Number(process.env.FUZZ_SEED ?? 20261128);

/** Code units worth trying: quotes, backslashes, controls, the escapes' own letters, non-ASCII, both halves of a pair alone, U+2028. */
const UNITS = ['"', "\\", "/", "u", "0", "a", "F", " ", "\b", "\f", "\n", "\r", "\t", "\u0000", "\u0001", "\u001f", "\u007f", "é", "€", "\u2028", "\u2029", "\ufeff", "\ufffd", "😀", "\ud83d", "\ude00", "}", "]", ","];
const randomText = (r: ReturnType<typeof rng>, max = 12): string => {
  let t = "";
  const n = r.int(max + 1);
  for (let i = 0; i < n; i++) t += r.pick(UNITS);
  return t;
};

/** The JSON string content (no quotes) JSON.stringify writes for `s`, as UTF-8. */
const stringified = (s: string): Buffer => Buffer.from(JSON.stringify(s).slice(1, -1));

/** Another spelling of the same text, as other servers write it: any character may be a \u escape (either case), `/` as `\/`, a pair as two escapes. */
function otherSpelling(s: string, r: ReturnType<typeof rng>): string {
  let out = "";
  for (const ch of s) {
    const roll = r.next();
    if (roll < 0.3) {
      for (let i = 0; i < ch.length; i++) {
        const hex = ch.charCodeAt(i).toString(16).padStart(4, "0");
        out += `\\u${r.next() < 0.5 ? hex : hex.toUpperCase()}`;
      }
    } else if (ch === "/" && roll < 0.6) out += "\\/";
    else out += JSON.stringify(ch).slice(1, -1);
  }
  return out;
}

describe("isStringifiedText: the upstream's escaping taken only as JSON.stringify writes it", () => {
  test("JSON.stringify's own output is taken for every well-formed string (random strings); a lone surrogate's escape is left to the decoding path", () => {
    const r = rng(SEED);
    let lone = 0;
    for (let i = 0; i < 5_000; i++) {
      const s = randomText(r, 16);
      const b = stringified(s);
      // A lone surrogate is written as a \u escape, which is taken for no character (a pair's two escapes are one raw character).
      if (!s.isWellFormed()) lone++;
      expect({ b: b.toString(), ok: isStringifiedText(b, 0, b.length) }).toEqual({ b: b.toString(), ok: s.isWellFormed() });
    }
    expect(lone).toBeGreaterThan(100);
  });

  test("bytes taken are exactly what decoding and escaping again writes (random bytes: escapes, quotes, UTF-8 good and bad)", () => {
    const r = rng(SEED + 1);
    const PIECES = ["a", " ", '"', "\\", "\\\\", '\\"', "\\/", "\\n", "\\t", "\\b", "\\f", "\\r", "\\x", "\\u", "\\u00", "\\u001f", "\\u001F", "\\u0000", "\\u000a", "\\u0008", "\\u0041", "\\u00e9", "\\ud83d", "\\ude00", "\\ud83d\\ude00", "0", "1f", "\n", "\u0001"];
    const BYTES = [[0xc3, 0xa9], [0xc3], [0xa9], [0xe2, 0x82, 0xac], [0xe2, 0x82], [0xf0, 0x9f, 0x98, 0x80], [0xf0, 0x9f], [0xc0, 0x80], [0xc1, 0xbf], [0xe0, 0x80, 0x80], [0xed, 0xa0, 0x80], [0xed, 0x9f, 0xbf], [0xf4, 0x90, 0x80, 0x80], [0xf4, 0x8f, 0xbf, 0xbf], [0xf5, 0x80, 0x80, 0x80], [0xff], [0x80], [0xe2, 0x80, 0xa8], [0x7f]];
    let taken = 0;
    for (let i = 0; i < 20_000; i++) {
      const parts: Buffer[] = [];
      const n = 1 + r.int(6);
      for (let j = 0; j < n; j++) parts.push(r.next() < 0.6 ? Buffer.from(r.pick(PIECES)) : Buffer.from(r.pick(BYTES)));
      const b = Buffer.concat(parts);
      if (!isStringifiedText(b, 0, b.length)) continue;
      taken++;
      // Decoded as the slow path decodes it (UTF-8, then JSON.parse), then escaped again: the same bytes.
      const text = JSON.parse(`"${b.toString("utf8")}"`) as string;
      expect({ b: [...b], again: [...stringified(text)] }).toEqual({ b: [...b], again: [...b] });
    }
    expect(taken).toBeGreaterThan(2_000);
  });

  test("each spelling JSON.stringify would not write is left to the decoding path", () => {
    const no = ["\\/", "\\u0041", "\\u00e9", "\\u00E9", "\\u001F", "\\u000a", "\\u0008", "\\u0009", "\\u000c", "\\u000d", "\\ud83d\\ude00", "\\ud83d", "\\x", "\\", "a\\", "\\u00", '"', 'a"b', "\n", "\u0001"];
    for (const s of no) expect({ s, ok: isStringifiedText(Buffer.from(s), 0, Buffer.byteLength(s)) }).toEqual({ s, ok: false });
    const badUtf8 = [[0x80], [0xc0, 0x80], [0xc1, 0xbf], [0xc3], [0xe0, 0x9f, 0xbf], [0xed, 0xa0, 0x80], [0xe2, 0x82], [0xf0, 0x8f, 0xbf, 0xbf], [0xf4, 0x90, 0x80, 0x80], [0xf5, 0x80, 0x80, 0x80], [0xff]];
    for (const bytes of badUtf8) expect({ bytes, ok: isStringifiedText(Buffer.from(bytes), 0, bytes.length) }).toEqual({ bytes, ok: false });
    const yes = ["", "plain", '\\"\\\\\\b\\f\\n\\r\\t', "\\u0000\\u001f\\u000b\\u001b", "é€😀\u2028\u2029\u007f\ufeff\ufffd", "\ud7ff\ue000\u{10ffff}"];
    for (const s of yes) expect({ s, ok: isStringifiedText(Buffer.from(s), 0, Buffer.byteLength(s)) }).toEqual({ s, ok: true });
    // Only the range given is read: an escape cut at its end is not taken.
    const cut = Buffer.from("ab\\u001f");
    expect(isStringifiedText(cut, 0, cut.length - 1)).toBe(false);
    expect(isStringifiedText(cut, 0, 2)).toBe(true);
  });
});

describe("plainTextAt: plainTextDelta on the chunk's bytes", () => {
  test("takes a chunk only when plainTextDelta does, with the same text, and every stringified plain delta", () => {
    const r = rng(SEED + 2);
    const body = (t: string, over = "") => `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m"${over},"choices":[{"index":0,"delta":{"content":"${t}"},"logprobs":null,"finish_reason":null}]}`;
    let taken = 0;
    for (let i = 0; i < 5_000; i++) {
      const text = randomText(r);
      const spellings = [JSON.stringify(text).slice(1, -1), otherSpelling(text, r), text.replaceAll('"', ""), text];
      for (const s of spellings) {
        for (const payload of [body(s), body(s, ',"usage":null'), body(s, ',"error":1'), ` ${body(s)}`, `${body(s)} `, `${body(s)}}`]) {
          const b = Buffer.from(`data: ${payload}\n\n`);
          const at = plainTextAt(b, 6, b.length - 2);
          if (at === -1) continue;
          taken++;
          const end = b.length - 2 - '"},"logprobs":null,"finish_reason":null}]}'.length;
          // What the decoding path reads: the data decoded (a lone surrogate in `payload` was written as U+FFFD).
          const slow = plainTextDelta(b.toString("utf8", 6, b.length - 2));
          expect({ payload, slow }).toEqual({ payload, slow: JSON.parse(`"${b.toString("utf8", at, end)}"`) });
        }
      }
      const canonical = Buffer.from(`data: ${body(JSON.stringify(text).slice(1, -1))}\n\n`);
      if (text.isWellFormed()) expect(plainTextAt(canonical, 6, canonical.length - 2)).not.toBe(-1);
    }
    expect(taken).toBeGreaterThan(5_000);
  });
});

/** Item ids are random and completed_at is the clock: the same stream translated twice is the same up to them. */
const normalise = (s: string) => s.replace(/"(msg|fc|rs)_[0-9a-f]+"/g, '"$1_x"').replace(/"completed_at":\d+/g, '"completed_at":0');
const text = (out: string | Uint8Array) => (typeof out === "string" ? out : Buffer.from(out).toString("utf8"));

/** A chat stream through the transform as the relay drives it: one read per event (whole events, so plain deltas take the byte path). */
function whole(events: (string | Buffer)[]) {
  const finals: ResponseObject[] = [];
  const tf = responsesTransform(meta({ store: false }), (r) => {
    finals.push(r);
  });
  const outs = [tf.start(), ...events.map((e) => tf.events([Buffer.from(e)]))];
  return { outs, text: outs.map(text).join(""), finals };
}

/** The same stream with each event cut in two reads: each is read by the decoding path (as a stream split anywhere is). */
function split(events: (string | Buffer)[]) {
  const finals: ResponseObject[] = [];
  const tf = responsesTransform(meta({ store: false }), (r) => {
    finals.push(r);
  });
  const outs: (string | Uint8Array)[] = [tf.start()];
  for (const e of events) {
    const b = Buffer.from(e);
    const cut = Math.max(1, b.length >> 1);
    outs.push(tf.events([b.subarray(0, cut)]), tf.events([b.subarray(cut)]));
  }
  return { outs, text: outs.map(text).join(""), finals };
}

/** A plain text delta exactly as vLLM writes it, with its text's JSON string content as given. */
const raw = (content: string) =>
  `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"chat-small","choices":[{"index":0,"delta":{"content":"${content}"},"logprobs":null,"finish_reason":null}]}\n\n`;

/**
 * A delta (`rawOf`'s chunk) whose text holds `bytes`, not UTF-8, then a delta `next`: the first is decoded
 * as before (its events a string, the decoding path) and its bytes are never passed on; the next still
 * goes as bytes, and the output is what events cut in two (always decoded) give.
 */
function decodedNotPassedOn(rawOf: (text: string) => string, next: Record<string, unknown>, bytes: number[]) {
  const [head, tail] = rawOf("a|b").split("|");
  const event = Buffer.concat([Buffer.from(head ?? ""), Buffer.from(bytes), Buffer.from(tail ?? "")]);
  const events = [ROLE, event, chunk(next), chunk({}, "stop"), USAGE, DONE];
  const w = whole(events);
  expect(w.outs[2]).toBeString();
  expect(w.outs[3]).toBeInstanceOf(Uint8Array);
  expect(normalise(w.text)).toBe(normalise(split(events).text));
  const sent = Buffer.concat(w.outs.map((o) => (typeof o === "string" ? Buffer.from(o) : o)));
  expect(sent.includes(Buffer.from(bytes))).toBe(false);
  return w;
}

/**
 * One random answer read whole (bytes where the upstream escaped as JSON.stringify) and cut in two (decoded): the
 * same bytes out and the same final Responses. Returns the whole run's result, and how many events it passed on as bytes.
 */
function sameWholeAndSplit(run: number, events: (string | Buffer)[]) {
  const w = whole(events);
  const s = split(events);
  expect({ run, events, out: normalise(w.text) }).toEqual({ run, events, out: normalise(s.text) });
  expect(normalise(JSON.stringify(w.finals))).toBe(normalise(JSON.stringify(s.finals)));
  return { w, byBytes: w.outs.filter((o) => o instanceof Uint8Array).length };
}

/** The `delta` of each event of one type, in order. */
function deltasOf(text: string, type: string): string[] {
  return text
    .split("\n\n")
    .filter((e) => e.startsWith(`event: ${type}\n`))
    .map((e) => (JSON.parse(e.slice(e.indexOf("data: ") + 6)) as { delta: string }).delta);
}

describe("the text delta event's bytes", () => {
  test("pinned: quotes, backslashes, control characters, \\u00xx, raw UTF-8 (2, 3 and 4 bytes), U+2028 and DEL, taken as bytes", () => {
    const tf = responsesTransform(meta({ store: false }), () => {});
    const start = text(tf.start());
    expect(tf.events([Buffer.from(ROLE)])).toBe(""); // an empty delta opens nothing
    const first = tf.events([Buffer.from(chunk({ content: 'a"b\\c\u0001\u001f\n\t é€😀\u2028\u007f/' }))]);
    expect(first).toBeInstanceOf(Uint8Array);
    const msg = /"id":"(msg_[0-9a-f]{48})"/.exec(text(first))?.[1];
    expect(msg).toBeDefined();
    expect(text(first)).toBe(
      `event: response.output_item.added\ndata: {"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"type":"message","id":"${msg}","status":"in_progress","role":"assistant","content":[]}}\n\n` +
        `event: response.content_part.added\ndata: {"type":"response.content_part.added","sequence_number":3,"item_id":"${msg}","output_index":0,"content_index":0,"part":{"type":"output_text","text":"","annotations":[],"logprobs":[]}}\n\n` +
        `event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":4,"item_id":"${msg}","output_index":0,"content_index":0,"delta":"a\\"b\\\\c\\u0001\\u001f\\n\\t é€😀\u2028\u007f/","logprobs":[]}\n\n`,
    );
    // The same text spelt otherwise by the upstream (\/, \u0041, escaped non-ASCII, a pair as two escapes): the same event, decoded and escaped again.
    const second = tf.events([Buffer.from(raw("\\/\\u0041\\u00e9\\ud83d\\ude00\\u001F"))]);
    expect(typeof second).toBe("string");
    expect(second).toBe(
      `event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":5,"item_id":"${msg}","output_index":0,"content_index":0,"delta":"/Aé😀\\u001f","logprobs":[]}\n\n`,
    );
    const third = tf.events([Buffer.from(chunk({ content: "!" }))]);
    expect(text(third)).toBe(
      `event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":6,"item_id":"${msg}","output_index":0,"content_index":0,"delta":"!","logprobs":[]}\n\n`,
    );
    const done = text(tf.events([Buffer.from(chunk({}, "stop"))]));
    expect(done.split("\n\n")[0]).toBe(
      `event: response.output_text.done\ndata: {"type":"response.output_text.done","sequence_number":7,"item_id":"${msg}","output_index":0,"content_index":0,"text":"a\\"b\\\\c\\u0001\\u001f\\n\\t é€😀\u2028\u007f//Aé😀\\u001f!","logprobs":[]}`,
    );
    expect(start).toContain('"sequence_number":1,');
  });

  test("a surrogate pair sent as two lone halves in two chunks: each delta a lone escape, the text the pair", () => {
    const events = [ROLE, raw("\\ud83d"), raw("\\ude00"), raw("x"), chunk({}, "stop"), USAGE, DONE];
    const w = whole(events);
    expect(w.text).toContain('"delta":"\\ud83d"');
    expect(w.text).toContain('"delta":"\\ude00"');
    expect(w.text).toContain('"text":"😀x"');
    expect(w.finals[0]?.output_text).toBe("😀x");
    expect(normalise(w.text)).toBe(normalise(split(events).text));
  });

  test("an unescaped quote or control character in the text is not passed on: the chunk is read as JSON, as before", () => {
    // The quote ends the string: the chunk is JSON whose content is "a" (and a field "x" of the delta, ignored).
    const injected = [ROLE, raw('a","x":"b'), chunk({}, "stop"), DONE];
    const w = whole(injected);
    expect(normalise(w.text)).toBe(normalise(split(injected).text));
    expect(w.text).toContain('"delta":"a","logprobs":[]}');
    expect(w.text).not.toContain('"x"');
    expect(w.finals[0]?.output_text).toBe("a");
    const broken = [ROLE, raw('a"b'), chunk({}, "stop"), DONE];
    expect(normalise(whole(broken).text)).toBe(normalise(split(broken).text));
    expect(whole(broken).text).toContain("response.failed");
    const control = [ROLE, raw("a\u0001b"), chunk({}, "stop"), DONE];
    expect(normalise(whole(control).text)).toBe(normalise(split(control).text));
    expect(whole(control).text).toContain("response.failed");
  });

  test("bytes that are not UTF-8 in the text (a stray continuation, a cut or overlong sequence, a surrogate, past U+10FFFF) are decoded as before, never passed on", () => {
    const bad = [[0x80], [0xc3], [0xc0, 0xaf], [0xe2, 0x82], [0xed, 0xa0, 0x80], [0xf4, 0x90, 0x80, 0x80], [0xff]];
    for (const bytes of bad) {
      const w = decodedNotPassedOn(raw, { content: "c" }, bytes);
      expect(w.finals[0]?.output_text).toBe(`a${Buffer.from(bytes).toString("utf8")}bc`);
    }
  });

  test("random answers: whole events (bytes where the upstream escaped as JSON.stringify) and events cut in two (decoded) give the same bytes", () => {
    const r = rng(SEED + 3);
    let byBytes = 0;
    for (let run = 0; run < 400; run++) {
      const texts: string[] = [];
      const events = [ROLE];
      let spliced = false;
      const n = 1 + r.int(8);
      for (let i = 0; i < n; i++) {
        const t = r.next() < 0.05 ? randomText(r, 400) : randomText(r);
        const roll = r.next();
        if (roll < 0.6) {
          texts.push(t);
          events.push(chunk({ content: t }));
        } else if (roll < 0.8) {
          texts.push(t);
          events.push(raw(otherSpelling(t, r)));
        } else if (roll < 0.9) {
          // Not a plain delta (logprobs, a role): the full parse, within the same part.
          texts.push(t);
          events.push(chunk({ content: t, role: "assistant" }));
        } else {
          // Raw text spliced in unescaped: not JSON, or not one string; the stream may fail there.
          events.push(raw(t));
          spliced = true;
        }
      }
      events.push(chunk({}, r.next() < 0.5 ? "stop" : "length"), USAGE, DONE);
      const { w, byBytes: b } = sameWholeAndSplit(run, events);
      byBytes += b;
      // With no text spliced in, the deltas are the texts and the text is their join.
      if (!spliced) {
        expect(deltasOf(w.text, "response.output_text.delta")).toEqual(texts.filter((t) => t !== ""));
        expect(w.finals[0]?.output_text).toBe(texts.join(""));
      }
    }
    expect(byBytes).toBeGreaterThan(400);
  });

  test("a client gone mid-answer: the cancelled Response has the text so far, bytes and decoded pieces joined", () => {
    const finals: ResponseObject[] = [];
    const tf = responsesTransform(meta({ store: false }), (r) => {
      finals.push(r);
    });
    tf.start();
    for (const e of [ROLE, chunk({ content: "caf" }), raw("\\u00e9 "), chunk({ content: "ok" })]) tf.events([Buffer.from(e)]);
    tf.cancel();
    expect(finals).toHaveLength(1);
    expect(finals[0]).toMatchObject({ status: "cancelled", output_text: "café ok", output: [{ status: "incomplete", content: [{ text: "café ok" }] }] });
  });
});

/** A plain argument delta of tool call `index` exactly as vLLM writes it, with its arguments' JSON string content as given. */
const rawArgs = (content: string, index = "0") =>
  `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"chat-small","choices":[{"index":0,"delta":{"tool_calls":[{"index":${index},"function":{"arguments":"${content}"}}]},"logprobs":null,"finish_reason":null}]}\n\n`;
const callOpen = (index: number, name: string, args = "") => chunk({ tool_calls: [{ index, id: `call_${index}`, type: "function", function: { name, arguments: args } }] });
const argsDelta = (index: number, args: string) => chunk({ tool_calls: [{ index, function: { arguments: args } }] });

describe("argumentsAt and the argument delta event's bytes", () => {
  const at = (e: string) => {
    const b = Buffer.from(e);
    return argumentsAt(b, 6, b.length - 2);
  };
  test("takes vLLM's argument delta after the call's first chunk, and nothing else", () => {
    expect(at(argsDelta(0, '{"a":"\\"é😀\n'))).toBeGreaterThan(0);
    expect(at(rawArgs("x", "12"))).toBeGreaterThan(0);
    // A leading zero, a negative or fractional index, ten digits: decoded.
    for (const index of ["01", "-1", "1.0", "1e0", '"1"', "1234567890", ""]) expect(at(rawArgs("x", index))).toBe(-1);
    // Another spelling of the text, an unescaped quote or control character: decoded.
    for (const content of ["\\u0041", "\\/", '"', "\n"]) expect(at(rawArgs(content))).toBe(-1);
    // A name, an id, a type, two calls, usage or an error before the choices, a finish, logprobs, text: decoded.
    expect(at(callOpen(0, "f", "x"))).toBe(-1);
    expect(at(chunk({ tool_calls: [{ index: 0, function: { name: "f", arguments: "x" } }] }))).toBe(-1);
    expect(at(chunk({ tool_calls: [{ index: 0, function: { arguments: "x" } }, { index: 1, function: { arguments: "y" } }] }))).toBe(-1);
    expect(at(rawArgs("x").replace('"created":1', '"usage":null'))).toBe(-1);
    expect(at(rawArgs("x").replace('"created":1', '"error":null'))).toBe(-1);
    expect(at(argsDelta(0, "x").replace('"finish_reason":null', '"finish_reason":"stop"'))).toBe(-1);
    expect(at(chunk({ content: "x", tool_calls: [{ index: 0, function: { arguments: "x" } }] }))).toBe(-1);
  });

  test("taken as bytes once the call's item is added; before (a name not yet come), decoded; both give the same bytes as events cut in two", () => {
    const events = [ROLE, argsDelta(0, '{"a":'), callOpen(0, "f"), argsDelta(0, '"b\\"'), argsDelta(0, ""), argsDelta(0, '"}'), chunk({}, "tool_calls"), USAGE, DONE];
    const w = whole(events);
    // The first piece (no name yet) and the call's first chunk are decoded; the pieces after go as bytes.
    expect(w.outs[3]).toBeString();
    expect(w.outs[4]).toBeInstanceOf(Uint8Array);
    expect(w.outs[5]).toBe("");
    expect(w.outs[6]).toBeInstanceOf(Uint8Array);
    expect(normalise(w.text)).toBe(normalise(split(events).text));
    expect(deltasOf(w.text, "response.function_call_arguments.delta")).toEqual(['{"a":', '"b\\"', '"}']);
    expect(w.finals[0]?.output).toMatchObject([{ type: "function_call", name: "f", arguments: '{"a":"b\\""}', status: "completed" }]);
  });

  test("random answers of text and interleaved calls: whole events (bytes where the upstream escaped as JSON.stringify) and events cut in two (decoded) give the same bytes", () => {
    const r = rng(SEED + 7);
    let byBytes = 0;
    for (let run = 0; run < 300; run++) {
      const events = [ROLE];
      const want = new Map<number, string>();
      if (r.next() < 0.5) events.push(chunk({ content: randomText(r) }));
      const n = 1 + r.int(12);
      for (let i = 0; i < n; i++) {
        const index = r.int(3);
        const t = randomText(r);
        if (!want.has(index)) {
          events.push(callOpen(index, `f${index}`, r.next() < 0.3 ? t : ""));
          want.set(index, "");
        } else if (r.next() < 0.8) events.push(argsDelta(index, t));
        else events.push(rawArgs(otherSpelling(t, r), String(index)));
        // The first chunk carried arguments only when the roll above gave them: what was sent is what counts.
        const sent = events[events.length - 1] as string;
        const v = JSON.parse(sent.slice(6)) as { choices: { delta: { tool_calls: { function: { arguments: string } }[] } }[] };
        want.set(index, `${want.get(index)}${v.choices[0]?.delta.tool_calls[0]?.function.arguments}`);
      }
      const end = r.next();
      if (end < 0.8) events.push(chunk({}, "tool_calls"), USAGE, DONE);
      else if (end < 0.9) events.push(USAGE, DONE);
      const { w } = sameWholeAndSplit(run, events);
      byBytes += w.outs.filter((o) => o instanceof Uint8Array).length;
      if (end >= 0.9) continue;
      const calls = (w.finals[0]?.output ?? []).filter((o) => o.type === "function_call") as { name: string; arguments: string }[];
      expect(calls.map((c) => [c.name, c.arguments])).toEqual([...want].map(([k, v]) => [`f${k}`, v]));
    }
    expect(byBytes).toBeGreaterThan(300);
  });

  test("a client gone, or the stream failed, mid-call: the Response has the arguments so far, bytes and decoded pieces joined", () => {
    for (const end of ["cancel", "fail"] as const) {
      const finals: ResponseObject[] = [];
      const tf = responsesTransform(meta({ store: false }), (r) => {
        finals.push(r);
      });
      tf.start();
      for (const e of [ROLE, callOpen(0, "f", "{"), argsDelta(0, '"a":'), rawArgs("\\u0031"), argsDelta(0, "2")]) tf.events([Buffer.from(e)]);
      if (end === "cancel") tf.cancel();
      else tf.fail("gone");
      expect(finals).toHaveLength(1);
      expect(finals[0]?.output).toMatchObject([{ type: "function_call", name: "f", arguments: '{"a":12', status: "incomplete" }]);
    }
  });
});

describe("JsonText and ByteWriter", () => {
  test("JsonText: pieces from bytes and from JSON.stringify joined, past its starting room, decoded once", () => {
    const t = new JsonText();
    expect(t.text()).toBe("");
    let want = "";
    for (let i = 0; i < 300; i++) {
      const piece = `${i}:"é😀\n\\`;
      want += piece;
      if (i % 2 === 0) t.appendQuoted(JSON.stringify(piece));
      else {
        const b = Buffer.from(`xx${JSON.stringify(piece).slice(1, -1)}yy`);
        t.appendContent(b, 2, b.length - 2);
      }
    }
    t.appendQuoted('""');
    expect(t.text()).toBe(want);
    expect(t.text()).toBe(want);
  });

  test("ByteWriter: integers as String() writes them, UTF-8 strings, bytes; past its room and back", () => {
    const w = new ByteWriter();
    for (const v of [0, 7, 9, 10, 99, 100, 12345, 2 ** 31, Number.MAX_SAFE_INTEGER]) {
      w.reset();
      w.int(v);
      expect(Buffer.from(w.take()).toString()).toBe(String(v));
    }
    w.reset();
    w.string("é😀");
    w.bytes(Buffer.from("abcdef"), 1, 3);
    w.string("");
    w.int(42);
    expect(Buffer.from(w.take()).toString()).toBe("é😀bc42");
    const big = "x".repeat(200_000);
    w.reset();
    w.string("<");
    w.string(big);
    w.bytes(Buffer.from(">"));
    expect(Buffer.from(w.take()).toString()).toBe(`<${big}>`);
    w.reset();
    w.string("after");
    expect(Buffer.from(w.take()).toString()).toBe("after");
  });
});

/** A plain reasoning delta exactly as vLLM's reasoning parsers write one (`reasoning_content`, or `reasoning` in newer vLLM), its text's JSON string content as given. */
const rawReasoning = (content: string, key: "reasoning_content" | "reasoning" = "reasoning_content") =>
  `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"chat-small","choices":[{"index":0,"delta":{"${key}":"${content}"},"logprobs":null,"finish_reason":null}]}\n\n`;

describe("reasoningTextAt: a plain reasoning delta on the chunk's bytes", () => {
  test("takes a chunk only when it is one reasoning delta of choice 0 and nothing else, with the text the full parse gives, and every stringified one", () => {
    const r = rng(SEED + 4);
    const body = (t: string, key: string, over = "", delta = "") =>
      `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m"${over},"choices":[{"index":0,"delta":{${delta}"${key}":"${t}"},"logprobs":null,"finish_reason":null}]}`;
    let taken = 0;
    for (let i = 0; i < 3_000; i++) {
      const text = randomText(r);
      const spellings = [JSON.stringify(text).slice(1, -1), otherSpelling(text, r), text.replaceAll('"', ""), text];
      for (const key of ["reasoning_content", "reasoning", "content", "refusal"]) {
        for (const s of spellings) {
          for (const payload of [body(s, key), body(s, key, ',"usage":null'), body(s, key, ',"error":1'), body(s, key, "", '"content":"x",'), body(s, key, "", '"reasoning":"x",'), ` ${body(s, key)}`, `${body(s, key)}}`]) {
            const b = Buffer.from(`data: ${payload}\n\n`);
            const at = reasoningTextAt(b, 6, b.length - 2);
            if (at === -1) continue;
            taken++;
            const end = b.length - 2 - '"},"logprobs":null,"finish_reason":null}]}'.length;
            // What the decoding path reads: the chunk parsed, its delta's reasoning (either name) and nothing else.
            const delta = (JSON.parse(b.toString("utf8", 6, b.length - 2)) as { choices: { delta: Record<string, unknown> }[] }).choices[0]?.delta;
            expect({ payload, keys: Object.keys(delta ?? {}) }).toEqual({ payload, keys: [key] });
            expect({ payload, text: delta?.[key] }).toEqual({ payload, text: JSON.parse(`"${b.toString("utf8", at, end)}"`) });
          }
        }
        const canonical = Buffer.from(`data: ${body(JSON.stringify(text).slice(1, -1), key)}\n\n`);
        const reasoning = key === "reasoning_content" || key === "reasoning";
        if (text.isWellFormed()) expect({ key, at: reasoningTextAt(canonical, 6, canonical.length - 2) !== -1 }).toEqual({ key, at: reasoning });
      }
    }
    expect(taken).toBeGreaterThan(3_000);
  });
});

describe("the reasoning delta event's bytes", () => {
  test("pinned: escapes and raw UTF-8 taken as bytes, under either name; another spelling decoded; the item's text, its done events and the final Response the same as decoded", () => {
    const finals: ResponseObject[] = [];
    const tf = responsesTransform(meta({ store: false }), (r) => {
      finals.push(r);
    });
    text(tf.start());
    expect(tf.events([Buffer.from(ROLE)])).toBe("");
    const first = tf.events([Buffer.from(chunk({ reasoning_content: 'a"b\\c\u0001\n é€😀\u2028/' }))]);
    expect(first).toBeInstanceOf(Uint8Array);
    const rs = /"id":"(rs_[0-9a-f]{48})"/.exec(text(first))?.[1];
    expect(rs).toBeDefined();
    expect(text(first)).toBe(
      `event: response.output_item.added\ndata: {"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"type":"reasoning","id":"${rs}","summary":[],"content":[],"status":"in_progress"}}\n\n` +
        `event: response.content_part.added\ndata: {"type":"response.content_part.added","sequence_number":3,"item_id":"${rs}","output_index":0,"content_index":0,"part":{"type":"reasoning_text","text":""}}\n\n` +
        `event: response.reasoning_text.delta\ndata: {"type":"response.reasoning_text.delta","sequence_number":4,"item_id":"${rs}","output_index":0,"content_index":0,"delta":"a\\"b\\\\c\\u0001\\n é€😀\u2028/"}\n\n`,
    );
    // vLLM's newer name: the same item, as bytes.
    const second = tf.events([Buffer.from(chunk({ reasoning: "!" }))]);
    expect(second).toBeInstanceOf(Uint8Array);
    expect(text(second)).toBe(
      `event: response.reasoning_text.delta\ndata: {"type":"response.reasoning_text.delta","sequence_number":5,"item_id":"${rs}","output_index":0,"content_index":0,"delta":"!"}\n\n`,
    );
    // Another spelling of the same text: decoded and escaped again, the same event.
    const third = tf.events([Buffer.from(rawReasoning("\\/\\u0041\\u00e9\\ud83d\\ude00\\u001F", "reasoning"))]);
    expect(typeof third).toBe("string");
    expect(third).toBe(
      `event: response.reasoning_text.delta\ndata: {"type":"response.reasoning_text.delta","sequence_number":6,"item_id":"${rs}","output_index":0,"content_index":0,"delta":"/Aé😀\\u001f"}\n\n`,
    );
    // An empty reasoning delta: nothing.
    expect(tf.events([Buffer.from(chunk({ reasoning_content: "" }))])).toBe("");
    // The text begins: the reasoning item ends with its whole text (bytes and decoded pieces joined).
    const all = 'a"b\\c\u0001\n é€😀\u2028/!/Aé😀\u001f';
    const answer = text(tf.events([Buffer.from(chunk({ content: "ok" }))]));
    const [done, partDone, itemDone] = answer.split("\n\n");
    expect(done).toBe(`event: response.reasoning_text.done\ndata: {"type":"response.reasoning_text.done","sequence_number":7,"item_id":"${rs}","output_index":0,"content_index":0,"text":${JSON.stringify(all)}}`);
    expect(partDone).toBe(
      `event: response.content_part.done\ndata: {"type":"response.content_part.done","sequence_number":8,"item_id":"${rs}","output_index":0,"content_index":0,"part":{"type":"reasoning_text","text":${JSON.stringify(all)}}}`,
    );
    expect(itemDone).toBe(
      `event: response.output_item.done\ndata: {"type":"response.output_item.done","sequence_number":9,"output_index":0,"item":{"type":"reasoning","id":"${rs}","summary":[],"content":[{"type":"reasoning_text","text":${JSON.stringify(all)}}],"status":"completed"}}`,
    );
    for (const e of [chunk({}, "stop"), USAGE, DONE]) tf.events([Buffer.from(e)]);
    expect(finals[0]?.output[0]).toMatchObject({ type: "reasoning", content: [{ text: all }], status: "completed" });
  });

  test("an unescaped quote or control character in the reasoning is not passed on: the chunk is read as JSON, as before (a quote may end the string and open content)", () => {
    // The quote ends the string: the chunk is JSON whose delta is reasoning "a" and content "b".
    const injected = [ROLE, rawReasoning('a","content":"b'), chunk({}, "stop"), DONE];
    const w = whole(injected);
    expect(w.outs[2]).toBeString();
    expect(normalise(w.text)).toBe(normalise(split(injected).text));
    expect(w.text).toContain('"delta":"a"}');
    expect(w.finals[0]?.output_text).toBe("b");
    for (const bad of ['a"b', "a\u0001b", "a\nb"]) {
      const events = [ROLE, rawReasoning(bad), chunk({}, "stop"), DONE];
      expect(normalise(whole(events).text)).toBe(normalise(split(events).text));
      expect(whole(events).text).toContain("response.failed");
    }
    // Bytes that are not UTF-8: decoded as before (U+FFFD), never passed on.
    for (const bytes of [[0x80], [0xc3], [0xed, 0xa0, 0x80], [0xff]]) decodedNotPassedOn((t) => rawReasoning(t), { reasoning_content: "c" }, bytes);
  });

  test("random answers of reasoning and text: whole events (bytes where the upstream escaped as JSON.stringify) and events cut in two (decoded) give the same bytes", () => {
    const r = rng(SEED + 5);
    let byBytes = 0;
    for (let run = 0; run < 400; run++) {
      const reasoning: string[] = [];
      const events = [ROLE];
      let spliced = false;
      let answered = false;
      const n = 1 + r.int(10);
      for (let i = 0; i < n; i++) {
        const t = r.next() < 0.05 ? randomText(r, 400) : randomText(r);
        const key = r.next() < 0.5 ? "reasoning_content" : "reasoning";
        const roll = r.next();
        if (roll < 0.45) {
          reasoning.push(t);
          events.push(chunk({ [key]: t }));
        } else if (roll < 0.6) {
          reasoning.push(t);
          events.push(rawReasoning(otherSpelling(t, r), key));
        } else if (roll < 0.8) {
          // Both names (the same text), or reasoning with content: not a plain delta, the full parse.
          reasoning.push(t);
          if (r.next() < 0.5) events.push(chunk({ reasoning: t, reasoning_content: t }));
          else {
            events.push(chunk({ [key]: t, content: "x" }));
            answered = true;
          }
        } else if (roll < 0.95) {
          events.push(chunk({ content: t }));
          answered = true;
        } else {
          events.push(rawReasoning(t, key));
          spliced = true;
        }
      }
      events.push(chunk({}, r.next() < 0.5 ? "stop" : "length"), USAGE, DONE);
      const { w, byBytes: b } = sameWholeAndSplit(run, events);
      byBytes += b;
      // Reasoning only (nothing spliced): the deltas are the texts, and the item's text is their join.
      if (!spliced && !answered) {
        expect(deltasOf(w.text, "response.reasoning_text.delta")).toEqual(reasoning.filter((t) => t !== ""));
        const item = w.finals[0]?.output.find((o) => o.type === "reasoning");
        if (reasoning.join("") !== "") expect(item?.type === "reasoning" && item.content[0]?.text).toBe(reasoning.join(""));
      }
    }
    expect(byBytes).toBeGreaterThan(400);
  });

  test("a client gone, or the stream failed, mid-reasoning: the Response has the reasoning so far, bytes and decoded pieces joined", () => {
    for (const end of ["cancel", "fail"] as const) {
      const finals: ResponseObject[] = [];
      const tf = responsesTransform(meta({ store: false }), (r) => {
        finals.push(r);
      });
      tf.start();
      for (const e of [ROLE, chunk({ reasoning_content: "caf" }), rawReasoning("\\u00e9 "), chunk({ reasoning: "ok" })]) tf.events([Buffer.from(e)]);
      if (end === "cancel") tf.cancel();
      else tf.fail("gone");
      expect(finals).toHaveLength(1);
      expect(finals[0]?.output).toMatchObject([{ type: "reasoning", status: "incomplete", content: [{ type: "reasoning_text", text: "café ok" }] }]);
    }
  });
});

describe("isRoleChunk: the answer's opening role chunk passed over without being decoded", () => {
  const TAIL = ',"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}';
  test("vLLM's (and the simulator's, through the relay) is taken; it causes no event", () => {
    const b = Buffer.from(ROLE);
    expect(isRoleChunk(b, 6, b.length - 2)).toBe(true);
    const tf = responsesTransform(meta({ store: false }), () => {});
    tf.start();
    expect(tf.events([b])).toBe("");
  });

  test("taken only when the whole chunk is JSON whose choice 0 is the empty role delta, with no usage or error (random prefixes)", () => {
    const r = rng(SEED + 6);
    const MEMBERS = ['"id":"chatcmpl-1"', '"object":"chat.completion.chunk"', '"created":1732000000', '"created":0', '"model":"m"', '"model":"é\\"\\\\"', '"n":null', '"a":01', '"b":-1', '"c":1.5', '"d":true', '"e":{}', '"f":[]', ' "g":1', '"h" :1', '"i": 1', '"usage":null', '"usage":{"prompt_tokens":1}', '"object":"error"', '"error":"x"', '"k":"\\u0041"', '"k":"a\nb"', '"k', '"k":"x', '"k":', ":1", '"choices":"x"', '"choices":[]', '"\\ud83d":1'];
    let taken = 0;
    for (let i = 0; i < 4_000; i++) {
      const n = r.int(5);
      const members: string[] = [];
      for (let j = 0; j < n; j++) members.push(r.pick(MEMBERS));
      const sep = r.next() < 0.9 ? "," : r.pick([", ", ",,", ""]);
      const prefix = `{${members.join(sep)}`;
      const tail = r.next() < 0.9 ? TAIL : r.pick([TAIL.replace('""', '"x"'), TAIL.replace("null}", '"stop"}'), `${TAIL} `, TAIL.replace("assistant", "user")]);
      const b = Buffer.from(`data: ${prefix}${tail}\n\n`);
      const ok = isRoleChunk(b, 6, b.length - 2);
      let parsed: unknown;
      try {
        parsed = JSON.parse(b.toString("utf8", 6, b.length - 2));
      } catch {
        parsed = undefined;
      }
      const v = parsed as { usage?: unknown; error?: unknown; object?: unknown; choices?: unknown } | undefined;
      const isObj = (x: unknown) => typeof x === "object" && x !== null && !Array.isArray(x);
      if (ok) {
        taken++;
        expect({ prefix, tail, parsed: parsed !== undefined }).toEqual({ prefix, tail, parsed: true });
        expect({ prefix, choices: v?.choices, usage: isObj(v?.usage), error: isObj(v?.error) || v?.object === "error" }).toEqual({
          prefix,
          choices: [{ index: 0, delta: { role: "assistant", content: "" }, logprobs: null, finish_reason: null }],
          usage: false,
          error: false,
        });
      }
      // Whichever path reads it, the stream's events are the same.
      const events = [b, chunk({ content: "x" }), chunk({}, "stop"), DONE];
      expect({ prefix, tail, out: normalise(whole(events).text) }).toEqual({ prefix, tail, out: normalise(split(events).text) });
    }
    expect(taken).toBeGreaterThan(200);
  });
});
