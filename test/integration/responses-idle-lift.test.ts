import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { upstreamAliases } from "../../src/config/load.ts";
import { createLogger } from "../../src/lib/log.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { bearer, type SeededOrg, seedOrg, sharedDatabase, testConfig } from "../helpers/harness.ts";

setDefaultTimeout(90_000);

/**
 * A model that thinks longer than the connection's idle timer while the body
 * was read (idleTimeoutS + 8 s, in Bun's 4 s steps: at most ~12 s here) still
 * answers on every inference route: once the body is read the timer is lifted
 * until the answer is complete (src/http/idle.ts). The first token comes after
 * 16 s; the three calls run at once.
 */

let sim: Simulator;
let gw: Gateway;
let org: SeededOrg;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 16_000, interTokenMs: 0, completionTokens: 3 });
  const config = await testConfig({ aliases: upstreamAliases(sim.url), idleTimeoutS: 1, responses: { enabled: true } });
  gw = await startGateway({ config, database: await sharedDatabase(), log: createLogger("error", () => {}) });
  org = await seedOrg(gw.database);
}, 120_000);
afterAll(async () => {
  await gw?.stop();
  await sim?.stop();
});

const post = (path: string, body: Record<string, unknown>) =>
  fetch(`${gw.url}${path}`, { method: "POST", headers: bearer(org.serviceKey, { "content-type": "application/json" }), body: JSON.stringify(body) })
    .then(async (r) => `${r.status} ${(await r.text()).slice(0, 0)}`.trim())
    .catch((e: unknown) => `failed: ${String(e)}`);

describe("the idle timer is lifted while the model works", () => {
  test("chat, a Responses API answer and a streamed one, each 16 s in coming, all answer 200", async () => {
    const got = await Promise.all([
      post("/v1/chat/completions", { model: "svc-fast", messages: [{ role: "user", content: "think" }] }),
      post("/v1/responses", { model: "svc-fast", input: "think", store: false }),
      post("/v1/responses", { model: "svc-fast", input: "think", store: false, stream: true }),
    ]);
    expect(got).toEqual(["200", "200", "200"]);
  });
});
