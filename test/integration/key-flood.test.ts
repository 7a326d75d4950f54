import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { randomBytes } from "node:crypto";
import net from "node:net";
import { createKey } from "../../src/admin/service.ts";
import type { Gateway } from "../../src/server.ts";
import { bearer, errorOf, seedOrg, sharedDatabase, startTestGateway } from "../helpers/harness.ts";

setDefaultTimeout(120_000);

/**
 * A flood of random well-formed keys (issue 13 item 9): lookups of keys not
 * in the cache are budgeted per client network (/24, /48) and in total;
 * beyond that the request gets 429 rate_limit_error with retry-after and no
 * database lookup. Keys already cached are never affected. Lookups are
 * counted through gateway_key_cache_total{result="miss"}.
 */

const PLANS = { Standard: { requestsPerMinute: 1_000_000 }, Ultra: { requestsPerMinute: 1_000_000 } };

function keyCache(unknownPerPrefixPerMin: number, unknownPerMin: number) {
  return { ttlMs: 60_000, max: 100_000, negativeTtlMs: 5_000, negativeMax: 10_000, unknownPerPrefixPerMin, unknownPerMin };
}

function randomKey(): string {
  const alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
  return `sk-gw-${[...randomBytes(43)].map((b) => alphabet[b % 62]).join("")}`;
}

/** gateway_key_cache_total{result=…}, read the way a scrape reads it. */
async function keyCacheCount(gw: Gateway, result: string): Promise<number> {
  const text = await gw.metrics.registry.metrics();
  const m = new RegExp(`^gateway_key_cache_total\\{result="${result}"\\} (\\d+)$`, "m").exec(text);
  return m ? Number(m[1]) : 0;
}

/** One GET over a socket bound to `from` (any 127/8 address is loopback), so the gateway sees that client address. */
function getFrom(gw: Gateway, from: string, path: string, headers: Record<string, string>): Promise<{ status: number; headers: string; body: string }> {
  return new Promise((resolve, reject) => {
    const sock = net.connect({ host: "127.0.0.1", port: gw.port, localAddress: from });
    let raw = "";
    sock.setTimeout(20_000, () => sock.destroy(new Error("timed out")));
    sock.on("data", (d) => {
      raw += d.toString("latin1");
    });
    sock.on("error", reject);
    sock.on("connect", () => {
      const lines = Object.entries({ host: "gw", connection: "close", ...headers }).map(([k, v]) => `${k}: ${v}`);
      sock.write(`GET ${path} HTTP/1.1\r\n${lines.join("\r\n")}\r\n\r\n`);
    });
    sock.on("close", () => {
      const at = raw.indexOf("\r\n\r\n");
      const status = Number(/^HTTP\/1\.1 (\d{3})/.exec(raw)?.[1] ?? 0);
      resolve({ status, headers: raw.slice(0, at).toLowerCase(), body: raw.slice(at + 4) });
    });
  });
}

describe("per client network", () => {
  const PER_PREFIX = 20;
  let gw: Gateway;
  beforeAll(async () => {
    gw = await startTestGateway({ plans: PLANS, keyCache: keyCache(PER_PREFIX, 1_000_000) });
  });
  afterAll(async () => {
    await gw.stop();
  });

  test("10,000 random keys from one /24 cost a bounded number of lookups; a cached key keeps working throughout", async () => {
    const org = await seedOrg(gw.database);
    expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(org.personalKey) })).status).toBe(200);
    const missesBefore = await keyCacheCount(gw, "miss");
    const t0 = performance.now();

    const statuses = new Map<number, number>();
    const cachedKeyStatuses: number[] = [];
    let retryAfterBad = 0;
    let next = 0;
    const TOTAL = 10_000;
    const worker = async () => {
      while (next < TOTAL) {
        const i = next++;
        if (i % 100 === 0) {
          const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(org.personalKey) });
          cachedKeyStatuses.push(res.status);
          await res.arrayBuffer();
        }
        const res = await fetch(`${gw.url}/v1/me`, { headers: bearer(randomKey()) });
        statuses.set(res.status, (statuses.get(res.status) ?? 0) + 1);
        if (res.status === 429) {
          const ra = Number(res.headers.get("retry-after"));
          const err = await errorOf(res);
          if (!(ra >= 1 && ra <= 60) || err.code !== "rate_limit_error" || err.type !== "rate_limit_error" || err.message.includes("budget_exceeded")) retryAfterBad++;
        } else await res.arrayBuffer();
      }
    };
    await Promise.all(Array.from({ length: 32 }, worker));
    const minutes = (performance.now() - t0) / 60_000;
    const lookups = (await keyCacheCount(gw, "miss")) - missesBefore;
    // The budget, plus what refills while the flood runs.
    const bound = PER_PREFIX + Math.ceil(PER_PREFIX * minutes) + 1;
    console.log(`flood: ${JSON.stringify([...statuses])}, ${lookups} lookups in ${(minutes * 60).toFixed(1)} s (bound ${bound})`);

    expect(lookups).toBeLessThanOrEqual(bound);
    expect(statuses.get(401) ?? 0).toBe(lookups);
    expect(statuses.get(429) ?? 0).toBe(TOTAL - lookups);
    expect([...statuses.keys()].sort()).toEqual([401, 429]);
    expect(retryAfterBad).toBe(0);
    expect(await keyCacheCount(gw, "throttled")).toBeGreaterThanOrEqual(TOTAL - lookups);
    expect(cachedKeyStatuses.length).toBe(TOTAL / 100);
    expect(new Set(cachedKeyStatuses)).toEqual(new Set([200]));
    // Another network's budget is its own: an unknown key from there is looked up (401), not throttled.
    const other = await getFrom(gw, "127.0.77.5", "/v1/me", bearer(randomKey()));
    expect(other.status).toBe(401);
  });

  test("a key that is found gives its lookup back: valid keys never use up the network's budget", async () => {
    const db = await sharedDatabase();
    const from = "127.0.78.9";
    // Twice the budget of distinct valid keys, none in the cache yet.
    const org = await seedOrg(db);
    for (let i = 0; i < 2 * PER_PREFIX; i++) {
      const k = await createKey(db, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" });
      expect((await getFrom(gw, from, "/v1/me", bearer(k.key))).status).toBe(200);
    }
    // …and the budget for unknown keys is still whole: at least PER_PREFIX of them are looked up before the first 429.
    let looked = 0;
    let res = await getFrom(gw, from, "/v1/me", bearer(randomKey()));
    while (res.status === 401 && looked < 3 * PER_PREFIX) {
      looked++;
      res = await getFrom(gw, from, "/v1/me", bearer(randomKey()));
    }
    expect(res.status).toBe(429);
    expect(res.headers).toMatch(/\r\nretry-after: \d+\r\n/);
    expect(looked).toBeGreaterThanOrEqual(PER_PREFIX);
  });

  test("a browser-looking request with a random key is charged too (its key is peeked at for the audit log)", async () => {
    const from = "127.0.79.1";
    const before = await keyCacheCount(gw, "miss");
    const results = await Promise.all(Array.from({ length: 200 }, () => getFrom(gw, from, "/v1/me", bearer(randomKey(), { origin: "https://x.example" }))));
    expect(new Set(results.map((r) => r.status))).toEqual(new Set([403]));
    // The peeks run after the answer: wait until the budget is spent, then no more lookups happen.
    const deadline = performance.now() + 10_000;
    while ((await getFrom(gw, from, "/v1/me", bearer(randomKey()))).status !== 429 && performance.now() < deadline) await Bun.sleep(10);
    expect((await keyCacheCount(gw, "miss")) - before).toBeLessThanOrEqual(PER_PREFIX + 2);
  });

  test("the budget is the /24's, not one address's: unknown keys from 40 addresses of one /24 share one budget; the next /24 has its own", async () => {
    // Each unknown key from a new address of 127.0.81.0/24: one network's budget, whatever address sends it.
    const statuses: number[] = [];
    for (let i = 0; i < 2 * PER_PREFIX; i++) statuses.push((await getFrom(gw, `127.0.81.${1 + i}`, "/v1/me", bearer(randomKey()))).status);
    const looked = statuses.filter((s) => s === 401).length;
    expect(looked).toBeGreaterThanOrEqual(PER_PREFIX);
    // The budget plus what refills meanwhile: far from one lookup per address.
    expect(looked).toBeLessThan(2 * PER_PREFIX);
    expect(statuses.at(-1)).toBe(429);
    // The next /24 is another network, with a budget of its own.
    expect((await getFrom(gw, "127.0.82.1", "/v1/me", bearer(randomKey()))).status).toBe(401);
  });
});

describe("all networks together", () => {
  const PER_ALL = 40;
  let gw: Gateway;
  beforeAll(async () => {
    gw = await startTestGateway({ plans: PLANS, keyCache: keyCache(1_000, PER_ALL) });
  });
  afterAll(async () => {
    await gw.stop();
  });

  test("random keys spread over many /24s are bounded by the global budget", async () => {
    const org = await seedOrg(gw.database);
    expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(org.serviceKey) })).status).toBe(200);
    const missesBefore = await keyCacheCount(gw, "miss");
    const t0 = performance.now();
    const results = await Promise.all(
      Array.from({ length: 60 }, async (_, n) => {
        const from = `127.0.${100 + n}.1`;
        const out: number[] = [];
        for (let i = 0; i < 3; i++) out.push((await getFrom(gw, from, "/v1/me", bearer(randomKey()))).status);
        return out;
      }),
    );
    const minutes = (performance.now() - t0) / 60_000;
    const lookups = (await keyCacheCount(gw, "miss")) - missesBefore;
    const flat = results.flat();
    expect(lookups).toBeLessThanOrEqual(PER_ALL + Math.ceil(PER_ALL * minutes) + 1);
    expect(flat.filter((s) => s === 401).length).toBe(lookups);
    expect(flat.filter((s) => s === 429).length).toBe(180 - lookups);
    // The cached key is untouched, from any network.
    expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(org.serviceKey) })).status).toBe(200);
    expect((await getFrom(gw, "127.0.200.1", "/v1/me", bearer(org.serviceKey))).status).toBe(200);
  });
});
