/**
 * CPU per request against a bare Bun proxy, with `wrk` as the load generator
 * (issue 17): `bun run bench:wrk` (or `bun run bench -- --wrk`).
 *
 * A load generator slower than what it measures under-states the direct path
 * and flatters every ratio; wrk (C, one thread) is not. The simulated
 * upstream, three servers measured side by side:
 *   direct   the simulator itself,
 *   bare     bench/bare-proxy.ts (Bun.serve + fetch, nothing else),
 *   gateway  `serve` on an embedded database with everything on: auth, the
 *            rate limiter (a plan whose rate never binds), a token quota set
 *            on the organisation (large: leases are taken, usage is written),
 *            the access log (to a file) and metrics (their own listener).
 * Gateway and bare proxy are pinned to CPU 0, simulator and wrk to CPU 1.
 *
 * Per round and server: `wrk -t1 -c64` for --duration seconds (non-streamed
 * chat, body from a Lua script): req/s, CPU per request of the serving
 * process (utime + stime from /proc/<pid>/stat over requests), then
 * `wrk -t1 -c1 --latency` for --c1-duration seconds: p50/p99, and what the
 * proxy adds over direct. Rounds run interleaved (direct, bare, gateway,
 * direct, bare, gateway, ...), so the machine's noise shows as a range.
 * The gateway's database transactions per request come from its
 * gateway_database_transactions_total counter.
 *
 * Options: --rounds N (2), --duration S (10), --c1-duration S (5), --warmup S (3),
 * --gateway-config JSON (merged into the gateway's config), --profile DIR
 * (the gateway runs under `bun --cpu-prof --cpu-prof-md --cpu-prof-interval=200`, profile written on exit;
 * only the gateway is loaded then, the c1 runs too),
 * --compare DIR (also measure a gateway from another checkout, e.g. `git archive COMMIT | tar -x -C DIR` with node_modules linked: paired before/after figures),
 * --binary PATH (this checkout's gateway runs as the compiled executable at PATH, `bun run build`'s dist/gateway, as operators run it, rather than from source;
 * with `--compare .` the same code from source is the base: what bundling and minifying change),
 * --base-env K=V,... (environment added for the base gateway only; with `--compare .` the same code under
 * other runtime settings, e.g. `BUN_JSC_useConcurrentGC=0`),
 * --gc (gateway and bare proxy run with JSC's GC log, `BUN_JSC_logGC=1`; each c1
 * run also prints the request thread's collections: how many, the young
 * budget, and their pauses. At c1 wrk's coordinated-omission correction turns each pause of P
 * ms into about P / cycle extra samples, so this predicts the p99:
 * docs/benchmarks.md, "What wrk's p99 at concurrency 1 measures"),
 * --keep (keep the temporary directory).
 */
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { type GcWindow, gcSince, logSize } from "./gc-log.ts";
import { firstLine, median, runBench, waitFor } from "./lib.ts";

const { values: args } = parseArgs({
  args: Bun.argv.slice(2),
  options: {
    rounds: { type: "string", default: "2" },
    duration: { type: "string", default: "10" },
    "c1-duration": { type: "string", default: "5" },
    warmup: { type: "string", default: "3" },
    "gateway-config": { type: "string" },
    profile: { type: "string" },
    keep: { type: "boolean", default: false },
    wrk: { type: "boolean", default: false },
    compare: { type: "string" },
    only: { type: "string" },
    gc: { type: "boolean", default: false },
    binary: { type: "string" },
    "base-env": { type: "string" },
  },
  strict: false,
});

const UPSTREAM_MODEL = "sim/bench-model";
const hasTaskset = Bun.spawnSync(["sh", "-c", "command -v taskset"]).exitCode === 0;
const cpus = navigator.hardwareConcurrency;
const pinned = hasTaskset && cpus >= 2;
const pin = (cpu: number, cmd: string[]) => (pinned ? ["taskset", "-c", String(cpu), ...cmd] : cmd);
// As the systemd units run it (docs/operations.md), unless the caller sets it.
const env = { ...process.env, MIMALLOC_PURGE_HOLES: process.env.MIMALLOC_PURGE_HOLES ?? "0" };
const dir = mkdtempSync(join(tmpdir(), "gateway-wrk-"));
const children: ReturnType<typeof Bun.spawn>[] = [];

/** wrk from the distribution's package when it is missing (Debian/Ubuntu). */
function ensureWrk(): void {
  if (Bun.spawnSync(["sh", "-c", "command -v wrk"]).exitCode === 0) return;
  console.log("wrk not found: installing it with apt-get");
  const sudo = process.getuid?.() === 0 ? "" : "sudo -n ";
  const r = Bun.spawnSync(["sh", "-c", `${sudo}apt-get install -y wrk || (${sudo}apt-get update && ${sudo}apt-get install -y wrk)`], { stdout: "inherit", stderr: "inherit" });
  if (r.exitCode !== 0) throw new Error("wrk is not installed and apt-get could not install it");
}


/** CPU time of a process (all its threads) in µs, from /proc/<pid>/stat (clock ticks of 10 ms). */
function cpuUs(pid: number): number {
  const fields = readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1]?.split(" ") ?? [];
  return (Number(fields[11]) + Number(fields[12])) * 10_000;
}

interface Target {
  name: "direct" | "bare" | "gateway" | "base";
  url: string;
  /** Lua script setting method, headers and body. */
  script: string;
  pid?: number;
  metricsUrl?: string;
  /** JSC's GC log of the serving process (--gc). */
  gcLog?: string;
}

interface WrkResult {
  requests: number;
  seconds: number;
  rps: number;
  errors: number;
  p50Ms: number;
  p99Ms: number;
  cpuUsPerRequest: number;
  txPerRequest: number;
  gc?: GcWindow;
}

/** The request and a `done` hook that prints wrk's own figures as JSON (latencies in µs). */
function luaScript(body: string, headers: Record<string, string>): string {
  const h = Object.entries(headers)
    .map(([k, v]) => `wrk.headers[${JSON.stringify(k)}] = ${JSON.stringify(v)}`)
    .join("\n");
  return `wrk.method = "POST"
wrk.body = ${JSON.stringify(body)}
${h}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('\\nRESULT {"requests":%d,"us":%d,"status_errors":%d,"socket_errors":%d,"p50":%d,"p99":%d}\\n',
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99)))
end
`;
}

async function dbTransactions(t: Target): Promise<number> {
  if (!t.metricsUrl) return Number.NaN;
  const text = await (await fetch(t.metricsUrl)).text();
  const m = text.match(/^gateway_database_transactions_total (\d+(?:\.\d+)?)/m);
  return m ? Number(m[1]) : Number.NaN;
}

async function wrk(t: Target, connections: number, seconds: number): Promise<WrkResult> {
  const cpu0 = t.pid ? cpuUs(t.pid) : Number.NaN;
  const tx0 = await dbTransactions(t);
  const gcFrom = t.gcLog ? logSize(t.gcLog) : 0;
  const cmd = pin(1, ["wrk", "-t1", `-c${connections}`, `-d${seconds}s`, "--timeout", "10s", "-s", t.script, t.url]);
  const p = Bun.spawn(cmd, { stdout: "pipe", stderr: "inherit" });
  const out = await new Response(p.stdout).text();
  await p.exited;
  const cpu1 = t.pid ? cpuUs(t.pid) : Number.NaN;
  const tx1 = await dbTransactions(t);
  const gc = t.gcLog ? gcSince(t.gcLog, gcFrom) : undefined;
  const line = out.split("\n").find((l) => l.startsWith("RESULT "));
  if (!line) throw new Error(`wrk gave no result for ${t.name}: ${out}`);
  const r = JSON.parse(line.slice(7)) as { requests: number; us: number; status_errors: number; socket_errors: number; p50: number; p99: number };
  return {
    requests: r.requests,
    seconds: r.us / 1e6,
    rps: r.requests / (r.us / 1e6),
    errors: r.status_errors + r.socket_errors,
    p50Ms: r.p50 / 1000,
    p99Ms: r.p99 / 1000,
    cpuUsPerRequest: (cpu1 - cpu0) / r.requests,
    txPerRequest: (tx1 - tx0) / r.requests,
    ...(gc ? { gc } : {}),
  };
}

const f0 = (n: number) => (Number.isFinite(n) ? n.toFixed(0) : "n/a");
const f1 = (n: number) => (Number.isFinite(n) ? n.toFixed(1) : "n/a");
const f2 = (n: number) => (Number.isFinite(n) ? n.toFixed(2) : "n/a");
const f3 = (n: number) => (Number.isFinite(n) ? n.toFixed(3) : "n/a");
/** "lo–hi" over rounds (one value when there is one round). */
function range(xs: number[], fmt: (n: number) => string): string {
  const lo = Math.min(...xs);
  const hi = Math.max(...xs);
  return xs.length < 2 || fmt(lo) === fmt(hi) ? fmt(lo) : `${fmt(lo)}–${fmt(hi)}`;
}

/**
 * What the collections of one c1 run come to: requests per collection, the
 * young budget JSC reported (collections also come from Bun's own GC timers,
 * so it need not be what a request allocates), the pauses, and the samples
 * wrk's correction adds for them (a pause of P ms on a cycle of C ms adds
 * about P / C) as a share of all samples: over 1 % and the p99 is a pause.
 */
function gcLine(r: WrkResult, gc: GcWindow): string {
  const n = gc.young + gc.full;
  const cycleMs = (r.seconds * 1000) / r.requests;
  const added = gc.pausesMs.reduce((s, p) => s + Math.floor(p / cycleMs), 0);
  const sorted = [...gc.pausesMs].sort((a, b) => a - b);
  const mean = sorted.reduce((s, p) => s + p, 0) / (sorted.length || 1);
  return (
    `GC: ${gc.young} young + ${gc.full} full collections, 1 per ${f0(r.requests / n)} requests (young budget ${f1(gc.allowedBytes / 2 ** 20)} MB), ` +
    `pause mean ${f2(mean)} ms, max ${f2(sorted[sorted.length - 1] ?? Number.NaN)} ms; ` +
    `samples wrk adds for them ${added} = ${f2((100 * added) / (r.requests + added))} %` +
    (gc.others.young + gc.others.full > 0 ? `; the database worker's heap ${gc.others.young} young + ${gc.others.full} full (not the request thread's)` : "")
  );
}

const chatBody = (model: string) =>
  JSON.stringify({ model, messages: [{ role: "user", content: "Summarise the plot of Hamlet in two sentences." }], max_tokens: 64 });

function scriptFile(name: string, model: string, headers: Record<string, string>): string {
  const path = join(dir, `${name}.lua`);
  writeFileSync(path, luaScript(chatBody(model), { "Content-Type": "application/json", ...headers }));
  return path;
}

/**
 * A gateway from the checkout at `src` ("." is this one; --compare gives
 * another, e.g. a `git worktree` of the commit before a change), on its own
 * embedded database, with its own organisation and key.
 */
/** How a gateway is run: "gateway" as the compiled binary given by --binary, else (and "base" always) from its checkout's source with bun. */
function gatewayCmd(name: Target["name"]): string[] {
  return args.binary && name === "gateway" ? [String(args.binary)] : ["bun", "run", "src/main.ts"];
}

async function startGateway(src: string, name: Target["name"], simUrl: string): Promise<Target> {
  const config = join(dir, `${name}.json`);
  writeFileSync(
    config,
    JSON.stringify({
      host: "127.0.0.1",
      port: 0,
      dataDir: join(dir, `${name}-data`),
      logLevel: "info",
      accessLog: true,
      metrics: { enabled: true, listen: "127.0.0.1:0" },
      plans: { Bench: { requestsPerMinute: 100_000_000 } },
      aliases: { "svc-fast": { targets: [{ baseUrl: simUrl, model: UPSTREAM_MODEL, weight: 1 }] } },
      ...(args["gateway-config"] ? (JSON.parse(String(args["gateway-config"])) as Record<string, unknown>) : {}),
    }),
  );
  const cli = (argv: string[]): Record<string, string> => {
    const r = Bun.spawnSync([...gatewayCmd(name), ...argv, "--config", config, "--json"], { cwd: src, env, stderr: "pipe" });
    if (r.exitCode !== 0) throw new Error(`gateway ${argv.join(" ")} failed: ${r.stderr.toString()}`);
    return JSON.parse(r.stdout.toString()) as Record<string, string>;
  };
  const org = cli(["orgs", "create", "--name", "bench", "--plan", "Bench", "--quota-tokens", "1000000000000", "--quota-window", "month"]);
  const key = cli(["keys", "create", "--org", String(org.id), "--kind", "service", "--scopes", "inference"]).key;

  const logPath = join(dir, `${name}.log`);
  const profile = args.profile && name === "gateway" ? ["--cpu-prof", "--cpu-prof-md", "--cpu-prof-interval=200", `--cpu-prof-dir=${args.profile}`] : [];
  const gcLog = args.gc ? join(dir, `${name}.gc.log`) : undefined;
  const extra = name === "base" && args["base-env"] ? Object.fromEntries(String(args["base-env"]).split(",").map((kv) => [kv.slice(0, kv.indexOf("=")), kv.slice(kv.indexOf("=") + 1)])) : {};
  const gw = Bun.spawn(pin(0, args.binary && name === "gateway" ? [String(args.binary), "serve", "--config", config] : ["bun", ...profile, "run", "src/main.ts", "serve", "--config", config]), {
    cwd: src,
    env: gcLog ? { ...env, ...extra, BUN_JSC_logGC: "1" } : { ...env, ...extra },
    stdout: Bun.file(logPath),
    stderr: gcLog ? Bun.file(gcLog) : "inherit",
  });
  children.push(gw);
  const listening = await waitFor(`the gateway (${name}) to listen`, () => {
    let text = "";
    try {
      text = readFileSync(logPath, "utf8");
    } catch {
      return undefined;
    }
    const line = text.split("\n").find((l) => l.includes('"msg":"listening"'));
    return line ? (JSON.parse(line) as { url: string; metrics_url?: string | null }) : undefined;
  }, 60_000);
  return {
    name,
    url: `${listening.url}/v1/chat/completions`,
    script: scriptFile(name, "svc-fast", { Authorization: `Bearer ${key}` }),
    pid: gw.pid,
    ...(listening.metrics_url ? { metricsUrl: listening.metrics_url } : {}),
    ...(gcLog ? { gcLog } : {}),
  };
}

async function setup(): Promise<Target[]> {
  const sim = Bun.spawn(pin(1, ["bun", "run", "src/main.ts", "simulate-upstream", "--port", "0", "--ttft-ms", "0", "--inter-token-ms", "0", "--tokens", "16"]), {
    env,
    stdout: "pipe",
    stderr: "inherit",
  });
  children.push(sim);
  const simUrl = (JSON.parse(await firstLine(sim.stdout)) as { url: string }).url;

  const gateways = [await startGateway(".", "gateway", simUrl)];
  if (args.compare) gateways.push(await startGateway(String(args.compare), "base", simUrl));

  const bareGc = args.gc ? join(dir, "bare.gc.log") : undefined;
  const bp = Bun.spawn(pin(0, ["bun", "bench/bare-proxy.ts", "--upstream", simUrl]), {
    env: bareGc ? { ...env, BUN_JSC_logGC: "1" } : env,
    stdout: "pipe",
    stderr: bareGc ? Bun.file(bareGc) : "inherit",
  });
  children.push(bp);
  const bareUrl = (JSON.parse(await firstLine(bp.stdout)) as { url: string }).url;

  const script = (name: string, model: string, headers: Record<string, string>) => scriptFile(name, model, headers);
  return [
    { name: "direct", url: `${simUrl}/chat/completions`, script: script("direct", UPSTREAM_MODEL, {}) },
    { name: "bare", url: `${bareUrl}/chat/completions`, script: script("bare", UPSTREAM_MODEL, {}), pid: bp.pid, ...(bareGc ? { gcLog: bareGc } : {}) },
    ...gateways,
  ];
}

async function main() {
  ensureWrk();
  const rounds = Number(args.rounds);
  const seconds = Number(args.duration);
  const c1Seconds = Number(args["c1-duration"]);
  console.log(`gateway wrk bench: bun ${Bun.version}, ${cpus} CPUs, taskset ${pinned ? "on (gateway and bare proxy CPU 0; simulator and wrk CPU 1)" : "off"}`);
  console.log(`command: bun run bench:wrk${Bun.argv.length > 2 ? ` -- ${Bun.argv.slice(2).join(" ")}` : ""}`);
  console.log(`rounds ${rounds}, wrk -t1 -c64 -d${seconds}s and wrk -t1 -c1 -d${c1Seconds}s --latency per server and round\n`);
  // Profiling: load on the gateway alone, so the profile holds as little idle time as possible.
  // --only gateway,base: paired before/after runs of two checkouts without the direct and bare rounds.
  const only = args.only ? new Set(String(args.only).split(",")) : undefined;
  const targets = (await setup()).filter((t) => (!args.profile || t.name === "gateway") && (!only || only.has(t.name)));
  for (const t of targets) await wrk(t, 64, Number(args.warmup));

  const sat: Record<string, WrkResult[]> = {};
  const one: Record<string, WrkResult[]> = {};
  for (let i = 0; i < rounds; i++) {
    for (const t of targets) {
      const r = await wrk(t, 64, seconds);
      sat[t.name] = [...(sat[t.name] ?? []), r];
      console.log(
        `   round ${i + 1} ${t.name.padEnd(7)} c64: ${f0(r.rps)} req/s   p99 ${f2(r.p99Ms)} ms   errors ${r.errors}${t.pid ? `   CPU ${f1(r.cpuUsPerRequest)} µs/req` : ""}${t.metricsUrl ? `   ${f3(r.txPerRequest)} db tx/req` : ""}`,
      );
    }
    for (const t of targets) {
      const r = await wrk(t, 1, c1Seconds);
      one[t.name] = [...(one[t.name] ?? []), r];
      console.log(`   round ${i + 1} ${t.name.padEnd(7)} c1:  p50 ${f3(r.p50Ms)} ms   p99 ${f3(r.p99Ms)} ms   errors ${r.errors}`);
      if (r.gc) console.log(`                   ${gcLine(r, r.gc)}`);
    }
  }

  // A profiling run loads the gateway alone: nothing to compare against.
  if (args.profile) console.log(`\nprofile of the gateway: ${args.profile} (written when it exits)`);
  else if (!sat.direct || !sat.bare) {
    // --only without direct and bare: CPU per request of each target, and the pair's ratio per round.
    for (const [name, rs] of Object.entries(sat)) {
      const cpu = rs.map((r) => r.cpuUsPerRequest);
      console.log(`${name.padEnd(8)} CPU per request median ${f1(median(cpu))} µs (${cpu.map(f1).join(", ")}); req/s ${range(rs.map((r) => r.rps), f0)}`);
    }
    const base = sat.base;
    if (sat.gateway && base) {
      const ratios = sat.gateway.map((g, i) => g.cpuUsPerRequest / (base[i] as WrkResult).cpuUsPerRequest);
      console.log(`gateway/base CPU per request, per round: ${ratios.map(f3).join(", ")} (median ${f3(median(ratios))})`);
    }
  } else {
    const d = sat.direct ?? [];
    const b = sat.bare ?? [];
    const d1 = one.direct ?? [];
    const b1 = one.bare ?? [];
    // Ratios are taken within a round (the same minute of the machine's noise), then ranged.
    const per = (xs: WrkResult[], ys: WrkResult[], f: (x: WrkResult, y: WrkResult) => number) => xs.map((x, i) => f(x, ys[i] as WrkResult));
    console.log("\n| | req/s (c64) | vs direct | CPU per request | vs bare proxy | p99 added at c1 | db tx/request |");
    console.log("|---|---:|---:|---:|---:|---:|---:|");
    console.log(`| direct | ${range(d.map((r) => r.rps), f0)} | 1 | – | – | – | – |`);
    console.log(
      `| bare proxy | ${range(b.map((r) => r.rps), f0)} | ${range(per(b, d, (x, y) => x.rps / y.rps), f2)}× | ${range(b.map((r) => r.cpuUsPerRequest), f1)} µs | 1 | ${range(per(b1, d1, (x, y) => x.p99Ms - y.p99Ms), f2)} ms | – |`,
    );
    for (const name of ["gateway", "base"] as const) {
      const g = sat[name];
      const g1 = one[name] ?? [];
      if (!g) continue;
      console.log(
        `| ${name === "base" ? `base (${args.compare})` : "gateway"} | ${range(g.map((r) => r.rps), f0)} | ${range(per(g, d, (x, y) => x.rps / y.rps), f2)}× | ${range(g.map((r) => r.cpuUsPerRequest), f1)} µs | **${range(per(g, b, (x, y) => x.cpuUsPerRequest / y.cpuUsPerRequest), f2)}×** | ${range(per(g1, d1, (x, y) => x.p99Ms - y.p99Ms), f2)} ms | ${range(g.map((r) => r.txPerRequest), f3)} |`,
      );
      const cpuRatio = per(g, b, (x, y) => x.cpuUsPerRequest / y.cpuUsPerRequest);
      const vsDirect = per(g, d, (x, y) => x.rps / y.rps);
      const c1OverBare = per(g1, b1, (x, y) => x.p99Ms - y.p99Ms);
      console.log(`   ${name}: p99 at c1 minus the bare proxy's ${range(c1OverBare, f2)} ms`);
      // The targets judged on the median round, with how many rounds met each.
      const met = (xs: number[], ok: (x: number) => boolean) => `${xs.filter(ok).length} of ${xs.length} rounds`;
      console.log(
        `   ${name}, medians over the rounds: CPU ${f2(median(cpuRatio))}x the bare proxy's (<= 2.0 in ${met(cpuRatio, (x) => x <= 2)}); ` +
          `${f2(median(vsDirect))}x direct (>= 0.25 in ${met(vsDirect, (x) => x >= 0.25)}); ` +
          `c1 p99 ${f2(median(c1OverBare))} ms over the bare proxy's (<= 0.5 in ${met(c1OverBare, (x) => x <= 0.5)})`,
      );
    }
    if (sat.base && sat.gateway) {
      console.log(`   gateway/base CPU per request, per round: ${per(sat.gateway, sat.base, (x, y) => x.cpuUsPerRequest / y.cpuUsPerRequest).map(f3).join(", ")}`);
    }
    console.log("\ntargets: CPU/request <= 2.0x the bare proxy's; throughput >= 0.25x direct; p99 added at c1 <= the bare proxy's + 0.5 ms; db tx/request <= 0.01");
  }
  const errors = Object.values(sat)
    .concat(Object.values(one))
    .flat()
    .reduce((n, r) => n + r.errors, 0);
  if (errors > 0) console.log(`WARNING: ${errors} failed requests (non-2xx or socket errors) across all runs`);
}

await runBench(main, { children, dir, keep: args.keep === true, killAfterMs: 10_000 });
