import { afterAll, describe, expect, test } from "bun:test";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { runCli } from "../../src/cli/index.ts";
import { ConfigError, loadConfig, maskConfig, upstreamAliases } from "../../src/config/load.ts";
import type { TSchema } from "@sinclair/typebox";
import { ConfigSchema, DEFAULT_PLANS, SPEC_ALIASES } from "../../src/config/schema.ts";
import { removeScratch, scratchDir } from "../helpers/process.ts";

const dir = scratchDir("gw-config-");
afterAll(() => removeScratch());

let n = 0;
function file(content: unknown): string {
  const p = join(dir, `c${n++}.json`);
  writeFileSync(p, typeof content === "string" ? content : JSON.stringify(content));
  return p;
}

/** The problems loadConfig reports, or [] when it accepts the input. */
async function problems(input: Parameters<typeof loadConfig>[0]): Promise<string[]> {
  try {
    await loadConfig(input);
    return [];
  } catch (e) {
    if (e instanceof ConfigError) return e.problems;
    throw e;
  }
}

function capture() {
  const o = { out: "", err: "" };
  const out = {
    stdout: (s: string) => {
      o.out += s;
    },
    stderr: (s: string) => {
      o.err += s;
    },
  };
  return { o, out };
}

describe("metrics.listen", () => {
  test("host:port, [v6]:port, port 0 and \"main\" are accepted; METRICS_LISTEN sets it", async () => {
    for (const listen of ["0.0.0.0:9100", "[::1]:9464", "127.0.0.1:0", "main"]) {
      expect((await loadConfig({ env: {}, file: file({ metrics: { listen } }) })).metrics.listen).toBe(listen);
    }
    const viaEnv = await loadConfig({ env: { METRICS_LISTEN: "10.0.0.5:9100" }, file: file({ metrics: { enabled: true, listen: "main" } }) });
    expect(viaEnv.metrics).toEqual({ enabled: true, listen: "10.0.0.5:9100" });
  });

  test("a port out of range, no port, or another word is refused", async () => {
    for (const listen of ["127.0.0.1:70000", "127.0.0.1", "public", "main:"]) {
      const p = await problems({ env: {}, file: file({ metrics: { listen } }) });
      expect(p.some((x) => x.startsWith("/metrics/listen:"))).toBe(true);
    }
  });
});

describe("defaults", () => {
  test("an empty environment gives the documented defaults", async () => {
    const c = await loadConfig({ env: {} });
    expect(c).toMatchObject({
      host: "127.0.0.1",
      port: 8080,
      dataDir: "./data",
      dbPoolMax: 10,
      logLevel: "info",
      accessLog: true,
      bodyLimitBytes: 16 * 1024 * 1024,
      drainMs: 30_000,
      keyTag: "gw",
      defaultPlan: "Standard",
      keyCache: { ttlMs: 60_000, max: 100_000, negativeTtlMs: 5_000, negativeMax: 10_000, unknownPerPrefixPerMin: 60, unknownPerMin: 6_000 },
      rateLimit: { instances: 1, maxOrgs: 100_000 },
      upstream: { attempts: 3, backoffMs: 50, timeouts: { connectMs: 5_000, firstByteMs: 60_000, idleMs: 60_000 } },
      // Metrics are not on the public port unless an operator says so.
      metrics: { enabled: true, listen: "127.0.0.1:9464" },
    });
    expect(c.databaseUrl).toBeUndefined();
    expect(c.cursorSecret).toBeUndefined();
    expect(c.plans).toEqual(DEFAULT_PLANS);
    expect(c.aliases).toEqual({});
  });

  test("a file may set any subset; nested objects are completed", async () => {
    const c = await loadConfig({ env: {}, file: file({ drainMs: 5_000, keyCache: { ttlMs: 1_000 }, upstream: { timeouts: { idleMs: 7 } } }) });
    expect(c.drainMs).toBe(5_000);
    expect(c.port).toBe(8080);
    expect(c.keyCache).toEqual({ ttlMs: 1_000, max: 100_000, negativeTtlMs: 5_000, negativeMax: 10_000, unknownPerPrefixPerMin: 60, unknownPerMin: 6_000 });
    expect(c.upstream.timeouts).toEqual({ connectMs: 5_000, firstByteMs: 60_000, idleMs: 7 });
    expect(c.upstream.attempts).toBe(3);
  });

  test("GATEWAY_CONFIG names the file when --config is absent", async () => {
    const c = await loadConfig({ env: { GATEWAY_CONFIG: file({ port: 9001 }) } });
    expect(c.port).toBe(9001);
  });
});

describe("precedence: file < env < flags", () => {
  test("env overrides the file", async () => {
    const c = await loadConfig({
      env: {
        HOST: "0.0.0.0",
        PORT: "9000",
        GATEWAY_DATA_DIR: "/var/lib/gateway",
        DATABASE_URL: "postgres://u:p@db:5432/gw",
        LOG_LEVEL: "warn",
        GATEWAY_CURSOR_SECRET: "x".repeat(32),
        GATEWAY_RATE_LIMIT_INSTANCES: "3",
      },
      file: file({ host: "10.0.0.1", port: 1, dataDir: "/elsewhere", logLevel: "debug", rateLimit: { maxOrgs: 5 } }),
    });
    expect(c).toMatchObject({
      host: "0.0.0.0",
      port: 9000,
      dataDir: "/var/lib/gateway",
      databaseUrl: "postgres://u:p@db:5432/gw",
      logLevel: "warn",
      cursorSecret: "x".repeat(32),
      rateLimit: { instances: 3, maxOrgs: 5 },
    });
  });

  test("flags override env; empty env values are ignored", async () => {
    const c = await loadConfig({ env: { HOST: "0.0.0.0", PORT: "9000", GATEWAY_DATA_DIR: "" }, overrides: { port: 7000, dataDir: "./d" } });
    expect(c).toMatchObject({ host: "0.0.0.0", port: 7000, dataDir: "./d" });
  });
});

describe("environment variables of the responses API and the shared port", () => {
  test("GATEWAY_RESPONSES, GATEWAY_RESPONSES_STORE, GATEWAY_RESPONSES_RETENTION_DAYS, GATEWAY_RESPONSES_WEB_SEARCH set responses.*, over the file", async () => {
    expect((await loadConfig({ env: {} })).responses).toEqual({ enabled: false, store: true, retentionDays: 30, webSearch: "refuse" });
    const f = file({ responses: { enabled: false, store: true, retentionDays: 7, webSearch: "ignore" } });
    const c = await loadConfig({ env: { GATEWAY_RESPONSES: "1", GATEWAY_RESPONSES_STORE: "false", GATEWAY_RESPONSES_RETENTION_DAYS: "90", GATEWAY_RESPONSES_WEB_SEARCH: "refuse" }, file: f });
    expect(c.responses).toEqual({ enabled: true, store: false, retentionDays: 90, webSearch: "refuse" });
    // Unset or empty: the file's values stand.
    expect((await loadConfig({ env: { GATEWAY_RESPONSES: "", GATEWAY_RESPONSES_RETENTION_DAYS: "", GATEWAY_RESPONSES_WEB_SEARCH: "" }, file: f })).responses).toEqual({
      enabled: false,
      store: true,
      retentionDays: 7,
      webSearch: "ignore",
    });
    expect((await problems({ env: { GATEWAY_RESPONSES_WEB_SEARCH: "allow" } })).join("\n")).toContain("/responses/webSearch");
    expect(await problems({ env: { GATEWAY_RESPONSES_RETENTION_DAYS: "0" } })).toEqual(["/responses/retentionDays: Expected integer to be greater or equal to 1 (got 0)"]);
    expect(await problems({ env: { GATEWAY_RESPONSES_RETENTION_DAYS: "30d" } })).toEqual([`env GATEWAY_RESPONSES_RETENTION_DAYS: expected a whole number, got "30d"`]);
  });

  test("switches read 1/true/yes/on and 0/false/no/off in any case; any other value is a problem, not false", async () => {
    const on = file({ responses: { enabled: true, store: true } });
    for (const v of ["1", "true", "TRUE", "yes", "On"]) {
      expect((await loadConfig({ env: { GATEWAY_RESPONSES: v, GATEWAY_RESPONSES_STORE: v } })).responses).toMatchObject({ enabled: true, store: true });
    }
    for (const v of ["0", "false", "No", "OFF"]) {
      expect((await loadConfig({ env: { GATEWAY_RESPONSES: v, GATEWAY_RESPONSES_STORE: v }, file: on })).responses).toMatchObject({ enabled: false, store: false });
      expect((await loadConfig({ env: { GATEWAY_REUSE_PORT: v } })).reusePort).toBe(false);
    }
    for (const [name, v] of [
      ["GATEWAY_REUSE_PORT", "enable"],
      ["GATEWAY_RESPONSES", "y"],
      ["GATEWAY_RESPONSES_STORE", "2"],
      ["GATEWAY_RESPONSES", " true"],
    ] as const) {
      expect(await problems({ env: { [name]: v }, file: on })).toEqual([`env ${name}: expected 1, true, yes, on or 0, false, no, off, got ${JSON.stringify(v)}`]);
    }
  });
});

describe("durations in milliseconds", () => {
  // A timer longer than 2^31 - 1 ms fires after 1 ms in Bun (and Node): drainMs 3e9 would end the drain at once.
  const MS_PATHS = [
    "drainMs",
    "keyCache/ttlMs",
    "keyCache/negativeTtlMs",
    "rateLimit/windowMs",
    "quota/flushMs",
    "upstream/backoffMs",
    "upstream/breakerCooldownMs",
    "upstream/timeouts/connectMs",
    "upstream/timeouts/firstByteMs",
    "upstream/timeouts/idleMs",
    "upstream/imageUrls/resolveTimeoutMs",
    "aliases/x/timeouts/idleMs",
  ];
  const withValue = (path: string, v: number): Record<string, unknown> => {
    const keys = path.split("/");
    let value: unknown = v;
    for (const k of keys.slice(1).reverse()) value = { [k]: value };
    const top = keys[0] ?? "";
    if (top !== "aliases") return { [top]: value };
    return { aliases: { x: { kind: "chat", targets: [{ baseUrl: "http://h/v1", model: "m" }], ...(value as { x: object }).x } } };
  };

  test("stop at 2^31 - 1 (~24.8 days); beyond, a problem naming the option", async () => {
    for (const path of MS_PATHS) {
      expect({ path, problems: await problems({ env: {}, file: file(withValue(path, 2 ** 31 - 1)) }) }).toEqual({ path, problems: [] });
      for (const v of [2 ** 31, 1e300]) {
        const p = await problems({ env: {}, file: file(withValue(path, v)) });
        expect({ path, v, named: p.some((x) => x.startsWith(`/${path}:`)) }).toEqual({ path, v, named: true });
      }
    }
  });
});

describe("numbers", () => {
  /** Every integer option of the schema, as a path with `x` for a plan or alias name. */
  function integerPaths(schema: TSchema, path: string[] = []): string[][] {
    if (schema.type === "integer") return [path];
    if (schema.type === "object" && schema.properties) {
      return Object.entries(schema.properties as Record<string, TSchema>).flatMap(([k, v]) => integerPaths(v, [...path, k]));
    }
    if (schema.type === "object" && schema.patternProperties) {
      return Object.values(schema.patternProperties as Record<string, TSchema>).flatMap((v) => integerPaths(v, [...path, "x"]));
    }
    return [];
  }
  /** A config file setting `path` to `v`, with what the rest of its object needs to be valid. */
  function withNumber(path: string[], v: number): Record<string, unknown> {
    const [top, ...rest] = path;
    let value: unknown = v;
    for (const k of [...rest].reverse()) value = { [k]: value };
    if (top === "aliases") {
      const x = (value as { x: Record<string, unknown> }).x;
      const targets = [{ baseUrl: "http://h/v1", model: "m", ...((x.targets as object[] | undefined)?.[0] ?? {}) }];
      return { aliases: { x: { kind: "chat", ...x, targets } } };
    }
    if (top === "plans") return { plans: value, defaultPlan: "x" };
    return { [top ?? ""]: value };
  }

  test("every integer option refuses what is not a safe integer (beyond 2^53 - 1), naming the option", async () => {
    const paths = integerPaths(ConfigSchema);
    expect(paths.map((p) => p.join("/"))).toContain("quota/leaseTokens");
    expect(paths.length).toBeGreaterThan(15);
    for (const path of paths) {
      for (const v of [2 ** 53, 1e300]) {
        const p = await problems({ env: {}, file: file(withNumber(path, v)) });
        expect({ path: path.join("/"), v, named: p.some((x) => x.startsWith(`/${path.join("/")}:`)) }).toEqual({ path: path.join("/"), v, named: true });
      }
    }
  });

  test("a target's weight is at most 1,000,000: two weights of 1e308 sum to Infinity, and the weighted choice then always took the last target", async () => {
    const at = (w: number) => ({ aliases: { x: { kind: "chat", targets: [{ baseUrl: "http://h/v1", model: "m", weight: w }, { baseUrl: "http://h2/v1", model: "m", weight: 1 }] } } });
    expect(await problems({ env: {}, file: file(at(1_000_000)) })).toEqual([]);
    for (const w of [1_000_001, 1e308]) {
      const p = await problems({ env: {}, file: file(at(w)) });
      expect(p.some((x) => x.startsWith("/aliases/x/targets/0/weight:"))).toBe(true);
    }
  });
});

describe("plans", () => {
  test("a file's plans are merged with the built-in ones", async () => {
    const c = await loadConfig({ env: {}, file: file({ plans: { Enterprise: { requestsPerMinute: 1_200 } } }) });
    expect(c.plans).toEqual({ ...DEFAULT_PLANS, Enterprise: { requestsPerMinute: 1_200 } });
  });

  test("a file may override a built-in plan's limit", async () => {
    const c = await loadConfig({ env: {}, file: file({ plans: { Standard: { requestsPerMinute: 10 } } }) });
    expect(c.plans.Standard).toEqual({ requestsPerMinute: 10 });
    expect(c.plans.Ultra).toEqual({ requestsPerMinute: 300 });
  });

  test("plan and alias names that are built-in object members are refused, and defaultPlan must be a plan of its own", async () => {
    // An inherited member ('toString' in any object) once passed as a plan; '__proto__' was dropped silently.
    expect(await problems({ env: {}, file: file({ defaultPlan: "toString" }) })).toEqual([`/defaultPlan: plan "toString" is not in /plans`]);
    const raw = '{"plans": {"__proto__": {"requestsPerMinute": 5}}, "aliases": {"constructor": {"kind": "chat", "targets": [{"baseUrl": "http://127.0.0.1:9/v1", "model": "m"}]}}}';
    const found = await problems({ env: {}, file: file(raw) });
    expect(found).toContain(`/plans/__proto__: not a usable name (it is a built-in member of every object)`);
    expect(found).toContain(`/aliases/constructor: not a usable name (it is a built-in member of every object)`);
  });

  test("defaultPlan must name a configured plan", async () => {
    expect(await problems({ env: {}, file: file({ defaultPlan: "Gold" }) })).toEqual([`/defaultPlan: plan "Gold" is not in /plans`]);
    const c = await loadConfig({ env: {}, file: file({ defaultPlan: "Gold", plans: { Gold: { requestsPerMinute: 5 } } }) });
    expect(c.defaultPlan).toBe("Gold");
  });
});

describe("aliases", () => {
  test("UPSTREAM_BASE_URL points the four spec aliases at one server", async () => {
    const c = await loadConfig({ env: { UPSTREAM_BASE_URL: "http://10.0.0.5:8000/v1" } });
    expect(Object.keys(c.aliases).sort()).toEqual(["svc-bigthink", "svc-embed", "svc-fast", "svc-smart"]);
    for (const [name, a] of Object.entries(c.aliases)) {
      expect(a.targets).toEqual([{ baseUrl: "http://10.0.0.5:8000/v1", model: name, weight: 1 }]);
      const spec = SPEC_ALIASES[name];
      expect(spec).toBeDefined();
      expect(a.kind).toBe(spec?.kind ?? a.kind);
      expect(a.contextWindow).toBe(spec?.contextWindow);
      expect(a.capabilities).toEqual(spec?.capabilities ?? []);
    }
    expect(c.aliases["svc-embed"]).toMatchObject({ kind: "embedding", dimensions: 1024 });
    expect(c.aliases["svc-fast"]).toMatchObject({ kind: "chat", contextWindow: 128_000, capabilities: ["images", "tools"] });
    // Only svc-bigthink has its own (long) timeouts; the others inherit upstream.timeouts.
    expect(c.aliases["svc-bigthink"]?.timeouts).toEqual({ connectMs: 5_000, firstByteMs: 600_000, idleMs: 300_000 });
    expect(c.aliases["svc-fast"]?.timeouts).toBeUndefined();
  });

  test("UPSTREAM_API_KEY makes every target send that key (by env name, not value)", async () => {
    const c = await loadConfig({ env: { UPSTREAM_BASE_URL: "http://u:1/v1", UPSTREAM_API_KEY: "secret" } });
    for (const a of Object.values(c.aliases)) expect(a.targets[0]?.apiKeyEnv).toBe("UPSTREAM_API_KEY");
    expect(JSON.stringify(c)).not.toContain("secret");
  });

  test("upstreamAliases is what the env shortcut uses", () => {
    const a = upstreamAliases("http://x/v1") as Record<string, { targets: { model: string }[] }>;
    expect(Object.keys(a)).toEqual(Object.keys(SPEC_ALIASES));
    expect(a["svc-smart"]?.targets[0]?.model).toBe("svc-smart");
  });

  test("aliases in a file win over UPSTREAM_BASE_URL and inherit the spec table", async () => {
    const c = await loadConfig({
      env: { UPSTREAM_BASE_URL: "http://ignored/v1" },
      file: file({ aliases: { "svc-fast": { targets: [{ baseUrl: "http://10.0.0.5:8000/v1", model: "mistral" }] } } }),
    });
    expect(Object.keys(c.aliases)).toEqual(["svc-fast"]);
    expect(c.aliases["svc-fast"]).toMatchObject({
      kind: "chat",
      contextWindow: 128_000,
      capabilities: ["images", "tools"],
      ownedBy: "gateway",
      // weight defaults inside a record entry (TypeBox's Default does not descend there by itself)
      targets: [{ baseUrl: "http://10.0.0.5:8000/v1", model: "mistral", weight: 1 }],
    });
  });

  test("a custom alias takes defaults for capabilities, owner and weight; partial timeouts are completed", async () => {
    const c = await loadConfig({
      env: {},
      file: file({ aliases: { "my-model": { kind: "chat", targets: [{ baseUrl: "https://h/v1", model: "m" }], timeouts: { firstByteMs: 9 } } } }),
    });
    expect(c.aliases["my-model"]).toEqual({
      kind: "chat",
      capabilities: [],
      ownedBy: "gateway",
      targets: [{ baseUrl: "https://h/v1", model: "m", weight: 1 }],
      timeouts: { connectMs: 5_000, firstByteMs: 9, idleMs: 60_000 },
    });
  });

  test("the README's example config file is valid", async () => {
    const c = await loadConfig({
      env: { GPU2_KEY: "k" },
      file: file({
        aliases: {
          "svc-fast": {
            targets: [
              { baseUrl: "http://10.0.0.5:8000/v1", model: "mistralai/Mistral-Small-3.2-24B-Instruct-2506", weight: 2 },
              { baseUrl: "http://10.0.0.6:8000/v1", model: "mistralai/Mistral-Small-3.2-24B-Instruct-2506", weight: 1, apiKeyEnv: "GPU2_KEY" },
            ],
          },
          "svc-bigthink": {
            targets: [{ baseUrl: "http://10.0.0.7:8000/v1", model: "big" }],
            timeouts: { connectMs: 5000, firstByteMs: 600000, idleMs: 300000 },
          },
        },
        plans: { Enterprise: { requestsPerMinute: 1200 } },
      }),
    });
    expect(Object.keys(c.aliases)).toEqual(["svc-fast", "svc-bigthink"]);
    expect(c.plans.Enterprise).toEqual({ requestsPerMinute: 1200 });
  });
});

describe("errors: all listed at once, each with its path", () => {
  test("schema errors from the file and env together", async () => {
    const p = await problems({
      env: { PORT: "eighty", GATEWAY_RATE_LIMIT_INSTANCES: "-1" },
      file: file({
        logLevel: "loud",
        bogus: 1,
        keyCache: { ttlMs: -1 },
        databaseUrl: "mysql://x",
        keyTag: "Has-Dash",
        aliases: { "bad name!": { kind: "chat", targets: [] } },
      }),
    });
    expect(p).toContain(`env PORT: expected a whole number, got "eighty"`);
    expect(p).toContain(`env GATEWAY_RATE_LIMIT_INSTANCES: expected a whole number, got "-1"`);
    expect(p).toContain("/bogus: Unexpected property (got 1)");
    expect(p).toContain(`/logLevel: expected one of "debug", "info", "warn", "error", "silent" (got "loud")`);
    expect(p.some((m) => m.startsWith("/keyCache/ttlMs:"))).toBe(true);
    expect(p.some((m) => m.startsWith("/databaseUrl:"))).toBe(true);
    expect(p.some((m) => m.startsWith("/keyTag:"))).toBe(true);
    // An alias name outside the pattern is refused, not silently accepted unvalidated.
    expect(p.some((m) => m.startsWith("/aliases/bad name!:"))).toBe(true);
    expect(p.length).toBeGreaterThanOrEqual(8);
  });

  test("semantic errors: bad URL, missing key env, all-zero weights", async () => {
    const p = await problems({
      env: {},
      file: file({
        aliases: {
          "svc-fast": { targets: [{ baseUrl: "ftp://h/v1", model: "m", apiKeyEnv: "NOT_SET_ANYWHERE" }] },
          x: { kind: "chat", targets: [{ baseUrl: "http://h/v1", model: "m", weight: 0 }] },
        },
      }),
    });
    expect(p).toEqual([
      "/aliases/svc-fast/targets/0/baseUrl: not an http(s) URL",
      "/aliases/svc-fast/targets/0/apiKeyEnv: env NOT_SET_ANYWHERE is not set",
      "/aliases/x/targets: every target has weight 0",
    ]);
  });

  test("a schema error does not hide the other problems: every one is listed in the same run", async () => {
    const p = await problems({
      env: {},
      file: file({
        port: "x",
        defaultPlan: "Gold",
        keys: { defaultLifetime: "800d", maxLifetime: "30d" },
        aliases: {
          "svc-fast": { targets: [{ baseUrl: "ftp://h/v1", model: "m", apiKeyEnv: "NOT_SET_ANYWHERE" }] },
          // An alias with a schema error of its own is not checked further (its targets may not be objects).
          x: { kind: "chat", targets: "none" },
        },
      }),
    });
    expect(p).toContain(`/port: Expected integer (got "x")`);
    expect(p).toContain(`/defaultPlan: plan "Gold" is not in /plans`);
    expect(p).toContain("/keys/defaultLifetime: 800d is longer than /keys/maxLifetime (30d)");
    expect(p).toContain("/aliases/svc-fast/targets/0/baseUrl: not an http(s) URL");
    expect(p).toContain("/aliases/svc-fast/targets/0/apiKeyEnv: env NOT_SET_ANYWHERE is not set");
    expect(p.some((m) => m.startsWith("/aliases/x/targets:"))).toBe(true);
    // Shapes the later checks cannot read are reported by the schema alone, never a crash.
    const q = await problems({ env: {}, file: file({ plans: 5, defaultPlan: 7, keys: "x", metrics: { listen: 9 }, upstream: { imageUrls: { allow: "x" } }, aliases: [] }) });
    expect(q.map((m) => m.slice(0, m.indexOf(":"))).sort()).toEqual(["/defaultPlan", "/keys", "/metrics/listen", "/upstream/imageUrls/allow"]);
  });

  test("a missing file, invalid JSON, or a non-object", async () => {
    expect(await problems({ env: {}, file: join(dir, "nope.json") })).toEqual([`config file ${join(dir, "nope.json")}: not found`]);
    // A directory exists but is no file: said so, not "not found".
    expect(await problems({ env: {}, file: dir })).toEqual([`config file ${dir}: is a directory, not a file`]);
    const bad = file("{ not json");
    expect((await problems({ env: {}, file: bad }))[0]).toStartWith(`config file ${bad}: invalid JSON`);
    const arr = file([1, 2]);
    expect(await problems({ env: {}, file: arr })).toEqual([`config file ${arr}: must hold a JSON object`]);
  });

  test("the error message lists every problem on its own line", () => {
    const e = new ConfigError(["/a: x", "/b: y"]);
    expect(e.message).toBe("invalid configuration:\n  - /a: x\n  - /b: y");
  });
});

describe("gateway config check|print", () => {
  test("check: exit 2, every problem on stderr, nothing on stdout", async () => {
    const { o, out } = capture();
    const code = await runCli(["config", "check", "--config", file({ port: "x", logLevel: "loud", drainMs: -5 })], out);
    expect(code).toBe(2);
    expect(o.out).toBe("");
    expect(o.err).toContain("invalid configuration:");
    for (const path of ["/port", "/logLevel", "/drainMs"]) expect(o.err).toContain(`  - ${path}:`);
  });

  test("check: a valid file exits 0; --json prints only JSON", async () => {
    const { o, out } = capture();
    const aliases = { "svc-fast": { targets: [{ baseUrl: "http://10.0.0.5:8000/v1", model: "m" }] } };
    expect(await runCli(["config", "check", "--config", file({ port: 9000, aliases }), "--json"], out)).toBe(0);
    expect(JSON.parse(o.out)).toEqual({ ok: true });
    expect(o.err).toBe("");
  });

  test("print masks secrets", async () => {
    const { o, out } = capture();
    const cfg = file({ databaseUrl: "postgres://gw:hunter2@db:5432/gw", cursorSecret: "s".repeat(40) });
    expect(await runCli(["config", "print", "--config", cfg], out)).toBe(0);
    expect(o.out).not.toContain("hunter2");
    expect(o.out).not.toContain("s".repeat(40));
    const printed = JSON.parse(o.out) as { databaseUrl: string; cursorSecret: string };
    expect(printed.databaseUrl).toBe("postgres://gw:***@db:5432/gw");
    expect(printed.cursorSecret).toBe("***");
  });

  test("maskConfig masks every credential form postgres.js (and libpq) accept", async () => {
    const cases: [url: string, masked: string, secret: string][] = [
      ["postgres://gw:hunter2@db:5432/gw", "postgres://gw:***@db:5432/gw", "hunter2"],
      ["postgres://u:pa/ss@db/gw", "postgres://u:***@db/gw", "pa/ss"],
      ["postgres://u:p@ss@db/gw", "postgres://u:***@db/gw", "p@ss"],
      ["postgres://u:p:a:ss@db/gw", "postgres://u:***@db/gw", "p:a:ss"],
      ["postgres://u:p?ss=1&x@db/gw?sslmode=require", "postgres://u:***@db/gw?sslmode=require", "p?ss=1&x"],
      ["postgres://u:p#ss@db/gw", "postgres://u:***@db/gw", "p#ss"],
      ["postgres://u:/@:?#@db/gw", "postgres://u:***@db/gw", "/@:?#"],
      ["postgres://u:p%40ss%2F@db/gw", "postgres://u:***@db/gw", "p%40ss%2F"],
      ["postgresql://:hunter2@db/gw", "postgresql://:***@db/gw", "hunter2"],
      ["postgres://u:hunter2@h1:5432,h2:5433/gw", "postgres://u:***@h1:5432,h2:5433/gw", "hunter2"],
      ["postgres://db/gw?password=hunter2&sslmode=require", "postgres://db/gw?password=***&sslmode=require", "hunter2"],
      ["postgres://u@db/gw?sslmode=require&PASSWORD=hun%26ter2", "postgres://u@db/gw?sslmode=require&PASSWORD=***", "hun%26ter2"],
      ["postgres://u@db/gw?sslpassword=hunter2", "postgres://u@db/gw?sslpassword=***", "hunter2"],
      ["postgres://u:one@db/gw?password=two#frag", "postgres://u:***@db/gw?password=***#frag", "one"],
    ];
    for (const [url, masked, secret] of cases) {
      const c = await loadConfig({ env: { DATABASE_URL: url } });
      const out = maskConfig(c).databaseUrl ?? "";
      expect(out).toBe(masked);
      expect(out).not.toContain(secret);
      expect(JSON.stringify(maskConfig(c))).not.toContain(secret);
    }
  });

  test("config print masks the URL forms too", async () => {
    const { o, out } = capture();
    const cfg = file({ databaseUrl: "postgres://gw:pa/ss@w:rd@db:5432/gw?password=second&sslmode=require" });
    expect(await runCli(["config", "print", "--config", cfg], out)).toBe(0);
    for (const secret of ["pa/ss", "w:rd", "second"]) expect(o.out).not.toContain(secret);
    expect((JSON.parse(o.out) as { databaseUrl: string }).databaseUrl).toBe("postgres://gw:***@db:5432/gw?password=***&sslmode=require");
  });

  test("maskConfig leaves a password-less URL alone and does not mutate its input", async () => {
    const c = await loadConfig({ env: { DATABASE_URL: "postgres://gw@db/gw" } });
    expect(maskConfig(c).databaseUrl).toBe("postgres://gw@db/gw");
    const s = await loadConfig({ env: { DATABASE_URL: "postgres://gw:pw@db/gw" } });
    expect(maskConfig(s).databaseUrl).toBe("postgres://gw:***@db/gw");
    expect(s.databaseUrl).toBe("postgres://gw:pw@db/gw");
  });
});
