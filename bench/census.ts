/**
 * What one non-streamed chat request allocates in the gateway's request
 * thread: `bun run bench/census.ts [--requests N] [--warmup N] > /dev/null`;
 * with `--stream` (or `--responses`, a Responses stream with `store: false`)
 * and `--tokens N`, what one streamed request of N upstream chunks allocates
 * (the access log goes to standard output, the figures to standard error);
 * `--reasoning N` puts N reasoning deltas before the answer (the simulator's
 * `reasoning_content` chunks, as vLLM's reasoning parsers send them);
 * the chunks come in one burst unless `--inter-token-ms M` (> 0) spaces them,
 * one read each, as a real server's.
 *
 * A gateway in this process (embedded database in memory, access log on,
 * metrics on, a quota on the organisation), the simulator and the client in
 * their own processes. After a warm-up and a full collection, N sequential
 * requests; `bun:jsc` heapStats() before and after gives the objects by type
 * a request leaves for the young generation to collect (heapStats has no
 * allocated-bytes figure: `bun run bench:wrk -- --gc` gives the bytes per
 * request from the young generation's budget). A window in which a
 * collection ran is measured again (a weak reference to a fresh object tells).
 *
 * `--promoted --stream|--responses --requests 64 --tokens 40 --inter-token-ms 20`: instead, what N streams
 * open at once leave in the old generation once they are over (a young collection while they are open
 * promotes their state; a full collection then frees it): per stream, in bytes and cells. That is what
 * fills the old generation towards a full collection, whose stop lands in every open stream's gaps.
 *
 * Why it matters (docs/benchmarks.md, "What wrk's p99 at concurrency 1
 * measures"): JSC collects the young generation when the bytes allocated since
 * the last collection reach a budget, and at concurrency 1 the p99 that wrk
 * reports counts those pauses. Fewer bytes a request, fewer pauses.
 */
import { heapStats } from "bun:jsc";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { createKey, createOrg } from "../src/admin/service.ts";
import { loadConfig } from "../src/config/load.ts";
import { createLogger } from "../src/lib/log.ts";
import { startGateway } from "../src/server.ts";
import { firstLine } from "./lib.ts";

const { values: args } = parseArgs({
  args: Bun.argv.slice(2),
  options: {
    requests: { type: "string", default: "300" },
    warmup: { type: "string", default: "3000" },
    windows: { type: "string", default: "5" },
    // Instead of the census: --requests streams at once, a young collection while they are open, and what they
    // leave in the old generation once over (what was promoted then died: the full collections' fuel), per stream.
    promoted: { type: "boolean", default: false },
    // Streamed requests instead (chat, or the Responses API with `store: false`), and the upstream's tokens per answer:
    // the difference between two token counts over their difference is what one more chunk leaves.
    stream: { type: "boolean", default: false },
    responses: { type: "boolean", default: false },
    tokens: { type: "string", default: "16" },
    // Reasoning deltas before the answer's tokens (a reasoning model behind vLLM's reasoning parser).
    reasoning: { type: "string", default: "0" },
    // The upstream's time between tokens: 0 sends the answer in one burst (a few reads for the whole stream);
    // above 0 each chunk comes in its own read, as from a real server, and what a read costs is counted too.
    "inter-token-ms": { type: "string", default: "0" },
    // Settings merged into the gateway's config (what a feature leaves per request: '{"accessLog":false}').
    "gateway-config": { type: "string" },
    // The organisation's token quota ("none": no quota, so no admission or lease per request).
    "quota-tokens": { type: "string", default: "1000000000000" },
  },
});
const N = Number(args.requests);

const sim = Bun.spawn(["bun", "run", "src/main.ts", "simulate-upstream", "--port", "0", "--ttft-ms", "0", "--inter-token-ms", String(Number(args["inter-token-ms"])), "--tokens", String(Number(args.tokens))], {
  stdout: "pipe",
  stderr: "inherit",
});
const simUrl = (JSON.parse(await firstLine(sim.stdout)) as { url: string }).url;
const reasoningDeltas = Math.max(0, Math.floor(Number(args.reasoning) || 0));
if (reasoningDeltas > 0) {
  // The simulator sends its reasoning text 4 characters a delta.
  const r = await fetch(`${new URL(simUrl).origin}/__sim/config`, { method: "POST", body: JSON.stringify({ reasoning: "hmm ".repeat(reasoningDeltas) }) });
  if (!r.ok) throw new Error(`simulator config: ${r.status}`);
}

// Configured through a file, as `serve --config` is.
const configFile = join(mkdtempSync(join(tmpdir(), "gateway-census-")), "config.json");
writeFileSync(
  configFile,
  JSON.stringify({
    logLevel: "info",
    accessLog: true,
    metrics: { enabled: true, listen: "127.0.0.1:0" },
    plans: { Bench: { requestsPerMinute: 100_000_000 } },
    // Only for --responses: the chat figures are measured on the default configuration, as before.
    ...(args.responses ? { responses: { enabled: true } } : {}),
    aliases: { "svc-fast": { targets: [{ baseUrl: simUrl, model: "sim/bench-model", weight: 1 }] } },
    ...(args["gateway-config"] ? (JSON.parse(args["gateway-config"]) as Record<string, unknown>) : {}),
  }),
);
const config = await loadConfig({ env: {}, file: configFile, overrides: { host: "127.0.0.1", port: 0, dataDir: "memory://" } });
// The access log is on and written as in production (standard output, buffered): run with `> /dev/null`; figures go to standard error.
const gw = await startGateway({ config, log: createLogger("info") });
const org = await createOrg(gw.database, { name: "census", plan: "Bench", plans: ["Bench"], ...(args["quota-tokens"] === "none" ? {} : { quotaTokens: Number(args["quota-tokens"]), quotaWindow: "month" as const }) });
const key = (await createKey(gw.database, { orgId: org.id, kind: "service", scopes: ["inference"], knownModels: ["svc-fast"], tag: "gw" })).key;

/** A client process that sends `n` sequential requests and exits. */
async function client(n: number): Promise<void> {
  const body = args.responses
    ? JSON.stringify({ model: "svc-fast", input: "Summarise the plot of Hamlet in two sentences.", stream: true, store: false })
    : JSON.stringify({
        model: "svc-fast",
        messages: [{ role: "user", content: "Summarise the plot of Hamlet in two sentences." }],
        // Never below the answer's tokens: a cap cut a long streamed answer short (64 chunks at --tokens 80) and so halved what a chunk seemed to cost.
        max_tokens: Math.max(64, Number(args.tokens)),
        ...(args.stream ? { stream: true } : {}),
      });
  const path = args.responses ? "/v1/responses" : "/v1/chat/completions";
  if (args.promoted) {
    // All at once, each stream read to its end.
    const code = `const h={"content-type":"application/json",authorization:${JSON.stringify(`Bearer ${key}`)}};await Promise.all(Array.from({length:${n}},async()=>{const r=await fetch(${JSON.stringify(`${gw.url}${path}`)},{method:"POST",headers:h,body:${JSON.stringify(body)}});if(r.status!==200){console.error(r.status,await r.text());process.exit(1)}await r.arrayBuffer()}))`;
    if ((await Bun.spawn(["bun", "-e", code], { stdout: "inherit", stderr: "inherit" }).exited) !== 0) throw new Error("client failed");
    return;
  }
  const code = `const h={"content-type":"application/json",authorization:${JSON.stringify(`Bearer ${key}`)}};for(let i=0;i<${n};i++){const r=await fetch(${JSON.stringify(`${gw.url}${path}`)},{method:"POST",headers:h,body:${JSON.stringify(body)}});if(r.status!==200){console.error(r.status,await r.text());process.exit(1)}await r.arrayBuffer()}`;
  const p = Bun.spawn(["bun", "-e", code], { stdout: "inherit", stderr: "inherit" });
  if ((await p.exited) !== 0) throw new Error("client failed");
}

if (args.promoted) {
  const { edenGC, fullGC, heapSize } = await import("bun:jsc");
  for (let i = 0; i < 3; i++) await client(N);
  const perStream: number[] = [];
  let types = "";
  for (let w = 0; w < Number(args.windows); w++) {
    fullGC();
    const open = client(N);
    // Mid-stream (the upstream's time between tokens times half the tokens): the open streams' state is promoted.
    await Bun.sleep((Number(args["inter-token-ms"]) * Number(args.tokens)) / 2 + 300);
    edenGC();
    await open;
    await Bun.sleep(50);
    edenGC();
    edenGC();
    const before = heapSize();
    const s0 = heapStats().objectTypeCounts;
    fullGC();
    perStream.push((before - heapSize()) / N);
    const s1 = heapStats().objectTypeCounts;
    if (w === 0) {
      const d = Object.entries(s0).map(([t, c]) => [t, (c - (s1[t] ?? 0)) / N] as const).filter(([, c]) => c >= 0.5);
      types = d.sort((a, b) => b[1] - a[1]).slice(0, 12).map(([t, c]) => `${t} ${c.toFixed(1)}`).join(", ");
    }
  }
  perStream.sort((a, b) => a - b);
  console.error(`promoted, then dead once over: ${perStream.map((x) => x.toFixed(0)).join(" ")} bytes a stream (median ${perStream[Math.floor(perStream.length / 2)]?.toFixed(0)}; ${N} at once); cells a stream: ${types}`);
  await gw.stop();
  sim.kill();
  process.exit(0);
}
await client(Number(args.warmup));
const per: { counts: Record<string, number> }[] = [];
for (let tries = 0; per.length < Number(args.windows) && tries < 50; tries++) {
  Bun.gc(true);
  const s0 = heapStats();
  let sentinel: WeakRef<object> | undefined = new WeakRef({ young: true });
  await client(N);
  const s1 = heapStats();
  // A collection in the window freed the sentinel (nothing else holds it): the counts are not the window's.
  if (sentinel.deref() === undefined) continue;
  sentinel = undefined;
  const counts: Record<string, number> = {};
  for (const [t, c] of Object.entries(s1.objectTypeCounts)) counts[t] = (c - (s0.objectTypeCounts[t] ?? 0)) / N;
  per.push({ counts });
}
const med = (xs: number[]) => xs.sort((a, b) => a - b)[Math.floor(xs.length / 2)] ?? Number.NaN;
console.error(`census: ${per.length} windows of ${N} sequential requests without a collection (medians over the windows, per request)`);
const types = new Set(per.flatMap((p) => Object.keys(p.counts)));
const rows = [...types].map((t) => [t, med(per.map((p) => p.counts[t] ?? 0))] as const).filter(([, c]) => c >= 0.5);
rows.sort((a, b) => b[1] - a[1]);
console.error(`  ${"all cells".padEnd(28)} ${rows.reduce((n, [, c]) => n + c, 0).toFixed(1)}`);
for (const [t, c] of rows) console.error(`  ${t.padEnd(28)} ${c.toFixed(1)}`);
await gw.stop();
sim.kill();
process.exit(0);
