import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { TEST_DATABASE_URL } from "../helpers/harness.ts";
import {
  BUN,
  MAIN,
  ROOT,
  type Proc,
  type ScratchPostgres,
  cleanEnv,
  createScratchDatabase,
  exitWithin,
  freePort,
  listeningUrl,
  onlyJson,
  removeScratch,
  run,
  runGateway,
  scratchDir,
  startGatewayProcess,
  waitFor200,
} from "../helpers/process.ts";

// Gateway processes and PGlite start-ups on a busy 2-core machine.
setDefaultTimeout(240_000);

/**
 * Claims round 10: promises of the README's Quick start, Configuration and
 * CLI sections and of docs/operations.md that an operator acts on and no
 * other test held, each through a real `gateway` process.
 */

let sim: Simulator;
beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 4 });
});
afterAll(async () => {
  await sim?.stop();
  removeScratch();
});

describe("README, Quick start: the demo prints ready-to-paste curl lines", () => {
  test("every curl line `serve --demo` prints runs as printed (in sh) and is answered 200 with what it asks for", async () => {
    const demo = startGatewayProcess(["serve", "--demo", "--port", "0"], { env: cleanEnv({ MIMALLOC_PURGE_HOLES: "0" }) });
    try {
      await listeningUrl(demo);
      await demo.waitForLine(/^Stop with Ctrl-C\.$/, 60_000);
      const out = demo.stdout();
      const block = out.slice(out.indexOf("\nTry:\n") + "\nTry:\n".length, out.indexOf("\nOr with the OpenAI SDK"));
      // Commands as sh reads them: a trailing backslash continues the line.
      const commands = block
        .replace(/\\\n\s*/g, "")
        .split("\n")
        .map((l) => l.trim())
        .filter(Boolean);
      expect(commands.length).toBeGreaterThanOrEqual(7);
      expect(commands.every((c) => c.startsWith("curl "))).toBe(true);
      const answers: Record<string, unknown> = {};
      for (const command of commands) {
        // Pasted as printed; the status is appended on a line of its own (curl's --write-out, set from the environment).
        const r = await run(["sh", "-c", `curl() { command curl -w '\\n%{http_code}' "$@"; }\n${command}`], { env: cleanEnv() });
        const lines = r.stdout.trimEnd().split("\n");
        const status = lines.pop();
        expect({ command, code: r.code, status }).toEqual({ command, code: 0, status: "200" });
        const path = /http:\/\/[^/]+(\/v1\/[a-z/-]+)/.exec(command)?.[1] ?? "";
        const body = lines.join("\n");
        answers[`${path}${command.includes('"stream":true') ? " stream" : ""}`] = command.includes('"stream":true') ? body : JSON.parse(body);
      }
      const me = answers["/v1/me"] as { key: { kind: string } };
      expect(me.key.kind).toBe("personal");
      const models = answers["/v1/models"] as { data: { id: string }[] };
      expect(models.data.map((m) => m.id).sort()).toEqual(["svc-bigthink", "svc-embed", "svc-fast", "svc-smart"]);
      const chat = answers["/v1/chat/completions"] as { choices: { message: { content: string } }[] };
      expect(chat.choices[0]?.message.content.length).toBeGreaterThan(0);
      const stream = String(answers["/v1/chat/completions stream"]);
      expect(stream).toContain('"object":"chat.completion.chunk"');
      expect(stream.trimEnd().endsWith("data: [DONE]")).toBe(true);
      const response = answers["/v1/responses"] as { object: string; status: string; output_text?: string };
      expect([response.object, response.status]).toEqual(["response", "completed"]);
      const embedding = answers["/v1/embeddings"] as { data: { embedding: number[] }[] };
      expect(embedding.data[0]?.embedding.length).toBeGreaterThan(0);
      const audit = answers["/v1/audit-events"] as { data: unknown[] };
      expect(audit.data).toHaveLength(5);
      demo.kill("SIGTERM");
      expect(await exitWithin(demo, 30_000)).toBe(0);
    } finally {
      demo.kill("SIGKILL");
    }
  });
});

describe(`README, Configuration: logLevel (LOG_LEVEL) and accessLog in a serve process (${TEST_DATABASE_URL ? "Postgres" : "embedded database"})`, () => {
  let pg: ScratchPostgres | undefined;
  let dir: string;
  let key: string;
  let orgId: string;
  let keyId: string;
  let env: Record<string, string>;

  beforeAll(async () => {
    dir = scratchDir("gw-claims10-log-");
    pg = TEST_DATABASE_URL ? await createScratchDatabase(TEST_DATABASE_URL, "gw_claims10") : undefined;
    env = cleanEnv({ UPSTREAM_BASE_URL: sim.url, GATEWAY_DATA_DIR: join(dir, "data"), ...(pg ? { DATABASE_URL: pg.url } : {}) });
    const org = await runGateway(["orgs", "create", "--name", "Logs", "--json"], { env });
    expect(org.code).toBe(0);
    orgId = onlyJson<{ id: string }>(org.stdout).id;
    const k = await runGateway(["keys", "create", "--org", orgId, "--kind", "service", "--scopes", "inference", "--json"], { env });
    expect(k.code).toBe(0);
    ({ key, id: keyId } = onlyJson<{ key: string; id: string }>(k.stdout));
  });
  afterAll(async () => {
    await pg?.drop();
  });

  /** Serve with `extra` in its environment (on a port picked beforehand: at warn and above there is no listening line), send one chat completion, stop it. */
  async function served(extra: Record<string, string>, args: string[] = [], accessLine = false): Promise<{ proc: Proc; requestId: string; lines: string[]; metrics?: string }> {
    const port = freePort();
    const proc = startGatewayProcess(["serve", "--port", String(port), ...args], { env: { ...env, ...extra } });
    try {
      await waitFor200(`http://127.0.0.1:${port}/readyz`, 60_000);
      const res = await fetch(`http://127.0.0.1:${port}/v1/chat/completions`, {
        method: "POST",
        headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
        body: JSON.stringify({ model: "svc-fast", messages: [{ role: "user", content: "hello there" }] }),
      });
      expect(res.status).toBe(200);
      await res.json();
      const requestId = String(res.headers.get("x-request-id"));
      // The line of a request already answered is written at the end of its turn: give it a moment before the stop.
      let metrics: string | undefined;
      if (accessLine) {
        await proc.waitForLine(new RegExp(`"msg":"request".*"request_id":"${requestId}"`), 10_000);
        // The metrics listener's address as the listening line gives it (METRICS_LISTEN=127.0.0.1:0: any free port).
        const listening = JSON.parse(await proc.waitForLine(/"msg":"listening"/)) as { metrics_url: string };
        metrics = await (await fetch(listening.metrics_url)).text();
      }
      proc.kill("SIGTERM");
      expect(await exitWithin(proc, 30_000)).toBe(0);
      return { proc, requestId, lines: proc.stdout().split("\n").filter(Boolean), metrics };
    } finally {
      proc.kill("SIGKILL");
    }
  }

  test("by default (info, accessLog true): JSON lines on stdout, the listening line's metrics_url is where /metrics answers, one access line with the documented fields", async () => {
    const { proc, requestId, lines, metrics } = await served({}, [], true);
    expect(metrics).toMatch(/^gateway_http_requests_total\{route="\/v1\/chat\/completions",method="POST",status="200",code=""\} 1$/m);
    // docs/operations.md: "Logs are JSON lines on stdout".
    for (const l of lines) expect(() => JSON.parse(l)).not.toThrow();
    expect(proc.stderr()).toBe("");
    const parsed = lines.map((l) => JSON.parse(l) as Record<string, unknown>);
    // One line per request: the chat completion's, and the /readyz polls' before it.
    const access = parsed.filter((l) => l.msg === "request" && l.request_id === requestId);
    expect(access).toHaveLength(1);
    expect(parsed.filter((l) => l.msg === "request" && l.route === "/readyz").length).toBeGreaterThan(0);
    const line = access[0] ?? {};
    // "one access line per request with request id, organisation, key id, route, alias, status, latency and tokens".
    expect({
      request_id: line.request_id,
      org_id: line.org_id,
      key_id: line.key_id,
      route: line.route,
      alias: line.alias,
      status: line.status,
      latency: typeof line.latency_ms === "number" && line.latency_ms > 0,
      prompt: typeof line.prompt_tokens === "number" && line.prompt_tokens > 0,
      completion_tokens: line.completion_tokens,
    }).toEqual({
      request_id: requestId,
      org_id: orgId,
      key_id: keyId,
      route: "/v1/chat/completions",
      alias: "svc-fast",
      status: 200,
      latency: true,
      prompt: true,
      completion_tokens: 4,
    });
    expect(parsed.some((l) => l.msg === "stopped")).toBe(true);
  });

  test("accessLog false (config file): no access line, the other info lines stay", async () => {
    const cfg = join(dir, "no-access.json");
    writeFileSync(cfg, JSON.stringify({ accessLog: false }));
    const { lines } = await served({}, ["--config", cfg]);
    const msgs = lines.map((l) => (JSON.parse(l) as { msg: string }).msg);
    expect(msgs).toContain("listening");
    expect(msgs).toContain("stopped");
    expect(msgs).not.toContain("request");
  });

  test("LOG_LEVEL=warn: no info line (listening, request, stopped), the start's warning still written; LOG_LEVEL=silent: nothing on stdout at all", async () => {
    // MIMALLOC_PURGE_HOLES unset: serve warns at start (docs/operations.md, The allocator setting).
    const warn = await served({ LOG_LEVEL: "warn" });
    const levels = warn.lines.map((l) => (JSON.parse(l) as { level: string }).level);
    expect(levels.length).toBeGreaterThan(0);
    expect(levels.filter((l) => l !== "warn" && l !== "error")).toEqual([]);
    expect(warn.lines.some((l) => l.includes("MIMALLOC_PURGE_HOLES is unset"))).toBe(true);
    const silent = await served({ LOG_LEVEL: "silent" });
    expect(silent.proc.stdout()).toBe("");
    expect(silent.proc.stderr()).toBe("");
  });
});

describe("README, Configuration: dbPoolMax is 1–200", () => {
  test("`config check` refuses 0, 201 and 10.5 (exit 2, the option named) and accepts 1 and 200", async () => {
    const work = scratchDir("gw-claims10-pool-");
    const env = cleanEnv({ UPSTREAM_BASE_URL: "http://10.0.0.5:8000/v1" });
    for (const [v, ok] of [
      [0, false],
      [201, false],
      [10.5, false],
      [1, true],
      [200, true],
    ] as const) {
      const file = join(work, `pool-${v}.json`);
      writeFileSync(file, JSON.stringify({ dbPoolMax: v }));
      const r = await runGateway(["config", "check", "--config", file], { env });
      expect({ v, code: r.code, named: r.stderr.includes("/dbPoolMax") }).toEqual({ v, code: ok ? 0 : 2, named: !ok });
    }
  });
});

describe("README, Configuration: `gateway config check` lists every problem with its path and exits 2", () => {
  test("an environment with no upstream (no UPSTREAM_BASE_URL, no aliases in the file), which serve refuses with exit 2: config check refuses it too, naming /aliases", async () => {
    const work = scratchDir("gw-claims10-check-");
    const file = join(work, "config.json");
    writeFileSync(file, JSON.stringify({ port: 8080 }));
    const env = cleanEnv({ GATEWAY_DATA_DIR: join(work, "data") });
    // What systemd runs (deploy/gateway.service): exit 2, not restarted (RestartPreventExitStatus=2).
    const serve = await runGateway(["serve", "--config", file], { env });
    expect({ code: serve.code, named: serve.stderr.includes("/aliases") }).toEqual({ code: 2, named: true });
    // What an operator runs before it, on the same file and environment.
    const check = await runGateway(["config", "check", "--config", file], { env });
    expect({ code: check.code, stdout: check.stdout, named: check.stderr.includes("/aliases") }).toEqual({ code: 2, stdout: "", named: true });
    // Either way of naming an upstream satisfies both.
    const withUpstream = await runGateway(["config", "check", "--config", file], { env: { ...env, UPSTREAM_BASE_URL: "http://10.0.0.5:8000/v1" } });
    expect({ code: withUpstream.code, stderr: withUpstream.stderr }).toEqual({ code: 0, stderr: "" });
    const aliases = join(work, "aliases.json");
    writeFileSync(aliases, JSON.stringify({ aliases: { "svc-fast": { targets: [{ baseUrl: "http://10.0.0.5:8000/v1", model: "m" }] } } }));
    const withAliases = await runGateway(["config", "check", "--config", aliases], { env });
    expect({ code: withAliases.code, stderr: withAliases.stderr }).toEqual({ code: 0, stderr: "" });
  });
});

describe(`docs/operations.md, Deployment: the CLI given the service's environment file (${TEST_DATABASE_URL ? "Postgres" : "embedded database"})`, () => {
  test("the documented `sh -c 'set -a; . gateway.env; exec gateway orgs create …'` line, run as written while the service runs: the organisation is in the service's database, made under its configuration", async () => {
    const doc = readFileSync(join(ROOT, "docs", "operations.md"), "utf8");
    const line = /^sudo sh -c '(set -a; \. \/etc\/gateway\/gateway\.env; exec gateway [^']+)'$/m.exec(doc)?.[1];
    expect(line).toBeDefined();
    const root = scratchDir("gw-claims10-envfile-");
    // /var/lib/gateway, /etc/gateway, and the folder root's shell is in when the operator types the line.
    const state = join(root, "var-lib-gateway");
    const etc = join(root, "etc-gateway");
    const cwd = join(root, "root-home");
    for (const d of [etc, cwd]) Bun.spawnSync(["mkdir", "-p", d]);
    const pg = TEST_DATABASE_URL ? await createScratchDatabase(TEST_DATABASE_URL, "gw_envfile") : undefined;
    // "When that file sets DATABASE_URL or GATEWAY_CONFIG": a configuration of its own (another key tag, a plan of its own as the default).
    const configFile = join(etc, "config.json");
    writeFileSync(configFile, JSON.stringify({ keyTag: "acme", plans: { Gold: { requestsPerMinute: 500 } }, defaultPlan: "Gold" }));
    const envFile = join(etc, "gateway.env");
    writeFileSync(envFile, [`UPSTREAM_BASE_URL=${sim.url}`, `GATEWAY_CONFIG=${configFile}`, ...(pg ? [`DATABASE_URL=${pg.url}`] : []), ""].join("\n"));
    const fileEnv = Object.fromEntries(
      readFileSync(envFile, "utf8")
        .split("\n")
        .filter(Boolean)
        .map((l) => [l.slice(0, l.indexOf("=")), l.slice(l.indexOf("=") + 1)]),
    );
    // The service as deploy/gateway.service runs it: EnvironmentFile, `serve --data-dir /var/lib/gateway`.
    const server = startGatewayProcess(["serve", "--data-dir", state, "--port", "0"], { cwd: state.replace(/var-lib-gateway$/, ""), env: cleanEnv({ ...fileEnv, MIMALLOC_PURGE_HOLES: "0" }) });
    try {
      const url = await listeningUrl(server);
      await waitFor200(`${url}/readyz`, 60_000);
      const script = (line ?? "")
        .replaceAll("/etc/gateway/gateway.env", envFile)
        .replaceAll("/var/lib/gateway", state)
        .replace("exec gateway ", `exec ${BUN} run ${MAIN} `);
      const r = await run(["sh", "-c", script], { cwd, env: cleanEnv() });
      expect({ code: r.code, stderr: r.stderr }).toEqual({ code: 0, stderr: "" });
      const org = onlyJson<{ id: string; plan: string }>(r.stdout);
      // Made under the service's configuration, and nothing left where root's shell was.
      expect(org.plan).toBe("Gold");
      expect(existsSync(join(cwd, "data"))).toBe(false);
      // In the service's database: a key made for it (the service's way: its data directory, or its Postgres) works against the service.
      const key = await runGateway(["keys", "create", "--org", org.id, "--kind", "service", "--scopes", "inference", "--data-dir", state, "--json"], { env: cleanEnv(fileEnv) });
      expect({ code: key.code, stderr: key.stderr }).toEqual({ code: 0, stderr: "" });
      const secret = onlyJson<{ key: string }>(key.stdout).key;
      expect(secret.startsWith("sk-acme-")).toBe(true);
      const me = await fetch(`${url}/v1/me`, { headers: { authorization: `Bearer ${secret}` } });
      expect(me.status).toBe(200);
      expect(((await me.json()) as { organization: { id: string } }).organization.id).toBe(org.id);
      server.kill("SIGTERM");
      expect(await exitWithin(server, 30_000)).toBe(0);
    } finally {
      server.kill("SIGKILL");
      await pg?.drop();
    }
  });
});

describe(`docs/operations.md, Deployment: which configuration a CLI command without GATEWAY_CONFIG uses while the service runs (${TEST_DATABASE_URL ? "Postgres" : "embedded database"})`, () => {
  test(
    TEST_DATABASE_URL
      ? "on Postgres the CLI works on its own: the default plan and key tag, a key the service (keyTag acme) refuses"
      : "on the embedded database the command runs inside the service, with the service's configuration: its default plan and its key tag, a key that works",
    async () => {
      const root = scratchDir("gw-claims10-cfg-");
      const state = join(root, "state");
      const configFile = join(root, "config.json");
      writeFileSync(configFile, JSON.stringify({ keyTag: "acme", plans: { Gold: { requestsPerMinute: 500 } }, defaultPlan: "Gold" }));
      const pg = TEST_DATABASE_URL ? await createScratchDatabase(TEST_DATABASE_URL, "gw_cfgcli") : undefined;
      const dbEnv = pg ? { DATABASE_URL: pg.url } : {};
      const server = startGatewayProcess(["serve", "--data-dir", state, "--port", "0"], {
        env: cleanEnv({ UPSTREAM_BASE_URL: sim.url, GATEWAY_CONFIG: configFile, MIMALLOC_PURGE_HOLES: "0", ...dbEnv }),
      });
      try {
        const url = await listeningUrl(server);
        await waitFor200(`${url}/readyz`, 60_000);
        // The operator's shell: the database (DATABASE_URL or --data-dir), not the configuration.
        const env = cleanEnv(dbEnv);
        const org = await runGateway(["orgs", "create", "--name", "Acme", "--data-dir", state, "--json"], { env });
        expect({ code: org.code, stderr: org.stderr }).toEqual({ code: 0, stderr: "" });
        const made = onlyJson<{ id: string; plan: string }>(org.stdout);
        const key = await runGateway(["keys", "create", "--org", made.id, "--kind", "service", "--scopes", "inference", "--data-dir", state, "--json"], { env });
        expect({ code: key.code, stderr: key.stderr }).toEqual({ code: 0, stderr: "" });
        const secret = onlyJson<{ key: string }>(key.stdout).key;
        const me = await fetch(`${url}/v1/me`, { headers: { authorization: `Bearer ${secret}` } });
        await me.arrayBuffer();
        expect({ plan: made.plan, tag: secret.split("-")[1], status: me.status }).toEqual(
          pg ? { plan: "Standard", tag: "gw", status: 401 } : { plan: "Gold", tag: "acme", status: 200 },
        );
        server.kill("SIGTERM");
        expect(await exitWithin(server, 30_000)).toBe(0);
      } finally {
        server.kill("SIGKILL");
        await pg?.drop();
      }
    },
  );
});
