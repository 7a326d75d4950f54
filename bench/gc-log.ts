/**
 * JSC's GC log (`BUN_JSC_logGC=1`, written to standard error) read over a
 * window of a run: what the benchmarks' `--gc` prints beside a latency tail.
 *
 * The lines, per heap (a process has one per thread: the embedded database's
 * worker has its own):
 *  - `[GC<heap>: starting …]`, then `Requesting GC because bytes allocated this
 *    cycle: N exceed bytes allowed: M …` when the young generation's budget
 *    started it (no such line: Bun's GC controller's timer did,
 *    `BunGCController.cpp`);
 *  - `[GC<heap>: START M 27946kb => EdenCollection, … p=1.02ms (max …)…]`, and
 *    for a collection that goes on concurrently, more lines `[GC<heap>: M …
 *    p=0.69ms …]` or `C …`, the last one ending `… cycle 11.1ms END]`.
 *
 * Every `p=` is one stop of the world: the request thread stands still that
 * long, and a gap or a request that spans it grows by it. A collection that
 * finishes in one stop has one; one that marks concurrently (streams held
 * open keep much alive) has several, the last often the longest.
 */
import { readFileSync } from "node:fs";

export interface GcWindow {
  young: number;
  full: number;
  /** Collections started by the young generation's budget (the rest: Bun's controller). */
  byBudget: number;
  /** Every stop of the world, in ms. */
  pausesMs: number[];
  /** Each collection's stops summed, in ms. */
  perCollectionMs: number[];
  /** Median "bytes allowed" of the budget's requests: the young generation's budget. */
  allowedBytes: number;
  /** The other heaps' collections in the window (the embedded database's worker): they stop their own thread, not the request thread. */
  others: { young: number; full: number };
}

interface HeapState extends Omit<GcWindow, "others"> {
  allowed: number[];
  budgetPending: boolean;
  open: boolean;
}

const median = (xs: number[]): number => {
  if (xs.length === 0) return Number.NaN;
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? (s[m] as number) : ((s[m - 1] as number) + (s[m] as number)) / 2;
};

/**
 * The window's collections of the request thread's heap: `requestHeap` when
 * known (requestHeapOf: the first heap a process logs is its main thread's),
 * else the heap that collected most. Under a load of stored Responses the
 * embedded database's worker can collect more often than the request thread,
 * and its collections (full ones with a heap of wasm memory) are not pauses of
 * the request thread: they are counted apart, in `others`.
 */
export function gcWindow(text: string, requestHeap?: string): GcWindow {
  const heaps = new Map<string, HeapState>();
  let current = "";
  const heap = (id: string): HeapState => {
    let h = heaps.get(id);
    if (!h) {
      h = { young: 0, full: 0, byBudget: 0, pausesMs: [], perCollectionMs: [], allowedBytes: Number.NaN, allowed: [], budgetPending: false, open: false };
      heaps.set(id, h);
    }
    return h;
  };
  for (const line of text.split("\n")) {
    const tagged = /^\[GC<(0x[0-9a-f]+)>: (\S+)/.exec(line);
    if (!tagged) {
      const allowed = /^Requesting GC because .*bytes allowed: (\d+)/.exec(line);
      if (allowed && current) {
        const h = heap(current);
        h.allowed.push(Number(allowed[1]));
        h.budgetPending = true;
      }
      continue;
    }
    const id = tagged[1] as string;
    current = id;
    const h = heap(id);
    if (tagged[2] === "START") {
      const kind = /=> (Eden|Full)Collection/.exec(line)?.[1];
      if (kind === "Eden") h.young++;
      else h.full++;
      if (h.budgetPending) h.byBudget++;
      h.budgetPending = false;
      h.perCollectionMs.push(0);
      h.open = true;
    }
    const p = /\bp=([\d.]+)ms/.exec(line);
    if (p && h.open) {
      const ms = Number(p[1]);
      h.pausesMs.push(ms);
      h.perCollectionMs[h.perCollectionMs.length - 1] = (h.perCollectionMs.at(-1) ?? 0) + ms;
    }
    if (line.includes(" END]")) h.open = false;
  }
  const chosen = requestHeap !== undefined ? heaps.get(requestHeap) : [...heaps.values()].sort((a, b) => b.young + b.full - (a.young + a.full))[0];
  const others = { young: 0, full: 0 };
  for (const h of heaps.values()) {
    if (h === chosen) continue;
    others.young += h.young;
    others.full += h.full;
  }
  if (!chosen) return { young: 0, full: 0, byBudget: 0, pausesMs: [], perCollectionMs: [], allowedBytes: Number.NaN, others };
  const { young, full, byBudget, pausesMs, perCollectionMs } = chosen;
  return { young, full, byBudget, pausesMs, perCollectionMs, allowedBytes: median(chosen.allowed), others };
}

/** The heap of the log's first line: a process's main thread logs before any worker exists (undefined: nothing logged yet). */
export function requestHeapOf(text: string): string | undefined {
  return /\[GC<(0x[0-9a-f]+)>/.exec(text)?.[1];
}

/** Bytes in the log now (a window's start). */
export function logSize(path: string): number {
  try {
    return Bun.file(path).size;
  } catch {
    return 0;
  }
}

/** The request thread's collections logged since `from` (a logSize). */
export function gcSince(path: string, from: number): GcWindow {
  const all = readFileSync(path);
  return gcWindow(all.subarray(from).toString("utf8"), requestHeapOf(all.subarray(0, 4096).toString("utf8")));
}

const f2 = (n: number) => (Number.isFinite(n) ? n.toFixed(2) : "n/a");

/** One line: how many, who started them, and the stops. */
export function gcSummary(w: GcWindow): string {
  const stops = [...w.pausesMs].sort((a, b) => a - b);
  const total = stops.reduce((s, p) => s + p, 0);
  return (
    `GC: ${w.young} young + ${w.full} full collections (${w.byBudget} started by the young budget, the rest by Bun's controller), ` +
    `${stops.length} stops of the world: longest ${f2(stops.at(-1) ?? Number.NaN)} ms, p50 ${f2(median(stops))} ms, ${f2(total)} ms in all, ` +
    `per collection up to ${f2(w.perCollectionMs.length > 0 ? Math.max(...w.perCollectionMs) : Number.NaN)} ms` +
    (w.others.young + w.others.full > 0 ? `; other threads' heaps (the database worker): ${w.others.young} young + ${w.others.full} full` : "")
  );
}
