import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { readdirSync } from "node:fs";
import { revokeKey } from "../../src/admin/service.ts";
import { upstreamAliases } from "../../src/config/load.ts";
import { createLogger } from "../../src/lib/log.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { bearer, type SeededOrg, seedOrg, sharedDatabase, testConfig } from "../helpers/harness.ts";
import { eventually, until } from "../helpers/poll.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Hardening: keys and content never leak into logs, metrics or the audit log,
 * and upstream faults leave no descriptors behind.
 */

let sim: Simulator;
let gw: Gateway;
let org: SeededOrg;
const lines: string[] = [];
const PROMPT = "the secret prompt Zebra-42";

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 1, completionTokens: 8 });
  const config = await testConfig({
    aliases: upstreamAliases(sim.url),
    accessLog: true,
    logLevel: "debug",
    plans: { Standard: { requestsPerMinute: 1_000_000 }, Ultra: { requestsPerMinute: 1_000_000 } },
  });
  // Debug level and the access log on: everything the gateway would ever write.
  gw = await startGateway({ config, database: await sharedDatabase(), log: createLogger("debug", (l) => lines.push(l)) });
  org = await seedOrg(gw.database);
});
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

const chat = (key: string, stream = false) =>
  fetch(`${gw.url}/v1/chat/completions`, {
    method: "POST",
    headers: bearer(key, { "content-type": "application/json", "user-agent": "openai-node/6.1 secret-ua" }),
    body: JSON.stringify({ model: "svc-fast", stream, messages: [{ role: "user", content: PROMPT }] }),
  }).then(async (r) => ({ status: r.status, text: await r.text() }));

describe("secrets and content stay out of logs, metrics and the audit log", () => {
  test("valid, unknown, revoked and browser-borne keys; prompts and replies", async () => {
    const revoked = await seedOrg(gw.database);
    await revokeKey(gw.database, revoked.serviceKeyId);
    const unknown = `sk-gw-${"K".repeat(43)}`;
    expect((await chat(org.serviceKey)).status).toBe(200);
    expect((await chat(org.serviceKey, true)).status).toBe(200);
    expect((await chat(unknown)).status).toBe(401);
    const rev = await chat(revoked.serviceKey);
    expect(rev.status).toBe(401);
    expect(rev.text).not.toContain(revoked.serviceKey);
    const browser = await fetch(`${gw.url}/v1/me`, { headers: bearer(org.personalKey, { origin: "https://x.example" }) });
    expect(browser.status).toBe(403);
    await gw.quota.flush();
    // The security event is written off the request path: wait until it is there.
    await until(
      async () => (await (await fetch(`${gw.url}/v1/audit-events?limit=200`, { headers: bearer(org.serviceKey) })).text()).includes("security.browser_request_rejected"),
      "the browser request's security event in the audit log",
    );
    const metrics = await (await fetch(`${gw.metricsUrl}`)).text();
    const audit = await (await fetch(`${gw.url}/v1/audit-events?limit=200`, { headers: bearer(org.serviceKey) })).text();
    const auditRevoked = await (await fetch(`${gw.url}/v1/audit-events?limit=200`, { headers: bearer(org.serviceKey) })).text();
    const logs = lines.join("");
    expect(logs).toContain('"msg":"request"'); // the access log did run
    for (const secret of [org.serviceKey, org.personalKey, revoked.serviceKey, unknown, PROMPT, "token0 token1"]) {
      expect(logs).not.toContain(secret);
      expect(metrics).not.toContain(secret);
      expect(audit).not.toContain(secret);
      expect(auditRevoked).not.toContain(secret);
    }
    // The audit log holds a prefix of the address and a summary of the client, never more.
    expect(audit).toContain("security.browser_request_rejected");
    expect(audit).not.toContain("secret-ua");
    expect(audit).not.toContain("127.0.0.1\"");
  });
});

describe("a key pasted into the URL stays out of the logs and metrics", () => {
  test("the access line's route masks sk-… keys, bearer tokens and JWTs in the path and keeps the rest; the query is not logged", async () => {
    const jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJaZWJyYTQyIn0.c2lnbmF0dXJlWmVicmE0Mg";
    const opaque = "Q7xLmN3pR8sT2vW9yZ4bC6dF";
    const other = `sk-proj-${"Zz9".repeat(20)}`;
    const cases: [string, Record<string, string>, string][] = [
      [`/v1/${org.serviceKey}`, {}, "/v1/sk-…redacted"],
      [`/v1/models/${org.personalKey}`, bearer(org.personalKey), "/v1/models/sk-…redacted"],
      [`/${other}/v1/models`, {}, "/sk-…redacted/v1/models"],
      [`/v1/chat/completions/${org.serviceKey}/x`, {}, "/v1/chat/completions/sk-…redacted/x"],
      [`/v1/Bearer%20${opaque}`, {}, "/v1/Bearer%20…redacted"],
      [`/v1/models/${jwt}`, {}, "/v1/models/…redacted"],
      [`/v1/models?api_key=${org.serviceKey}`, bearer(org.serviceKey), "/v1/models"],
      [`/v1/nothing-here?key=${org.personalKey}&x=1`, {}, "/v1/nothing-here"],
    ];
    for (const [path, headers] of cases) {
      const res = await fetch(`${gw.url}${path}`, { headers });
      await res.text();
      const id = String(res.headers.get("x-request-id"));
      await until(() => lines.some((l) => l.includes(`"request_id":"${id}"`) && l.includes('"msg":"request"')), `the access line of ${id}`);
    }
    const logs = lines.join("");
    const metrics = await (await fetch(`${gw.metricsUrl}`)).text();
    for (const secret of [org.serviceKey, org.personalKey, other, jwt, opaque, org.serviceKey.slice(10, 30), org.personalKey.slice(-20)]) {
      expect(logs).not.toContain(secret);
      expect(metrics).not.toContain(secret);
    }
    // Operators can still read what was asked for: the path around the masked part stays.
    const routes = lines.map((l) => JSON.parse(l) as Record<string, unknown>).filter((l) => l.msg === "request").map((l) => String(l.route));
    for (const [, , expected] of cases) expect(routes).toContain(expected);
  });

  test("a key or token percent-encoded in the path (any character of it, in either case, twice over, after a malformed escape) is masked all the same", async () => {
    /** Every character as its escape: `sk-…` as `%73%6B%2D…`. */
    const escaped = (s: string, lower = false) =>
      [...s].map((c) => `%${c.charCodeAt(0).toString(16).padStart(2, "0")[lower ? "toLowerCase" : "toUpperCase"]()}`).join("");
    const key = org.serviceKey;
    // Another service's key, with `_` and `-` in its secret (OpenAI's project keys).
    const other = `sk-proj-Ab9_cD8-${"Yx7".repeat(15)}_Wv6`;
    const opaque = "P5kQ7mW2nR9tX4vB8cZ3hJ6";
    const jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJZZWJyYTQzIn0.c2lnbmF0dXJlWWVicmE0Mw";
    const cases: [string, string][] = [
      [`/v1/sk%2D${key.slice(3)}`, "/v1/sk-…redacted"],
      [`/v1/sk%2d${key.slice(3).replaceAll("-", "%2d")}`, "/v1/sk-…redacted"],
      [`/v1/%73${key.slice(1)}`, "/v1/sk-…redacted"],
      [`/v1/${escaped(key)}`, "/v1/sk-…redacted"],
      [`/v1/models/${escaped(key, true)}/x`, "/v1/models/sk-…redacted/x"],
      [`/v1/${other.replaceAll("_", "%5F")}`, "/v1/sk-…redacted"],
      [`/v1/Bearer%2B${opaque}`, "/v1/Bearer%2B…redacted"],
      [`/v1/%42earer%20${key}`, "/v1/%42earer%20…redacted"],
      [`/v1/x/Bearer%20${opaque.slice(0, 9)}%3F${opaque.slice(9)}`, "/v1/x/Bearer%20…redacted"],
      [`/v1/models/${jwt.replaceAll(".", "%2E")}`, "/v1/models/…redacted"],
      // Encoded twice: `%2573` is `%73` once decoded, `s` twice.
      [`/v1/%2573%256B%252D${key.slice(3)}`, "/v1/sk-…redacted"],
      // A malformed escape (not two hex digits, or cut off at the end) is kept as it is, and what follows still read.
      [`/v1/%ZZ/%E0%A4%/sk%2D${key.slice(3)}`, "/v1/%ZZ/%E0%A4%/sk-…redacted"],
      [`/v1/x%/${other}%`, "/v1/x%/sk-…redacted%"],
      // The query is not logged, escaped key or not.
      [`/v1/nothing-here?api_key=sk%2D${key.slice(3)}&key=${escaped(key)}`, "/v1/nothing-here"],
    ];
    const from = lines.length;
    for (const [path] of cases) {
      const res = await fetch(`${gw.url}${path}`);
      await res.text();
      const id = String(res.headers.get("x-request-id"));
      await until(() => lines.some((l) => l.includes(`"request_id":"${id}"`) && l.includes('"msg":"request"')), `the access line of ${path}`);
    }
    const logged = lines.slice(from);
    const logs = logged.join("");
    const metrics = await (await fetch(`${gw.metricsUrl}`)).text();
    const secrets = [key.slice(6), key.slice(10, 30), key.slice(-20), other.slice(8), "Yx7Yx7Yx7", opaque, opaque.slice(9), jwt.slice(20, 40), escaped(key.slice(10, 20)), escaped(key.slice(10, 20), true)];
    for (const secret of secrets) {
      expect(logs).not.toContain(secret);
      expect(metrics).not.toContain(secret);
    }
    const routes = logged.map((l) => JSON.parse(l) as Record<string, unknown>).filter((l) => l.msg === "request").map((l) => String(l.route));
    expect(routes).toEqual(cases.map(([, expected]) => expected));
  });
});

describe("a key sent as the x-request-id is not taken as the request's id", () => {
  test("sk-… keys, bearer tokens and JWTs: a generated id answers, is logged and is sent upstream; the value is in no log line", async () => {
    const jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJaZWJyYTQyIn0.c2lnbmF0dXJlWmVicmE0Mg";
    const other = `sk-proj-${"Zz9".repeat(20)}`;
    const values = [org.serviceKey, org.personalKey, other, `trace.${org.serviceKey}`, jwt, `Bearer:${jwt}`, `bearer:Q7xLmN3pR8sT2vW9yZ4bC6dF`, `Bearer ${org.serviceKey}`];
    /** Each value the gateway took as the request's id (answered with, logged, sent upstream). */
    const taken: string[] = [];
    for (const value of values) {
      const res = await fetch(`${gw.url}/v1/chat/completions`, {
        method: "POST",
        headers: bearer(org.serviceKey, { "content-type": "application/json", "x-request-id": value }),
        body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }),
      });
      expect(res.status).toBe(200);
      await res.text();
      const id = String(res.headers.get("x-request-id"));
      if (!/^req_[0-9a-f]{32}$/.test(id)) taken.push(id);
      // The upstream is sent the generated id, not the value.
      expect(sim.stats.lastHeaders?.get("x-request-id")).toBe(id);
      await until(() => lines.some((l) => l.includes(`"request_id":"${id}"`) && l.includes('"msg":"request"')), `the access line of ${id}`);
    }
    expect(taken).toEqual([]);
    const logs = lines.join("");
    for (const value of values) expect(logs).not.toContain(value.replace(/^(trace\.|bearer[: ])/i, ""));
    // An ordinary id is still the caller's own, on every line of its request.
    for (const plain of ["trace-123", "task-7.sk_ok", "0af7651916cd43dd8448eb211c80319c"]) {
      const res = await fetch(`${gw.url}/v1/models`, { headers: bearer(org.serviceKey, { "x-request-id": plain }) });
      await res.text();
      expect(res.headers.get("x-request-id")).toBe(plain);
    }
  });
});

describe("upstream faults leave nothing behind", () => {
  test("hangs, drops, 503s and client aborts: descriptors return to where they were", async () => {
    const fds = () => readdirSync("/proc/self/fd").length;
    // Warm the pools first so the baseline includes them.
    for (let i = 0; i < 5; i++) await chat(org.serviceKey);
    const before = fds();
    const rounds: (() => Promise<unknown>)[] = [];
    for (let i = 0; i < 20; i++) {
      rounds.push(async () => {
        sim.setFault({ kind: "drop-mid-stream", afterChunks: 3 });
        await chat(org.serviceKey, true);
        sim.setFault({ kind: "status", status: 503 });
        await chat(org.serviceKey);
        sim.setFault({ kind: "hang" });
        const ac = new AbortController();
        const pending = fetch(`${gw.url}/v1/chat/completions`, {
          method: "POST",
          signal: ac.signal,
          headers: bearer(org.serviceKey, { "content-type": "application/json" }),
          body: JSON.stringify({ model: "svc-fast", stream: true, messages: [{ role: "user", content: "hang" }] }),
        }).catch(() => undefined);
        // Abort once the request hangs at the upstream (the case under test), not before it got there.
        await until(() => sim.stats.inFlight === 1, "the hanging request at the upstream");
        ac.abort();
        await pending;
        sim.setFault(null);
      });
    }
    for (const r of rounds) await r();
    sim.setFault(null);
    // Aborted upstream requests must be gone from the simulator too.
    await until(() => sim.stats.inFlight === 0, "no request left at the upstream");
    expect((await chat(org.serviceKey)).status).toBe(200);
    // Closed sockets are released asynchronously: poll for the count to come back.
    // Keep-alive pools may hold a few more connections; a leak would grow with the 60 requests.
    const after = await eventually(fds, (n) => n - before <= 10, `descriptors back within 10 of ${before}`);
    console.log(`descriptors: before=${before} after=${after} (60 faulty requests)`);
    expect(after - before).toBeLessThanOrEqual(10);
  });
});
