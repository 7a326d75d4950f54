import { readFileSync, readdirSync } from "node:fs";
import { monitorEventLoopDelay } from "node:perf_hooks";
import { Counter, Gauge, type Registry } from "./exposition.ts";

/**
 * The process metrics prom-client's `collectDefaultMetrics` exposed, with the
 * same names, help texts and meanings, read at scrape time:
 * `<prefix>process_*` (CPU, memory, descriptors, start time) and
 * `<prefix>nodejs_*` (event-loop delay, JavaScript heap, runtime version).
 * Left out (docs/decisions.md, "Our own metrics exposition"): the
 * `nodejs_active_{resources,handles,requests}` gauges and totals, which Bun
 * always answers empty (0), `nodejs_gc_duration_seconds`, which never had a
 * sample (Bun emits no `gc` performance entries), and, since 2026-11-24, the
 * per-space heap gauges (a walk of the whole heap on the request thread).
 */

const START_SECONDS = Math.round(Date.now() / 1000 - process.uptime());
const linux = process.platform === "linux";

/** VmRSS, VmSize and VmData of /proc/self/status, in bytes (a virtual file: never blocks). */
function procStatus(): { rss: number; size: number; data: number } | undefined {
  let text: string;
  try {
    text = readFileSync("/proc/self/status", "utf8");
  } catch {
    return undefined;
  }
  const kb = (field: string) => {
    const m = new RegExp(`^${field}:\\s*(\\d+) kB$`, "m").exec(text);
    return m ? Number(m[1]) * 1024 : Number.NaN;
  };
  return { rss: kb("VmRSS"), size: kb("VmSize"), data: kb("VmData") };
}

/** The soft limit on open files ("Max open files" in /proc/self/limits), read once. */
function maxFds(): number | undefined {
  try {
    const line = readFileSync("/proc/self/limits", "utf8")
      .split("\n")
      .find((l) => l.startsWith("Max open files"));
    const n = Number(line?.split(/ {2,}/)[1]);
    return Number.isFinite(n) ? n : undefined;
  } catch {
    return undefined;
  }
}

export function registerProcessMetrics(registry: Registry, prefix: string): void {
  const registers = [registry];

  // CPU since the process started (prom-client counted from the registry's creation, a moment later).
  let cpu = process.cpuUsage();
  const cpuUser = new Counter({
    name: `${prefix}process_cpu_user_seconds_total`,
    help: "Total user CPU time spent in seconds.",
    registers,
    collect() {
      const now = process.cpuUsage();
      const user = Math.max(0, now.user - cpu.user);
      const system = Math.max(0, now.system - cpu.system);
      cpu = now;
      cpuUser.inc(user / 1e6);
      cpuSystem.inc(system / 1e6);
      cpuTotal.inc((user + system) / 1e6);
    },
  });
  const cpuSystem = new Counter({ name: `${prefix}process_cpu_system_seconds_total`, help: "Total system CPU time spent in seconds.", registers });
  const cpuTotal = new Counter({ name: `${prefix}process_cpu_seconds_total`, help: "Total user and system CPU time spent in seconds.", registers });
  cpuUser.inc(cpu.user / 1e6);
  cpuSystem.inc(cpu.system / 1e6);
  cpuTotal.inc((cpu.user + cpu.system) / 1e6);

  // Constants set at each scrape, so a reset (tests) does not lose them.
  const start = new Gauge({
    name: `${prefix}process_start_time_seconds`,
    help: "Start time of the process since unix epoch in seconds.",
    registers,
    collect() {
      start.set(START_SECONDS);
    },
  });

  const resident = new Gauge({
    name: `${prefix}process_resident_memory_bytes`,
    help: "Resident memory size in bytes.",
    registers,
    collect() {
      const s = linux ? procStatus() : undefined;
      if (!s) {
        resident.set(process.memoryUsage.rss());
        return;
      }
      resident.set(s.rss);
      virtual?.set(s.size);
      heap?.set(s.data);
    },
  });
  const virtual = linux ? new Gauge({ name: `${prefix}process_virtual_memory_bytes`, help: "Virtual memory size in bytes.", registers }) : undefined;
  const heap = linux ? new Gauge({ name: `${prefix}process_heap_bytes`, help: "Process heap size in bytes.", registers }) : undefined;

  if (linux) {
    const open = new Gauge({
      name: `${prefix}process_open_fds`,
      help: "Number of open file descriptors.",
      registers,
      collect() {
        try {
          // Less the descriptor readdirSync itself held open while reading.
          open.set(readdirSync("/proc/self/fd").length - 1);
        } catch {
          // kept at its last value
        }
      },
    });
  }
  const max = maxFds();
  if (max !== undefined) {
    const g = new Gauge({ name: `${prefix}process_max_fds`, help: "Maximum number of open file descriptors.", registers, collect() {
      g.set(max);
    } });
  }

  // Event-loop delay: a 10 ms timer's lateness, summarised and reset at each scrape;
  // lag_seconds is how late a setImmediate ran at the previous scrape (prom-client's meaning).
  const delay = monitorEventLoopDelay();
  delay.enable();
  const lag = new Gauge({
    name: `${prefix}nodejs_eventloop_lag_seconds`,
    help: "Lag of event loop in seconds.",
    registers,
    collect() {
      const start = performance.now();
      setImmediate(() => lag.set((performance.now() - start) / 1000));
      lagMin.set(delay.min / 1e9);
      lagMax.set(delay.max / 1e9);
      lagMean.set(delay.mean / 1e9);
      lagStddev.set(delay.stddev / 1e9);
      lagP50.set(delay.percentile(50) / 1e9);
      lagP90.set(delay.percentile(90) / 1e9);
      lagP99.set(delay.percentile(99) / 1e9);
      delay.reset();
    },
  });
  const lagMin = new Gauge({ name: `${prefix}nodejs_eventloop_lag_min_seconds`, help: "The minimum recorded event loop delay.", registers });
  const lagMax = new Gauge({ name: `${prefix}nodejs_eventloop_lag_max_seconds`, help: "The maximum recorded event loop delay.", registers });
  const lagMean = new Gauge({ name: `${prefix}nodejs_eventloop_lag_mean_seconds`, help: "The mean of the recorded event loop delays.", registers });
  const lagStddev = new Gauge({
    name: `${prefix}nodejs_eventloop_lag_stddev_seconds`,
    help: "The standard deviation of the recorded event loop delays.",
    registers,
  });
  const lagP50 = new Gauge({ name: `${prefix}nodejs_eventloop_lag_p50_seconds`, help: "The 50th percentile of the recorded event loop delays.", registers });
  const lagP90 = new Gauge({ name: `${prefix}nodejs_eventloop_lag_p90_seconds`, help: "The 90th percentile of the recorded event loop delays.", registers });
  const lagP99 = new Gauge({ name: `${prefix}nodejs_eventloop_lag_p99_seconds`, help: "The 99th percentile of the recorded event loop delays.", registers });

  // process.memoryUsage() reads the heap's counters; it does not walk the heap (test/unit/metrics-scrape.test.ts).
  const heapTotal = new Gauge({
    name: `${prefix}nodejs_heap_size_total_bytes`,
    help: "Process heap size from Node.js in bytes.",
    registers,
    collect() {
      const m = process.memoryUsage();
      heapTotal.set(m.heapTotal);
      heapUsed.set(m.heapUsed);
      external.set(m.external);
    },
  });
  const heapUsed = new Gauge({ name: `${prefix}nodejs_heap_size_used_bytes`, help: "Process heap size used from Node.js in bytes.", registers });
  const external = new Gauge({ name: `${prefix}nodejs_external_memory_bytes`, help: "Node.js external memory size in bytes.", registers });

  const [major, minor, patch] = process.version.slice(1).split(".").map(Number);
  const versionLabels = { version: process.version, major: major ?? "", minor: minor ?? "", patch: patch ?? "" };
  const version = new Gauge({
    name: `${prefix}nodejs_version_info`,
    help: "Node.js version info.",
    labelNames: ["version", "major", "minor", "patch"] as const,
    registers,
    collect() {
      version.set(versionLabels, 1);
    },
  });
}
