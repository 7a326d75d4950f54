/**
 * Phase r of `bun run bench` (bench/inference.ts): the Responses API's
 * streaming overhead over the same chat alias (issue 16's targets).
 *
 *  - Gaps: 64 concurrent streams of 40 tokens 20 ms apart for 8 s through the
 *    gateway (chat, Responses with `store: false`, Responses stored), each with
 *    64 streams direct to the simulator at the same time, in 3 rounds that
 *    interleave the kinds. The figure: the gateway stream's inter-read gap p99
 *    minus the direct one's in the same round (target <= 1 ms for Responses),
 *    median over the rounds; chat's figure is the relay's own share.
 *  - Memory: N streams (20 tokens 500 ms apart) held open at once, on a fresh
 *    gateway each time (one that already held streams reuses the memory it
 *    freed, which would flatter whichever ran second): chat, Responses with
 *    `store: false`, and Responses stored (the default). RSS per held stream is
 *    (peak - before) / N; the target is Responses <= 1.5x chat.
 */
import { echo } from "../test/helpers/responses.ts";
import { responsesTransform } from "../src/responses/events.ts";
import { gcSummary } from "./gc-log.ts";
import type { LoadSpec, PairedRound } from "./inference.ts";
import { median, streamLine } from "./lib.ts";

type Endpoint = { url: string; headers: Record<string, string> };
type Target = Omit<LoadSpec, "kind" | "concurrency" | "durationMs" | "warmupMs">;
/** Paired rounds per kind (each 8 s with its direct reference). */
const ROUNDS = 3;

export interface ResponsesPhaseContext {
  simRoot: string;
  direct: Endpoint;
  key: string;
  streams: number;
  loadgen(spec: LoadSpec): Promise<Record<string, number>>;
  /** `rounds` runs of a stream load through `measured` with the same load on `reference` at the same time (bench/inference.ts); with `gcLog`, each round's collections too. */
  paired(rounds: number, reference: Target, measured: Target, gcLog?: string): Promise<PairedRound[]>;
  setSim(root: string, patch: Record<string, number>): Promise<void>;
  rssKb(pid: number, field: "VmRSS" | "VmHWM"): number;
  freshGateway(): Promise<{ url: string; pid: number; gcLog?: string }>;
  /** CPU time a process has used, in ms. */
  cpuMs(pid: number): number;
}

const UPSTREAM_MODEL = "sim/bench-model";
/** Streams open within the 2 s ramp and live 10 s: until 9.5 s after the start all are open. */
const OPEN_WINDOW_MS = 9_500;
const f1 = (n: number) => (Number.isFinite(n) ? n.toFixed(1) : "n/a");
const f2 = (n: number) => (Number.isFinite(n) ? n.toFixed(2) : "n/a");
const num = (r: Record<string, number> | undefined, k: string) => r?.[k] ?? Number.NaN;

const chatBody = (model: string) => JSON.stringify({ model, messages: [{ role: "user", content: "Count to forty." }], stream: true });
const responsesBody = (store: boolean) => JSON.stringify({ model: "svc-fast", input: "Count to forty.", stream: true, ...(store ? {} : { store: false }) });

type Kind = "chat" | "responses (store: false)" | "responses (stored)";

function via(gwUrl: string, key: string, kind: Kind): Target {
  const headers = { "content-type": "application/json", authorization: `Bearer ${key}` };
  if (kind === "chat") return { url: `${gwUrl}/v1/chat/completions`, headers, body: chatBody("svc-fast") };
  return { url: `${gwUrl}/v1/responses`, headers, body: responsesBody(kind === "responses (stored)"), responses: true };
}

export async function responsesPhase(ctx: ResponsesPhaseContext): Promise<void> {
  console.log("\nr. Responses API (POST /v1/responses, stream: true) on the same alias as chat");
  await ctx.setSim(ctx.simRoot, { ttftMs: 0, interTokenMs: 20, completionTokens: 40 });
  const gw = await ctx.freshGateway();
  console.log("   64 concurrent streams of 40 tokens 20 ms apart through the gateway, each round with 64 direct ones at the same time (8 s):");
  const direct = { ...ctx.direct, body: chatBody(UPSTREAM_MODEL) };
  const added: Record<Kind, number[]> = { chat: [], "responses (store: false)": [], "responses (stored)": [] };
  const events: Partial<Record<Kind, string>> = {};
  // The gateway process's CPU per stream started, by kind (the rounds' own: the direct streams run in the simulator).
  const cpu: Record<Kind, number> = { chat: 0, "responses (store: false)": 0, "responses (stored)": 0 };
  const started: Record<Kind, number> = { chat: 0, "responses (store: false)": 0, "responses (stored)": 0 };
  // Rounds interleave the kinds, so a slow minute of the machine falls on all of them.
  for (let round = 1; round <= ROUNDS; round++) {
    for (const kind of ["chat", "responses (store: false)", "responses (stored)"] as const) {
      const cpu0 = ctx.cpuMs(gw.pid);
      const [pair] = await ctx.paired(1, direct, via(gw.url, ctx.key, kind), gw.gcLog);
      if (!pair) continue;
      cpu[kind] += ctx.cpuMs(gw.pid) - cpu0;
      started[kind] += num(pair.got, "started");
      const { ref, got } = pair;
      console.log(`   round ${round}, ${kind}:`);
      console.log(streamLine("direct: ", ref));
      console.log(streamLine("gateway:", got));
      if (pair.gc) console.log(`            ${gcSummary(pair.gc)}`);
      added[kind].push(num(got, "gapP99") - num(ref, "gapP99"));
      events[kind] = `${got.eventsMin}-${got.eventsMax}`;
    }
  }
  for (const kind of ["chat", "responses (store: false)", "responses (stored)"] as const) {
    console.log(
      `   ${kind.padEnd(24)} inter-event gap p99 added over the upstream's chunks: ${added[kind].map(f2).join(" / ")} ms, median ${f2(median(added[kind]))} ms${kind === "chat" ? "" : " (target <= 1)"}   events per stream ${events[kind] ?? "?"}   CPU ${f1((cpu[kind] * 1000) / started[kind])} µs per stream`,
    );
  }

  console.log(`   ${ctx.streams} streams held open at once (20 tokens 500 ms apart), a fresh gateway for each:`);
  const perStream: Partial<Record<Kind, number>> = {};
  const idle: Partial<Record<Kind, number>> = {};
  const allOpen: Partial<Record<Kind, number>> = {};
  // One restart first, not measured: the first gateway after the gap rounds starts on the database
  // they wrote to (thousands of stored responses and usage rows) and idled ~20 MB higher than the
  // next ones, memory the embedded database's thread keeps and later reuses, which made the first
  // kind measured (chat) look up to a third cheaper per stream. Every measured gateway now starts
  // from the same, settled database.
  await ctx.freshGateway();
  for (const kind of ["chat", "responses (store: false)", "responses (stored)"] as const) {
    const g = await ctx.freshGateway();
    // The baseline is the idle fresh gateway, before its warm-up: measured after the warm-up it
    // would differ by kind (a warm-up's freed memory is reused by the held streams), which is what
    // made Responses look cheaper than chat. The warm-up (200 streams at full speed) loads and
    // compiles the code path; it is the same for every kind.
    const before = ctx.rssKb(g.pid, "VmRSS");
    await ctx.setSim(ctx.simRoot, { ttftMs: 0, interTokenMs: 0, completionTokens: 20 });
    await ctx.loadgen({ kind: "hold", ...via(g.url, ctx.key, kind), concurrency: 200, durationMs: 0, warmupMs: 0, rampMs: 200 });
    await ctx.setSim(ctx.simRoot, { ttftMs: 0, interTokenMs: 500, completionTokens: 20 });
    // Two peaks: while the streams are all open (the first one ends ~10 s after the first
    // opened: 20 tokens 500 ms apart), and overall, which adds the burst of their endings
    // (for stored responses: thousands of rows written within a second or two).
    const t0 = performance.now();
    let openPeak = before;
    let peak = before;
    const sampler = setInterval(() => {
      const now = ctx.rssKb(g.pid, "VmRSS");
      peak = Math.max(peak, now);
      if (performance.now() - t0 < OPEN_WINDOW_MS) openPeak = Math.max(openPeak, now);
    }, 100);
    const h = await ctx.loadgen({ kind: "hold", ...via(g.url, ctx.key, kind), concurrency: ctx.streams, durationMs: 0, warmupMs: 0, rampMs: 2_000 });
    clearInterval(sampler);
    peak = Math.max(peak, ctx.rssKb(g.pid, "VmHWM"));
    perStream[kind] = (openPeak - before) / ctx.streams;
    idle[kind] = before;
    allOpen[kind] = openPeak;
    console.log(
      `   ${kind.padEnd(24)} completed ${h.completed}/${h.streams} (${h.failed} failed, ${h.peakOpen} open at once)   RSS ${f1(before / 1024)} MB idle, ${f1(openPeak / 1024)} all open, ${f1(peak / 1024)} peak with the endings   ${f1(num(perStream, kind))} KB per open stream (${f1((peak - before) / ctx.streams)} with the endings)`,
    );
  }
  // The idle fresh gateways' RSS differs by up to ~20 MB from one start to the next (±5 KB a
  // stream at 4,000), whatever the kind: the same figures against the median of the three idles.
  const idleMedian = median(Object.values(idle));
  console.log(
    `   against the median idle RSS (${f1(idleMedian / 1024)} MB): ${(["chat", "responses (store: false)", "responses (stored)"] as const).map((k) => `${k} ${f1(((allOpen[k] ?? Number.NaN) - idleMedian) / ctx.streams)} KB`).join(", ")} per open stream = ${f2(((allOpen["responses (store: false)"] ?? Number.NaN) - idleMedian) / ((allOpen.chat ?? Number.NaN) - idleMedian))}x / ${f2(((allOpen["responses (stored)"] ?? Number.NaN) - idleMedian) / ((allOpen.chat ?? Number.NaN) - idleMedian))}x chat`,
  );
  const chat = num(perStream, "chat");
  console.log(
    `   memory per open stream, responses / chat: ${f2(num(perStream, "responses (store: false)") / chat)}x (store: false), ${f2(num(perStream, "responses (stored)") / chat)}x (stored) (target <= 1.5)`,
  );
  translationCost();
}

/** The translation alone, in this process: CPU per upstream chunk (what it can add to a gap), from the gateway's own modules. */
function translationCost(): void {
  const chunk = (i: number) =>
    Buffer.from(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"svc-fast","choices":[{"index":0,"delta":{"content":"token${i} "},"logprobs":null,"finish_reason":null}]}\n\n`);
  const chunks = Array.from({ length: 40 }, (_, i) => chunk(i));
  const meta = { id: "resp_bench", createdAt: 0, model: "svc-fast", echo: echo({ store: false }) };
  const times: number[] = [];
  for (let s = 0; s < 2_000; s++) {
    // As the relay runs it: one read's events in, the bytes to write out.
    const t = responsesTransform(meta, () => {});
    t.start();
    for (const c of chunks) {
      const t0 = performance.now();
      t.events([c]);
      times.push(performance.now() - t0);
    }
  }
  times.sort((a, b) => a - b);
  const at = (p: number) => (times[Math.min(times.length - 1, Math.floor((p / 100) * times.length))] ?? Number.NaN) * 1000;
  console.log(`   translation per upstream chunk (in-process, ${times.length} chunks): p50 ${f1(at(50))} µs, p99 ${f1(at(99))} µs`);
}

