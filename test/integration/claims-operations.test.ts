import { afterAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import type { TSchema } from "@sinclair/typebox";
import { COMMANDS } from "../../src/cli/commands/index.ts";
import { COMMON_FLAGS, commandPath } from "../../src/cli/command.ts";
import { loadConfig } from "../../src/config/load.ts";
import { ConfigSchema } from "../../src/config/schema.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { TEST_DATABASE_URL } from "../helpers/harness.ts";
import {
  ROOT,
  cleanEnv,
  createScratchDatabase,
  exitWithin,
  listeningUrl,
  onlyJson,
  removeScratch,
  runGateway,
  scratchDir,
  startGatewayProcess,
  waitFor200,
} from "../helpers/process.ts";

// Gateway processes and PGlite start-ups on a busy 2-core machine.
setDefaultTimeout(240_000);

/**
 * Promises of the README, docs/operations.md and the CLI's help (src/cli/help.ts)
 * that an operator follows to the letter and that no other test held: the
 * configuration table's option names, defaults and variables, the CLI synopsis
 * and the help's examples against the command table, the "Running it for real"
 * and "First key on the VM" command sequences as written (no --data-dir: ./data),
 * the UPSTREAM_BASE_URL/UPSTREAM_API_KEY shortcut as the upstream sees it, and
 * simulate-upstream's knobs.
 */

const README = readFileSync(join(ROOT, "README.md"), "utf8");
const OPERATIONS = readFileSync(join(ROOT, "docs", "operations.md"), "utf8");

let sim: Simulator | undefined;
afterAll(async () => {
  await sim?.stop();
  removeScratch();
});

/** The text of a markdown section, from its heading to the next heading of any level. */
function section(doc: string, heading: string): string {
  const start = doc.indexOf(`\n${heading}\n`);
  if (start < 0) throw new Error(`no section ${heading}`);
  const rest = doc.slice(start + heading.length + 2);
  const end = rest.search(/\n#{1,6} /);
  return end < 0 ? rest : rest.slice(0, end);
}

/** The first fenced code block of a section, as lines, continuation lines (indented) joined to theirs. */
function commandLines(text: string): string[] {
  const block = /```[a-z]*\n([\s\S]*?)```/.exec(text)?.[1] ?? "";
  const lines: string[] = [];
  for (const l of block.split("\n")) {
    if (/^\s+\S/.test(l) && lines.length) lines[lines.length - 1] += ` ${l.trim()}`;
    else if (l.trim()) lines.push(l.trim());
  }
  return lines;
}

/** README's configuration table: option paths (column 1) and environment variables (column 2), per row. */
function configRows(): { options: string[]; env: string[]; defaults: string }[] {
  const rows = section(README, "## Configuration")
    .split("\n")
    .filter((l) => l.startsWith("| ") && !l.startsWith("| Option") && !l.startsWith("|---"));
  return rows.map((l) => {
    const [options = "", env = "", defaults = ""] = l.split(" | ").map((c) => c.replace(/^\| /, ""));
    return {
      options: [...options.matchAll(/`([a-zA-Z.]+)`/g)].map((m) => m[1] ?? ""),
      env: [...env.matchAll(/`([A-Z][A-Z0-9_]*)`/g)].map((m) => m[1] ?? ""),
      defaults,
    };
  });
}

describe("README's configuration table", () => {
  test("names only options the schema has (the table is read from README.md)", () => {
    const rows = configRows();
    expect(rows.length).toBeGreaterThanOrEqual(25);
    const missing: string[] = [];
    for (const { options } of rows) {
      for (const path of options) {
        let node: TSchema | undefined = ConfigSchema;
        for (const part of path.split(".")) node = (node?.properties as Record<string, TSchema> | undefined)?.[part];
        if (!node) missing.push(path);
      }
    }
    expect(missing).toEqual([]);
  });

  test("its defaults are what an empty environment gives (those config.test does not already hold)", async () => {
    const c = await loadConfig({ env: {} });
    expect({
      reusePort: c.reusePort,
      idleTimeoutS: c.idleTimeoutS,
      keys: c.keys,
      plans: c.plans,
      windowMs: c.rateLimit.windowMs,
      quota: { leaseTokens: c.quota.leaseTokens, flushMs: c.quota.flushMs, defaultMaxTokens: c.quota.defaultMaxTokens },
      maxResponseBytes: c.upstream.maxResponseBytes,
      breaker: [c.upstream.breakerFailures, c.upstream.breakerCooldownMs],
      imageUrls: c.upstream.imageUrls,
    }).toEqual({
      reusePort: false,
      idleTimeoutS: 60,
      // "365d, unset"
      keys: { defaultLifetime: "365d" },
      // "`Standard` 60/min, `Ultra` 300/min", written out here: config.test compares with the source's own constant.
      plans: { Standard: { requestsPerMinute: 60 }, Ultra: { requestsPerMinute: 300 } },
      windowMs: 60_000,
      quota: { leaseTokens: 20_000, flushMs: 1_000, defaultMaxTokens: 4_096 },
      maxResponseBytes: 8 * 1024 * 1024,
      breaker: [5, 30_000],
      imageUrls: { allowPrivate: false, allow: [], resolveTimeoutMs: 2_000 },
    });
  });

  test("every environment variable it names sets the option of its row; an empty one counts as unset", async () => {
    // A value for each variable, and where it shows in the loaded configuration.
    const upstream = "http://10.9.8.7:8000/v1";
    const known: Record<string, [string, (c: Awaited<ReturnType<typeof loadConfig>>) => unknown, unknown]> = {
      HOST: ["0.0.0.0", (c) => c.host, "0.0.0.0"],
      PORT: ["9001", (c) => c.port, 9001],
      GATEWAY_REUSE_PORT: ["1", (c) => c.reusePort, true],
      DATABASE_URL: ["postgres://gw@db.example:5432/gw", (c) => c.databaseUrl, "postgres://gw@db.example:5432/gw"],
      GATEWAY_DATA_DIR: ["/srv/gw", (c) => c.dataDir, "/srv/gw"],
      LOG_LEVEL: ["silent", (c) => c.logLevel, "silent"],
      GATEWAY_CURSOR_SECRET: ["s".repeat(32), (c) => c.cursorSecret, "s".repeat(32)],
      GATEWAY_RATE_LIMIT_INSTANCES: ["4", (c) => c.rateLimit.instances, 4],
      METRICS_LISTEN: ["10.0.0.2:9464", (c) => c.metrics.listen, "10.0.0.2:9464"],
      GATEWAY_RESPONSES: ["on", (c) => c.responses.enabled, true],
      GATEWAY_RESPONSES_STORE: ["no", (c) => c.responses.store, false],
      GATEWAY_RESPONSES_RETENTION_DAYS: ["7", (c) => c.responses.retentionDays, 7],
      GATEWAY_RESPONSES_WEB_SEARCH: ["ignore", (c) => c.responses.webSearch, "ignore"],
      UPSTREAM_BASE_URL: [upstream, (c) => c.aliases["svc-fast"]?.targets[0]?.baseUrl, upstream],
      // "(and optionally UPSTREAM_API_KEY)": by the variable's name, read when a request is sent.
      UPSTREAM_API_KEY: ["k-123", (c) => c.aliases["svc-embed"]?.targets[0]?.apiKeyEnv, "UPSTREAM_API_KEY"],
      // Read by the runtime at start, not by the loader (serve-env.test, runtime-env.test).
      MIMALLOC_PURGE_HOLES: ["0", () => undefined, undefined],
    };
    const named = configRows().flatMap((r) => r.env);
    expect(named.length).toBeGreaterThanOrEqual(15);
    // A variable added to the README must be added here, with what it sets.
    expect(named.filter((v) => !(v in known))).toEqual([]);
    // Every variable is read (reusePort needs a database URL, the key a base URL, to be loaded at all).
    const base = { DATABASE_URL: "postgres://gw@db.example:5432/gw", UPSTREAM_BASE_URL: upstream };
    const empty = await loadConfig({ env: base });
    for (const name of named) {
      const [value, read, expected] = known[name] ?? ["", () => undefined, undefined];
      const c = await loadConfig({ env: { ...base, [name]: value } });
      expect({ name, value: read(c) }).toEqual({ name, value: expected });
      if (name in base || name === "MIMALLOC_PURGE_HOLES") continue;
      expect({ name, changed: read(empty) !== expected }).toEqual({ name, changed: true });
      // "an empty variable counts as unset"
      const unset = await loadConfig({ env: { ...base, [name]: "" } });
      expect({ name, value: read(unset) }).toEqual({ name, value: read(empty) });
    }
  });
});

describe("README's CLI synopsis and the help's examples", () => {
  const synopsis = commandLines(section(README, "## CLI")).filter((l) => l.startsWith("gateway ") && !l.startsWith("gateway --"));

  test("every command of the table is in the synopsis, with each of its own flags and arguments; every flag the synopsis shows is accepted", () => {
    const problems: string[] = [];
    const listed = new Set<string>();
    for (const line of synopsis) {
      const [group = "", sub = ""] = line.split(" ").slice(1);
      const commands = COMMANDS.filter((c) => c.group === group && (c.name === undefined || sub.split("|").includes(c.name)));
      if (commands.length === 0) problems.push(`README names an unknown command: ${line}`);
      const flags = new Set([...line.matchAll(/--([a-z][a-z-]*)/g)].map((m) => m[1] ?? ""));
      for (const c of commands) {
        listed.add(commandPath(c));
        for (const f of flags) if (!(f in c.flags) && !(f in COMMON_FLAGS)) problems.push(`${commandPath(c)}: README shows --${f}, which it refuses`);
        for (const f of Object.keys(c.flags)) if (!flags.has(f)) problems.push(`${commandPath(c)}: --${f} is missing from README`);
        for (const p of c.positionals) if (!line.split(" ").includes(p.name)) problems.push(`${commandPath(c)}: argument ${p.name} is missing from README`);
      }
    }
    for (const c of COMMANDS) if (!listed.has(commandPath(c))) problems.push(`${commandPath(c)} is missing from README`);
    expect(problems).toEqual([]);
  });

  test("every example in the commands' help runs as written (ids, paths and ports made real), each exit 0", async () => {
    sim = sim ?? (await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 3 }));
    const dir = scratchDir("gw-claims-ops-");
    const pg = TEST_DATABASE_URL ? await createScratchDatabase(TEST_DATABASE_URL, "gw_examples") : undefined;
    try {
      // The examples run in a folder of their own: no --data-dir, the embedded database is ./data (or DATABASE_URL).
      const env = cleanEnv({ LOG_LEVEL: "error", MIMALLOC_PURGE_HOLES: "0", ...(pg ? { DATABASE_URL: pg.url } : {}) });
      const gw = async (args: string[], extraEnv: Record<string, string> = {}) => {
        const r = await runGateway(args, { cwd: dir, env: { ...env, ...extraEnv } });
        expect({ args: args.join(" "), code: r.code, stderr: r.stderr }).toEqual({ args: args.join(" "), code: 0, stderr: "" });
        return r;
      };
      const cfg = join(dir, "config.json");
      writeFileSync(cfg, JSON.stringify({ aliases: { "svc-fast": { targets: [{ baseUrl: sim.url, model: "svc-fast" }] } } }));
      const org = onlyJson<{ id: string }>((await gw(["orgs", "create", "--name", "Examples", "--json"])).stdout).id;
      const user = onlyJson<{ id: string }>((await gw(["users", "create", "--org", org, "--name", "U", "--email", "u@examples.example", "--json"])).stdout).id;
      const newKey = async () => onlyJson<{ id: string }>((await gw(["keys", "create", "--org", org, "--kind", "service", "--scopes", "inference", "--json"])).stdout).id;
      const events = join(dir, "events.jsonl");
      writeFileSync(
        events,
        `${JSON.stringify({ org_id: org, action: "member.invited", category: "member", actor: { type: "user", id: user, name: "U", email: "u@examples.example" }, origin: { ip_prefix: "203.0.113.0/24", user_agent_summary: "Firefox/131.0" } })}\n`,
      );

      const ran: string[] = [];
      for (const c of COMMANDS) {
        for (const example of c.examples) {
          // `NAME=value gateway …`: the variables, then the command line (quotes as a shell reads them).
          const words = [...example.matchAll(/"([^"]*)"|(\S+)/g)].map((m) => m[1] ?? m[2] ?? "");
          const exampleEnv: Record<string, string> = {};
          while (/^[A-Z_]+=/.test(words[0] ?? "")) {
            const [name = "", ...value] = (words.shift() ?? "").split("=");
            exampleEnv[name] = value.join("=");
          }
          expect(words.shift()).toBe("gateway");
          // Real values for the examples' placeholders.
          if (exampleEnv.DATABASE_URL) {
            if (!pg) continue; // An example of the Postgres form: run where the suite has a Postgres.
            exampleEnv.DATABASE_URL = pg.url;
          }
          if (exampleEnv.UPSTREAM_BASE_URL) exampleEnv.UPSTREAM_BASE_URL = sim.url;
          const key = words.some((w) => w === "5b0e7c9e-2f4d-4c1a-9d8e-0f1a2b3c4d5e") ? await newKey() : "";
          const args = words.map((w) =>
            w === "7f8f3c2a-1b2c-4d5e-8f90-123456789abc"
              ? org
              : w === "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
                ? user
                : w === "5b0e7c9e-2f4d-4c1a-9d8e-0f1a2b3c4d5e"
                  ? key
                  : w === "/etc/gateway/config.json"
                    ? cfg
                    : w,
          );
          const line = [...Object.entries(exampleEnv).map(([k, v]) => `${k}=${v}`), "gateway", ...args].join(" ");
          if (args[0] === "serve" || args[0] === "simulate-upstream") {
            // Servers: a port of their own (the examples' 8000 and the default 8080 may be taken), up, then SIGTERM.
            const i = args.indexOf("--port");
            if (i >= 0) args[i + 1] = "0";
            else args.push("--port", "0");
            const proc = startGatewayProcess(args, { cwd: dir, env: { ...env, ...exampleEnv, LOG_LEVEL: "info" } });
            try {
              const url = await listeningUrl(proc, 60_000, args[0] === "serve" ? /"msg":"listening"/ : /simulator listening/);
              await waitFor200(args[0] === "serve" ? `${url}/readyz` : `${url}/models`, 60_000);
              proc.kill("SIGTERM");
              expect({ line, code: await exitWithin(proc, 30_000) }).toEqual({ line, code: 0 });
            } finally {
              proc.kill("SIGKILL");
            }
          } else {
            await gw(args, exampleEnv);
          }
          ran.push(line);
        }
      }
      // Every example ran but the Postgres form where there is none.
      expect(ran.length).toBe(COMMANDS.flatMap((c) => c.examples).length - (pg ? 0 : 1));
    } finally {
      await pg?.drop();
    }
  });
});

describe("README's \"Running it for real\" and docs/operations.md's \"First key on the VM\", as written", () => {
  test("migrate creates ./data; orgs and keys create with the README's flags; serve with UPSTREAM_BASE_URL, --host and --port; keys made while it runs work at once", async () => {
    // The upstream sees what the gateway sends: every alias under its own name as the model, UPSTREAM_API_KEY as the bearer.
    sim = sim ?? (await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 3 }));
    const target = sim.url;
    const seen: { path: string; model: string; auth: string | null }[] = [];
    const recorder = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      async fetch(req) {
        const url = new URL(req.url);
        const body = req.method === "POST" ? await req.text() : undefined;
        if (body) seen.push({ path: url.pathname, model: (JSON.parse(body) as { model: string }).model, auth: req.headers.get("authorization") });
        const headers = new Headers(req.headers);
        headers.delete("host");
        return fetch(`${target.replace(/\/v1$/, "")}${url.pathname}`, { method: req.method, headers, ...(body ? { body } : {}) });
      },
    });
    const dir = scratchDir("gw-claims-ops-");
    const pg = TEST_DATABASE_URL ? await createScratchDatabase(TEST_DATABASE_URL, "gw_readme") : undefined;
    const env = cleanEnv({ LOG_LEVEL: "error", MIMALLOC_PURGE_HOLES: "0", ...(pg ? { DATABASE_URL: pg.url } : {}) });
    const shell = (line: string, id?: string) =>
      [...line.replace("<org id>", id ?? "<org id>").matchAll(/"([^"]*)"|(\S+)/g)].map((m) => m[1] ?? m[2] ?? "").slice(1);
    const readme = commandLines(section(README, "## Running it for real")).map((l) => l.replace(/\s+#.*$/, ""));
    expect(readme.map((l) => l.split(" ").slice(0, 3).join(" "))).toEqual([
      "bun run build",
      "./dist/gateway migrate",
      "./dist/gateway orgs create",
      "./dist/gateway keys create",
      "UPSTREAM_BASE_URL=http://10.0.0.5:8000/v1 ./dist/gateway serve",
    ]);
    const cli = async (line: string, id?: string) => {
      const r = await runGateway(shell(line, id), { cwd: dir, env });
      expect({ line, code: r.code, stderr: r.stderr }).toEqual({ line, code: 0, stderr: "" });
      return r;
    };
    let server: ReturnType<typeof startGatewayProcess> | undefined;
    try {
      await cli(readme[1] ?? "");
      // "creates ./data (embedded database)": in the working directory, unless DATABASE_URL names a Postgres.
      expect(existsSync(join(dir, "data", "pg"))).toBe(!pg);
      const org = onlyJson<{ id: string; plan: string; quota: unknown }>((await cli(readme[2] ?? "")).stdout);
      expect(org.plan).toBe("Standard");
      const key = onlyJson<{ key: string; scopes: string[] }>((await cli(readme[3] ?? "", org.id)).stdout);
      expect(key.scopes).toEqual(["inference", "audit:read"]);

      // serve: --host 0.0.0.0 as written (all addresses, loopback among them); the port is any free one, not 8080.
      const serveArgs = shell((readme[4] ?? "").replace(/^UPSTREAM_BASE_URL=\S+ /, ""));
      expect(serveArgs).toEqual(["serve", "--host", "0.0.0.0", "--port", "8080"]);
      serveArgs[4] = "0";
      server = startGatewayProcess(serveArgs, { cwd: dir, env: { ...env, LOG_LEVEL: "info", UPSTREAM_BASE_URL: `http://127.0.0.1:${recorder.port}/v1`, UPSTREAM_API_KEY: "sk-upstream-77" } });
      const listening = await listeningUrl(server);
      expect(new URL(listening).hostname).toBe("0.0.0.0");
      const url = `http://127.0.0.1:${new URL(listening).port}`;
      await waitFor200(`${url}/readyz`, 60_000);
      if (!pg) expect(existsSync(join(dir, "data", "admin", "admin.sock"))).toBe(true);

      const auth = (k: string) => ({ authorization: `Bearer ${k}`, "content-type": "application/json" });
      const me = (await (await fetch(`${url}/v1/me`, { headers: auth(key.key) })).json()) as { organization: { id: string } };
      expect(me.organization.id).toBe(org.id);
      for (const model of ["svc-fast", "svc-smart", "svc-bigthink"]) {
        const res = await fetch(`${url}/v1/chat/completions`, { method: "POST", headers: auth(key.key), body: JSON.stringify({ model, messages: [{ role: "user", content: "hi" }] }) });
        expect({ model, status: res.status }).toEqual({ model, status: 200 });
        await res.arrayBuffer();
      }
      const emb = await fetch(`${url}/v1/embeddings`, { method: "POST", headers: auth(key.key), body: JSON.stringify({ model: "svc-embed", input: "hi" }) });
      expect(emb.status).toBe(200);
      await emb.arrayBuffer();
      expect(seen.map((s) => [s.path, s.model, s.auth])).toEqual([
        ["/v1/chat/completions", "svc-fast", "Bearer sk-upstream-77"],
        ["/v1/chat/completions", "svc-smart", "Bearer sk-upstream-77"],
        ["/v1/chat/completions", "svc-bigthink", "Bearer sk-upstream-77"],
        ["/v1/embeddings", "svc-embed", "Bearer sk-upstream-77"],
      ]);

      // docs/operations.md, First key on the VM: "the service may be running; the CLI goes through its admin socket".
      const first = commandLines(section(OPERATIONS, "## Deployment (systemd)").slice(section(OPERATIONS, "## Deployment (systemd)").indexOf("First key on the VM")));
      expect(first.map((l) => l.split(" ").slice(0, 4).join(" "))).toEqual(["sudo gateway orgs create", "sudo gateway keys create"]);
      const vm = (line: string, id?: string) => cli(line.replace(/^sudo /, "").replaceAll("/var/lib/gateway", join(dir, "data")), id);
      const vmOrg = onlyJson<{ id: string }>((await vm(first[0] ?? "")).stdout);
      const vmKey = onlyJson<{ key: string }>((await vm(first[1] ?? "", vmOrg.id)).stdout);
      // A key made while serving works at once, and can read its organisation's audit log.
      const audit = await fetch(`${url}/v1/audit-events`, { headers: auth(vmKey.key) });
      expect(audit.status).toBe(200);
      expect(((await audit.json()) as { data: { action: string }[] }).data.map((e) => e.action)).toContain("org.created");
      // help.ts: every command reads GATEWAY_DATA_DIR as it reads --data-dir.
      const listed = await runGateway(["keys", "list", "--org", vmOrg.id, "--json"], { cwd: ROOT, env: { ...env, GATEWAY_DATA_DIR: join(dir, "data") } });
      expect({ code: listed.code, stderr: listed.stderr, n: listed.code === 0 ? onlyJson<unknown[]>(listed.stdout).length : -1 }).toEqual({ code: 0, stderr: "", n: 1 });

      server.kill("SIGTERM");
      expect(await exitWithin(server, 30_000)).toBe(0);
    } finally {
      server?.kill("SIGKILL");
      recorder.stop(true);
      await pg?.drop();
    }
  });
});

describe("SIGTERM once serve listens (docs/operations.md: stop accepting, drain, exit 0)", () => {
  test("serve --demo, signalled while it seeds its keys (after the listening line): a graceful stop, exit 0, not the signal's default exit 143", async () => {
    // The window is the demo's seeding: the signal must land before its keys are printed. Tried a few times
    // until it does (on a fast machine the seeding may finish before the signal is sent).
    let exercised = 0;
    for (let attempt = 0; attempt < 5 && exercised < 2; attempt++) {
      const demo = startGatewayProcess(["serve", "--demo", "--port", "0"], { env: cleanEnv({ MIMALLOC_PURGE_HOLES: "0" }) });
      try {
        await demo.waitForLine(/"msg":"listening"/, 60_000);
        demo.kill("SIGTERM");
        const seededFirst = demo.stdout().includes("Demo organisation");
        const code = await exitWithin(demo, 30_000);
        if (seededFirst) continue;
        exercised++;
        expect({ code, stopped: demo.stdout().includes('"msg":"stopped"') }).toEqual({ code: 0, stopped: true });
      } finally {
        demo.kill("SIGKILL");
      }
    }
    expect(exercised).toBeGreaterThan(0);
  });
});

describe("gateway simulate-upstream's knobs (README synopsis)", () => {
  test("--tokens sets the completion's length; --ttft-ms and --inter-token-ms its pace", async () => {
    const proc = startGatewayProcess(["simulate-upstream", "--port", "0", "--tokens", "7", "--ttft-ms", "300", "--inter-token-ms", "100"]);
    try {
      const url = await listeningUrl(proc, 30_000, /simulator listening/);
      const t0 = performance.now();
      const res = await fetch(`${url}/chat/completions`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }),
      });
      const body = (await res.json()) as { usage: { completion_tokens: number } };
      const elapsed = performance.now() - t0;
      expect(res.status).toBe(200);
      expect(body.usage.completion_tokens).toBe(7);
      // 300 ms to the first token, 100 ms to each of the 6 others: at least 900 ms (the defaults: 20 + 15 × 5 ms).
      expect(elapsed).toBeGreaterThanOrEqual(880);
      proc.kill("SIGTERM");
      expect(await exitWithin(proc, 10_000)).toBe(0);
    } finally {
      proc.kill("SIGKILL");
    }
  });
});
