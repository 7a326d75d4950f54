import { writeSync } from "node:fs";

/**
 * JSON-lines logger on stdout. A tiny writer instead of pino: pino's
 * transports use worker threads, which the compiled executable would have to
 * carry separately; JSON lines batched per event-loop turn are all we need.
 */
export type Level = "debug" | "info" | "warn" | "error" | "silent";
const RANK: Record<Level, number> = { debug: 10, info: 20, warn: 30, error: 40, silent: 100 };

export interface Logger {
  debug(msg: string, fields?: Record<string, unknown>): void;
  info(msg: string, fields?: Record<string, unknown>): void;
  warn(msg: string, fields?: Record<string, unknown>): void;
  error(msg: string, fields?: Record<string, unknown>): void;
  enabled(level: Level): boolean;
}

/**
 * Lines written in one turn of the event loop go out in one write: at
 * thousands of requests a second, a write call per access-log line was a
 * measurable share of the request thread. What is buffered is written at the
 * end of the turn, and on exit.
 */
let pending: string[] = [];
let scheduled = false;
function takePending(): string {
  const text = pending.length === 1 ? (pending[0] as string) : pending.join("");
  pending = [];
  return text;
}
/**
 * Output with nowhere to go is dropped: the terminal `serve` ran in was
 * closed (EIO: the SIGHUP that ends it gracefully comes with it), or whatever
 * read the output is gone (EPIPE). Unhandled, the write's error could end the
 * process in the middle of that graceful stop, with usage still to write; and
 * the exit handler's write threw, turning the stop's exit 0 into 1.
 */
let stdoutGone = false;
process.stdout.on("error", () => {
  stdoutGone = true;
});
process.stderr.on("error", () => {});
function flushStdout(): void {
  scheduled = false;
  if (pending.length === 0) return;
  const text = takePending();
  if (!stdoutGone) process.stdout.write(text);
}
// At exit there is no later turn: write what is left synchronously.
process.on("exit", () => {
  if (pending.length === 0 || stdoutGone) return;
  try {
    writeSync(1, takePending());
  } catch {
    // Nowhere to write it (above); the exit code stays the command's.
  }
});
function bufferedStdout(line: string): void {
  pending.push(line);
  if (!scheduled) {
    scheduled = true;
    setImmediate(flushStdout);
  }
}

/** The ISO time of the current millisecond, formatted once however many lines share it. */
let lastMs = -1;
let lastIso = "";
function isoNow(): string {
  const ms = Date.now();
  if (ms !== lastMs) {
    lastMs = ms;
    lastIso = new Date(ms).toISOString();
  }
  return lastIso;
}

export function createLogger(level: Level, write: (line: string) => void = bufferedStdout): Logger {
  const min = RANK[level];
  const emit = (lvl: Exclude<Level, "silent">, msg: string, fields?: Record<string, unknown>) => {
    if (RANK[lvl] < min) return;
    write(`${JSON.stringify({ time: isoNow(), level: lvl, msg, ...fields })}\n`);
  };
  return {
    debug: (m, f) => emit("debug", m, f),
    info: (m, f) => emit("info", m, f),
    warn: (m, f) => emit("warn", m, f),
    error: (m, f) => emit("error", m, f),
    enabled: (l) => RANK[l] >= min,
  };
}
