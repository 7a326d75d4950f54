/**
 * JSON-lines logger on stdout. A tiny writer instead of pino: pino's
 * transports use worker threads, which the compiled executable would have to
 * carry separately; one synchronous line per event is all we need.
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

export function createLogger(level: Level, write: (line: string) => void = (l) => process.stdout.write(l)): Logger {
  const min = RANK[level];
  const emit = (lvl: Exclude<Level, "silent">, msg: string, fields?: Record<string, unknown>) => {
    if (RANK[lvl] < min) return;
    write(`${JSON.stringify({ time: new Date().toISOString(), level: lvl, msg, ...fields })}\n`);
  };
  return {
    debug: (m, f) => emit("debug", m, f),
    info: (m, f) => emit("info", m, f),
    warn: (m, f) => emit("warn", m, f),
    error: (m, f) => emit("error", m, f),
    enabled: (l) => RANK[l] >= min,
  };
}
