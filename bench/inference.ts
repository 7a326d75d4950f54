/**
 * Inference path benchmark (issue 4): `bun run bench`.
 *
 * Starts the upstream simulator and the gateway as separate processes, the
 * way they run in production (`gateway simulate-upstream`, `gateway serve
 * --config FILE` on an embedded database in a temporary directory), and a
 * small Bun load generator (this file with --role loadgen). With `taskset`
 * available the gateway is pinned to CPU 0 and the simulator plus load
 * generator to CPU 1, so the gateway's cost is measured on one core.
 *
 * Everything the gateway does per request stays on: authentication, the rate
 * limiter (an organisation on a plan whose rate never binds), the token quota
 * (a large one, so leases are taken and usage is written), access logs (to a
 * file) and metrics.
 *
 * Phases:
 *  1. non-streamed chat, concurrency 64 for 15 s (after 2 s warm-up):
 *     direct to the simulator, then through the gateway; requests/s, p50/p99
 *     latency and the throughput ratio. Then an open loop at 1,000 req/s for
 *     5 s, direct and through the gateway: the latency the gateway adds when
 *     it is not the bottleneck.
 *  2. streamed chat, 40 tokens 20 ms apart, 64 concurrent streams for 8 s
 *     (starts spread over 0.8 s): time to first byte and gaps between chunks
 *     as the client sees them, through the gateway with 64 direct streams at
 *     the same time as the reference, 3 rounds (with --bare, 3 more through
 *     the bare proxy); chunks and reads per stream (merged or lost chunks
 *     would show as a difference).
 *  3. N concurrent slow streams (default 10,000; 20 tokens 500 ms apart)
 *     through the gateway: all must complete; the gateway's peak RSS.
 *  r. the Responses API on the same alias (bench/responses.ts): the gap its
 *     stream adds over the upstream's chunks, and memory per open stream
 *     against chat (--responses-streams N held open, default 4,000).
 *
 * --wrk runs bench/wrk.ts instead (wrk as the load generator, CPU per request against the bare proxy).
 * Options: --streams N (phase 3 size), --duration S (phase 1 seconds),
 * --phases 1,2,3,r, --skip-direct, --keep (keep the temporary directory),
 * --quota-tokens N|none (the organisation's quota; default 10^12, i.e. on but never binding),
 * --profile DIR (write the gateway's CPU profile there),
 * --gateway-config JSON (merged into the gateway's config: e.g. '{"accessLog":false}' to see what a feature costs),
 * --open-seconds S (length of the 1,000 req/s open loop; default 5), --open-rate R (its rate).
 * --stream-tokens N (phase 2's tokens per stream, default 40): with 400, a stream outlasts the
 * 8 s round, so no stream starts or ends in the measured part and the gap is the relay's alone.
 * The gateway gets MIMALLOC_PURGE_HOLES=0, as the systemd units set it, unless the environment sets it.
 * Phase "o" runs only phase 1's open loop.
 * --bare also measures bench/bare-proxy.ts (a 20-line Bun proxy with nothing
 * else, pinned like the gateway) in phases 1 and 2: what Bun itself costs here.
 * --bare-relay js makes that proxy read each chunk in JavaScript and write it to
 * a direct stream, as the gateway must (what relaying in JS costs by itself).
 * With DATABASE_URL set, the gateway uses that Postgres instead of the
 * embedded database (use a throwaway database: the bench creates an
 * organisation and a key in it).
 * Each process needs file descriptors: the gateway two per open stream. When
 * `ulimit -n` is too low for --streams, phase 3 is reduced and says so.
 * --gc runs the gateway (and the bare proxy) with JSC's GC log (`BUN_JSC_logGC=1`) and prints,
 * for each paired round of phases 2 and r, the request thread's collections and their stops of
 * the world (bench/gc-log.ts): what a gap's tail is made of.
 */
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { type GcWindow, gcSince, gcSummary, logSize } from "./gc-log.ts";
import { firstLine, median, runBench, streamLine, waitFor } from "./lib.ts";
import { responsesPhase } from "./responses.ts";

// `bun run bench -- --wrk [options]`: the wrk phase (bench/wrk.ts) instead of the phases below.
if (Bun.argv.includes("--wrk")) {
  const wrk = Bun.spawn(["bun", "bench/wrk.ts", ...Bun.argv.slice(2).filter((a) => a !== "--wrk")], { stdio: ["inherit", "inherit", "inherit"] });
  process.exit(await wrk.exited);
}

const { values: args } = parseArgs({
  args: Bun.argv.slice(2),
  options: {
    role: { type: "string" },
    spec: { type: "string" },
    streams: { type: "string", default: "10000" },
    duration: { type: "string", default: "15" },
    "skip-direct": { type: "boolean", default: false },
    keep: { type: "boolean", default: false },
    phases: { type: "string", default: "1,2,3,r" },
    "quota-tokens": { type: "string", default: "1000000000000" },
    profile: { type: "string" },
    "gateway-config": { type: "string" },
    "open-seconds": { type: "string", default: "5" },
    "open-rate": { type: "string", default: "1000" },
    "stream-tokens": { type: "string", default: "40" },
    bare: { type: "boolean", default: false },
    "bare-relay": { type: "string", default: "native" },
    "responses-streams": { type: "string", default: "4000" },
    gc: { type: "boolean", default: false },
  },
});

const UPSTREAM_MODEL = "sim/bench-model";

// ---------------------------------------------------------------------------
// Load generator (runs in its own process)
// ---------------------------------------------------------------------------

export interface LoadSpec {
  kind: "json" | "paced" | "stream" | "hold";
  url: string;
  headers: Record<string, string>;
  body: string;
  concurrency: number;
  durationMs: number;
  warmupMs: number;
  /** hold: open `concurrency` streams within this many ms. */
  rampMs?: number;
  /** paced: requests per second, sent on schedule whatever the answers take (open loop). */
  rate?: number;
  /** stream/hold: the answer is a Responses event stream (ends with response.completed, not [DONE]). */
  responses?: boolean;
  /**
   * stream: the clients' first streams start spread over this many ms (client i after
   * i/concurrency of it) instead of all at once; each client then starts its next stream when the
   * last one ends, so the spacing holds.
   */
  staggerMs?: number;
}

function percentile(sorted: number[], p: number): number {
  if (sorted.length === 0) return Number.NaN;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))] ?? Number.NaN;
}

const sortNum = (xs: number[]) => Float64Array.from(xs).sort();

/** One non-streamed request, body read to the end; false on an error status or a failed connection. */
async function post(s: LoadSpec): Promise<boolean> {
  try {
    const res = await fetch(s.url, { method: "POST", headers: s.headers, body: s.body });
    await res.arrayBuffer();
    return res.ok;
  } catch {
    return false;
  }
}

async function loadJson(s: LoadSpec) {
  const lat: number[] = [];
  let errors = 0;
  let sent = 0;
  const start = performance.now();
  const measureFrom = start + s.warmupMs;
  const end = measureFrom + s.durationMs;
  await Promise.all(
    Array.from({ length: s.concurrency }, async () => {
      while (performance.now() < end) {
        const t0 = performance.now();
        sent++;
        if (!(await post(s))) errors++;
        const t1 = performance.now();
        if (t0 >= measureFrom && t1 <= end) lat.push(t1 - t0);
      }
    }),
  );
  const sorted = Array.from(sortNum(lat));
  return { requests: lat.length, sent, rps: lat.length / (s.durationMs / 1000), p50: percentile(sorted, 50), p99: percentile(sorted, 99), errors };
}

/** Open loop at a fixed rate: latency as a client sees it when the gateway is not the bottleneck. */
async function loadPaced(s: LoadSpec) {
  const rate = s.rate ?? 1_000;
  const lat: number[] = [];
  let errors = 0;
  const pending: Promise<void>[] = [];
  const one = async (measure: boolean) => {
    const t0 = performance.now();
    if (!(await post(s))) errors++;
    if (measure) lat.push(performance.now() - t0);
  };
  const start = performance.now();
  const total = s.warmupMs + s.durationMs;
  let sent = 0;
  while (performance.now() - start < total) {
    const due = Math.floor(((performance.now() - start) * rate) / 1000);
    while (sent < due) {
      pending.push(one(performance.now() - start >= s.warmupMs));
      sent++;
    }
    await Bun.sleep(1);
  }
  await Promise.all(pending);
  const sorted = Array.from(sortNum(lat));
  return { requests: lat.length, sent, rps: lat.length / (s.durationMs / 1000), p50: percentile(sorted, 50), p99: percentile(sorted, 99), errors };
}

/** One streamed request: time to first chunk, gaps between chunks, events and reads. */
async function oneStream(s: LoadSpec, signal?: AbortSignal) {
  const t0 = performance.now();
  const res = await fetch(s.url, { method: "POST", headers: s.headers, body: s.body, ...(signal ? { signal } : {}) });
  const reader = res.ok ? res.body?.getReader() : undefined;
  if (!reader) {
    const text = await res.text().catch((e: unknown) => `(body unreadable: ${String(e)})`);
    reportFailure(`HTTP ${res.status} ${res.headers.get("content-type")}: ${text.slice(0, 300)}`);
    return { ok: false, ttfb: 0, gaps: [] as number[], events: 0, reads: 0 };
  }
  const dec = new TextDecoder();
  let ttfb = -1;
  let last = 0;
  const gaps: number[] = [];
  let events = 0;
  let reads = 0;
  let tail = "";
  let last_ = "";
  for (;;) {
    const r = await reader.read();
    if (r.done) break;
    const now = performance.now();
    if (ttfb < 0) ttfb = now - t0;
    else gaps.push(now - last);
    last = now;
    reads++;
    const text = tail + dec.decode(r.value, { stream: true });
    const parts = text.split("\n\n");
    tail = parts.pop() ?? "";
    events += parts.length;
    if (parts.length > 0) last_ = parts[parts.length - 1] ?? "";
    if (text.includes("data: [DONE]")) tail = "";
  }
  const ok = tail === "" && events > 0 && (s.responses ? last_.startsWith("event: response.completed") : !last_.includes('"error"'));
  if (!ok) reportFailure(`stream ended badly after ${events} events: ${last_.slice(0, 200)}`);
  return { ok, ttfb, gaps, events, reads };
}

let failuresShown = 0;
/** The first few failures go to stderr, so a failing phase says why. */
function reportFailure(what: string) {
  if (failuresShown++ < 3) console.error(`   loadgen: ${what}`);
}

async function loadStream(s: LoadSpec) {
  const ttfb: number[] = [];
  const gaps: number[] = [];
  const events: number[] = [];
  const reads: number[] = [];
  let failed = 0;
  let started = 0;
  let chunks = 0;
  const end = performance.now() + s.warmupMs + s.durationMs;
  const measureFrom = performance.now() + s.warmupMs;
  await Promise.all(
    Array.from({ length: s.concurrency }, async (_, i) => {
      if (s.staggerMs) await Bun.sleep((i * s.staggerMs) / s.concurrency);
      while (performance.now() < end) {
        const t0 = performance.now();
        started++;
        const r = await oneStream(s).catch(() => ({ ok: false, ttfb: 0, gaps: [], events: 0, reads: 0 }));
        chunks += r.events;
        if (!r.ok) failed++;
        if (t0 < measureFrom || !r.ok) continue;
        ttfb.push(r.ttfb);
        gaps.push(...r.gaps);
        events.push(r.events);
        reads.push(r.reads);
      }
    }),
  );
  const st = Array.from(sortNum(ttfb));
  const sg = Array.from(sortNum(gaps));
  const se = Array.from(sortNum(events));
  const sr = Array.from(sortNum(reads));
  return {
    streams: ttfb.length,
    failed,
    started,
    chunks,
    ttfbP50: percentile(st, 50),
    ttfbP99: percentile(st, 99),
    gapP50: percentile(sg, 50),
    gapP99: percentile(sg, 99),
    gapMax: sg.at(-1) ?? Number.NaN,
    eventsMin: se[0] ?? 0,
    eventsMax: se.at(-1) ?? 0,
    readsP50: percentile(sr, 50),
  };
}

async function loadHold(s: LoadSpec) {
  let completed = 0;
  let failed = 0;
  let open = 0;
  let peakOpen = 0;
  const rampMs = s.rampMs ?? 2_000;
  const batch = Math.max(1, Math.ceil(s.concurrency / Math.max(1, rampMs / 20)));
  const t0 = performance.now();
  const all: Promise<void>[] = [];
  for (let i = 0; i < s.concurrency; i += batch) {
    for (let j = i; j < Math.min(s.concurrency, i + batch); j++) {
      all.push(
        (async () => {
          open++;
          peakOpen = Math.max(peakOpen, open);
          const r = await oneStream(s).catch((e: unknown) => {
            reportFailure(String(e));
            return { ok: false };
          });
          open--;
          if (r.ok) completed++;
          else failed++;
        })(),
      );
    }
    await Bun.sleep(20);
  }
  await Promise.all(all);
  return { streams: s.concurrency, completed, failed, peakOpen, seconds: (performance.now() - t0) / 1000 };
}

if (args.role === "loadgen") {
  const spec = JSON.parse(args.spec ?? "{}") as LoadSpec;
  const run = { json: loadJson, paced: loadPaced, stream: loadStream, hold: loadHold }[spec.kind];
  const result = await run(spec);
  process.stdout.write(`${JSON.stringify(result)}\n`);
  process.exit(0);
}

// ---------------------------------------------------------------------------
// Orchestrator
// ---------------------------------------------------------------------------

const hasTaskset = Bun.spawnSync(["sh", "-c", "command -v taskset"]).exitCode === 0;
const cpus = navigator.hardwareConcurrency;
const pin = (cpu: number, cmd: string[]) => (hasTaskset && cpus >= 2 ? ["taskset", "-c", String(cpu), ...cmd] : cmd);
// The allocator setting the systemd units give the gateway (docs/decisions.md "The allocator"), unless
// the caller sets it (MIMALLOC_PURGE_HOLES=1 measures without it). The load generator is a fetch
// client: Bun's fetch keeps at most 256 requests in flight unless BUN_CONFIG_MAX_HTTP_REQUESTS is
// set when the process starts.
const env = { ...process.env, MIMALLOC_PURGE_HOLES: process.env.MIMALLOC_PURGE_HOLES ?? "0", BUN_CONFIG_MAX_HTTP_REQUESTS: "65535" };
const dir = mkdtempSync(join(tmpdir(), "gateway-bench-"));
const children: ReturnType<typeof Bun.spawn>[] = [];

function cli(argv: string[]): unknown {
  const r = Bun.spawnSync(["bun", "run", "src/main.ts", ...argv, "--config", join(dir, "config.json"), "--json"], { env, stderr: "pipe" });
  if (r.exitCode !== 0) throw new Error(`gateway ${argv.join(" ")} failed: ${r.stderr.toString()}`);
  return JSON.parse(r.stdout.toString());
}


async function loadgen(spec: LoadSpec): Promise<Record<string, number>> {
  const p = Bun.spawn(pin(1, ["bun", "bench/inference.ts", "--role", "loadgen", "--spec", JSON.stringify(spec)]), { env, stdout: "pipe", stderr: "inherit" });
  const out = await new Response(p.stdout).text();
  await p.exited;
  return JSON.parse(out.trim().split("\n").at(-1) ?? "{}") as Record<string, number>;
}

/** CPU time a process (all its threads) has used, in ms, from /proc (NaN where there is none). */
function cpuMs(pid: number | undefined): number {
  if (pid === undefined) return Number.NaN;
  try {
    const fields = readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1]?.split(" ") ?? [];
    // utime and stime are fields 14 and 15 of stat(5), in clock ticks (100 a second on Linux).
    return (Number(fields[11]) + Number(fields[12])) * 10;
  } catch {
    return Number.NaN;
  }
}

/** Minor page faults a process (all its threads) has taken, from /proc (NaN where there is none). */
function minorFaults(pid: number | undefined): number {
  if (pid === undefined) return Number.NaN;
  try {
    // minflt is field 10 of stat(5).
    return Number((readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1]?.split(" ") ?? [])[7]);
  } catch {
    return Number.NaN;
  }
}

/**
 * Run a load against a server process and add the CPU it used and the minor page faults it took per request
 * sent: figures the machine's noise moves far less than latency.
 */
async function measured(pid: number | undefined, spec: LoadSpec): Promise<Record<string, number>> {
  const before = cpuMs(pid);
  const faults = minorFaults(pid);
  const r = await loadgen(spec);
  r.cpuUsPerRequest = ((cpuMs(pid) - before) * 1000) / (r.sent ?? Number.NaN);
  r.faultsPerRequest = (minorFaults(pid) - faults) / (r.sent ?? Number.NaN);
  return r;
}

function rssKb(pid: number, field: "VmRSS" | "VmHWM"): number {
  try {
    const m = readFileSync(`/proc/${pid}/status`, "utf8").match(new RegExp(`${field}:\\s+(\\d+)`));
    return m ? Number(m[1]) : Number.NaN;
  } catch {
    return Number.NaN;
  }
}

function fdLimit(): number {
  try {
    const m = readFileSync("/proc/self/limits", "utf8").match(/Max open files\s+(\d+)/);
    return m ? Number(m[1]) : Number.POSITIVE_INFINITY;
  } catch {
    return Number.POSITIVE_INFINITY;
  }
}

const f1 = (n: number) => (Number.isFinite(n) ? n.toFixed(1) : "n/a");
const f2 = (n: number) => (Number.isFinite(n) ? n.toFixed(2) : "n/a");

async function setSim(root: string, patch: Record<string, number>) {
  const r = await fetch(`${root}/__sim/config`, { method: "POST", body: JSON.stringify(patch) });
  if (!r.ok) throw new Error(`simulator config: ${r.status}`);
}

async function main() {
  const durationMs = Number(args.duration) * 1000;
  let streams = Number(args.streams);
  const limit = fdLimit();
  const fdNote = 2 * streams + 200 > limit ? ` (reduced from ${streams}: ulimit -n is ${limit}, the gateway holds two sockets per stream)` : "";
  if (fdNote) streams = Math.floor((limit - 200) / 2);

  console.log(`gateway inference bench: bun ${Bun.version}, ${cpus} CPUs, taskset ${hasTaskset && cpus >= 2 ? "on (gateway CPU 0; simulator + load generator CPU 1)" : "off"}`);
  console.log(`command: bun run bench${Bun.argv.length > 2 ? ` -- ${Bun.argv.slice(2).join(" ")}` : ""}\n`);

  // Simulator first: the gateway's config needs its address.
  const sim = Bun.spawn(pin(1, ["bun", "run", "src/main.ts", "simulate-upstream", "--port", "0", "--ttft-ms", "0", "--inter-token-ms", "0", "--tokens", "16"]), {
    env,
    stdout: "pipe",
    stderr: "inherit",
  });
  children.push(sim);
  const simUrl = (JSON.parse(await firstLine(sim.stdout)) as { url: string }).url;
  const simRoot = simUrl.replace(/\/v1$/, "");

  writeFileSync(
    join(dir, "config.json"),
    JSON.stringify({
      host: "127.0.0.1",
      port: 0,
      dataDir: join(dir, "data"),
      logLevel: "info",
      accessLog: true,
      plans: { Bench: { requestsPerMinute: 100_000_000 } },
      aliases: {
        "svc-fast": { targets: [{ baseUrl: simUrl, model: UPSTREAM_MODEL, weight: 1 }] },
      },
      // For phase r; chat does not notice.
      responses: { enabled: true },
      // Any free port (read from the listening line): phase 2 reads the event-loop delay there.
      metrics: { listen: "127.0.0.1:0" },
      ...(args["gateway-config"] ? (JSON.parse(args["gateway-config"]) as Record<string, unknown>) : {}),
    }),
  );
  const org = cli(["orgs", "create", "--name", "bench", "--plan", "Bench", "--quota-tokens", args["quota-tokens"] ?? "none", "--quota-window", "month"]) as { id: string };
  const key = (cli(["keys", "create", "--org", org.id, "--kind", "service", "--scopes", "inference"]) as { key: string }).key;

  let gw = await spawnGateway();
  const gwProc = gw.proc;
  const gwUrl = gw.url;
  const direct = { url: `${simUrl}/chat/completions`, headers: { "content-type": "application/json" } };
  let bare: Endpoint | undefined;
  if (args.bare) {
    const bareGc = args.gc ? join(dir, "bare.gc.log") : undefined;
    const bp = Bun.spawn(pin(0, ["bun", "bench/bare-proxy.ts", "--upstream", simUrl, "--relay", args["bare-relay"] ?? "native"]), {
      env: bareGc ? { ...env, BUN_JSC_logGC: "1" } : env,
      stdout: "pipe",
      stderr: bareGc ? Bun.file(bareGc) : "inherit",
    });
    children.push(bp);
    bare = {
      url: `${(JSON.parse(await firstLine(bp.stdout)) as { url: string }).url}/chat/completions`,
      headers: { "content-type": "application/json" },
      pid: bp.pid,
      ...(bareGc ? { gcLog: bareGc } : {}),
    };
  }
  const viaGw: Endpoint = {
    url: `${gwUrl}/v1/chat/completions`,
    headers: { "content-type": "application/json", authorization: `Bearer ${key}` },
    pid: gwProc.pid,
    ...(gw.metricsUrl ? { metricsUrl: gw.metricsUrl } : {}),
    ...(gw.gcLog ? { gcLog: gw.gcLog } : {}),
  };
  const phases = new Set((args.phases ?? "").split(",").map((x) => x.trim()));
  if (phases.has("1")) await nonStreamed(direct, viaGw, durationMs, bare);
  else if (phases.has("o")) await openLoop(direct, viaGw, bare);
  if (phases.has("2")) await streamed(simRoot, direct, viaGw, bare);
  if (phases.has("3")) await manyStreams(simRoot, viaGw, gwProc.pid, streams, fdNote);
  if (phases.has("r")) {
    await responsesPhase({
      simRoot,
      direct,
      key,
      streams: Math.min(streams, Number(args["responses-streams"])),
      loadgen,
      paired: pairedStreams,
      setSim,
      rssKb,
      cpuMs,
      // A fresh gateway for each memory figure: one that already held streams reuses the memory it freed.
      async freshGateway() {
        gw.proc.kill("SIGTERM");
        await gw.proc.exited;
        gw = await spawnGateway();
        return { url: gw.url, pid: gw.proc.pid, ...(gw.gcLog ? { gcLog: gw.gcLog } : {}) };
      },
    });
  }
}

let gatewayRuns = 0;
/** Starts `gateway serve` on the bench config (pinned to CPU 0); its log goes to a file, where its address is read from. */
async function spawnGateway(): Promise<{ proc: ReturnType<typeof Bun.spawn>; url: string; metricsUrl: string | undefined; gcLog?: string }> {
  const logPath = join(dir, `gateway-${gatewayRuns++}.log`);
  const gcLog = args.gc ? `${logPath}.gc` : undefined;
  const profile = args.profile ? ["--cpu-prof", "--cpu-prof-md", "--cpu-prof-interval=100", `--cpu-prof-dir=${args.profile}`] : [];
  const proc = Bun.spawn(pin(0, ["bun", ...profile, "run", "src/main.ts", "serve", "--config", join(dir, "config.json")]), {
    env: gcLog ? { ...env, BUN_JSC_logGC: "1" } : env,
    stdout: Bun.file(logPath),
    stderr: gcLog ? Bun.file(gcLog) : "inherit",
  });
  children.push(proc);
  const listening = await waitFor("the gateway to listen", () => {
    let text = "";
    try {
      text = readFileSync(logPath, "utf8");
    } catch {
      return undefined;
    }
    const m = text.match(/"msg":"listening","url":"([^"]+)","metrics_url":(?:"([^"]+)"|null)/);
    return m ? { url: m[1] as string, metricsUrl: m[2] } : undefined;
  }, 30_000);
  return { proc, ...listening, ...(gcLog ? { gcLog } : {}) };
}

/** Where load goes; `pid` is the serving process whose CPU is measured (gateway and bare proxy). */
type Endpoint = { url: string; headers: Record<string, string>; pid?: number; metricsUrl?: string; gcLog?: string };

const jsonBody = (model: string) =>
  JSON.stringify({ model, messages: [{ role: "user", content: "Summarise the plot of Hamlet in two sentences." }], max_tokens: 64 });
const streamBody = (model: string) => JSON.stringify({ model, messages: [{ role: "user", content: "Count to forty." }], stream: true });
const num = (r: Record<string, number> | undefined, k: string) => r?.[k] ?? Number.NaN;
const cpuNote = (r: Record<string, number>) =>
  (Number.isFinite(num(r, "cpuUsPerRequest")) ? `   CPU ${f1(num(r, "cpuUsPerRequest"))} µs/request` : "") +
  (Number.isFinite(num(r, "faultsPerRequest")) ? `   minor faults ${f2(num(r, "faultsPerRequest"))}/request` : "");

/** Phase 1: non-streamed chat at concurrency 64; the simulator answers at once, so this is pure overhead. */
async function nonStreamed(direct: Endpoint, viaGw: Endpoint, durationMs: number, bare?: Endpoint) {
  console.log(`1. non-streamed chat, concurrency 64, ${durationMs / 1000} s (16 tokens, no simulated latency)`);
  const base = { concurrency: 64, durationMs, warmupMs: 2_000 };
  const d = args["skip-direct"] ? undefined : await loadgen({ kind: "json", ...direct, body: jsonBody(UPSTREAM_MODEL), ...base });
  const b = bare ? await measured(bare.pid, { kind: "json", ...bare, body: jsonBody(UPSTREAM_MODEL), ...base }) : undefined;
  const g = await measured(viaGw.pid, { kind: "json", ...viaGw, body: jsonBody("svc-fast"), ...base });
  const line = (name: string, r: Record<string, number>) =>
    `   ${name} ${f1(num(r, "rps"))} req/s   p50 ${f2(num(r, "p50"))} ms   p99 ${f2(num(r, "p99"))} ms   errors ${r.errors}${cpuNote(r)}`;
  if (d) console.log(line("direct: ", d));
  if (b) console.log(line("bare:   ", b));
  console.log(line("gateway:", g));
  if (d && b) console.log(`   bare Bun proxy/direct: throughput ${f2(num(b, "rps") / num(d, "rps"))}x (the ceiling for any Bun proxy here)`);
  if (d) {
    console.log(
      `   gateway/direct: throughput ${f2(num(g, "rps") / num(d, "rps"))}x (target >= 0.40)   added latency at saturation p50 ${f2(num(g, "p50") - num(d, "p50"))} ms, p99 ${f2(num(g, "p99") - num(d, "p99"))} ms`,
    );
  }
  await openLoop(direct, viaGw, bare);
}

/**
 * At saturation latency is concurrency / throughput (Little's law), so "added
 * latency" there mostly restates the throughput ratio; the gateway's own
 * cost per request shows at a rate it handles without queueing.
 */
async function openLoop(direct: Endpoint, viaGw: Endpoint, bare?: Endpoint) {
  const rate = Number(args["open-rate"]);
  const seconds = Number(args["open-seconds"]);
  console.log(`   open loop at ${rate} req/s, ${seconds} s:`);
  const paced = { durationMs: seconds * 1_000, warmupMs: 1_000, concurrency: 0, rate };
  const line = (name: string, r: Record<string, number>) =>
    `   ${name} ${f1(num(r, "rps"))} req/s   p50 ${f2(num(r, "p50"))} ms   p99 ${f2(num(r, "p99"))} ms   errors ${r.errors}${cpuNote(r)}`;
  const dp = args["skip-direct"] ? undefined : await loadgen({ kind: "paced", ...direct, body: jsonBody(UPSTREAM_MODEL), ...paced });
  const bp = bare ? await measured(bare.pid, { kind: "paced", ...bare, body: jsonBody(UPSTREAM_MODEL), ...paced }) : undefined;
  const gp = await measured(viaGw.pid, { kind: "paced", ...viaGw, body: jsonBody("svc-fast"), ...paced });
  if (dp) console.log(line("direct: ", dp));
  if (bp) console.log(line("bare:   ", bp));
  console.log(line("gateway:", gp));
  console.log(`   gateway RSS after the loop: ${f1(rssKb(viaGw.pid ?? -1, "VmRSS") / 1024)} MB`);
  if (dp && bp) console.log(`   added by the bare Bun proxy: p50 ${f2(num(bp, "p50") - num(dp, "p50"))} ms, p99 ${f2(num(bp, "p99") - num(dp, "p99"))} ms`);
  if (dp) console.log(`   added latency p50 ${f2(num(gp, "p50") - num(dp, "p50"))} ms, p99 ${f2(num(gp, "p99") - num(dp, "p99"))} ms (target <= 2)`);
}

/**
 * Streams measured in pairs: `rounds` rounds of 8 s, each running the
 * reference streams (direct to the simulator) and the measured ones (through
 * the gateway) at the same time, 64 concurrent streams each. Measured one
 * after the other, as this phase first was, the direct run's own p99 moved by
 * ±1 ms from run to run on this shared machine (the simulator and the load
 * generator share a core, and other work comes and goes), which is as large
 * as the target; at the same time both sides see the same moments. The figure
 * per round is the measured gap p99 minus the reference's in that round; the
 * headline is the median over the rounds.
 */
async function pairedStreams(
  rounds: number,
  reference: Omit<LoadSpec, "kind" | "concurrency" | "durationMs" | "warmupMs">,
  measured: Omit<LoadSpec, "kind" | "concurrency" | "durationMs" | "warmupMs">,
  /** The measured server's GC log (--gc): each round then also gives its collections. */
  gcLog?: string,
): Promise<PairedRound[]> {
  // Starts spread over one stream's length (40 tokens 20 ms apart): 64 independent clients, not 64
  // requests arriving in the same millisecond every 0.8 s (see docs/benchmarks.md, phase r).
  const base = { kind: "stream" as const, concurrency: 64, durationMs: 8_000, warmupMs: 1_000, staggerMs: 800 };
  const out: PairedRound[] = [];
  for (let i = 0; i < rounds; i++) {
    const from = gcLog ? logSize(gcLog) : 0;
    const [ref, got] = await Promise.all([loadgen({ ...base, ...reference }), loadgen({ ...base, ...measured })]);
    out.push({ ref, got, ...(gcLog ? { gc: gcSince(gcLog, from) } : {}) });
  }
  return out;
}

export interface PairedRound {
  ref: Record<string, number>;
  got: Record<string, number>;
  /** The measured server's collections during the round (--gc). */
  gc?: GcWindow;
}

/**
 * The gateway's event-loop delay since the last scrape (the
 * monitorEventLoopDelay histogram, which each scrape resets;
 * src/metrics/process.ts): the longest stall of its request thread, which a
 * stream's gap and a request's latency include.
 */
async function loopDelay(e: Endpoint): Promise<{ maxMs: number; p99Ms: number } | undefined> {
  if (!e.metricsUrl) return undefined;
  const text = await (await fetch(e.metricsUrl)).text();
  const read = (name: string) => Number(text.match(new RegExp(`^gateway_nodejs_eventloop_lag_${name}_seconds (\\S+)`, "m"))?.[1]) * 1000;
  return { maxMs: read("max"), p99Ms: read("p99") };
}

/** CPU per stream and per chunk over paired rounds (streams started during the warm-ups count too: a round's every stream, measured or not, is in the CPU time). */
function cpuPerStream(cpuMsTotal: number, rounds: { got: Record<string, number> }[]): string {
  const started = rounds.reduce((n, r) => n + num(r.got, "started"), 0);
  const chunks = rounds.reduce((n, r) => n + num(r.got, "chunks"), 0);
  return `CPU ${f1(cpuMsTotal)} ms for ${started} streams and ${chunks} chunks: ${f1((cpuMsTotal * 1000) / started)} µs per stream, ${f2((cpuMsTotal * 1000) / chunks)} µs per chunk if starts were free`;
}

/** Phase 2: streams of 40 tokens 20 ms apart; what the gateway adds to first byte and to the gaps (paired with direct streams, 3 rounds). */
async function streamed(simRoot: string, direct: Endpoint, viaGw: Endpoint, bare?: Endpoint) {
  const tokens = Number(args["stream-tokens"]);
  if (!Number.isInteger(tokens) || tokens < 1) throw new Error("--stream-tokens takes a positive integer");
  await setSim(simRoot, { ttftMs: 0, interTokenMs: 20, completionTokens: tokens });
  console.log(`\n2. streamed chat, ${tokens} tokens 20 ms apart, 64 concurrent streams through the gateway and 64 direct at the same time, 3 rounds of 8 s`);
  if (args["skip-direct"]) {
    const g = await loadgen({ kind: "stream", ...viaGw, body: streamBody("svc-fast"), concurrency: 64, durationMs: 8_000, warmupMs: 1_000 });
    console.log(streamLine("gateway:", g));
    return;
  }
  await loopDelay(viaGw); // a scrape resets the monitor: what the next one reads is the rounds' alone
  const cpu0 = cpuMs(viaGw.pid);
  const rounds = await pairedStreams(3, { ...direct, body: streamBody(UPSTREAM_MODEL) }, { ...viaGw, body: streamBody("svc-fast") }, viaGw.gcLog);
  const gwCpu = cpuMs(viaGw.pid) - cpu0;
  const added: number[] = [];
  const ttfbAdded: number[] = [];
  let same = true;
  rounds.forEach(({ ref: d, got: g, gc }, i) => {
    console.log(`   round ${i + 1}`);
    console.log(streamLine("direct: ", d));
    console.log(streamLine("gateway:", g));
    if (gc) console.log(`            ${gcSummary(gc)}`);
    added.push(num(g, "gapP99") - num(d, "gapP99"));
    ttfbAdded.push(num(g, "ttfbP99") - num(d, "ttfbP99"));
    same &&= d.eventsMin === g.eventsMin && d.eventsMax === g.eventsMax && d.readsP50 === g.readsP50;
  });
  console.log(
    `   added by the gateway: gap p99 ${added.map(f2).join(" / ")} ms, median ${f2(median(added))} ms (target <= 1)   TTFB p99 median ${f2(median(ttfbAdded))} ms   same events and reads per stream (nothing merged or lost): ${same ? "yes" : "NO"}`,
  );
  console.log(`   ${cpuPerStream(gwCpu, rounds)} (the gateway process)`);
  const lag = await loopDelay(viaGw);
  if (lag) console.log(`   the gateway's event-loop delay over the rounds (its own monitor, 10 ms resolution): max ${f2(lag.maxMs)} ms, p99 ${f2(lag.p99Ms)} ms`);
  if (!bare) return;
  // The same rounds through the bare Bun proxy (--bare): what relaying a chunk costs Bun itself here.
  const bareCpu0 = cpuMs(bare.pid);
  const bareRounds = await pairedStreams(3, { ...direct, body: streamBody(UPSTREAM_MODEL) }, { ...bare, body: streamBody(UPSTREAM_MODEL) }, bare.gcLog);
  const bareCpu = cpuMs(bare.pid) - bareCpu0;
  const bareAdded = bareRounds.map(({ ref, got }) => num(got, "gapP99") - num(ref, "gapP99"));
  bareRounds.forEach(({ ref, got, gc }, i) => {
    console.log(`   bare proxy, round ${i + 1}`);
    console.log(streamLine("direct: ", ref));
    console.log(streamLine("bare:   ", got));
    if (gc) console.log(`            ${gcSummary(gc)}`);
  });
  console.log(`   added by the bare Bun proxy: gap p99 ${bareAdded.map(f2).join(" / ")} ms, median ${f2(median(bareAdded))} ms   ${cpuPerStream(bareCpu, bareRounds)}`);
}

/** Phase 3: N slow streams held open at once through the gateway; all must complete; the gateway's peak RSS. */
async function manyStreams(simRoot: string, viaGw: Endpoint, gwPid: number, streams: number, fdNote: string) {
  await setSim(simRoot, { ttftMs: 0, interTokenMs: 500, completionTokens: 20 });
  console.log(`\n3. ${streams} concurrent streams through the gateway, 20 tokens 500 ms apart${fdNote}`);
  const rssBefore = rssKb(gwPid, "VmRSS");
  let peak = rssBefore;
  const sampler = setInterval(() => {
    peak = Math.max(peak, rssKb(gwPid, "VmRSS"));
  }, 100);
  const g = await loadgen({ kind: "hold", ...viaGw, body: streamBody("svc-fast"), concurrency: streams, durationMs: 0, warmupMs: 0, rampMs: 2_000 });
  clearInterval(sampler);
  const hwm = rssKb(gwPid, "VmHWM");
  if (Number.isFinite(hwm)) peak = Math.max(peak, hwm);
  console.log(`   completed ${g.completed}/${g.streams} (${g.failed} failed) in ${f1(num(g, "seconds"))} s, ${g.peakOpen} open at once`);
  console.log(`   gateway RSS: ${f1(rssBefore / 1024)} MB before, peak ${f1(peak / 1024)} MB (target <= 512)`);
}

await runBench(main, { children, dir, keep: args.keep === true, killAfterMs: 5_000 });
