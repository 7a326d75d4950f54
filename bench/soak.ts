/**
 * Soak (issue 7): `bun run soak [-- --minutes 10 --rps 40]`.
 *
 * Runs the gateway as its own process (`gateway serve` on an embedded database
 * in a temporary directory) in front of an in-process simulated upstream, and
 * drives it at a steady rate with a mix of every endpoint: chat (JSON and
 * streamed), embeddings, models, /v1/me and the audit log, plus a share of
 * requests that must fail (unknown key, unknown model). Every 10 s it samples
 * the gateway's RSS and open file descriptors from /proc; at the end it prints
 * the series, the status counts, and a verdict: no unexpected status, and RSS
 * and descriptors flat (last third vs first third).
 */
import { mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { startSimulator } from "../src/sim/index.ts";

const { values: args } = parseArgs({
  args: Bun.argv.slice(2),
  options: { minutes: { type: "string", default: "10" }, rps: { type: "string", default: "40" }, sample: { type: "string", default: "10" } },
});
const MINUTES = Number(args.minutes);
const RPS = Number(args.rps);
const SAMPLE_S = Number(args.sample);
const ROOT = join(import.meta.dir, "..");
const MAIN = join(ROOT, "src/main.ts");

const dir = mkdtempSync(join(tmpdir(), "gw-soak-"));
const dataDir = join(dir, "data");
const sim = await startSimulator({ port: 0, ttftMs: 20, interTokenMs: 10, completionTokens: 12 });
const env = { PATH: process.env.PATH ?? "", HOME: process.env.HOME ?? "", UPSTREAM_BASE_URL: sim.url, LOG_LEVEL: "warn" };

async function cli(argv: string[]): Promise<Record<string, string>> {
  const p = Bun.spawn([process.execPath, "run", MAIN, ...argv, "--data-dir", dataDir, "--json"], { env, stdout: "pipe", stderr: "inherit" });
  const out = await new Response(p.stdout).text();
  if ((await p.exited) !== 0) throw new Error(`gateway ${argv.join(" ")} failed`);
  return JSON.parse(out) as Record<string, string>;
}

const org = await cli(["orgs", "create", "--name", "soak", "--quota-tokens", "1000000000000", "--quota-window", "month"]);
const key = (await cli(["keys", "create", "--org", org.id as string, "--kind", "service", "--scopes", "inference,audit:read"])).key as string;
const cfg = join(dir, "config.json");
await Bun.write(cfg, JSON.stringify({ plans: { Standard: { requestsPerMinute: 1_000_000 } }, accessLog: false }));
const port = 20_000 + Math.floor(Math.random() * 20_000);
const gw = Bun.spawn([process.execPath, "run", MAIN, "serve", "--port", String(port), "--data-dir", dataDir, "--config", cfg], {
  env,
  stdout: "ignore",
  stderr: "inherit",
});
const base = `http://127.0.0.1:${port}`;
for (let i = 0; ; i++) {
  try {
    if ((await fetch(`${base}/readyz`)).status === 200) break;
  } catch {}
  if (i > 600) throw new Error("gateway did not become ready");
  await Bun.sleep(100);
}

const auth = { authorization: `Bearer ${key}`, "content-type": "application/json" };
const chat = (stream: boolean) => ({
  method: "POST",
  headers: auth,
  body: JSON.stringify({ model: "svc-fast", stream, messages: [{ role: "user", content: "soak" }] }),
});
type Req = { name: string; path: string; init?: RequestInit; expect: number };
const MIX: Req[] = [
  { name: "chat", path: "/v1/chat/completions", init: chat(false), expect: 200 },
  { name: "chat", path: "/v1/chat/completions", init: chat(false), expect: 200 },
  { name: "stream", path: "/v1/chat/completions", init: chat(true), expect: 200 },
  { name: "stream", path: "/v1/chat/completions", init: chat(true), expect: 200 },
  { name: "embed", path: "/v1/embeddings", init: { method: "POST", headers: auth, body: JSON.stringify({ model: "svc-embed", input: ["a", "b"] }) }, expect: 200 },
  { name: "models", path: "/v1/models", init: { headers: auth }, expect: 200 },
  { name: "me", path: "/v1/me", init: { headers: auth }, expect: 200 },
  { name: "audit", path: "/v1/audit-events?limit=20", init: { headers: auth }, expect: 200 },
  { name: "badkey", path: "/v1/me", init: { headers: { authorization: `Bearer sk-gw-${"Q".repeat(43)}` } }, expect: 401 },
  {
    name: "badmodel",
    path: "/v1/chat/completions",
    init: { method: "POST", headers: auth, body: JSON.stringify({ model: "nope", messages: [{ role: "user", content: "x" }] }) },
    expect: 404,
  },
];

const counts = new Map<string, number>();
let unexpected = 0;
let inflight = 0;
const bump = (k: string) => counts.set(k, (counts.get(k) ?? 0) + 1);

async function one(r: Req) {
  inflight++;
  try {
    const res = await fetch(`${base}${r.path}`, { ...r.init, signal: AbortSignal.timeout(30_000) });
    await res.arrayBuffer();
    bump(`${r.name} ${res.status}`);
    if (res.status !== r.expect) unexpected++;
  } catch (e) {
    bump(`${r.name} error:${(e as Error).name}`);
    unexpected++;
  } finally {
    inflight--;
  }
}

function sampleProc(): { rssMb: number; fds: number } {
  const status = readFileSync(`/proc/${gw.pid}/status`, "utf8");
  const rss = Number(/VmRSS:\s+(\d+)/.exec(status)?.[1] ?? 0) / 1024;
  return { rssMb: Math.round(rss * 10) / 10, fds: readdirSync(`/proc/${gw.pid}/fd`).length };
}

const samples: { t: number; rssMb: number; fds: number; inflight: number }[] = [];
const started = performance.now();
const endAt = started + MINUTES * 60_000;
let sent = 0;
let nextSample = started;
const interval = 1000 / RPS;
let next = started;
console.log(`soak: ${MINUTES} min at ${RPS} req/s against ${base} (pid ${gw.pid})`);
while (performance.now() < endAt) {
  const now = performance.now();
  if (now >= nextSample) {
    const s = { t: Math.round((now - started) / 1000), ...sampleProc(), inflight };
    samples.push(s);
    console.log(`t=${s.t}s rss=${s.rssMb}MB fds=${s.fds} inflight=${s.inflight} sent=${sent} unexpected=${unexpected}`);
    nextSample += SAMPLE_S * 1000;
  }
  // Open loop: a fixed arrival rate, whatever the latency.
  while (next <= performance.now()) {
    void one(MIX[sent % MIX.length] as Req);
    sent++;
    next += interval;
  }
  await Bun.sleep(Math.max(1, next - performance.now()));
}
while (inflight > 0) await Bun.sleep(50);
const last = sampleProc();
samples.push({ t: Math.round((performance.now() - started) / 1000), ...last, inflight: 0 });
gw.kill("SIGTERM");
const code = await gw.exited;
await sim.stop();
rmSync(dir, { recursive: true, force: true });

// The first sample is before any traffic (pools not yet open): compare warmed-up thirds.
const warm = samples.slice(1);
const third = Math.max(1, Math.floor(warm.length / 3));
const avg = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
const early = warm.slice(0, third);
const late = warm.slice(-third);
const rssEarly = avg(early.map((s) => s.rssMb));
const rssLate = avg(late.map((s) => s.rssMb));
const fdsEarly = avg(early.map((s) => s.fds));
const fdsLate = avg(late.map((s) => s.fds));
console.log("\nstatus counts:");
for (const [k, v] of [...counts].sort()) console.log(`  ${k.padEnd(24)} ${v}`);
console.log(
  `\nsoak summary: requests=${sent} unexpected=${unexpected} rss_first_third=${rssEarly.toFixed(1)}MB rss_last_third=${rssLate.toFixed(1)}MB ` +
    `rss_max=${Math.max(...samples.map((s) => s.rssMb))}MB fds_first_third=${fdsEarly.toFixed(1)} fds_last_third=${fdsLate.toFixed(1)} exit=${code}`,
);
const flat = rssLate <= rssEarly * 1.25 + 10 && fdsLate <= fdsEarly + 5;
console.log(flat && unexpected === 0 && code === 0 ? "verdict: OK (flat memory and descriptors, no unexpected status)" : "verdict: CHECK");
process.exit(flat && unexpected === 0 && code === 0 ? 0 : 1);
