import { describe, expect, test } from "bun:test";
import { gcWindow, requestHeapOf } from "../../bench/gc-log.ts";

// Lines as JSC writes them with BUN_JSC_logGC=1 (shortened in the middle, as the parser reads only the ends).
const REQUEST = "0x52b67418118";
const WORKER = "0x52b77d10118";
const log = [
  // Started by the young budget, finished in one stop.
  `[GC<${REQUEST}>: starting 0.036143ms]`,
  "Requesting GC because bytes allocated this cycle: 8458202 exceed bytes allowed: 8388608 normal bytes: 7876214 oversized bytes: 581988 last oversized: 298884",
  `[GC<${REQUEST}>: START M 7850kb => EdenCollection, a=0kb i#1:N<CsMsrShDMsm(0)SrbBcs> 1021+0 i#6:P<Msm(0)Cs>Pbc => 12460kb, p=1.5ms (max 1.5), cycle 1.6ms END]`,
  "GC END!",
  // The other thread's heap: not the request thread's (fewer collections).
  `[GC<${WORKER}>: START M 289146kb => FullCollection, a=0kb p=1.104580ms (max 11.369000)...]`,
  `[GC<${WORKER}>: C a=0kb v=533kb p=0.536206ms (max 11.369000)...]`,
  `[GC<${WORKER}>: M a=0kb => 6887kb, p=0.25ms (max 11.369000), cycle 1.11ms END]`,
  // Started by Bun's controller, marked concurrently: three stops, the last the longest.
  `[GC<${REQUEST}>: START M 27946kb => EdenCollection, a=0kb i#1:N<CsMsrShDMsm(1072)SrbBcs> 44+1072 p=1.0ms (max 11.369000)...]`,
  `[GC<${REQUEST}>: M a=7kb v=230kb p=0.25ms (max 11.369000)...]`,
  `[GC<${REQUEST}>: M a=10kb i#4:P<Msm(0)ShCsBcsSrbMsrDCbDomoOJwWs>Pbc => 21964kb, p=2.75ms (max 11.369000), cycle 11.147681ms END]`,
  "GC END!",
  `[GC<${REQUEST}>: epilogue 0.020420ms]`,
  `[GC<${REQUEST}>: START M 33998kb => FullCollection, a=0kb p=0.5ms (max 11.369000), cycle 0.6ms END]`,
].join("\n");

describe("bench/gc-log.ts: JSC's GC log", () => {
  test("counts the request thread's collections, who started them, and every stop of the world", () => {
    const w = gcWindow(log);
    expect(w.young).toBe(2);
    expect(w.full).toBe(1);
    expect(w.byBudget).toBe(1);
    expect(w.pausesMs).toEqual([1.5, 1.0, 0.25, 2.75, 0.5]);
    expect(w.perCollectionMs).toEqual([1.5, 4, 0.5]);
    expect(w.allowedBytes).toBe(8388608);
  });

  test("the request thread's heap is the first one a process logs, even in a window where another heap collects more", () => {
    // A window of stored Responses: the embedded database's worker writes rows and collects more often than the
    // request thread, full collections included. Those stop the worker, not the requests.
    const window = [
      `[GC<${WORKER}>: START M 289146kb => EdenCollection, a=0kb p=2.0ms (max 11.3), cycle 2.1ms END]`,
      `[GC<${WORKER}>: START M 289146kb => EdenCollection, a=0kb p=2.2ms (max 11.3), cycle 2.3ms END]`,
      `[GC<${WORKER}>: START M 289146kb => FullCollection, a=0kb p=12.5ms (max 12.5), cycle 13ms END]`,
      `[GC<${REQUEST}>: START M 27946kb => EdenCollection, a=0kb p=0.75ms (max 11.3), cycle 0.8ms END]`,
    ].join("\n");
    const heap = requestHeapOf(log);
    expect(heap).toBe(REQUEST);
    const w = gcWindow(window, heap);
    expect([w.young, w.full]).toEqual([1, 0]);
    expect(w.pausesMs).toEqual([0.75]);
    expect(w.others).toEqual({ young: 2, full: 1 });
  });

  test("an empty window has no collections", () => {
    const w = gcWindow("");
    expect([w.young, w.full, w.byBudget, w.pausesMs.length]).toEqual([0, 0, 0, 0]);
  });
});
