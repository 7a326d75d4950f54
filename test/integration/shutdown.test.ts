import { afterAll, beforeAll, describe, expect, test, setDefaultTimeout } from "bun:test";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { sql } from "drizzle-orm";
import { createKey, createOrg } from "../../src/admin/service.ts";
import { type Database, migrate, openDatabase } from "../../src/db/client.ts";
import { charsToTokens } from "../../src/inference/tokens.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { TEST_DATABASE_URL } from "../helpers/harness.ts";
import { until } from "../helpers/poll.ts";
import {
  BUN,
  cleanEnv,
  createScratchDatabase,
  exitWithin,
  listeningUrl,
  MAIN,
  type Proc,
  removeScratch,
  scratchDir,
  startGatewayProcess,
  startInTerminal,
  type TerminalProc,
  waitFor200,
} from "../helpers/process.ts";

// Bun 1.4.5 applies a preload's setDefaultTimeout only to the first test file it
// runs (test/helpers/setup.ts), so files that spawn processes or open PGlite set
// their own: a cold PGlite start on a busy 2-core machine takes several seconds.
setDefaultTimeout(60_000);

/**
 * Graceful shutdown of a real `gateway serve` process: on SIGTERM it stops
 * accepting connections, lets in-flight requests and streams finish (up to
 * drainMs), writes buffered usage, closes the database and exits 0.
 * The slow in-flight work is a chat completion against the simulator with a
 * long time-to-first-token, so the request is provably in flight at SIGTERM.
 */

const work = scratchDir("gw-shutdown-");
const dataDir = join(work, "data");
let sim: Simulator;
let orgId = "";
let key = "";

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 1_500, interTokenMs: 40, completionTokens: 20 });
  // Set up the embedded database before the gateway owns it (one process at a time).
  const db = await openDatabase({ dataDir });
  try {
    await migrate(db);
    const org = await createOrg(db, { name: "Shutdown", plan: "Ultra", plans: ["Standard", "Ultra"] });
    orgId = org.id;
    key = (await createKey(db, { orgId, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" })).key;
  } finally {
    await db.close();
  }
});
afterAll(async () => {
  await sim?.stop();
  removeScratch();
});

async function startGateway(drainMs: number, upstream = sim): Promise<{ proc: Proc; base: string; port: number }> {
  const config = join(work, `config-${drainMs}.json`);
  writeFileSync(config, JSON.stringify({ drainMs, accessLog: true }));
  const proc = startGatewayProcess(["serve", "--port", "0", "--data-dir", dataDir, "--config", config], {
    env: cleanEnv({ UPSTREAM_BASE_URL: upstream.url }),
  });
  let base: string;
  let port: number;
  try {
    base = await listeningUrl(proc);
    port = Number(new URL(base).port);
    await waitFor200(`${base}/readyz`);
  } catch (e) {
    proc.kill("SIGKILL");
    throw e;
  }
  return { proc, base, port };
}

function chat(base: string, stream: boolean): Promise<Response> {
  return fetch(`${base}/v1/chat/completions`, {
    method: "POST",
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
    body: JSON.stringify({ model: "svc-fast", stream, messages: [{ role: "user", content: "Say something slowly." }] }),
  });
}

/** Wait until the simulator is serving `n` requests, i.e. they are in flight through the gateway. */
function inFlight(n: number, timeoutMs = 10_000): Promise<void> {
  return until(() => sim.stats.inFlight >= n, `${n} requests at the upstream`, timeoutMs, 10);
}

/** True when a new TCP connection to the port is refused. */
async function refusesConnections(port: number): Promise<boolean> {
  try {
    const s = await Bun.connect({ hostname: "127.0.0.1", port, socket: { data() {} } });
    s.end();
    return false;
  } catch {
    return true;
  }
}

describe("graceful shutdown of `gateway serve`", () => {
  test("SIGTERM: an in-flight stream and an in-flight JSON request complete, new connections are refused, exit 0", async () => {
    // A drain limit far above the bounds below: finishing early is the gateway's doing, not the limit's.
    const { proc, base, port } = await startGateway(60_000);
    try {
      sim.reset();
      const streaming = chat(base, true);
      const plain = chat(base, false);
      await inFlight(2);
      const t0 = Date.now();
      proc.kill("SIGTERM");
      await proc.waitForLine(/"msg":"shutting down"/, 5_000);

      // Refusing new work: the listener closes at once, while the two requests go on.
      await until(() => refusesConnections(port), "new connections refused", 10_000, 20);

      const s = await streaming;
      expect(s.status).toBe(200);
      expect(s.headers.get("content-type")).toContain("text/event-stream");
      const text = await s.text();
      expect(text.trimEnd().endsWith("data: [DONE]")).toBe(true);
      const chunks = text.split("\n\n").filter((e) => e.startsWith("data: {"));
      expect(chunks.length).toBeGreaterThanOrEqual(20);

      const p = await plain;
      expect(p.status).toBe(200);
      const body = (await p.json()) as { choices: { message: { content: string } }[]; usage: { completion_tokens: number } };
      expect(body.choices[0]?.message.content.length).toBeGreaterThan(0);
      expect(body.usage.completion_tokens).toBe(20);

      expect(await exitWithin(proc, 20_000)).toBe(0);
      // It waited for the requests (ttft 1.5 s + 20 tokens), not for the drain limit (60 s).
      expect(Date.now() - t0).toBeLessThan(20_000);
      expect(proc.stdout()).toContain('"msg":"stopped"');
      expect(proc.stdout()).not.toContain("drain time over");
    } finally {
      proc.kill("SIGKILL");
    }

    // Usage of both requests was written before the database closed.
    const db = await openDatabase({ dataDir });
    try {
      const rows = await db.rows<{ n: number; streamed: number }>(
        sql`select coalesce(sum(requests), 0)::int as n, coalesce(sum(requests) filter (where streamed), 0)::int as streamed from usage_events where org_id = ${orgId}`,
      );
      expect(rows[0]).toEqual({ n: 2, streamed: 1 });
    } finally {
      await db.close();
    }
  }, 60_000);

  test("SIGTERM with a stream longer than drainMs: at the drain limit the stream ends with an error event and a clean close; usage recorded; exit 0", async () => {
    // A 40-second stream (200 tokens, 200 ms apart) against a 0.5 s drain limit.
    const slow = await startSimulator({ port: 0, ttftMs: 100, interTokenMs: 200, completionTokens: 200 });
    const { proc, base } = await startGateway(500, slow);
    let text = "";
    try {
      const res = await chat(base, true);
      expect(res.status).toBe(200);
      const reader = res.body?.getReader();
      if (!reader) throw new Error("no body");
      const dec = new TextDecoder();
      const first = await reader.read();
      expect(first.done).toBe(false);
      text += dec.decode(first.value, { stream: true });
      const t0 = Date.now();
      proc.kill("SIGTERM");
      // Read to the end: a reset connection would throw here and fail the test.
      for (;;) {
        const r = await reader.read();
        if (r.done) break;
        text += dec.decode(r.value, { stream: true });
      }
      // Drain limit 0.5 s plus at most 1 s for the last events to go out, and the rest of the shutdown.
      expect(await exitWithin(proc, 15_000)).toBe(0);
      expect(Date.now() - t0).toBeLessThan(15_000);
      expect(proc.stdout()).toContain("drain time over");
    } finally {
      proc.kill("SIGKILL");
      await slow.stop();
    }
    // The stream's last event is an error in the wire shape, the way a mid-stream upstream failure ends.
    const { last, delivered } = cutStream(text);
    expect(Object.keys(last.error ?? {}).sort()).toEqual(["code", "message", "param", "type"]);

    // The cut stream's usage was written before the database closed: what was delivered, as a failed (503) stream.
    const db = await openDatabase({ dataDir });
    try {
      const rows = await db.rows<{ completion_tokens: number; prompt_tokens: number }>(
        sql`select completion_tokens, prompt_tokens from usage_events where org_id = ${orgId} and status = 503 and streamed`,
      );
      expect(rows.length).toBe(1);
      expect(rows[0]?.completion_tokens).toBe(charsToTokens(delivered.length));
      expect(rows[0]?.prompt_tokens).toBeGreaterThan(0);
    } finally {
      await db.close();
    }
  }, 60_000);

  test("SIGINT is graceful too; an idle gateway stops at once and releases the data directory", async () => {
    const { proc } = await startGateway(60_000);
    try {
      const t0 = Date.now();
      proc.kill("SIGINT");
      // "At once": far below the 60 s drain limit, with room for a busy machine.
      expect(await exitWithin(proc, 20_000)).toBe(0);
      expect(Date.now() - t0).toBeLessThan(20_000);
      expect(proc.stdout()).toContain('"signal":"SIGINT"');
    } finally {
      proc.kill("SIGKILL");
    }
    // The pid lock is gone: another process may open the directory now.
    const db = await openDatabase({ dataDir });
    await db.close();
  }, 60_000);
});

/**
 * A stream the gateway cut: no [DONE], its last event an error in the wire shape with code
 * service_unavailable, every event before it an ordinary chunk. That error, and the text the chunks
 * delivered (what the client was charged for; some was).
 */
function cutStream(text: string): { last: { error?: Record<string, unknown> }; delivered: string } {
  const events = text.split("\n\n").filter((e) => e.startsWith("data: "));
  expect(events).not.toContain("data: [DONE]");
  const last = JSON.parse(String(events.at(-1)).slice("data: ".length)) as { error?: Record<string, unknown> };
  expect(last.error?.code).toBe("service_unavailable");
  let delivered = "";
  for (const e of events.slice(0, -1)) {
    const chunk = JSON.parse(e.slice("data: ".length)) as { choices: { delta: { content?: string } }[] };
    delivered += chunk.choices[0]?.delta.content ?? "";
  }
  expect(delivered.length).toBeGreaterThan(0);
  return { last, delivered };
}

/**
 * A database of a test's own, a scratch Postgres (TEST_DATABASE_URL) or an embedded data directory, migrated,
 * with one organisation (a quota of 1,000,000 a month) and a service key of it.
 */
async function seededStore(name: string) {
  const pg = TEST_DATABASE_URL ? await createScratchDatabase(TEST_DATABASE_URL, `gw_${name}`) : undefined;
  const dir = join(work, `${name}-data`);
  const open = () => openDatabase(pg ? { databaseUrl: pg.url, dataDir: "", poolMax: 2 } : { dataDir: dir });
  const setup = await open();
  try {
    await migrate(setup);
    const org = await createOrg(setup, { name, plan: "Ultra", plans: ["Standard", "Ultra"], quotaTokens: 1_000_000, quotaWindow: "month" });
    const { key } = await createKey(setup, { orgId: org.id, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" });
    return { pg, dir, open, orgId: org.id, key };
  } finally {
    await setup.close();
  }
}

/** An organisation's usage counters, summed over its windows. */
async function countersOf(db: Database, orgId: string): Promise<{ used: number; leased: number } | undefined> {
  const [c] = await db.rows<{ used: number; leased: number }>(
    sql`select coalesce(sum(used), 0)::int as used, coalesce(sum(leased), 0)::int as leased from usage_counters where org_id = ${orgId}`,
  );
  return c;
}

describe(`the terminal \`gateway serve\` runs in is closed (SIGHUP; ${TEST_DATABASE_URL ? "Postgres" : "embedded database"})`, () => {
  test("a graceful stop like SIGTERM's: the request in flight finishes, buffered usage is written, the quota lease returned, exit 0", async () => {
    // An operator runs `serve` in the foreground of an SSH session and closes it: the kernel sends SIGHUP, and
    // every write to the terminal after that fails (EIO). SIGHUP's default action killed the process, and
    // once handled, the first log line the stop wrote to the dead terminal did: either way the usage settled
    // since the last write was lost, and the lease stranded until the period ended. The flush interval is
    // far longer than the test, so only the graceful stop can write the usage.
    const { pg, dir: hupDir, open, orgId: hupOrg, key: hupKey } = await seededStore("sighup");
    let proc: TerminalProc | undefined;
    try {
      const config = join(work, "config-sighup.json");
      writeFileSync(config, JSON.stringify({ drainMs: 60_000, accessLog: true, quota: { flushMs: 60_000 } }));
      proc = startInTerminal([BUN, "run", MAIN, "serve", "--port", "0", "--config", config, ...(pg ? [] : ["--data-dir", hupDir])], {
        env: cleanEnv({ UPSTREAM_BASE_URL: sim.url, DATABASE_URL: pg?.url }),
      });
      const base = await listeningUrl(proc);
      await waitFor200(`${base}/readyz`);
      const ask = async (stream: boolean): Promise<number> => {
        const res = await fetch(`${base}/v1/chat/completions`, {
          method: "POST",
          headers: { authorization: `Bearer ${hupKey}`, "content-type": "application/json" },
          body: JSON.stringify({ model: "svc-fast", stream, stream_options: stream ? { include_usage: true } : undefined, messages: [{ role: "user", content: "Hello." }] }),
        });
        expect(res.status).toBe(200);
        const text = await res.text();
        const last = stream ? String(text.split("\n\n").findLast((e) => e.includes('"usage":{'))).slice("data: ".length) : text;
        return (JSON.parse(last) as { usage: { total_tokens: number } }).usage.total_tokens;
      };

      let tokens = (await ask(false)) + (await ask(true));
      if (pg) {
        // Nothing written yet, the lease held (the data directory is the server's until it exits: Postgres only).
        const db = await open();
        try {
          const [c] = await db.rows<{ used: number; leased: number }>(sql`select used::int, leased::int from usage_counters where org_id = ${hupOrg}`);
          expect(c?.used).toBe(0);
          expect(c?.leased).toBeGreaterThan(0);
        } finally {
          await db.close();
        }
      }
      // One more in flight (1.5 s to its first token) when the terminal goes: the stop outlasts its first log lines.
      sim.reset();
      const inFlightAsk = ask(true);
      await inFlight(1);
      proc.hangUp();
      const last = await inFlightAsk;
      tokens += last;
      expect(await exitWithin(proc, 30_000)).toBe(0);

      const db = await open();
      try {
        expect(await countersOf(db, hupOrg)).toEqual({ used: tokens, leased: 0 });
        const events = await db.rows<{ n: number; t: number }>(
          sql`select coalesce(sum(requests), 0)::int as n, coalesce(sum(prompt_tokens + completion_tokens), 0)::int as t from usage_events where org_id = ${hupOrg}`,
        );
        expect(events[0]).toEqual({ n: 3, t: tokens });
      } finally {
        await db.close();
      }
    } finally {
      proc?.kill("SIGKILL");
      await proc?.exited;
      await pg?.drop();
    }
  }, 90_000);
});

describe(`a second stop signal during the drain (${TEST_DATABASE_URL ? "Postgres" : "embedded database"})`, () => {
  test("ends the drain at once: the open stream is cut with its error event and charged, usage written, the lease returned, exit 0; a third is only logged", async () => {
    // An operator presses Ctrl-C a second time (or systemd's SIGTERM follows a SIGHUP): they want it to stop
    // now, but not at the price of the usage settled since the last write and the quota leases. Before, the
    // first signal's handler removed itself, so the second signal's default action killed the process.
    const { pg, dir: twiceDir, open, orgId: twiceOrg, key: twiceKey } = await seededStore("twice");
    // A 40-second stream (200 tokens, 200 ms apart) against a 60-second drain limit: only the second signal ends it early.
    const slow = await startSimulator({ port: 0, ttftMs: 100, interTokenMs: 200, completionTokens: 200 });
    let proc: Proc | undefined;
    try {
      const config = join(work, "config-twice.json");
      // The flush interval is far longer than the test: only the graceful stop can write the usage.
      writeFileSync(config, JSON.stringify({ drainMs: 60_000, accessLog: true, quota: { flushMs: 60_000 } }));
      proc = startGatewayProcess(["serve", "--port", "0", "--config", config, ...(pg ? [] : ["--data-dir", twiceDir])], {
        env: cleanEnv({ UPSTREAM_BASE_URL: slow.url, DATABASE_URL: pg?.url }),
      });
      const base = await listeningUrl(proc);
      await waitFor200(`${base}/readyz`);

      const res = await fetch(`${base}/v1/chat/completions`, {
        method: "POST",
        headers: { authorization: `Bearer ${twiceKey}`, "content-type": "application/json" },
        body: JSON.stringify({ model: "svc-fast", stream: true, messages: [{ role: "user", content: "Say something slowly." }] }),
      });
      expect(res.status).toBe(200);
      const reader = res.body?.getReader();
      if (!reader) throw new Error("no body");
      const dec = new TextDecoder();
      let text = "";
      const first = await reader.read();
      expect(first.done).toBe(false);
      text += dec.decode(first.value, { stream: true });

      proc.kill("SIGTERM");
      await proc.waitForLine(/"msg":"shutting down"/, 10_000);
      const t0 = Date.now();
      // Ctrl-C twice more, back to back (two different signals, so neither is merged into the other):
      // one ends the drain, the other finds the gateway already stopping.
      proc.kill("SIGINT");
      proc.kill("SIGHUP");
      // Read to the end: a reset connection would throw here and fail the test.
      for (;;) {
        const r = await reader.read();
        if (r.done) break;
        text += dec.decode(r.value, { stream: true });
      }
      const code = await exitWithin(proc, 20_000);
      const out = proc.stdout();
      expect({ code, out: code === 0 ? "" : out }).toEqual({ code: 0, out: "" });
      // Well before the drain limit (60 s) and the stream's own end (40 s): the cut, at most 1 s for its last
      // bytes, and the final writes.
      expect(Date.now() - t0).toBeLessThan(15_000);
      expect(out).toContain("stop signal again: ending the drain now");
      expect(out).toContain("already stopping");
      expect(out).toContain('"msg":"stopped"');

      // The stream ended the way the drain limit ends one: an error event in the wire shape, no [DONE].
      const { delivered } = cutStream(text);

      // Its usage was written: what was delivered, as a failed (503) stream; the counter holds it and no lease is left.
      const db = await open();
      try {
        const rows = await db.rows<{ completion_tokens: number; prompt_tokens: number }>(
          sql`select completion_tokens, prompt_tokens from usage_events where org_id = ${twiceOrg} and status = 503 and streamed`,
        );
        expect(rows.length).toBe(1);
        expect(rows[0]?.completion_tokens).toBe(charsToTokens(delivered.length));
        const charged = (rows[0]?.completion_tokens ?? 0) + (rows[0]?.prompt_tokens ?? 0);
        expect(await countersOf(db, twiceOrg)).toEqual({ used: charged, leased: 0 });
      } finally {
        await db.close();
      }
    } finally {
      proc?.kill("SIGKILL");
      await proc?.exited;
      await slow.stop();
      await pg?.drop();
    }
  }, 90_000);
});

describe(`requests still waiting for the upstream's answer at the drain limit (${TEST_DATABASE_URL ? "Postgres" : "embedded database"})`, () => {
  test("each is answered 503 service_unavailable (not a reset connection), and its usage record is written by the stop's final usage write: 503, nothing charged, the lease returned, exit 0", async () => {
    // A JSON request and a stream whose upstream takes 30 s to its first byte, against a drain limit of 0.3 s.
    // Before, the forced close of their connections at the drain's end settled them asynchronously, as clients
    // that left, racing the final usage write; a record settled after it was lost.
    const { pg, dir: heldDir, open, orgId: heldOrg, key: heldKey } = await seededStore("held");
    const slow = await startSimulator({ port: 0, ttftMs: 30_000, interTokenMs: 10, completionTokens: 5 });
    let proc: Proc | undefined;
    try {
      const config = join(work, "config-held.json");
      // The flush interval is far longer than the test: only the graceful stop can write the usage.
      writeFileSync(config, JSON.stringify({ drainMs: 300, accessLog: true, quota: { flushMs: 60_000 }, upstream: { timeouts: { firstByteMs: 60_000 } } }));
      proc = startGatewayProcess(["serve", "--port", "0", "--config", config, ...(pg ? [] : ["--data-dir", heldDir])], {
        env: cleanEnv({ UPSTREAM_BASE_URL: slow.url, DATABASE_URL: pg?.url }),
      });
      const base = await listeningUrl(proc);
      await waitFor200(`${base}/readyz`);
      const ask = (stream: boolean) =>
        fetch(`${base}/v1/chat/completions`, {
          method: "POST",
          headers: { authorization: `Bearer ${heldKey}`, "content-type": "application/json" },
          body: JSON.stringify({ model: "svc-fast", stream, messages: [{ role: "user", content: "Say something slowly." }] }),
        }).then(
          async (r) => ({ status: r.status, code: ((await r.json().catch(() => ({}))) as { error?: { code?: string } }).error?.code }),
          (e: unknown) => ({ status: 0, code: `rejected: ${String(e)}` }),
        );
      const plain = ask(false);
      const streaming = ask(true);
      await until(() => slow.stats.inFlight >= 2, "both requests at the upstream", 10_000, 10);
      const t0 = Date.now();
      proc.kill("SIGTERM");
      const answers = await Promise.all([plain, streaming]);
      const code = await exitWithin(proc, 20_000);
      const out = proc.stdout();
      expect({ code, out: code === 0 ? "" : out }).toEqual({ code: 0, out: "" });
      expect(Date.now() - t0).toBeLessThan(15_000);
      expect(out).toContain("drain time over");
      expect(answers).toEqual([
        { status: 503, code: "service_unavailable" },
        { status: 503, code: "service_unavailable" },
      ]);

      const db = await open();
      try {
        const rows = await db.rows<{ status: number; streamed: boolean; prompt_tokens: number; completion_tokens: number }>(
          sql`select status, streamed, prompt_tokens, completion_tokens from usage_events where org_id = ${heldOrg} order by streamed`,
        );
        expect(rows).toEqual([
          { status: 503, streamed: false, prompt_tokens: 0, completion_tokens: 0 },
          { status: 503, streamed: true, prompt_tokens: 0, completion_tokens: 0 },
        ]);
        expect(await countersOf(db, heldOrg)).toEqual({ used: 0, leased: 0 });
      } finally {
        await db.close();
      }
    } finally {
      proc?.kill("SIGKILL");
      await proc?.exited;
      await slow.stop();
      await pg?.drop();
    }
  }, 90_000);
});
