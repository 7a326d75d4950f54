import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { TEST_PLANS, post, seedTestOrg, testAliases, upstreamSettings } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Hostile request bodies that found defects, each through real HTTP against a
 * gateway with the Responses API on: every one must get a 400 in the wire
 * shape naming the field, never a 500, and must not reach the upstream.
 * (fuzz.test.ts throws random input at every endpoint; these are the cases
 * it did not reach.)
 */

let sim: Simulator;
let gw: Gateway;
let org: SeededOrg;

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 3 });
  gw = await startTestGateway({ aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: upstreamSettings(), responses: { enabled: true } });
  org = await seedTestOrg(gw.database);
});
afterEach(() => sim.reset());
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

/** Sends a body as written (a string is sent verbatim, so it may hold what JSON.stringify would never write). */
const send = (path: string, body: unknown) => post(gw, path, org.serviceKey, body);

async function expect400(res: Response, param: string): Promise<string> {
  const text = await res.text();
  expect({ status: res.status, text }).toMatchObject({ status: 400 });
  const err = (JSON.parse(text) as { error: { message: string; type: string; param: string | null; code: string } }).error;
  expect({ type: err.type, code: err.code, param: err.param }).toEqual({ type: "invalid_request_error", code: "invalid_request_error", param });
  return err.message;
}

/** Names every object inherits (Object.prototype's): a lookup table keyed by them must not find anything. */
const PROTOTYPE_NAMES = ["toString", "constructor", "__proto__", "hasOwnProperty", "valueOf", "isPrototypeOf"];

describe("tag values that are Object.prototype's names", () => {
  test("chat: a message role such as 'toString' is an unknown role (400 messages[i].role), not a 500", async () => {
    for (const role of PROTOTYPE_NAMES) {
      const res = await send("/v1/chat/completions", { model: "svc-fast", messages: [{ role: "user", content: "hi" }, { role, content: "x" }] });
      const message = await expect400(res, "messages[1].role");
      expect(message).toContain("system, user, assistant, tool");
    }
    expect(sim.stats.requests).toBe(0);
  });

  test("Responses: an input item type such as 'constructor' is an unsupported type (400 input[j].type), not a 500", async () => {
    for (const type of PROTOTYPE_NAMES) {
      const res = await send("/v1/responses", { model: "svc-fast", input: [{ role: "user", content: "hi" }, { type }] });
      const message = await expect400(res, "input[1].type");
      expect(message).toContain("input items are message, function_call");
    }
    expect(sim.stats.requests).toBe(0);
  });

  test("parts and roles of those names are refused by name too (these held already)", async () => {
    for (const name of PROTOTYPE_NAMES) {
      await expect400(await send("/v1/chat/completions", { model: "svc-fast", messages: [{ role: "user", content: [{ type: name }] }] }), "messages[0].content[0].type");
      await expect400(await send("/v1/responses", { model: "svc-fast", input: [{ role: "user", content: [{ type: name }] }] }), "input[0].content[0].type");
      await expect400(await send("/v1/responses", { model: "svc-fast", input: [{ role: name, content: "x" }] }), "input[0].role");
    }
    expect(sim.stats.requests).toBe(0);
  });
});
