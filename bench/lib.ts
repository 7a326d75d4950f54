/** Small helpers the benchmark scripts share (each script is its own entry point). */
import { rmSync } from "node:fs";

/** The first line a child process prints (servers print their listening line as JSON first). */
export async function firstLine(stream: ReadableStream<Uint8Array>): Promise<string> {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let text = "";
  while (!text.includes("\n")) {
    const r = await reader.read();
    if (r.done) break;
    text += decoder.decode(r.value, { stream: true });
  }
  reader.releaseLock();
  return text.split("\n")[0] ?? "";
}

/** Polls `f` every 50 ms until it gives a value, or throws after `ms`. */
export async function waitFor<T>(what: string, f: () => T | undefined, ms: number): Promise<T> {
  const until = performance.now() + ms;
  for (;;) {
    const v = f();
    if (v !== undefined) return v;
    if (performance.now() > until) throw new Error(`timed out waiting for ${what}`);
    await Bun.sleep(50);
  }
}

/** The median of the finite values (NaN when there are none). */
export function median(xs: number[]): number {
  const s = xs.filter(Number.isFinite).sort((a, b) => a - b);
  if (s.length === 0) return Number.NaN;
  const m = Math.floor(s.length / 2);
  return s.length % 2 === 1 ? (s[m] ?? Number.NaN) : ((s[m - 1] ?? 0) + (s[m] ?? 0)) / 2;
}

const f2 = (n: number) => (Number.isFinite(n) ? n.toFixed(2) : "n/a");
const num = (r: Record<string, number>, k: string) => r[k] ?? Number.NaN;

/** One line of a stream load's figures (phases 2 and r). */
export const streamLine = (name: string, r: Record<string, number>) =>
  `   ${name} ${r.streams} streams (${r.failed} failed)   TTFB p50 ${f2(num(r, "ttfbP50"))} / p99 ${f2(num(r, "ttfbP99"))} ms   gap p50 ${f2(num(r, "gapP50"))} / p99 ${f2(num(r, "gapP99"))} / max ${f2(num(r, "gapMax"))} ms   events/stream ${r.eventsMin}-${r.eventsMax}   reads/stream p50 ${r.readsP50}`;

/**
 * Runs a benchmark's `main`, then stops its child processes (last started
 * first: SIGTERM, SIGKILL after `killAfterMs`) and removes its scratch
 * directory unless `keep`; exits 1 when `main` threw.
 */
export async function runBench(
  main: () => Promise<void>,
  opts: { children: ReturnType<typeof Bun.spawn>[]; dir: string; keep: boolean; killAfterMs: number },
): Promise<never> {
  let code = 0;
  try {
    await main();
  } catch (e) {
    console.error(`bench failed: ${e instanceof Error ? e.message : String(e)}`);
    code = 1;
  } finally {
    for (const c of opts.children.reverse()) {
      c.kill("SIGTERM");
      await Promise.race([c.exited, Bun.sleep(opts.killAfterMs)]);
      if (c.exitCode === null) c.kill("SIGKILL");
    }
    if (!opts.keep) rmSync(opts.dir, { recursive: true, force: true });
    else console.log(`\nkept ${opts.dir}`);
  }
  process.exit(code);
}
