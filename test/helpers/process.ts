import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import postgres from "postgres";

/**
 * Helpers for tests that run the gateway as a real process (CLI, shutdown,
 * compiled binary): spawn with a clean environment, read output as it comes,
 * wait for readiness, and make throwaway folders and Postgres databases.
 */

export const ROOT = resolve(import.meta.dir, "../..");
export const MAIN = join(ROOT, "src/main.ts");
/** The Bun running the tests: `bun run src/main.ts` with the same version. */
export const BUN = process.execPath;

/**
 * A minimal environment: the developer's own DATABASE_URL, GATEWAY_CONFIG,
 * UPSTREAM_BASE_URL, PORT … must not leak into a spawned gateway.
 */
export function cleanEnv(extra: Record<string, string | undefined> = {}): Record<string, string> {
  const env: Record<string, string> = {};
  for (const k of ["PATH", "HOME", "TMPDIR", "LANG", "TZ"]) {
    const v = process.env[k];
    if (v !== undefined) env[k] = v;
  }
  // Gateways started by tests never take the default metrics port (9464): any free one.
  env.METRICS_LISTEN = "127.0.0.1:0";
  for (const [k, v] of Object.entries(extra)) if (v !== undefined) env[k] = v;
  return env;
}

/**
 * A port that was free a moment ago. Racy (another process may take it before
 * the child binds it): prefer `--port 0` and `listeningUrl()`.
 */
export function freePort(): number {
  const s = Bun.serve({ port: 0, hostname: "127.0.0.1", fetch: () => new Response() });
  const port = s.port;
  s.stop(true);
  if (port === undefined) throw new Error("no port");
  return port;
}

const scratch: string[] = [];
/** An empty temporary folder, removed by `removeScratch()`. */
export function scratchDir(prefix = "gw-test-"): string {
  const dir = mkdtempSync(join(tmpdir(), prefix));
  scratch.push(dir);
  return dir;
}
export function removeScratch() {
  for (const d of scratch.splice(0)) rmSync(d, { recursive: true, force: true });
}

export interface RunResult {
  code: number;
  stdout: string;
  stderr: string;
}

export interface RunOptions {
  cwd?: string;
  env?: Record<string, string>;
  timeoutMs?: number;
  stdin?: string;
}

/** Run a command to completion. */
export async function run(cmd: string[], opts: RunOptions = {}): Promise<RunResult> {
  const p = Bun.spawn(cmd, {
    cwd: opts.cwd ?? ROOT,
    env: opts.env ?? cleanEnv(),
    stdin: opts.stdin === undefined ? "ignore" : new Blob([opts.stdin]),
    stdout: "pipe",
    stderr: "pipe",
    timeout: opts.timeoutMs ?? 60_000,
    killSignal: "SIGKILL",
  });
  const [stdout, stderr, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  return { code, stdout, stderr };
}

/** `bun run src/main.ts …` */
export function runGateway(args: string[], opts: RunOptions = {}): Promise<RunResult> {
  return run([BUN, "run", MAIN, ...args], opts);
}

export interface Proc {
  pid: number;
  /** Everything printed so far. */
  stdout(): string;
  stderr(): string;
  /** Resolves with the first stdout line matching `re`; rejects on exit or timeout. */
  waitForLine(re: RegExp, timeoutMs?: number): Promise<string>;
  kill(signal?: NodeJS.Signals): void;
  exited: Promise<number>;
}

/** The first line of `text()` matching `re`, polled until the process is done or the time is up. */
async function lineOf(re: RegExp, timeoutMs = 30_000, text: () => string, done: () => boolean, output: () => string): Promise<string> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const line = text()
      .split("\n")
      .find((l) => re.test(l));
    if (line !== undefined) return line;
    if (done()) throw new Error(`process exited before printing ${re}\n${output()}`);
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${re}\n${output()}`);
    await Bun.sleep(25);
  }
}

/** Start a long-running command, collecting its output as it arrives. */
export function start(cmd: string[], opts: Omit<RunOptions, "timeoutMs" | "stdin"> = {}): Proc {
  const p = Bun.spawn(cmd, { cwd: opts.cwd ?? ROOT, env: opts.env ?? cleanEnv(), stdin: "ignore", stdout: "pipe", stderr: "pipe" });
  let out = "";
  let err = "";
  const pump = async (s: ReadableStream<Uint8Array>, add: (t: string) => void) => {
    const dec = new TextDecoder();
    for await (const chunk of s) add(dec.decode(chunk, { stream: true }));
  };
  const outDone = pump(p.stdout, (t) => {
    out += t;
  });
  const errDone = pump(p.stderr, (t) => {
    err += t;
  });
  // `exited` resolves once the output is fully read, so assertions after it see everything.
  const exited = Promise.all([p.exited, outDone, errDone]).then(([code]) => code);
  let done = false;
  void exited.then(() => {
    done = true;
  });
  return {
    pid: p.pid,
    stdout: () => out,
    stderr: () => err,
    waitForLine: (re, timeoutMs) => lineOf(re, timeoutMs, () => out, () => done, () => `stdout:\n${out}\nstderr:\n${err}`),
    kill(signal = "SIGTERM") {
      if (!done) p.kill(signal);
    },
    exited,
  };
}

export interface TerminalProc extends Proc {
  /**
   * Close the terminal, as when the SSH session the command runs in ends: the
   * kernel sends it SIGHUP, and what it writes to the terminal after that fails (EIO).
   */
  hangUp(): void;
}

/**
 * Start a long-running command in a pseudo-terminal of its own, the way an
 * operator runs it in the foreground of a shell. What it writes (stdout and
 * stderr alike, lines ending in \r\n) is collected as stdout().
 */
export function startInTerminal(cmd: string[], opts: Omit<RunOptions, "timeoutMs" | "stdin"> = {}): TerminalProc {
  let out = "";
  const dec = new TextDecoder();
  const p = Bun.spawn(cmd, {
    cwd: opts.cwd ?? ROOT,
    env: opts.env ?? cleanEnv(),
    terminal: {
      data(_t, chunk) {
        out += dec.decode(chunk, { stream: true });
      },
    },
  });
  let done = false;
  const exited = p.exited.then((code) => {
    done = true;
    return code;
  });
  return {
    pid: p.pid,
    stdout: () => out,
    stderr: () => "",
    waitForLine: (re, timeoutMs) => lineOf(re, timeoutMs, () => out, () => done, () => `output:\n${out}`),
    kill(signal = "SIGTERM") {
      if (!done) p.kill(signal);
    },
    hangUp() {
      p.terminal?.close();
    },
    exited,
  };
}

/** `bun run src/main.ts …` in the background. */
export function startGatewayProcess(args: string[], opts: Omit<RunOptions, "timeoutMs" | "stdin"> = {}): Proc {
  return start([BUN, "run", MAIN, ...args], opts);
}

/**
 * The base URL a child `serve` (or `simulate-upstream`) bound, read from its
 * "listening" log line: children bind port 0, so no port is picked and then
 * released for them to race for.
 */
export async function listeningUrl(proc: Proc, timeoutMs = 60_000, line: RegExp = /"msg":"listening"/): Promise<string> {
  const url: unknown = JSON.parse(await proc.waitForLine(line, timeoutMs)).url;
  if (typeof url !== "string" || !/^http:\/\/[^/]+:\d+/.test(url)) throw new Error(`no listening url in the log line: ${String(url)}`);
  return url;
}

/** Poll `GET url` until it answers 200. */
export async function waitFor200(url: string, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  let last = "";
  while (Date.now() < deadline) {
    try {
      const res = await fetch(url, { signal: AbortSignal.timeout(2_000) });
      if (res.status === 200) return;
      last = `status ${res.status}`;
    } catch (e) {
      last = (e as Error).message;
    }
    await Bun.sleep(50);
  }
  throw new Error(`${url} not ready after ${timeoutMs} ms (${last})`);
}

/** Resolves with the exit code, or null if the process is still running after `ms`. */
export async function exitWithin(proc: Proc, ms: number): Promise<number | null> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const code = await Promise.race([proc.exited, new Promise<null>((r) => (timer = setTimeout(() => r(null), ms)))]);
  clearTimeout(timer);
  return code;
}

export interface ScratchPostgres {
  url: string;
  drop(): Promise<void>;
}

/**
 * A new, empty database on the server of `adminUrl` (TEST_DATABASE_URL), for
 * tests that must see migrations run from nothing; dropped by `drop()`.
 * `options` is appended to CREATE DATABASE (e.g. another encoding).
 */
export async function createScratchDatabase(adminUrl: string, prefix = "gw_scratch", options = ""): Promise<ScratchPostgres> {
  const name = `${prefix}_${crypto.randomUUID().replaceAll("-", "").slice(0, 12)}`;
  const admin = postgres(adminUrl, { max: 1, onnotice: () => {} });
  try {
    await admin.unsafe(`create database "${name}" ${options}`);
  } finally {
    await admin.end({ timeout: 5 });
  }
  const u = new URL(adminUrl);
  u.pathname = `/${name}`;
  return {
    url: u.toString(),
    async drop() {
      const a = postgres(adminUrl, { max: 1, onnotice: () => {} });
      try {
        await a.unsafe(`drop database if exists "${name}" with (force)`);
      } finally {
        await a.end({ timeout: 5 });
      }
    },
  };
}

/** Parse stdout that must be exactly one JSON document (the `--json` contract). */
export function onlyJson<T = Record<string, unknown>>(stdout: string): T {
  const trimmed = stdout.trim();
  if (!trimmed) throw new Error("stdout is empty");
  return JSON.parse(trimmed) as T;
}
