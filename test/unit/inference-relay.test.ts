import { describe, expect, test } from "bun:test";
import fc from "fast-check";
import { errorBody } from "../../src/http/errors.ts";
import { type EndableStream, relayStream, type StreamEnd } from "../../src/inference/stream.ts";
import { Breaker } from "../../src/inference/upstream/breaker.ts";
import { upstreamMessage } from "../../src/inference/upstream/error-body.ts";
import type { ByteReader, Opened, Target } from "../../src/inference/upstream/index.ts";
import { originOf } from "../../src/inference/upstream/origin.ts";
import { createConnectProbe } from "../../src/inference/upstream/probe.ts";
import { C, chunkText, cut, SPEC_ROWS, specData } from "../helpers/sse-spec.ts";

const enc = new TextEncoder();
const UP = "org/upstream-model";

function chunk(content: string | null, extra = ""): string {
  const delta = content === null ? "{}" : `{"content":${JSON.stringify(content)}}`;
  return `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"${UP}","choices":[{"index":0,"delta":${delta},"finish_reason":null}]${extra}}\n\n`;
}
const USAGE = `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"${UP}","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n`;
const DONE = "data: [DONE]\n\n";

/** An Opened over scripted reads; `null` in the script means "fail this read", a number means "hang", a promise "wait for it". */
function fakeOpened(parts: (string | Uint8Array | null | number | Promise<string>)[]) {
  const calls = { aborted: [] as string[], finished: [] as (boolean | null)[], detached: 0 };
  let i = 1;
  let reject: ((e: unknown) => void) | undefined;
  // Like a real upstream request: once aborted, every later read fails too.
  let abortedWith: string | undefined;
  const reader: ByteReader = {
    read() {
      if (abortedWith !== undefined) return Promise.reject(new Error(abortedWith));
      const p = parts[i++];
      if (p === undefined) return Promise.resolve({ done: true });
      if (p === null) return Promise.reject(new Error("reset"));
      if (typeof p === "number") return new Promise((_, rej) => (reject = rej));
      if (p instanceof Promise) {
        return new Promise((res, rej) => {
          reject = rej;
          void p.then((v) => res({ done: false, value: enc.encode(v) }));
        });
      }
      return Promise.resolve({ done: false, value: typeof p === "string" ? enc.encode(p) : p });
    },
    cancel() {
      reject?.(new Error("cancelled"));
      return Promise.resolve();
    },
  };
  const target = { modelField: enc.encode(`"model":${JSON.stringify(UP)}`), label: "t" } as unknown as Target;
  const opened: Opened = {
    target,
    reader,
    first: parts[0] instanceof Uint8Array ? parts[0] : enc.encode(String(parts[0])),
    abort(reason) {
      calls.aborted.push(reason);
      abortedWith ??= reason;
      reject?.(new Error(reason));
    },
    finish(ok) {
      calls.finished.push(ok);
    },
    detach() {
      calls.detached++;
    },
  };
  return { opened, calls };
}

async function relay(parts: (string | Uint8Array | null | number)[], opts: { clientWantsUsage?: boolean; idleMs?: number; maxTextBytes?: number } = {}) {
  const { opened, calls } = fakeOpened(parts);
  let ended: StreamEnd | undefined;
  const s = relayStream(opened, {
    alias: "svc-fast",
    clientWantsUsage: opts.clientWantsUsage ?? false,
    idleMs: opts.idleMs ?? 10_000,
    signal: new AbortController().signal,
    errorBody,
    ...(opts.maxTextBytes !== undefined ? { maxTextBytes: opts.maxTextBytes } : {}),
    onEnd: (e) => {
      ended = e;
    },
  });
  const out: string[] = [];
  const reader = s.getReader();
  for (;;) {
    const r = await reader.read();
    if (r.done) break;
    out.push(new TextDecoder().decode(r.value));
  }
  return { out, text: out.join(""), ended, calls };
}

/** Splits a string into pieces of `n` characters (ASCII here, so bytes too). */
/** Waits until `check` holds (at most `ms`). */
async function until(check: () => boolean, ms = 5_000): Promise<void> {
  const deadline = performance.now() + ms;
  while (!check()) {
    if (performance.now() > deadline) throw new Error("condition not met in time");
    await Bun.sleep(5);
  }
}

const pieces = (s: string, n: number) => Array.from({ length: Math.ceil(s.length / n) }, (_, k) => s.slice(k * n, k * n + n));

describe("relayStream", () => {
  const whole = chunk("Hel") + chunk("lo") + chunk(null, ',"x":1') + USAGE + DONE;
  const expected = (whole.replaceAll(`"model":"${UP}"`, '"model":"svc-fast"')).replace(USAGE.replace(UP, "svc-fast"), "");

  test("swaps the model id, drops the usage-only chunk, keeps the usage for metering", async () => {
    const r = await relay([whole]);
    expect(r.text).toBe(expected);
    expect(r.ended?.outcome).toBe("done");
    expect(r.ended?.usage).toEqual({ promptTokens: 7, completionTokens: 3 });
    expect(r.calls.finished).toEqual([true]);
  });

  test("events split at any byte boundary come out whole and unchanged", async () => {
    for (const n of [1, 2, 3, 7, 50]) {
      const r = await relay(pieces(whole, n));
      expect(r.text).toBe(expected);
      // Every chunk the client gets is one or more complete events.
      for (const o of r.out) expect(o.endsWith("\n\n")).toBe(true);
    }
  });

  test("a stream cut in two at every byte, \\n\\n and \\r\\n\\r\\n alike, comes out unchanged", async () => {
    const cases: [string, string][] = [
      [whole, expected],
      [whole.replaceAll("\n\n", "\r\n\r\n"), expected.replaceAll("\n\n", "\r\n\r\n")],
    ];
    for (const [input, want] of cases) {
      for (let at = 1; at < input.length; at++) {
        const r = await relay([input.slice(0, at), input.slice(at)]);
        expect(r.text).toBe(want);
      }
    }
  });

  test("events with other fields, comment lines, data over several lines or bare CR line ends come out as plain data events, cut anywhere, and are metered", async () => {
    /** `whole` with each event framed by `frame` (its data, its line end). */
    const reframe = (frame: (data: string, nl: string) => string, nl: string) =>
      whole
        .split("\n\n")
        .filter((e) => e !== "")
        .map((e) => frame(e.slice("data: ".length), nl))
        .join("");
    const cases: [string, string, string][] = [
      ["event: and id: lines", reframe((d, nl) => `event: message${nl}id: 3${nl}data: ${d}${nl}${nl}`, "\n"), expected],
      ["a field after the data", reframe((d, nl) => `data: ${d}${nl}retry: 10${nl}${nl}`, "\n"), expected],
      ["a comment line in the event", reframe((d, nl) => `: c${nl}data: ${d}${nl}${nl}`, "\n"), expected],
      ["data split at its commas", reframe((d, nl) => `data: ${d.replaceAll(",", `,${nl}data: `)}${nl}${nl}`, "\n"), expected],
      ["CRLF with an event: line", reframe((d, nl) => `event: m${nl}data: ${d}${nl}${nl}`, "\r\n"), expected.replaceAll("\n\n", "\r\n\r\n")],
      ["bare CR line ends", reframe((d, nl) => `data: ${d}${nl}${nl}`, "\r"), expected],
      ["bare CR with an event: line", reframe((d, nl) => `event: m${nl}data: ${d}${nl}${nl}`, "\r"), expected],
    ];
    for (const [name, input, want] of cases) {
      for (let at = 1; at < input.length; at += 7) {
        const r = await relay([input.slice(0, at), input.slice(at)]);
        expect(r.text, `${name}, cut at ${at}`).toBe(want);
        expect(r.ended?.usage, name).toEqual({ promptTokens: 7, completionTokens: 3 });
        expect(r.ended?.outcome, name).toBe("done");
      }
    }
    // Fields without data are not events a chat client reads: dropped; comments alone are keep-alives: passed on.
    const r = await relay(["event: ping\nid: 4\n\n: keep\n\n", chunk("a") + DONE]);
    expect(r.text).toBe(`: keep\n\n${chunk("a").replace(UP, "svc-fast")}${DONE}`);
  });

  test("pending bytes without an event separator are capped from the first byte: error event, upstream aborted", async () => {
    const block = "x".repeat(1024 * 1024);
    const r = await relay(["data: ", ...Array.from({ length: 20 }, () => block)]);
    expect(r.text).toContain("oversized SSE event");
    expect(r.ended?.outcome).toBe("failed");
    expect(r.calls.aborted.length).toBe(1);
  });

  test("usage reaches the client when asked for", async () => {
    const r = await relay([whole], { clientWantsUsage: true });
    expect(r.text).toContain('"usage":{"prompt_tokens":7');
    expect(r.text).toContain('"choices":[],"usage"');
  });

  test("\\r\\n\\r\\n-terminated events (sse-starlette servers)", async () => {
    const crlf = whole.replaceAll("\n\n", "\r\n\r\n");
    const r = await relay(pieces(crlf, 5));
    expect(r.text).toBe(expected.replaceAll("\n\n", "\r\n\r\n"));
  });

  test("a cut-off stream: error event, no usage, delivered text counted", async () => {
    const r = await relay([chunk("abcdefgh"), chunk('q\\"uote'), null]);
    const last = r.out.at(-1) ?? "";
    expect(last.startsWith('data: {"error":{')).toBe(true);
    expect(JSON.parse(last.slice(6)).error.code).toBe("service_unavailable");
    expect(r.ended?.outcome).toBe("failed");
    expect(r.ended?.usage).toBeUndefined();
    // "abcdefgh" + q\"uote: the text's UTF-8 bytes, not its escapes as sent (9 bytes before)
    expect(r.ended?.deliveredChars).toBe(8 + 7);
    expect(r.calls.finished).toEqual([false]);
  });

  test("maxTextBytes bounds the text's bytes as sent (escapes included), though it is charged its UTF-8 bytes", async () => {
    // 100 control characters: 100 bytes of text, sent (and written again as JSON by the Responses API) as 600.
    const text = "\u0001".repeat(100);
    const r = await relay([chunk(text), chunk(text), DONE], { maxTextBytes: 1_000 });
    expect(r.ended?.outcome).toBe("failed");
    expect(r.text).toContain("larger than 1000 bytes");
    // The first event was delivered: 100 bytes of text.
    expect(r.ended?.deliveredChars).toBe(100);
    const passes = await relay([chunk(text), DONE], { maxTextBytes: 600 });
    expect([passes.ended?.outcome, passes.ended?.deliveredChars]).toEqual(["done", 100]);
  });

  test("a stream that ends without [DONE] is reported as failed", async () => {
    const r = await relay([chunk("a"), chunk(null)]);
    expect(r.out.at(-1)).toContain('"error"');
    expect(r.ended?.outcome).toBe("failed");
  });

  test("an upstream error event is translated into our shape", async () => {
    const r = await relay([chunk("a"), 'data: {"error": {"object": "error", "message": "boom", "type": "X", "param": null, "code": 500}}\n\n', chunk("never")]);
    expect(r.out.length).toBe(2);
    const err = JSON.parse((r.out[1] ?? "").slice(6)).error;
    expect(err.message).toContain("boom");
    expect(err.code).toBe("service_unavailable");
    expect(r.text).not.toContain("never");
  });

  test("the model id is swapped with Python's spaced separators too", async () => {
    const spaced = `data: {"id": "c1", "model": "${UP}", "choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n${DONE}`;
    const r = await relay([spaced]);
    expect(r.text).toContain('"model":"svc-fast"');
    expect(r.text).not.toContain(UP);
  });

  test("comments and keep-alives pass through", async () => {
    const r = await relay([": keep-alive\n\n", chunk("a") + DONE]);
    expect(r.text.startsWith(": keep-alive\n\n")).toBe(true);
  });

  test("idle upstream: aborted after idleMs, error event", async () => {
    const t0 = performance.now();
    const r = await relay([chunk("a"), 1], { idleMs: 60 });
    expect(performance.now() - t0).toBeGreaterThanOrEqual(55);
    expect(r.calls.aborted[0]).toContain("idle");
    expect(r.out.at(-1)).toContain("stopped sending");
    expect(r.ended?.outcome).toBe("failed");
  });

  test("client cancel aborts the upstream and ends without a verdict", async () => {
    const { opened, calls } = fakeOpened([chunk("a"), 1]);
    let ended: StreamEnd | undefined;
    const s = relayStream(opened, { alias: "svc-fast", clientWantsUsage: false, idleMs: 10_000, signal: new AbortController().signal, errorBody, onEnd: (e) => (ended = e) });
    const reader = s.getReader();
    await reader.read();
    await reader.cancel();
    expect(calls.aborted).toEqual(["client disconnected"]);
    expect(ended?.outcome).toBe("client_gone");
    expect(calls.finished).toEqual([null]);
  });

  test("ended by the gateway (shutdown): error event, clean close, no verdict on the upstream, deregistered", async () => {
    const { opened, calls } = fakeOpened([chunk("a"), 1]);
    const open = new Set<EndableStream>();
    let ended: StreamEnd | undefined;
    const s = relayStream(opened, { alias: "svc-fast", clientWantsUsage: false, idleMs: 10_000, signal: new AbortController().signal, errorBody, onEnd: (e) => (ended = e), open });
    const reader = s.getReader();
    const dec = new TextDecoder();
    let text = dec.decode((await reader.read()).value);
    expect(open.size).toBe(1);
    for (const stream of open) stream.endStream("shutting down");
    for (;;) {
      const r = await reader.read();
      if (r.done) break;
      text += dec.decode(r.value);
    }
    expect(text.endsWith(`data: {"error":{"message":"shutting down","type":"service_unavailable","param":null,"code":"service_unavailable"}}\n\n`)).toBe(true);
    expect(ended?.outcome).toBe("ended");
    expect(ended?.deliveredChars).toBe(1);
    expect(calls.aborted[0]).toBe("shutting down");
    expect(calls.finished).toEqual([null]);
    expect(open.size).toBe(0);
  });
});

describe("relayStream reads SSE as the standard does (test/helpers/sse-spec.ts)", () => {
  /** Data compared as JSON where it is JSON: the relay puts a JSON text split over `data:` lines back on one line. */
  const norm = (d: string) => {
    try {
      return JSON.stringify(JSON.parse(d));
    } catch {
      return d;
    }
  };
  /** What the client reads of the relayed stream: its events' data, the relay's own error event at the end (no [DONE] came) left out. */
  const relayed = async (parts: Uint8Array[]) => {
    const data = specData((await relay(parts)).text);
    if (data.at(-1)?.startsWith('{"error"')) data.pop();
    return data.map(norm);
  };

  for (const row of SPEC_ROWS) {
    test(row.name, async () => {
      const bytes = enc.encode(row.input);
      // An event with empty data is nothing a chat client can read (the SDKs parse every event's data as JSON): not relayed.
      const want = row.data.filter((d) => d !== "").map(norm);
      expect(await relayed([bytes]), "whole").toEqual(want);
      for (let at = 1; at < bytes.length; at++) expect(await relayed(cut(bytes, [at])), `cut at ${at}`).toEqual(want);
      expect(await relayed(cut(bytes, Array.from(bytes.keys()))), "a byte a read").toEqual(want);
    });
  }
});

describe("relayStream: any stream read in pieces gives what it gives read whole", () => {
  const nl = fc.constantFrom("\n", "\r\n", "\r");
  /** One chunk's event, framed any way SSE allows: its line ends, other fields, comments, its data over one or two lines. */
  const event = fc.record({
    text: fc.constantFrom("a", "é", "😀", ""),
    comment: fc.boolean(),
    field: fc.constantFrom("", "event: message", "id: 1", "retry: 10", "event"),
    split: fc.boolean(),
    ends: fc.array(nl, { minLength: 4, maxLength: 4 }),
  });
  const stream = fc.record({ bom: fc.boolean(), lead: fc.array(nl, { maxLength: 2 }), events: fc.array(event, { maxLength: 6 }), done: nl });

  test("the same data reach the client however the reads fall (inside a CRLF, a character, a byte order mark), and the text is what the standard reads", async () => {
    await fc.assert(
      fc.asyncProperty(stream, fc.array(fc.nat({ max: 2_000 }), { maxLength: 10 }), async (s, at) => {
        const text =
          (s.bom ? "\uFEFF" : "") +
          s.lead.join("") +
          s.events
            .map((e) => {
              const [a = "\n", b = "\n", c = "\n", d = "\n"] = e.ends;
              const data = C(e.text);
              const lines = e.split ? `data: ${data.slice(0, 12)}${a}data: ${data.slice(12)}${b}` : `data: ${data}${a}`;
              // The blank line's own end: after a CR, an LF would only finish that line end (CRLF), so a CRLF.
              const blank = (e.split ? b : a) === "\r" && d === "\n" ? "\r\n" : d;
              return `${e.comment ? `: note${c}` : ""}${e.field ? `${e.field}${c}` : ""}${lines}${blank}`;
            })
            .join("") +
          `data: [DONE]${s.done}${s.done}`;
        const bytes = enc.encode(text);
        const whole = specData((await relay([bytes])).text);
        expect(whole.at(-1)).toBe("[DONE]");
        expect(whole.slice(0, -1).map((d) => chunkText(d)).join("")).toBe(s.events.map((e) => e.text).join(""));
        expect(specData((await relay(cut(bytes, at))).text)).toEqual(whole);
      }),
      { numRuns: 400 },
    );
  });
});

describe("relayStream: a client that leaves once the answer is complete", () => {
  const event = (k: number, delta: string, finish: string | null) =>
    `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"${UP}","choices":[{"index":${k},"delta":${delta},"finish_reason":${JSON.stringify(finish)}}]}\n\n`;
  const text = (k: number, content: string) => event(k, `{"content":${JSON.stringify(content)}}`, null);
  const finish = (k: number) => event(k, "{}", "stop");

  /** Relays `parts` (`choices` of them) to a reader that reads until `until` has come `times` times, then cancels (the client leaves). */
  async function leave(parts: (string | number | Promise<string>)[], until: string, choices = 1, times = choices) {
    const { opened, calls } = fakeOpened(parts);
    const end: { value?: StreamEnd } = {};
    const s = relayStream(opened, { alias: "svc-fast", clientWantsUsage: false, idleMs: 10_000, signal: new AbortController().signal, errorBody, onEnd: (e) => (end.value = e), choices });
    const reader = s.getReader();
    let got = "";
    while (got.split(until).length - 1 < times) {
      const r = await reader.read();
      if (r.done) throw new Error("ended early");
      got += new TextDecoder().decode(r.value);
    }
    await reader.cancel();
    return { calls, end };
  }

  test("the usage that comes after the client left is read and charged; the upstream is not aborted", async () => {
    let release: (s: string) => void = () => {};
    const later = new Promise<string>((r) => (release = r));
    const { calls, end } = await leave([text(0, "Hello") + finish(0), later], '"finish_reason":"stop"');
    expect(calls.detached).toBe(1);
    expect(calls.aborted).toEqual([]);
    expect(end.value).toBeUndefined();
    release(USAGE + DONE);
    await until(() => end.value !== undefined);
    expect(end.value).toMatchObject({ outcome: "client_gone", usage: { promptTokens: 7, completionTokens: 3 }, deliveredChars: 5 });
    expect(calls.aborted).toEqual([]);
    expect(calls.finished).toEqual([null]);
  });

  test("no usage within DRAIN_MS: the upstream is cut and the stream ends without the upstream's count (charged by estimate)", async () => {
    const t0 = performance.now();
    const { calls, end } = await leave([text(0, "Hello") + finish(0), 1], '"finish_reason":"stop"');
    await Bun.sleep(300);
    expect(end.value).toBeUndefined();
    await until(() => end.value !== undefined);
    expect(performance.now() - t0).toBeGreaterThanOrEqual(950);
    expect(end.value).toMatchObject({ outcome: "client_gone", usage: undefined, deliveredChars: 5 });
    expect(calls.aborted).toEqual(["client disconnected"]);
  });

  test("more than DRAIN_BYTES without the usage: cut at once", async () => {
    const { calls, end } = await leave([text(0, "Hello") + finish(0), Promise.resolve(": keep-alive\n\n".repeat(6_000))], '"finish_reason":"stop"');
    await until(() => end.value !== undefined, 500);
    expect(end.value).toMatchObject({ outcome: "client_gone", usage: undefined });
    expect(calls.aborted).toEqual(["client disconnected"]);
  });

  test("the answer not complete (one of two choices finished): the upstream is aborted at once", async () => {
    const { calls, end } = await leave([text(0, "a") + finish(0) + text(1, "b"), 1], '"content":"b"', 2, 1);
    expect(calls.detached).toBe(0);
    expect(calls.aborted).toEqual(["client disconnected"]);
    expect(end.value?.outcome).toBe("client_gone");
  });

  test("both of two choices finished: the usage is waited for", async () => {
    let release: (s: string) => void = () => {};
    const later = new Promise<string>((r) => (release = r));
    const { calls, end } = await leave([text(0, "a") + text(1, "b") + finish(0) + finish(1), later], '"finish_reason":"stop"', 2);
    expect(calls.detached).toBe(1);
    expect(calls.aborted).toEqual([]);
    release(USAGE + DONE);
    await until(() => end.value !== undefined);
    expect(end.value).toMatchObject({ outcome: "client_gone", usage: { promptTokens: 7, completionTokens: 3 } });
  });

  test("the usage came with the finish: nothing to wait for, the upstream is aborted at once and its count charged", async () => {
    const withUsage = finish(0).replace("]}\n\n", '],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n');
    const { calls, end } = await leave([text(0, "Hello") + withUsage, 1], '"finish_reason":"stop"');
    expect(calls.aborted).toEqual(["client disconnected"]);
    expect(end.value).toMatchObject({ outcome: "client_gone", usage: { promptTokens: 7, completionTokens: 3 } });
  });
});

describe("relayStream model swap across streams", () => {
  /** Relays `parts` with `target` (shared between calls, as one configured target is) under `alias`. */
  async function relayAs(target: Target, alias: string, parts: string[]): Promise<string> {
    const { opened } = fakeOpened(parts);
    const s = relayStream({ ...opened, target }, { alias, clientWantsUsage: true, idleMs: 10_000, signal: new AbortController().signal, errorBody, onEnd: () => {} });
    return new Response(s).text();
  }

  test("one target under several aliases: each stream names its own alias, both separators' spacing, and an alias equal to the model is left alone", async () => {
    const target = { modelField: enc.encode(`"model":${JSON.stringify(UP)}`), label: "t" } as unknown as Target;
    const spaced = chunk("x").replace(`"model":"${UP}"`, `"model": "${UP}"`);
    for (const alias of ["svc-fast", "svc-smart", UP, "svc-fast"]) {
      const text = await relayAs(target, alias, [chunk("x"), spaced, USAGE, DONE]);
      expect(text.split(`"model":${JSON.stringify(alias)}`).length - 1).toBe(alias === UP ? 2 : 3);
      if (alias !== UP) expect(text).not.toContain(UP);
      else expect(text).toContain(`"model": "${UP}"`);
    }
  });
});

describe("relayStream: a server that names another model than the one it was sent", () => {
  /** The stream's events naming `name` (a JSON value's text) where vLLM names UP. */
  const naming = (name: string) => (chunk("Hel") + chunk("lo") + USAGE + DONE).replaceAll(`"model":"${UP}"`, `"model":${name}`);
  const want = (chunk("Hel") + chunk("lo") + USAGE + DONE).replaceAll(`"model":"${UP}"`, '"model":"svc-fast"');

  test("any name (escaped quotes and backslashes, null, spaced) is the alias in every event, the stream cut in two at every byte", async () => {
    for (const name of ['"some-other-name"', '"ad\\"ap\\\\ter\\u00e9/x"', "null", ' "tgi/model"', '"\\\\"', '"model\\":\\"x"']) {
      const input = naming(name);
      expect((await relay([input], { clientWantsUsage: true })).text, name).toBe(want);
      for (let at = 1; at < input.length; at++) {
        expect((await relay([input.slice(0, at), input.slice(at)], { clientWantsUsage: true })).text, `${name} cut at ${at}`).toBe(want);
      }
    }
  });
});

describe("upstreamMessage", () => {
  test("reads every upstream error shape, never returns the shape", () => {
    expect(upstreamMessage('{"object":"error","message":"legacy","type":"BadRequestError","param":null,"code":400}').message).toBe("legacy");
    expect(upstreamMessage('{"error":{"message":"nested","type":"x","param":"top_p","code":400}}')).toEqual({ message: "nested", param: "top_p" });
    expect(upstreamMessage('{"detail":[{"msg":"field required"},{"msg":"bad"}]}').message).toBe("field required; bad");
    expect(upstreamMessage('{"error":"Unauthorized"}').message).toBe("Unauthorized");
    expect(upstreamMessage("plain text").message).toBe("plain text");
    expect(upstreamMessage("").message).toContain("rejected");
    expect(upstreamMessage(JSON.stringify({ message: "x".repeat(5000) })).message.length).toBeLessThan(1100);
  });
});

describe("Breaker", () => {
  test("closed → open after N failures → half-open after the cool-down, one probe at a time", () => {
    const b = new Breaker({ failures: 2, cooldownMs: 100 });
    expect(b.failure(0)).toBe(false);
    expect(b.state(0)).toBe("closed");
    expect(b.failure(1)).toBe(true);
    expect(b.available(50)).toBe(false);
    expect(b.state(101)).toBe("half-open");
    expect(b.available(101)).toBe(true);
    b.acquire(101);
    expect(b.available(102)).toBe(false);
    // The probe fails: open again for a full cool-down.
    expect(b.failure(110)).toBe(true);
    expect(b.available(200)).toBe(false);
    b.acquire(211);
    b.success();
    expect(b.state(212)).toBe("closed");
  });

  test("a success resets the count; a probe without verdict frees the slot", () => {
    const b = new Breaker({ failures: 2, cooldownMs: 100 });
    b.failure(0);
    b.success();
    expect(b.failure(1)).toBe(false);
    expect(b.failure(2)).toBe(true);
    b.acquire(150);
    expect(b.available(150)).toBe(false);
    b.release();
    expect(b.available(150)).toBe(true);
  });
});

describe("connect probe", () => {
  test("times out a connect that never completes; shares one probe; skips fresh origins", async () => {
    let connects = 0;
    let t = 0;
    const probe = createConnectProbe({ freshMs: 1_000, now: () => t, connect: () => {
        connects++;
        return new Promise(() => {});
      },
    });
    const origin = originOf("http://10.0.0.9:8000/v1");
    expect(origin).toEqual({ hostname: "10.0.0.9", port: 8000, key: "10.0.0.9:8000" });
    const [x, y] = await Promise.all([probe.check(origin, 20), probe.check(origin, 20)]);
    expect([x, y]).toEqual(["timeout", "timeout"]);
    expect(connects).toBe(1);
    probe.alive(origin);
    expect(probe.check(origin, 20)).toBeUndefined();
    t = 2_000;
    expect(probe.check(origin, 20)).toBeInstanceOf(Promise);
  });

  test("refused and ok", async () => {
    const refused = createConnectProbe({ connect: () => Promise.reject(new Error("ECONNREFUSED")) });
    expect(await refused.check(originOf("https://example.com/v1"), 50)).toBe("refused");
    const ok = createConnectProbe({ connect: () => Promise.resolve() });
    const o = originOf("https://[::1]/v1");
    expect(o.port).toBe(443);
    expect(o.hostname).toBe("::1");
    expect(await ok.check(o, 50)).toBe("ok");
    expect(ok.check(o, 50)).toBeUndefined();
  });
});
