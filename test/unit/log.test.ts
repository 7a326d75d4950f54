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

describe("the stdout writer (docs/operations.md, Logs: lines written in one turn of the event loop go out in one write, and what is left, synchronously at exit)", () => {
  const LOG = new URL("../../src/lib/log.ts", import.meta.url).pathname;

  /** Runs `body` in a child Bun with the gateway's logger at info; stdout.write calls are counted (to stderr) as they happen. */
  async function child(body: string): Promise<{ code: number; stdout: string; writes: number }> {
    const script = `
      const write = process.stdout.write.bind(process.stdout);
      process.stdout.write = (chunk, ...rest) => { process.stderr.write("W"); return write(chunk, ...rest); };
      const { createLogger } = await import(${JSON.stringify(LOG)});
      const log = createLogger("info");
      ${body}
    `;
    const p = Bun.spawn([process.execPath, "-e", script], { stdout: "pipe", stderr: "pipe", env: { PATH: process.env.PATH ?? "" } });
    const [stdout, stderr, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
    return { code, stdout, writes: [...stderr].filter((c) => c === "W").length };
  }

  test("200 lines logged in one turn: one write, every line in order", async () => {
    const r = await child(`for (let i = 0; i < 200; i++) log.info("line", { i }); await new Promise((r) => setTimeout(r, 50));`);
    expect(r.code).toBe(0);
    const lines = r.stdout.split("\n").filter(Boolean);
    expect(lines.map((l) => (JSON.parse(l) as { i: number }).i)).toEqual(Array.from({ length: 200 }, (_, i) => i));
    expect(r.writes).toBe(1);
  });

  test("lines logged just before process.exit (no later turn) are still written, exit code kept", async () => {
    const r = await child(`log.info("first"); log.error("last words", { code: 3 }); process.exit(3);`);
    expect(r.code).toBe(3);
    expect(r.stdout.split("\n").filter(Boolean).map((l) => (JSON.parse(l) as { msg: string }).msg)).toEqual(["first", "last words"]);
  });
});
