import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { ConfigError, loadConfig } from "../../src/config/load.ts";
import { createLogger } from "../../src/lib/log.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { errorOf, rejectionOf, type SeededOrg, sharedDatabase, testConfig } from "../helpers/harness.ts";
import { TEST_PLANS, arr, post, rec, seedTestOrg, testAliases, upstreamSettings } from "./inference-fixtures.ts";

setDefaultTimeout(30_000);

/**
 * Image URLs are fetched by the inference server inside the operator's
 * network: internal hosts are refused (issue 13 item 12). DNS is the one
 * outside service here, so the tests stand in for it with a table of names.
 */

const DNS: Record<string, string[] | "nx" | "hang"> = {
  "cdn.example.com": ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"],
  "internal.example.com": ["10.1.2.3"],
  "mixed.example.com": ["93.184.216.34", "::1"],
  "meta.example.com": ["fd00:ec2::254"],
  "mapped.example.com": ["::ffff:169.254.169.254"],
  "linklocal.example.com": ["fe80::1%eth0"],
  "nx.example.com": "nx",
  "slow.example.com": "hang",
};
const lookups: string[] = [];
function lookup(host: string): Promise<string[]> {
  lookups.push(host);
  // A resolver may also fail before it returns a promise.
  if (host === "throws.example.com") throw new Error("resolver crashed");
  const a = DNS[host];
  if (a === "hang") return new Promise<string[]>(() => {});
  if (a === undefined || a === "nx") return Promise.reject(Object.assign(new Error(`getaddrinfo ENOTFOUND ${host}`), { code: "ENOTFOUND" }));
  return Promise.resolve(a);
}

let sim: Simulator;
let org: SeededOrg;
const gateways: Gateway[] = [];
let gw: Gateway;
const RESOLVE_MS = 300;

async function gateway(imageUrls?: Record<string, unknown>): Promise<Gateway> {
  const config = await testConfig({ aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: { ...upstreamSettings(), ...(imageUrls ? { imageUrls } : {}) } });
  const g = await startGateway({ config, database: await sharedDatabase(), log: createLogger("silent"), lookup });
  gateways.push(g);
  return g;
}

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 2 });
  gw = await gateway({ allowPrivate: false, allow: [], resolveTimeoutMs: RESOLVE_MS });
  org = await seedTestOrg(gw.database);
});
afterEach(() => {
  sim.reset();
  lookups.length = 0;
});
afterAll(async () => {
  for (const g of gateways) await g.stop();
  await sim.stop();
});

const withImage = (url: string) => ({
  model: "svc-fast",
  messages: [{ role: "user", content: [{ type: "text", text: "what is this?" }, { type: "image_url", image_url: { url } }] }],
});
const chat = (g: Gateway, body: unknown, key: string | undefined = org.personalKey) => post(g, "/v1/chat/completions", key, body);
const forwardedUrl = () => rec(rec(arr(rec(arr(rec(sim.stats.lastBody).messages)[0]).content)[1]).image_url).url;

async function expectRefusedAt(res: Response, param: string, messageHas?: string): Promise<void> {
  expect(res.status).toBe(400);
  const err = await errorOf(res);
  expect(err.code).toBe("invalid_request_error");
  expect(err.param).toBe(param);
  if (messageHas) expect(err.message).toContain(messageHas);
}
const expectRefused = (res: Response, messageHas?: string) => expectRefusedAt(res, "messages[0].content[1].image_url.url", messageHas);

describe("image URLs naming internal addresses are refused", () => {
  test("IP literals in every spelling: loopback, private, link-local, CGNAT, unique-local, metadata", async () => {
    const urls = [
      "http://127.0.0.1/x.png",
      "http://2130706433/x.png", // decimal integer
      "http://0x7f000001/x.png", // hex integer
      "http://0177.0.0.1/x.png", // octal
      "http://0x7f.1/x.png",
      "http://127.1/x.png",
      "http://127.0.0.1./x.png", // trailing dot
      "http://①②⑦.0.0.1/x.png", // full-width digits, mapped by IDNA
      "http://0.0.0.0/x.png",
      "http://0/x.png",
      "http://169.254.169.254/latest/meta-data/",
      "http://10.0.0.5/x.png",
      "http://172.16.0.1/x.png",
      "http://172.31.255.255/x.png",
      "http://192.168.1.1/x.png",
      "http://100.64.0.1/x.png",
      "http://100.100.100.200/latest/meta-data/",
      "http://192.0.0.192/x.png",
      "http://[::1]/x.png",
      "http://[::]/x.png",
      "http://[::ffff:127.0.0.1]/x.png", // IPv4-mapped
      "http://[0:0:0:0:0:ffff:a9fe:a9fe]/latest/meta-data/",
      "http://[::127.0.0.1]/x.png", // IPv4-compatible
      "http://[64:ff9b::a9fe:a9fe]/x.png", // NAT64 of 169.254.169.254
      "http://[2002:a00:1::1]/x.png", // 6to4 of 10.0.0.1
      "http://[fd00:ec2::254]/latest/meta-data/",
      "http://[fe80::1]/x.png",
      "https://localhost/x.png",
      "https://LOCALHOST./x.png",
      "https://api.localhost/x.png",
    ];
    for (const url of urls) {
      const res = await chat(gw, withImage(url));
      if (res.status !== 400) throw new Error(`${url} was answered ${res.status}`);
      await expectRefused(res);
    }
    expect(sim.stats.requests).toBe(0);
    expect(lookups).toEqual([]);
  });

  test("URLs that parsers read differently are refused: credentials, backslashes, spaces", async () => {
    for (const url of ["http://user:pw@93.184.216.34/x.png", "http://93.184.216.34\\@127.0.0.1/x.png", "http://93.184.216.34 @127.0.0.1/x.png", "http://93.184.216.34:80:80/x.png"]) {
      await expectRefused(await chat(gw, withImage(url)));
    }
    expect(sim.stats.requests).toBe(0);
  });

  test("names resolving to an internal address (any of them), names that do not resolve or not in time", async () => {
    await expectRefused(await chat(gw, withImage("https://internal.example.com/a.png")), "internal address");
    await expectRefused(await chat(gw, withImage("https://mixed.example.com/a.png")), "internal address");
    await expectRefused(await chat(gw, withImage("https://meta.example.com/a.png")), "internal address");
    await expectRefused(await chat(gw, withImage("https://mapped.example.com/a.png")), "internal address");
    await expectRefused(await chat(gw, withImage("https://linklocal.example.com/a.png")), "internal address");
    await expectRefused(await chat(gw, withImage("https://Internal.Example.COM./a.png")), "internal address");
    await expectRefused(await chat(gw, withImage("https://nx.example.com/a.png")), "does not resolve");
    await expectRefused(await chat(gw, withImage("https://throws.example.com/a.png")), "does not resolve");
    const t0 = performance.now();
    await expectRefused(await chat(gw, withImage("https://slow.example.com/a.png")), "could not be resolved");
    const took = performance.now() - t0;
    expect(took).toBeGreaterThanOrEqual(RESOLVE_MS - 20);
    expect(took).toBeLessThan(RESOLVE_MS + 5_000);
    expect(sim.stats.requests).toBe(0);
  });

  test("at most 16 different hosts per request are resolved", async () => {
    const content: unknown[] = [{ type: "text", text: "x" }];
    for (let i = 0; i < 17; i++) content.push({ type: "image_url", image_url: { url: `https://h${i}.cdn.example.com/a.png` } });
    const res = await chat(gw, { model: "svc-fast", messages: [{ role: "user", content }] });
    expect(res.status).toBe(400);
    const err = await errorOf(res);
    expect(err.param).toBe("messages[0].content[17].image_url.url");
    expect(err.message).toContain("16");
    expect(lookups).toEqual([]);
  });
});

describe("lookups are bounded across requests", () => {
  test("names whose DNS never answers hold at most 64 lookups; beyond that 429 with retry-after, until the resolver returns", async () => {
    const stuck: (() => void)[] = [];
    const stalling = (host: string): Promise<string[]> =>
      host.endsWith(".stall.example.com") ? new Promise((resolve) => stuck.push(() => resolve(["93.184.216.34"]))) : lookup(host);
    const config = await testConfig({ aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: { ...upstreamSettings(), imageUrls: { resolveTimeoutMs: RESOLVE_MS } } });
    const g = await startGateway({ config, database: await sharedDatabase(), log: createLogger("silent"), lookup: stalling });
    gateways.push(g);
    const sixteen = (r: number) => {
      const content: unknown[] = [{ type: "text", text: "x" }];
      for (let i = 0; i < 16; i++) content.push({ type: "image_url", image_url: { url: `https://h${i}.r${r}.stall.example.com/a.png` } });
      return { model: "svc-fast", messages: [{ role: "user", content }] };
    };
    const first = await Promise.all([0, 1, 2, 3].map((r) => chat(g, sixteen(r))));
    for (const res of first) await expectRefusedAt(res, "messages[0].content[1].image_url.url", "could not be resolved");
    expect(stuck.length).toBe(64);
    // 64 lookups still hold the resolver: no further name is looked up.
    const busy = await chat(g, withImage("https://cdn.example.com/a.png"));
    expect(busy.status).toBe(429);
    expect(busy.headers.get("retry-after")).toBe("1");
    expect((await errorOf(busy)).code).toBe("rate_limit_error");
    expect(lookups).toEqual([]);
    // Literal addresses and data: images need no lookup and still pass.
    expect((await chat(g, withImage("https://93.184.216.34/a.png"))).status).toBe(200);
    // The resolver returns: lookups are possible again.
    for (const release of stuck) release();
    let res = await chat(g, withImage("https://cdn.example.com/a.png"));
    for (const until = performance.now() + 5_000; res.status === 429 && performance.now() < until; ) res = await chat(g, withImage("https://cdn.example.com/a.png"));
    expect(res.status).toBe(200);
  });
});

describe("what stays accepted", () => {
  test("public addresses and names pass; the canonical URL that was checked is what goes upstream", async () => {
    const cases: [string, string][] = [
      ["https://93.184.216.34/cat.png", "https://93.184.216.34/cat.png"],
      ["http://0x5d.0xb8.0xd8.0x22/cat.png", "http://93.184.216.34/cat.png"],
      ["https://[2606:2800:220:1:248:1893:25c8:1946]/cat.png", "https://[2606:2800:220:1:248:1893:25c8:1946]/cat.png"],
      ["https://cdn.example.com/cat.png?size=2", "https://cdn.example.com/cat.png?size=2"],
      ["https://CDN.example.com:8443/cat.png", "https://cdn.example.com:8443/cat.png"],
    ];
    for (const [url, forwarded] of cases) {
      const res = await chat(gw, withImage(url));
      if (res.status !== 200) throw new Error(`${url} was answered ${res.status}: ${await res.text()}`);
      expect(forwardedUrl()).toBe(forwarded);
    }
    expect(lookups).toEqual(["cdn.example.com", "cdn.example.com"]);
  });

  test("one lookup per distinct host of a request", async () => {
    const content: unknown[] = [{ type: "text", text: "x" }];
    for (let i = 0; i < 5; i++) content.push({ type: "image_url", image_url: { url: `https://cdn.example.com/${i}.png` } });
    expect((await chat(gw, { model: "svc-fast", messages: [{ role: "user", content }] })).status).toBe(200);
    expect(lookups).toEqual(["cdn.example.com"]);
  });

  test("data: images and requests without image URLs never touch DNS", async () => {
    expect((await chat(gw, withImage("data:image/png;base64,iVBORw0KGgo="))).status).toBe(200);
    expect((await chat(gw, { model: "svc-fast", messages: [{ role: "user", content: "hi" }] })).status).toBe(200);
    expect(lookups).toEqual([]);
  });

  test("the key is checked first: an anonymous or bad-key request with an internal or unresolvable URL gets 401, with no lookup", async () => {
    for (const key of ["", "sk-gw-not-a-real-key", "sk-gw-AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"]) {
      for (const url of ["http://169.254.169.254/", "https://slow.example.com/a.png"]) {
        const res = await chat(gw, withImage(url), key);
        expect(res.status).toBe(401);
        expect((await errorOf(res)).code).toBe("unauthorized");
      }
    }
    expect(lookups).toEqual([]);
  });
});

describe("the operator may allow internal image hosts", () => {
  test("allow: listed CIDRs, addresses and names pass; everything else internal is still refused", async () => {
    const g = await gateway({ allow: ["10.0.0.0/8", "fd00::/8", "192.168.7.7", "images.internal"], resolveTimeoutMs: RESOLVE_MS });
    for (const url of ["http://10.1.2.3/a.png", "https://internal.example.com/a.png", "http://[fd00:ec2::254]/a.png", "http://192.168.7.7/a.png", "http://images.internal/a.png", "http://IMAGES.internal./a.png"]) {
      const res = await chat(g, withImage(url));
      if (res.status !== 200) throw new Error(`${url} was answered ${res.status}: ${await res.text()}`);
    }
    // The allowed name is taken as is (no lookup); internal.example.com resolved into 10/8.
    expect(lookups).toEqual(["internal.example.com"]);
    for (const url of ["http://192.168.7.8/a.png", "http://127.0.0.1/a.png", "http://169.254.169.254/", "https://mixed.example.com/a.png"]) {
      await expectRefused(await chat(g, withImage(url)));
    }
  });

  test("allowPrivate: every host passes, no lookup", async () => {
    const g = await gateway({ allowPrivate: true });
    for (const url of ["http://127.0.0.1/a.png", "http://169.254.169.254/latest/meta-data/", "https://nx.example.com/a.png"]) {
      expect((await chat(g, withImage(url))).status).toBe(200);
    }
    expect(lookups).toEqual([]);
  });

  test("an allow entry that is neither a name nor an address nor a CIDR is a configuration error", async () => {
    const file = join(tmpdir(), `gw-image-allow-${process.pid}.json`);
    try {
      for (const bad of ["10.0.0.0/33", "10.0.0/8", "fd00::/129", "not a host", "http://x/"]) {
        writeFileSync(file, JSON.stringify({ upstream: { imageUrls: { allow: ["10.0.0.0/8", bad] } } }));
        const e = await rejectionOf(loadConfig({ env: {}, file }));
        expect(e).toBeInstanceOf(ConfigError);
        expect((e as ConfigError).problems).toEqual([expect.stringContaining("/upstream/imageUrls/allow/1")]);
      }
      writeFileSync(file, JSON.stringify({ upstream: { imageUrls: { allow: ["10.0.0.0/8", "fd00::/8", "192.168.1.1", "images.internal", "::1"] } } }));
      expect((await loadConfig({ env: {}, file })).upstream.imageUrls?.allow.length).toBe(5);
    } finally {
      rmSync(file, { force: true });
    }
  });
});
