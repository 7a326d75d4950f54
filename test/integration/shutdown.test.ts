import { afterAll, beforeAll, describe, expect, test, setDefaultTimeout } from "bun:test";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { sql } from "drizzle-orm";
import { createKey, createOrg } from "../../src/admin/service.ts";
import { migrate, openDatabase } from "../../src/db/client.ts";
import { charsToTokens } from "../../src/inference/tokens.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { until } from "../helpers/poll.ts";
import { cleanEnv, exitWithin, listeningUrl, type Proc, removeScratch, scratchDir, startGatewayProcess, waitFor200 } from "../helpers/process.ts";

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
    const events = text.split("\n\n").filter((e) => e.startsWith("data: "));
    expect(events).not.toContain("data: [DONE]");
    const last = JSON.parse(String(events.at(-1)).slice("data: ".length)) as { error?: Record<string, unknown> };
    expect(Object.keys(last.error ?? {}).sort()).toEqual(["code", "message", "param", "type"]);
    expect(last.error?.code).toBe("service_unavailable");
    // Every event before it is an ordinary chunk; their text is what the client was charged for.
    let delivered = "";
    for (const e of events.slice(0, -1)) {
      const chunk = JSON.parse(e.slice("data: ".length)) as { choices: { delta: { content?: string } }[] };
      delivered += chunk.choices[0]?.delta.content ?? "";
    }
    expect(delivered.length).toBeGreaterThan(0);

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
