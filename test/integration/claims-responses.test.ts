import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { sql } from "drizzle-orm";
import { createKey, revokeKey } from "../../src/admin/service.ts";
import { upstreamAliases } from "../../src/config/load.ts";
import { createLogger } from "../../src/lib/log.ts";
import { createResponseStore } from "../../src/responses/store.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { bearer, type SeededOrg, seedOrg, sharedDatabase, testConfig } from "../helpers/harness.ts";
import { until } from "../helpers/poll.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(90_000);

/**
 * docs/operations.md, Stored responses: conversation content "is never written
 * to the audit log or the access log" (decisions.md, Retention: it lives only
 * in the `responses` table). secrets.test holds this for chat; this holds it
 * for every Responses API operation, with the access log on and debug logging.
 */

let sim: Simulator;
let gw: Gateway;
let org: SeededOrg;
const lines: string[] = [];

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 8 });
  const config = await testConfig({ aliases: upstreamAliases(sim.url), responses: { enabled: true }, accessLog: true, logLevel: "debug" });
  gw = await startGateway({ config, database: await sharedDatabase(), log: createLogger("debug", (l) => lines.push(l)) });
  org = await seedOrg(gw.database);
});
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

describe("Responses API content stays in the responses table", () => {
  test("input, instructions, metadata and output of stored, streamed, chained, listed and deleted responses: in no log line, audit event or usage row", async () => {
    const INPUT = "the confidential input Quokka-77";
    const INSTRUCTIONS = "the private instructions Narwhal-31";
    const META = "metadata value Axolotl-58";
    const FOLLOW = "a follow-up Pangolin-12";
    const post = (body: Record<string, unknown>) =>
      fetch(`${gw.url}/v1/responses`, { method: "POST", headers: bearer(org.serviceKey, { "content-type": "application/json" }), body: JSON.stringify(body) });

    const first = await post({ model: "svc-fast", input: INPUT, instructions: INSTRUCTIONS, metadata: { note: META } });
    expect(first.status).toBe(200);
    const one = (await first.json()) as { id: string; output_text: string };
    expect(one.output_text.length).toBeGreaterThan(0);
    const streamed = await post({ model: "svc-fast", input: FOLLOW, previous_response_id: one.id, stream: true });
    expect(streamed.status).toBe(200);
    const events = await streamed.text();
    expect(events).toContain("response.completed");
    const id2 = /"id":"(resp_[^"]+)"/.exec(events)?.[1];
    expect(id2).toBeDefined();
    for (const path of [`/v1/responses/${one.id}`, `/v1/responses/${one.id}/input_items`]) {
      const res = await fetch(`${gw.url}${path}`, { headers: bearer(org.serviceKey) });
      expect(res.status).toBe(200);
      // Retrieval gives the content back: it was stored.
      expect(await res.text()).toContain(path.endsWith("input_items") ? INPUT : META);
    }
    expect((await fetch(`${gw.url}/v1/responses/${id2}`, { method: "DELETE", headers: bearer(org.serviceKey) })).status).toBe(200);
    await gw.quota.flush();

    const logs = lines.join("");
    // The access log did run, for these routes.
    expect(logs).toContain('"msg":"request"');
    expect(logs).toContain("/v1/responses");
    const audit = (await gw.database.rows<{ row: string }>(sql`select row_to_json(a)::text as row from audit_events a where org_id = ${org.orgId}`)).map((r) => r.row).join("\n");
    const usage = (await gw.database.rows<{ row: string }>(sql`select row_to_json(u)::text as row from usage_events u where org_id = ${org.orgId}`)).map((r) => r.row).join("\n");
    expect(usage).toContain("svc-fast");
    // The model's words: the simulator answers with numbered tokens.
    const output = one.output_text.trim();
    for (const secret of [INPUT, INSTRUCTIONS, META, FOLLOW, output]) {
      expect({ secret, inLogs: logs.includes(secret), inAudit: audit.includes(secret), inUsage: usage.includes(secret) }).toEqual({
        secret,
        inLogs: false,
        inAudit: false,
        inUsage: false,
      });
    }
  });
});

describe("the Responses API's checks are chat's (decisions.md, Responses API: On top of chat)", () => {
  test("expired, revoked, missing and academy-only keys and browser requests on every Responses operation, each with its code", async () => {
    const KNOWN = ["svc-fast", "svc-smart", "svc-bigthink", "svc-embed"];
    const expired = await createKey(gw.database, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: KNOWN, tag: "gw", expiresAt: new Date(Date.now() - 1_000) });
    const revoked = await createKey(gw.database, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: KNOWN, tag: "gw" });
    await revokeKey(gw.database, revoked.id);
    const academy = await seedOrg(gw.database, { academyOnly: true });
    const made = await fetch(`${gw.url}/v1/responses`, {
      method: "POST",
      headers: bearer(org.serviceKey, { "content-type": "application/json" }),
      body: JSON.stringify({ model: "svc-fast", input: "hi" }),
    });
    expect(made.status).toBe(200);
    const id = ((await made.json()) as { id: string }).id;
    const operations: [string, string, unknown?][] = [
      ["POST", "/v1/responses", { model: "svc-fast", input: "hi" }],
      ["GET", `/v1/responses/${id}`],
      ["GET", `/v1/responses/${id}/input_items`],
      ["DELETE", `/v1/responses/${id}`],
    ];
    const callers: [string, Record<string, string>, number, string][] = [
      ["expired", bearer(expired.key), 401, "key_expired"],
      ["revoked", bearer(revoked.key), 401, "unauthorized"],
      ["no key", {}, 401, "unauthorized"],
      ["academy-only", bearer(academy.serviceKey), 403, "academy_only"],
      ["Origin", bearer(org.serviceKey, { origin: "https://app.example" }), 403, "browser_request_rejected"],
      ["Cookie", bearer(org.serviceKey, { cookie: "sid=1" }), 403, "browser_request_rejected"],
      ["Sec-Fetch-Site", bearer(org.serviceKey, { "sec-fetch-site": "same-origin" }), 403, "browser_request_rejected"],
    ];
    for (const [method, path, body] of operations) {
      for (const [who, headers, status, code] of callers) {
        const res = await fetch(`${gw.url}${path}`, { method, headers: { ...headers, "content-type": "application/json" }, ...(body ? { body: JSON.stringify(body) } : {}) });
        const err = ((await res.json()) as { error?: { code: string } }).error;
        expect({ method, path, who, status: res.status, code: err?.code }).toEqual({ method, path, who, status, code });
      }
    }
    // None of those touched the stored response: its owner still reads it.
    expect((await fetch(`${gw.url}/v1/responses/${id}`, { headers: bearer(org.serviceKey) })).status).toBe(200);
  });
});

describe("the retention sweep (decisions.md, Responses API: Retention)", () => {
  /** A stored response of this org's service key, and `n` expired copies of its row. */
  async function expiredRows(prefix: string, n: number): Promise<void> {
    const made = await fetch(`${gw.url}/v1/responses`, {
      method: "POST",
      headers: bearer(org.serviceKey, { "content-type": "application/json" }),
      body: JSON.stringify({ model: "svc-fast", input: "hi" }),
    });
    expect(made.status).toBe(200);
    const { id } = (await made.json()) as { id: string };
    await gw.database.rows(sql`
      insert into responses (id, org_id, owner_user_id, owner_key_id, input_items, response, expires_at)
      select ${prefix} || g, org_id, owner_user_id, owner_key_id, input_items, response, now() - interval '1 second'
      from responses, generate_series(1, ${n}) g where id = ${id}`);
  }
  const left = async (prefix: string) =>
    Number((await gw.database.rows<{ n: number }>(sql`select count(*)::int as n from responses where id like ${`${prefix}%`}`))[0]?.n);

  test("a sweep deletes every expired row, however many batches of 500 that takes", async () => {
    await expiredRows("resp_sweepmany", 1_201);
    expect(await left("resp_sweepmany")).toBe(1_201);
    const store = createResponseStore(gw.database, { retentionDays: 30, log: createLogger("silent"), maxReplayBytes: 1 << 20 });
    expect(await store.sweep()).toBeGreaterThanOrEqual(1_201);
    expect(await left("resp_sweepmany")).toBe(0);
  });

  test("an instance sweeps at start: expired rows present when it starts are deleted with no request and no 10-minute wait", async () => {
    await expiredRows("resp_sweepstart", 3);
    expect(await left("resp_sweepstart")).toBe(3);
    const config = await testConfig({ aliases: upstreamAliases(sim.url), responses: { enabled: true } });
    const second = await startGateway({ config, database: await sharedDatabase() });
    try {
      await until(async () => (await left("resp_sweepstart")) === 0, "the start-up sweep to delete the expired rows");
    } finally {
      await second.stop();
    }
  });
});

describe("a failing store write (decisions.md, Responses API: A damaged row or a failing database)", () => {
  test("is logged (error, with the response's id), and the answer is still given", async () => {
    await gw.database.rows(sql`alter table responses rename to responses_away`);
    const from = lines.length;
    try {
      const res = await fetch(`${gw.url}/v1/responses`, {
        method: "POST",
        headers: bearer(org.serviceKey, { "content-type": "application/json" }),
        body: JSON.stringify({ model: "svc-fast", input: "hi" }),
      });
      expect(res.status).toBe(200);
      const { id } = (await res.json()) as { id: string };
      await until(() => lines.slice(from).some((l) => l.includes("storing a response failed")), "the failed write to be logged");
      const line = JSON.parse(lines.slice(from).find((l) => l.includes("storing a response failed")) ?? "{}") as Record<string, unknown>;
      expect({ level: line.level, response_id: line.response_id }).toEqual({ level: "error", response_id: id });
    } finally {
      await gw.database.rows(sql`alter table responses_away rename to responses`);
    }
  });
});
