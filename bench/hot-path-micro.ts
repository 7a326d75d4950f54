/**
 * Per-request costs of hot-path pieces, before and after the changes of
 * issue 17, measured in-process: `bun run bench/hot-path-micro.ts` (pin it:
 * `taskset -c 0 bun run bench/hot-path-micro.ts`). On a shared machine the
 * end-to-end figure (bench/wrk.ts) moves by more than any one of these; a
 * loop of a million iterations does not. "before" is the previous code,
 * kept here as it was; "after" is the code the gateway runs.
 */
import { Attempt } from "../src/inference/upstream/attempt.ts";
import { hexLineEnd, hexValue } from "../src/inference/upstream/http1-conn.ts";
import type { Target } from "../src/inference/upstream/targets.ts";
import { createLogger } from "../src/lib/log.ts";
import { Counter, Histogram, Registry } from "../src/metrics/exposition.ts";

const ROUNDS = 5;
const N = 300_000;

function measure(name: string, f: (i: number) => void): void {
  for (let i = 0; i < 20_000; i++) f(i);
  const us: number[] = [];
  for (let r = 0; r < ROUNDS; r++) {
    const t0 = performance.now();
    for (let i = 0; i < N; i++) f(i);
    us.push(((performance.now() - t0) * 1000) / N);
  }
  us.sort((a, b) => a - b);
  console.log(`${name.padEnd(64)} median ${(us[ROUNDS >> 1] ?? 0).toFixed(3)} µs   range ${(us[0] ?? 0).toFixed(3)}–${(us.at(-1) ?? 0).toFixed(3)}`);
}

// 1. The six metric updates of a non-streamed chat request. "before" (prom-client's
// labelled Counter and Histogram, 2.81 µs at 6c8002b, docs/benchmarks.md) left with
// prom-client itself; "after" is our own exposition's Map walk (src/metrics/exposition.ts).
const B = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300];
const r2 = [new Registry()];
const hot = {
  requests: new Counter({ name: "a", help: "a", labelNames: ["route", "method", "status", "code"] as const, registers: r2 }),
  duration: new Histogram({ name: "b", help: "b", labelNames: ["route"] as const, buckets: B, registers: r2 }),
  firstByte: new Histogram({ name: "c", help: "c", labelNames: ["alias"] as const, buckets: B, registers: r2 }),
  attempts: new Counter({ name: "d", help: "d", labelNames: ["alias", "target", "outcome"] as const, registers: r2 }),
  tokens: new Counter({ name: "e", help: "e", labelNames: ["alias", "direction"] as const, registers: r2 }),
};
const route = "/v1/chat/completions";
measure("metrics, 6 updates (Counter, Histogram of src/metrics/exposition.ts)", (i) => {
  const s = (i % 7) / 1000;
  hot.requests.inc({ route, method: "POST", status: 200, code: "" });
  hot.duration.record(route, s);
  hot.attempts.inc({ alias: "svc-fast", target: "sim-0", outcome: "ok" });
  hot.firstByte.record("svc-fast", s);
  hot.tokens.inc({ alias: "svc-fast", direction: "prompt" }, 12);
  hot.tokens.inc({ alias: "svc-fast", direction: "completion" }, 16);
});

// 2. The access-log line (written to a sink that drops it): its time stamp.
let sunk = 0;
// Reads the line's end, so a line built as a rope is flattened as the writer's join would.
const sink = (l: string) => {
  sunk += l.charCodeAt(l.length - 2);
};
const log = createLogger("info", sink);
const st = { id: "req_0123456789abcdef0123456789abcdef", start: performance.now(), orgId: "org_abc", keyId: "key_def", alias: "svc-fast", promptTokens: 12, completionTokens: 16, streamed: false };
const fields = () => ({
  request_id: st.id,
  method: "POST",
  route,
  status: 200,
  latency_ms: Math.round((performance.now() - st.start) * 100) / 100,
  org_id: st.orgId,
  key_id: st.keyId,
  alias: st.alias,
  prompt_tokens: st.promptTokens,
  completion_tokens: st.completionTokens,
  streamed: st.streamed,
  error: undefined,
});
measure("access log line: before (a Date formatted per line)", () => {
  sink(`${JSON.stringify({ time: new Date().toISOString(), level: "info", msg: "request", ...fields() })}\n`);
});
// 2026-11-25: the fields spliced after time, level and msg instead of merged
// into a copy measured the same (1.70 against 1.68 µs) and made five more
// small strings a line; not kept.
const timeOnce = new Date().toISOString();
measure("access log line: fields spliced after time, level, msg (not kept)", () => {
  const head = `{"time":"${timeOnce}","level":"info","msg":${JSON.stringify("request")}`;
  sink(`${head},${JSON.stringify(fields()).slice(1)}\n`);
});
measure("access log line: after (log.info, time formatted once per ms)", () => {
  log.info("request", fields());
});

// 3. An attempt's abort bookkeeping: the client's signal, the first-byte timer, the exchange's listener.
const client = new AbortController().signal;
const onAbort = () => {};
const abortListener = { handleEvent: onAbort };
const target = {} as Target;
measure("attempt bookkeeping: before (AbortController + listeners)", () => {
  const ac = new AbortController();
  const onClient = () => ac.abort();
  client.addEventListener("abort", onClient, { once: true });
  const timer = setTimeout(() => ac.abort(), 60_000);
  ac.signal.addEventListener("abort", onAbort, { once: true });
  ac.signal.removeEventListener("abort", onAbort);
  clearTimeout(timer);
  client.removeEventListener("abort", onClient);
});
measure("attempt bookkeeping: after (the Attempt is the signal)", () => {
  const a = new Attempt(target, client, 60_000);
  a.addEventListener("abort", abortListener);
  a.removeEventListener("abort", abortListener);
  a.clearTimer();
  a.unlink();
});
// 4. Per upstream chunk of a stream (2026-11-24): the chunk-size line, and the relay's error-event check.
const wire = Buffer.from("e3\r\ndata: {}\r\n");
const CRLF = Buffer.from("\r\n");
measure("chunk-size line: before (latin1 string, split, trim, regex, parseInt)", () => {
  const nl = wire.indexOf(CRLF, 0);
  const hex = (wire.toString("latin1", 0, nl).split(";", 1)[0] ?? "").trim();
  if (/^[0-9a-fA-F]{1,8}$/.test(hex)) sunk += Number.parseInt(hex, 16);
});
measure("chunk-size line: after (bytes)", () => {
  const end = hexLineEnd(wire, 0);
  if (end !== -1) sunk += hexValue(wire, 0, end);
});
const chunkEvent = Buffer.from('data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[]}\n\n');
const errorPrefixes = ['{"error"', '{"object":"error"', '{"object": "error"'].map((x) => Buffer.from(x));
const compareAt = (b: Buffer, at: number, p: Buffer) => b.length - at >= p.length && b.compare(p, 0, p.length, at, at + p.length) === 0;
const loopAt = (b: Buffer, at: number, p: Buffer) => {
  if (b.length - at < p.length) return false;
  for (let i = 0; i < p.length; i++) if (b[at + i] !== p[i]) return false;
  return true;
};
measure("error-event check of a chunk: before (three Buffer.compare)", () => {
  if (chunkEvent[6] === 0x7b && errorPrefixes.some((p) => compareAt(chunkEvent, 6, p))) sunk++;
});
measure("error-event check of a chunk: after (first bytes, then a byte loop)", () => {
  if (chunkEvent[6] === 0x7b && chunkEvent[7] === 0x22 && (chunkEvent[8] === 0x65 || chunkEvent[8] === 0x6f) && errorPrefixes.some((p) => loopAt(chunkEvent, 6, p))) sunk++;
});

// 5. Per chunk (2026-11-24, not changed): the relay awaits a read promise per
// upstream read; a callback pushed by the socket would skip that hop. What
// the hop costs: a queue read by an awaiting consumer against a direct call,
// each item handed over after a microtask as a socket read would be.
class HandOver {
  private waiter: ((v: { done: false; value: number }) => void) | undefined;
  private readonly queue: number[] = [];
  push(v: number): void {
    const w = this.waiter;
    if (w) {
      this.waiter = undefined;
      w({ done: false, value: v });
    } else this.queue.push(v);
  }
  read(): Promise<{ done: false; value: number }> {
    const v = this.queue.shift();
    if (v !== undefined) return Promise.resolve({ done: false, value: v });
    return new Promise((resolve) => {
      this.waiter = resolve;
    });
  }
}
async function measureAsync(name: string, f: (n: number) => Promise<void>): Promise<void> {
  await f(20_000);
  const us: number[] = [];
  for (let r = 0; r < ROUNDS; r++) {
    const t0 = performance.now();
    await f(N);
    us.push(((performance.now() - t0) * 1000) / N);
  }
  us.sort((a, b) => a - b);
  console.log(`${name.padEnd(64)} median ${(us[ROUNDS >> 1] ?? 0).toFixed(3)} µs   range ${(us[0] ?? 0).toFixed(3)}–${(us.at(-1) ?? 0).toFixed(3)}`);
}
await measureAsync("a chunk handed to an awaiting reader (a promise per read)", async (n) => {
  const q = new HandOver();
  const consumer = (async () => {
    for (let i = 0; i < n; i++) {
      const { value } = await q.read();
      sunk += value;
    }
  })();
  for (let i = 0; i < n; i++) {
    q.push(i);
    await null;
  }
  await consumer;
});
await measureAsync("a chunk handed to a callback", async (n) => {
  const take = (v: number) => {
    sunk += v;
  };
  for (let i = 0; i < n; i++) {
    take(i);
    await null;
  }
});
if (sunk < 0) console.log(sunk);

// 6. The usage writer's statements (2026-11-24): once a second per flush, one
// counter update per organisation with usage, and the batch guard. drizzle's
// query builder (before) against the SQL templates the writer now runs
// (after, as in src/limits/usage-writer.ts). A flush never runs often enough
// to get warm, so the first calls are the figure that counts.
{
  const { sql } = await import("drizzle-orm");
  const { drizzle } = await import("drizzle-orm/pglite");
  const schema = await import("../src/db/schema.ts");
  const { usageCounters, usageBatches } = schema;
  const db = drizzle({ client: {} as never, schema });
  const dialect = (db as unknown as { dialect: { sqlToQuery(s: unknown): { sql: string } } }).dialect;
  const d = { orgId: "6fc9ce56-d228-400c-9f3f-b9ff7f80d27f", start: Date.UTC(2026, 10, 1), used: 100, leased: -20 };
  const secs = 3.25;
  const before = () => {
    sunk += db.insert(usageBatches).values({ id: crypto.randomUUID() }).onConflictDoNothing().returning({ id: usageBatches.id }).toSQL().sql.length;
    sunk += db
      .insert(usageCounters)
      .values({ orgId: d.orgId, windowStart: new Date(d.start), used: d.used, leased: 0 })
      .onConflictDoUpdate({
        target: [usageCounters.orgId, usageCounters.windowStart],
        set: { used: sql`${usageCounters.used} + ${d.used}`, leased: sql`greatest(0, ${usageCounters.leased} + ${d.leased})` },
      })
      .returning({ used: usageCounters.used, leased: usageCounters.leased, wanted: sql<boolean>`coalesce(${usageCounters.wantedAt} > now() - make_interval(secs => ${secs}), false)` })
      .toSQL().sql.length;
  };
  const after = () => {
    sunk += dialect.sqlToQuery(sql`insert into usage_batches (id) values (${crypto.randomUUID()}) on conflict do nothing returning id`).sql.length;
    sunk += dialect.sqlToQuery(sql`
        insert into usage_counters (org_id, window_start, used, leased)
        values (${d.orgId}, timestamptz 'epoch' + ${d.start}::float8 * interval '1 millisecond', ${d.used}, 0)
        on conflict (org_id, window_start) do update
          set used = usage_counters.used + excluded.used, leased = greatest(0, usage_counters.leased + ${d.leased})
        returning used, leased, coalesce(wanted_at > now() - make_interval(secs => ${secs}), false) as wanted`).sql.length;
  };
  for (const [name, f] of [
    ["before (query builder)", before],
    ["after (SQL templates)", after],
  ] as const) {
    const first: number[] = [];
    for (let i = 0; i < 10; i++) {
      const t0 = performance.now();
      f();
      first.push((performance.now() - t0) * 1000);
    }
    for (let i = 0; i < 5_000; i++) f();
    const t0 = performance.now();
    for (let i = 0; i < 5_000; i++) f();
    const warm = ((performance.now() - t0) * 1000) / 5_000;
    console.log(`usage flush statements (batch guard + one counter), ${name.padEnd(24)} first 10 calls ${first.map((x) => x.toFixed(0)).join(" ")} µs; warm ${warm.toFixed(1)} µs`);
  }
}
