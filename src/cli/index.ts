import { existsSync } from "node:fs";
import { parseArgs } from "node:util";
import { FORWARDABLE, ForwardToServer, adminContext, forward, serveAdminSocket, socketPath } from "./admin-socket.ts";
import { createKey, createOrg, createUser, listKeys, revokeKey, rotateKey, setOrg } from "../admin/service.ts";
import { usageReport } from "../admin/usage.ts";
import { parseDuration } from "../auth/keys.ts";
import { importAudit } from "../audit/import.ts";
import { ConfigError, loadConfig, maskConfig, upstreamAliases } from "../config/load.ts";
import { type Config, SPEC_ALIASES } from "../config/schema.ts";
import { type Database, DataDirLockedError, migrate, openDatabase } from "../db/client.ts";
import { InputError } from "../lib/errors.ts";
import { startSimulator } from "../sim/index.ts";
import { startGateway } from "../server.ts";
import { seedDemo } from "./demo.ts";

import { COMMIT, VERSION } from "../lib/version.ts";
export { COMMIT, VERSION };

export const HELP = `gateway ${VERSION}: an OpenAI-compatible inference gateway with a small App API

Usage: gateway <command> [options]

Commands:
  serve [--host H] [--port P] [--config FILE] [--data-dir DIR] [--demo]
  migrate
  orgs create --name N [--plan P] [--quota-tokens N] [--quota-window hour|day|month] [--academy-only] [--json]
  orgs set --id ID [--plan P] [--quota-tokens N|none] [--quota-window W] [--academy-only true|false] [--json]
  users create --org ORG --name N --email E [--academy-only] [--json]
  keys create --org ORG [--user USER] --kind personal|service --scopes inference[,audit:read…]
              [--models a,b] [--expires-at ISO | --expires-in 90d] [--name N] [--json]
  keys list --org ORG [--json]
  keys revoke ID [--json]
  keys rotate ID [--grace 24h] [--json]
  audit import FILE                 JSON lines: org_id plus the spec 2.6 fields
  usage report --org ORG [--since ISO] [--json]   tokens per alias and key
  config check [--config FILE]      validate configuration and environment; exit 2 on error
  config print [--config FILE]      effective configuration, secrets masked
  simulate-upstream [--port P] [--host H] [--ttft-ms N] [--inter-token-ms N] [--tokens N]

Every command reads --config FILE (or GATEWAY_CONFIG), DATABASE_URL (Postgres) or
--data-dir / GATEWAY_DATA_DIR (embedded database, default ./data).
Options: --help, --version. Exit codes: 0 ok, 1 failure, 2 bad arguments or configuration.`;

export class UsageError extends InputError {}

type Out = { stdout: (s: string) => void; stderr: (s: string) => void };
const defaultOut: Out = { stdout: (s) => process.stdout.write(s), stderr: (s) => process.stderr.write(s) };

const COMMON = {
  config: { type: "string" },
  "data-dir": { type: "string" },
  json: { type: "boolean" },
  help: { type: "boolean" },
} as const;

function parse<const O extends Record<string, { type: "string" | "boolean" }>>(args: string[], options: O, positionals = 0) {
  let parsed: ReturnType<typeof parseArgs<{ args: string[]; options: O & typeof COMMON; allowPositionals: true; strict: true }>>;
  try {
    parsed = parseArgs({ args, options: { ...COMMON, ...options }, allowPositionals: true, strict: true });
  } catch (e) {
    throw new UsageError((e as Error).message);
  }
  if (parsed.positionals.length > positionals) throw new UsageError(`unexpected argument ${JSON.stringify(parsed.positionals[positionals])}`);
  return parsed;
}

function need(v: string | undefined, flag: string): string {
  if (v === undefined || v === "") throw new UsageError(`missing ${flag}`);
  return v;
}

function int(v: string, flag: string): number {
  if (!/^\d{1,15}$/.test(v)) throw new UsageError(`${flag} must be a whole number, got ${JSON.stringify(v)}`);
  return Number(v);
}

/** An ISO 8601 time given on the command line (a date first; JS parses much else loosely). */
function isoTime(v: string, flag: string): Date {
  const d = new Date(v);
  if (Number.isNaN(d.getTime()) || !/^\d{4}-\d{2}-\d{2}/.test(v)) throw new UsageError(`${flag} is not an ISO 8601 time: ${JSON.stringify(v)}`);
  return d;
}

function list(v: string | undefined): string[] {
  return (v ?? "")
    .split(",")
    .map((s) => s.trim())
    .filter(Boolean);
}

async function config(values: { config?: string; "data-dir"?: string }, extra: Partial<Config> = {}): Promise<Config> {
  // A command forwarded to the running server uses the server's own configuration.
  const served = adminContext.getStore();
  if (served) return served.config;
  return loadConfig({
    env: process.env,
    file: values.config,
    overrides: { ...(values["data-dir"] ? { dataDir: values["data-dir"] } : {}), ...extra },
  });
}

/** Open the database, bring its schema up to date (unless the command is `migrate` itself), run, close. */
async function withDb<T>(cfg: Config, fn: (db: Database) => Promise<T>, opts: { migrate: boolean } = { migrate: true }): Promise<T> {
  const served = adminContext.getStore();
  if (served) return fn(served.database);
  let database: Database;
  try {
    database = await openDatabase({ databaseUrl: cfg.databaseUrl, dataDir: cfg.dataDir, poolMax: 2 });
  } catch (e) {
    // The embedded database is held by a running server: run the command there.
    if (e instanceof DataDirLockedError && !cfg.databaseUrl && existsSync(socketPath(cfg.dataDir))) throw new ForwardToServer(socketPath(cfg.dataDir), e);
    throw e;
  }
  try {
    if (opts.migrate) await migrate(database);
    return await fn(database);
  } finally {
    await database.close();
  }
}

function print(out: Out, json: boolean | undefined, value: unknown, human: string) {
  out.stdout(json ? `${JSON.stringify(value)}\n` : `${human}\n`);
}

function knownModels(cfg: Config): string[] {
  return [...new Set([...Object.keys(SPEC_ALIASES), ...Object.keys(cfg.aliases)])];
}

export async function runCli(argv: string[], out: Out = defaultOut): Promise<number> {
  const [cmd, sub, ...rest] = argv;
  try {
    if (!cmd || cmd === "--help" || cmd === "-h" || cmd === "help") {
      out.stdout(`${HELP}\n`);
      return 0;
    }
    if (cmd === "--version" || cmd === "-v" || cmd === "version") {
      out.stdout(`gateway ${VERSION} (${COMMIT})\n`);
      return 0;
    }
    switch (cmd) {
      case "serve":
        return await serve([sub, ...rest].filter((a): a is string => a !== undefined), out);
      case "migrate": {
        const { values } = parse([sub, ...rest].filter((a): a is string => a !== undefined), {});
        const cfg = await config(values);
        // withDb must not migrate first here, or `migrate` would always report "up to date".
        const applied = await withDb(cfg, (db) => migrate(db), { migrate: false });
        print(out, values.json, { applied }, applied.length ? `applied: ${applied.join(", ")}` : "database is up to date");
        return 0;
      }
      case "orgs":
        return await orgs(sub, rest, out);
      case "users":
        return await usersCmd(sub, rest, out);
      case "keys":
        return await keys(sub, rest, out);
      case "audit": {
        if (sub !== "import") throw new UsageError("usage: gateway audit import FILE");
        const { values, positionals } = parse(rest, {}, 1);
        const file = need(positionals[0], "FILE");
        // Forwarded to a running server: the client already read the file (the
        // service's user may not see the path, nor share the client's cwd).
        const forwarded = adminContext.getStore()?.input;
        const f = Bun.file(file);
        if (forwarded === undefined && !(await f.exists())) throw new UsageError(`no such file: ${file}`);
        const cfg = await config(values);
        const text = forwarded ?? (await f.text());
        const n = await withDb(cfg, (db) => importAudit(db, text)).catch((e: unknown) => {
          if (e instanceof ForwardToServer) e.input = text;
          throw e;
        });
        print(out, values.json, { imported: n }, `imported ${n} events`);
        return 0;
      }
      case "usage": {
        if (sub !== "report") throw new UsageError("usage: gateway usage report --org ORG [--since ISO] [--json]");
        const { values } = parse(rest, { org: { type: "string" }, since: { type: "string" } });
        const cfg = await config(values);
        const orgId = need(values.org, "--org");
        const since = values.since === undefined ? undefined : isoTime(values.since, "--since");
        const rows = await withDb(cfg, (db) => usageReport(db, orgId, since));
        const human = rows.map((r) => `${r.alias.padEnd(14)} ${r.key_id}  ${String(r.requests).padStart(8)} req  ${String(r.total_tokens).padStart(12)} tokens`).join("\n");
        print(out, values.json, rows, human || "no usage");
        return 0;
      }
      case "config": {
        const { values } = parse(rest, {});
        if (sub !== "check" && sub !== "print") throw new UsageError("usage: gateway config check|print [--config FILE]");
        const cfg = await config(values);
        if (sub === "check") print(out, values.json, { ok: true }, "configuration is valid");
        else out.stdout(`${JSON.stringify(maskConfig(cfg), null, 2)}\n`);
        return 0;
      }
      case "simulate-upstream": {
        const { values } = parse([sub, ...rest].filter((a): a is string => a !== undefined), {
          port: { type: "string" },
          host: { type: "string" },
          "ttft-ms": { type: "string" },
          "inter-token-ms": { type: "string" },
          tokens: { type: "string" },
        });
        const sim = await startSimulator({
          port: values.port ? int(values.port, "--port") : 0,
          hostname: values.host ?? "127.0.0.1",
          ...(values["ttft-ms"] ? { ttftMs: int(values["ttft-ms"], "--ttft-ms") } : {}),
          ...(values["inter-token-ms"] ? { interTokenMs: int(values["inter-token-ms"], "--inter-token-ms") } : {}),
          ...(values.tokens ? { completionTokens: int(values.tokens, "--tokens") } : {}),
        });
        out.stdout(`${JSON.stringify({ msg: "simulator listening", url: sim.url })}\n`);
        await waitForSignal();
        await sim.stop();
        return 0;
      }
      default:
        throw new UsageError(`unknown command ${JSON.stringify(cmd)}; see gateway --help`);
    }
  } catch (e) {
    if (e instanceof ConfigError || e instanceof InputError) {
      out.stderr(`error: ${e.message}\n`);
      return 2;
    }
    if (e instanceof ForwardToServer) {
      // Only the admin commands run inside the server; `migrate` and the rest get the lock error.
      if (!FORWARDABLE.has(cmd ?? "")) {
        out.stderr(`error: ${e.cause instanceof Error ? e.cause.message : e.message}\n`);
        return 1;
      }
      const r = await forward(e.socket, argv, e.input);
      out.stdout(r.stdout);
      out.stderr(r.stderr);
      return r.code;
    }
    if (e instanceof DataDirLockedError) {
      out.stderr(`error: ${e.message}\n`);
      return 1;
    }
    // Anything else (database unreachable, port in use, a bug): one clear line for
    // the operator and exit 1; the stack only when asked for.
    const detail = e instanceof Error ? (process.env.LOG_LEVEL === "debug" ? (e.stack ?? e.message) : e.message) : String(e);
    out.stderr(`error: ${detail}\n`);
    return 1;
  }
}

function waitForSignal(): Promise<string> {
  return new Promise((resolve) => {
    const on = (sig: string) => {
      process.off("SIGTERM", on);
      process.off("SIGINT", on);
      resolve(sig);
    };
    process.on("SIGTERM", on);
    process.on("SIGINT", on);
  });
}

async function serve(args: string[], out: Out): Promise<number> {
  const { values } = parse(args, { host: { type: "string" }, port: { type: "string" }, demo: { type: "boolean" } });
  const overrides: Partial<Config> = {};
  if (values.host) overrides.host = values.host;
  if (values.port) overrides.port = int(values.port, "--port");
  let sim: Awaited<ReturnType<typeof startSimulator>> | undefined;
  let cfg: Config;
  if (values.demo) {
    // Demo: an in-memory database and an in-process simulated upstream, so it runs anywhere with nothing set up.
    sim = await startSimulator({ port: 0, ttftMs: 150, interTokenMs: 30 });
    const base = await config(values, { ...overrides, dataDir: values["data-dir"] ?? "memory://demo" });
    cfg = { ...base, aliases: Object.keys(base.aliases).length ? base.aliases : (upstreamAliases(sim.url) as Config["aliases"]) };
  } else {
    cfg = await config(values, overrides);
    if (Object.keys(cfg.aliases).length === 0) {
      throw new ConfigError(["/aliases: no upstream configured; set UPSTREAM_BASE_URL or aliases in the config file (or try --demo)"]);
    }
  }
  const gw = await startGateway({ config: cfg });
  gw.log.info("listening", { url: gw.url, database: gw.database.kind, demo: values.demo ?? false, version: VERSION });
  if (values.demo) out.stdout(await seedDemo(gw));
  const embeddedOnDisk = gw.database.kind === "pglite" && !cfg.dataDir.startsWith("memory://");
  const stopAdmin = embeddedOnDisk ? serveAdminSocket(cfg.dataDir, gw.database, cfg, (a, o) => runCli(a, o)) : undefined;
  const sig = await waitForSignal();
  gw.log.info("shutting down", { signal: sig, drain_ms: cfg.drainMs });
  stopAdmin?.();
  await gw.stop();
  await sim?.stop();
  gw.log.info("stopped");
  return 0;
}

async function orgs(sub: string | undefined, args: string[], out: Out): Promise<number> {
  if (sub === "create") {
    const { values } = parse(args, {
      name: { type: "string" },
      plan: { type: "string" },
      "quota-tokens": { type: "string" },
      "quota-window": { type: "string" },
      "academy-only": { type: "boolean" },
    });
    const cfg = await config(values);
    const name = need(values.name, "--name");
    const quota = values["quota-tokens"] === undefined || values["quota-tokens"] === "none" ? null : int(values["quota-tokens"], "--quota-tokens");
    const org = await withDb(cfg, (db) =>
      createOrg(db, {
        name,
        plan: values.plan ?? cfg.defaultPlan,
        plans: Object.keys(cfg.plans),
        quotaTokens: quota,
        ...(values["quota-window"] ? { quotaWindow: values["quota-window"] } : {}),
        academyOnly: values["academy-only"] ?? false,
      }),
    );
    print(out, values.json, org, `created organisation ${org.id} (${org.name}, plan ${org.plan})`);
    return 0;
  }
  if (sub === "set") {
    const { values } = parse(args, {
      id: { type: "string" },
      plan: { type: "string" },
      "quota-tokens": { type: "string" },
      "quota-window": { type: "string" },
      "academy-only": { type: "string" },
    });
    const cfg = await config(values);
    const id = need(values.id, "--id");
    const q = values["quota-tokens"];
    const academy = values["academy-only"];
    if (academy !== undefined && academy !== "true" && academy !== "false") throw new UsageError("--academy-only takes true or false");
    const org = await withDb(cfg, (db) =>
      setOrg(db, {
        id,
        plans: Object.keys(cfg.plans),
        ...(values.plan !== undefined ? { plan: values.plan } : {}),
        ...(q !== undefined ? { quotaTokens: q === "none" ? null : int(q, "--quota-tokens") } : {}),
        ...(values["quota-window"] !== undefined ? { quotaWindow: values["quota-window"] } : {}),
        ...(academy !== undefined ? { academyOnly: academy === "true" } : {}),
      }),
    );
    print(out, values.json, org, `updated organisation ${org.id}: plan ${org.plan}, quota ${org.quota_tokens ?? "none"} per ${org.quota_window}`);
    return 0;
  }
  throw new UsageError("usage: gateway orgs create|set …; see gateway --help");
}

async function usersCmd(sub: string | undefined, args: string[], out: Out): Promise<number> {
  if (sub !== "create") throw new UsageError("usage: gateway users create --org ORG --name N --email E");
  const { values } = parse(args, { org: { type: "string" }, name: { type: "string" }, email: { type: "string" }, "academy-only": { type: "boolean" } });
  const cfg = await config(values);
  const input = { orgId: need(values.org, "--org"), name: need(values.name, "--name"), email: need(values.email, "--email"), academyOnly: values["academy-only"] ?? false };
  const user = await withDb(cfg, (db) => createUser(db, input));
  print(out, values.json, user, `created user ${user.id} (${user.email})`);
  return 0;
}

async function keys(sub: string | undefined, args: string[], out: Out): Promise<number> {
  if (sub === "create") {
    const { values } = parse(args, {
      org: { type: "string" },
      user: { type: "string" },
      kind: { type: "string" },
      scopes: { type: "string" },
      models: { type: "string" },
      "expires-at": { type: "string" },
      "expires-in": { type: "string" },
      name: { type: "string" },
    });
    const cfg = await config(values);
    if (values["expires-at"] && values["expires-in"]) throw new UsageError("give --expires-at or --expires-in, not both");
    let expiresAt: Date | null = null;
    if (values["expires-at"]) {
      expiresAt = isoTime(values["expires-at"], "--expires-at");
      if (expiresAt.getTime() <= Date.now()) out.stderr("warning: --expires-at is in the past; the key is created already expired\n");
    } else if (values["expires-in"]) {
      const ms = parseDuration(values["expires-in"]);
      if (ms === null || ms === 0) throw new UsageError("--expires-in takes a duration such as 90d, 24h, 30m");
      expiresAt = new Date(Date.now() + ms);
    }
    const input = {
      orgId: need(values.org, "--org"),
      ...(values.user ? { userId: values.user } : {}),
      kind: need(values.kind, "--kind"),
      scopes: list(need(values.scopes, "--scopes")),
      models: list(values.models),
      knownModels: knownModels(cfg),
      expiresAt,
      name: values.name ?? "",
      tag: cfg.keyTag,
    };
    const key = await withDb(cfg, (db) => createKey(db, input));
    print(out, values.json, key, `created ${key.kind} key ${key.id}\n${key.key}\n(the key is shown only once; store it now)`);
    return 0;
  }
  if (sub === "list") {
    const { values } = parse(args, { org: { type: "string" } });
    const cfg = await config(values);
    const orgId = need(values.org, "--org");
    const rows = await withDb(cfg, (db) => listKeys(db, orgId));
    const human = rows
      .map((k) => `${k.id}  ${k.prefix}…  ${k.kind.padEnd(8)}  ${k.scopes.join(",")}  ${k.revoked_at ? "revoked" : k.expires_at ? `expires ${k.expires_at}` : "no expiry"}`)
      .join("\n");
    print(out, values.json, rows, human || "no keys");
    return 0;
  }
  if (sub === "revoke") {
    const { values, positionals } = parse(args, {}, 1);
    const cfg = await config(values);
    const id = need(positionals[0], "key ID");
    const k = await withDb(cfg, (db) => revokeKey(db, id));
    print(out, values.json, k, `revoked key ${k.id}`);
    return 0;
  }
  if (sub === "rotate") {
    const { values, positionals } = parse(args, { grace: { type: "string" } }, 1);
    const cfg = await config(values);
    const id = need(positionals[0], "key ID");
    const graceMs = values.grace === undefined ? 24 * 3_600_000 : values.grace === "0" ? 0 : parseDuration(values.grace);
    if (graceMs === null) throw new UsageError("--grace takes a duration such as 24h, 30m, 0");
    const k = await withDb(cfg, (db) => rotateKey(db, { id, graceMs, tag: cfg.keyTag }));
    print(out, values.json, k, `rotated: new key ${k.id}\n${k.key}\n(the old key works for ${values.grace ?? "24h"} more)`);
    return 0;
  }
  throw new UsageError("usage: gateway keys create|list|revoke|rotate …; see gateway --help");
}
