import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { upstreamAliases } from "../../src/config/load.ts";
import { createLogger } from "../../src/lib/log.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { bearer, type SeededOrg, seedOrg, sharedDatabase, testConfig } from "../helpers/harness.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Slow clients: a body that stops arriving and an idle connection are cut off
 * after idleTimeoutS, while a model that thinks longer than that still answers.
 */

let sim: Simulator;
let gw: Gateway;
let org: SeededOrg;
const errors: string[] = [];

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 3_000, interTokenMs: 0, completionTokens: 3 });
  const config = await testConfig({ aliases: upstreamAliases(sim.url), idleTimeoutS: 1 });
  gw = await startGateway({ config, database: await sharedDatabase(), log: createLogger("error", (l) => errors.push(l)) });
  org = await seedOrg(gw.database);
});
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

/** Open a raw connection, send `text`, and resolve with how long the server kept it open (ms). */
function holdOpen(text: string, maxMs: number): Promise<number> {
  const url = new URL(gw.url);
  const started = Date.now();
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => resolve(Number.POSITIVE_INFINITY), maxMs);
    Bun.connect({
      hostname: url.hostname,
      port: Number(url.port),
      socket: {
        open(s) {
          s.write(text);
        },
        data() {},
        close() {
          clearTimeout(timer);
          resolve(Date.now() - started);
        },
        error(_s, e) {
          clearTimeout(timer);
          reject(e);
        },
      },
    }).catch(reject);
  });
}

describe("slow clients", () => {
  test("a request body that stops arriving is cut off", async () => {
    const head =
      `POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${org.serviceKey}\r\n` +
      "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n" +
      '{"model":"svc-fast","messages":[';
    const held = await holdOpen(head, 10_000);
    expect(held).toBeLessThan(10_000);
    // A body cut off is the client's failure (400), never an unhandled error of ours.
    await Bun.sleep(100);
    expect(errors.join("")).not.toContain("unhandled error");
  });

  test("an idle keep-alive connection is closed after idleTimeoutS", async () => {
    const held = await holdOpen("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 10_000);
    expect(held).toBeLessThan(10_000);
  });

  test("a model that thinks longer than the idle timeout still answers", async () => {
    const res = await fetch(`${gw.url}/v1/chat/completions`, {
      method: "POST",
      headers: bearer(org.serviceKey, { "content-type": "application/json" }),
      body: JSON.stringify({ model: "svc-fast", stream: true, messages: [{ role: "user", content: "think" }] }),
    });
    expect(res.status).toBe(200);
    const text = await res.text();
    expect(text).toContain("data: [DONE]");
  });
});
