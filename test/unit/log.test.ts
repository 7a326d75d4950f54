import { describe, expect, test } from "bun:test";
import { createLogger } from "../../src/lib/log.ts";

/** The lines a logger at `level` writes for `run`. */
function lines(level: Parameters<typeof createLogger>[0], run: (log: ReturnType<typeof createLogger>) => void): string[] {
  const out: string[] = [];
  run(createLogger(level, (l) => out.push(l)));
  return out;
}

describe("log lines", () => {
  const cases: [string, Record<string, unknown> | undefined][] = [
    ["no fields", undefined],
    ["empty fields", {}],
    ["plain", { request_id: "req_1", status: 200, latency_ms: 0.42, streamed: false, alias: null }],
    ["only undefined", { a: undefined }],
    ["some undefined", { a: undefined, b: 1, c: undefined }],
    ['quotes "and" \\ backslashes', { s: 'say "hi"\\n', nested: { list: [1, "two", { three: 3 }] } }],
    ["unicode ✓ and a\nnewline", { emoji: "😀", control: "\u0001" }],
    ["a date", { at: new Date(0) }],
  ];

  test("each line is one JSON object: time, level, msg, then the fields, exactly as JSON.stringify of the merged object", () => {
    for (const [msg, fields] of cases) {
      const [line] = lines("debug", (log) => log.info(msg, fields));
      expect(line?.endsWith("\n")).toBe(true);
      const text = (line ?? "").slice(0, -1);
      const time = (JSON.parse(text) as { time: string }).time;
      expect(time).toMatch(/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/);
      expect({ msg, text }).toEqual({ msg, text: JSON.stringify({ time, level: "info", msg, ...fields }) });
    }
  });

  test("a field named like the line's own keys reads as the field's value, as the merged object did", () => {
    const [line] = lines("debug", (log) => log.warn("m", { msg: "theirs", level: "x", extra: 1 }));
    expect(JSON.parse(line ?? "")).toEqual({ time: expect.any(String), level: "x", msg: "theirs", extra: 1 });
  });

  test("levels below the logger's are not written; enabled() says which are", () => {
    const out = lines("warn", (log) => {
      log.debug("d");
      log.info("i");
      log.warn("w");
      log.error("e", { code: 1 });
      expect([log.enabled("info"), log.enabled("warn"), log.enabled("error")]).toEqual([false, true, true]);
    });
    expect(out.map((l) => (JSON.parse(l) as { level: string }).level)).toEqual(["warn", "error"]);
    expect(lines("silent", (log) => log.error("e"))).toEqual([]);
  });
});
