import { stat } from "node:fs/promises";
import { Value } from "@sinclair/typebox/value";
import { Alias, type Config, ConfigSchema, DEFAULT_PLANS, SPEC_ALIASES } from "./schema.ts";
import { isRecord } from "../lib/guards.ts";
import { allowListProblems } from "../inference/image-url.ts";
import { parseDuration } from "../auth/keys.ts";

export class ConfigError extends Error {
  constructor(readonly problems: string[]) {
    super(`invalid configuration:\n${problems.map((p) => `  - ${p}`).join("\n")}`);
  }
}

/**
 * What `serve` refuses in a configuration the loader accepts: no upstream at
 * all. The admin commands need none (they run where the service's
 * environment may not be), so the loader does not; `config check` lists it,
 * so that "valid" there means `serve` starts on it.
 */
export function serveProblems(config: Config): string[] {
  if (Object.keys(config.aliases).length > 0) return [];
  return ["/aliases: no upstream configured; set UPSTREAM_BASE_URL or aliases in the config file (or try --demo)"];
}

export interface LoadInput {
  env: Record<string, string | undefined>;
  /** Path of a JSON config file (from --config or GATEWAY_CONFIG). */
  file?: string;
  /** Command-line flags; they win over env and file. */
  overrides?: Partial<Pick<Config, "host" | "port" | "dataDir">>;
}

type Json = Record<string, unknown>;

async function readFile(path: string, problems: string[]): Promise<Json> {
  const f = Bun.file(path);
  // Bun.file(dir).exists() is false: a directory is told apart first, or it would be "not found".
  const isDir = await stat(path).then(
    (s) => s.isDirectory(),
    () => false,
  );
  if (isDir) {
    problems.push(`config file ${path}: is a directory, not a file`);
    return {};
  }
  if (!(await f.exists())) {
    problems.push(`config file ${path}: not found`);
    return {};
  }
  try {
    const parsed: unknown = JSON.parse(await f.text());
    if (!isRecord(parsed)) {
      problems.push(`config file ${path}: must hold a JSON object`);
      return {};
    }
    return parsed;
  } catch (e) {
    problems.push(`config file ${path}: invalid JSON (${(e as Error).message})`);
    return {};
  }
}

function envInt(env: LoadInput["env"], name: string, problems: string[]): number | undefined {
  const raw = env[name];
  if (raw === undefined || raw === "") return undefined;
  if (!/^\d+$/.test(raw)) {
    problems.push(`env ${name}: expected a whole number, got ${JSON.stringify(raw)}`);
    return undefined;
  }
  return Number(raw);
}

/** A switch: unset or empty is undefined; anything but the usual words for on and off is a problem, never a silent false. */
function envBool(env: LoadInput["env"], name: string, problems: string[]): boolean | undefined {
  const raw = env[name];
  if (raw === undefined || raw === "") return undefined;
  if (/^(1|true|yes|on)$/i.test(raw)) return true;
  if (/^(0|false|no|off)$/i.test(raw)) return false;
  problems.push(`env ${name}: expected 1, true, yes, on or 0, false, no, off, got ${JSON.stringify(raw)}`);
  return undefined;
}

/**
 * Parse the configuration once at boot: file, then env, then flags. Every
 * problem is collected so an operator fixes them all in one go.
 */
export async function loadConfig(input: LoadInput): Promise<Config> {
  const { env } = input;
  const problems: string[] = [];
  const path = input.file ?? env.GATEWAY_CONFIG;
  const raw: Json = path ? await readFile(path, problems) : {};

  const set = (key: string, value: unknown) => {
    if (value !== undefined && value !== "") raw[key] = value;
  };
  set("host", env.HOST);
  set("port", envInt(env, "PORT", problems));
  set("dataDir", env.GATEWAY_DATA_DIR);
  set("databaseUrl", env.DATABASE_URL);
  set("logLevel", env.LOG_LEVEL);
  set("cursorSecret", env.GATEWAY_CURSOR_SECRET);
  const reusePort = envBool(env, "GATEWAY_REUSE_PORT", problems);
  if (reusePort !== undefined) raw.reusePort = reusePort;
  if (env.METRICS_LISTEN) raw.metrics = { ...(isRecord(raw.metrics) ? raw.metrics : {}), listen: env.METRICS_LISTEN };
  const instances = envInt(env, "GATEWAY_RATE_LIMIT_INSTANCES", problems);
  if (instances !== undefined) raw.rateLimit = { ...(isRecord(raw.rateLimit) ? raw.rateLimit : {}), instances };
  const responses: Json = {};
  const enabled = envBool(env, "GATEWAY_RESPONSES", problems);
  if (enabled !== undefined) responses.enabled = enabled;
  const store = envBool(env, "GATEWAY_RESPONSES_STORE", problems);
  if (store !== undefined) responses.store = store;
  const retentionDays = envInt(env, "GATEWAY_RESPONSES_RETENTION_DAYS", problems);
  if (retentionDays !== undefined) responses.retentionDays = retentionDays;
  // A string: the schema checks it is refuse or ignore, and names the field when not.
  if (env.GATEWAY_RESPONSES_WEB_SEARCH) responses.webSearch = env.GATEWAY_RESPONSES_WEB_SEARCH;
  if (Object.keys(responses).length > 0) raw.responses = { ...(isRecord(raw.responses) ? raw.responses : {}), ...responses };
  for (const [k, v] of Object.entries(input.overrides ?? {})) set(k, v);

  // Plans: a file that adds a plan keeps the built-in ones unless it overrides them.
  raw.plans = { ...DEFAULT_PLANS, ...(isRecord(raw.plans) ? raw.plans : {}) };

  // Aliases: spec aliases named in a file inherit the spec's table; with no
  // aliases at all, UPSTREAM_BASE_URL points all four at one server.
  const fileAliases = isRecord(raw.aliases) ? raw.aliases : undefined;
  if (fileAliases && Object.keys(fileAliases).length > 0) {
    for (const [name, a] of Object.entries(fileAliases)) {
      const spec = SPEC_ALIASES[name];
      if (spec && isRecord(a)) {
        const { defaultModel: _unused, ...defaults } = spec;
        fileAliases[name] = { ...defaults, ...a };
      }
    }
  } else if (env.UPSTREAM_BASE_URL) {
    raw.aliases = upstreamAliases(env.UPSTREAM_BASE_URL, env.UPSTREAM_API_KEY ? "UPSTREAM_API_KEY" : undefined);
  }

  // A name every object already has ('__proto__', 'constructor', 'toString', …) would be dropped or
  // shadowed by lookups; names come from the file, so each is checked before anything reads them.
  for (const group of ["plans", "aliases"] as const) {
    const named = raw[group];
    if (!isRecord(named)) continue;
    for (const name of Object.keys(named)) {
      if (name in Object.prototype) problems.push(`/${group}/${name}: not a usable name (it is a built-in member of every object)`);
    }
  }

  const config = Value.Default(ConfigSchema, raw) as Config;
  // TypeBox's Default does not descend into Record values whose schema has no
  // `default` of its own, so each alias (and its targets' weight) is defaulted
  // here. An alias without `timeouts` keeps none: it inherits upstream.timeouts.
  if (isRecord(config.aliases)) {
    for (const [name, a] of Object.entries(config.aliases)) {
      const inherits = isRecord(a) && !("timeouts" in a);
      const defaulted = Value.Default(Alias, a);
      if (inherits && isRecord(defaulted)) delete defaulted.timeouts;
      (config.aliases as Json)[name] = defaulted;
    }
  }
  const invalid: string[] = [];
  for (const err of Value.Errors(ConfigSchema, config)) {
    invalid.push(err.path);
    problems.push(`${err.path || "/"}: ${describe(err.schema, err.message)}${err.value === undefined ? "" : ` (got ${clip(JSON.stringify(err.value))})`}`);
  }
  // The checks below read what they check as the schema types it, so each runs
  // only where the schema found nothing wrong (at that path, inside it, or
  // around it): a schema error elsewhere no longer hides their problems.
  const valid = (...paths: string[]) => paths.every((p) => !invalid.some((e) => e === "" || e === p || e.startsWith(`${p}/`) || p.startsWith(`${e}/`)));
  // The embedded database belongs to one process, so instances sharing a port
  // would each have their own keys and quota: only a shared Postgres makes sense.
  if (valid("/reusePort", "/databaseUrl") && config.reusePort && !config.databaseUrl) problems.push("/reusePort: several instances on one port need a shared Postgres (databaseUrl)");
  if (valid("/plans", "/defaultPlan") && !Object.hasOwn(config.plans, config.defaultPlan)) problems.push(`/defaultPlan: plan ${JSON.stringify(config.defaultPlan)} is not in /plans`);
  if (valid("/upstream/imageUrls")) problems.push(...allowListProblems(config.upstream.imageUrls?.allow ?? []));
  const { defaultLifetime, maxLifetime } = valid("/keys") ? config.keys : { defaultLifetime: "", maxLifetime: undefined };
  if (maxLifetime !== undefined && (parseDuration(defaultLifetime) ?? 0) > (parseDuration(maxLifetime) ?? 0)) {
    problems.push(`/keys/defaultLifetime: ${defaultLifetime} is longer than /keys/maxLifetime (${maxLifetime})`);
  }
  if (valid("/metrics/listen") && config.metrics.listen !== "main" && listenAddress(config.metrics.listen).port > 65535) {
    problems.push(`/metrics/listen: port out of range (got ${JSON.stringify(config.metrics.listen)})`);
  }
  for (const [name, alias] of valid("/aliases") || isRecord(config.aliases) ? Object.entries(config.aliases) : []) {
    if (!valid(`/aliases/${name}`)) continue;
    for (const [i, t] of alias.targets.entries()) {
      if (!URL.canParse(t.baseUrl) || !/^https?:$/.test(new URL(t.baseUrl).protocol)) {
        problems.push(`/aliases/${name}/targets/${i}/baseUrl: not an http(s) URL`);
      }
      if (t.apiKeyEnv && !env[t.apiKeyEnv]) problems.push(`/aliases/${name}/targets/${i}/apiKeyEnv: env ${t.apiKeyEnv} is not set`);
    }
    if (alias.kind === "chat" && alias.targets.every((t) => t.weight === 0)) {
      problems.push(`/aliases/${name}/targets: every target has weight 0`);
    }
  }
  if (problems.length > 0) throw new ConfigError(problems);
  return config;
}

function clip(s: string): string {
  return s.length > 80 ? `${s.slice(0, 77)}...` : s;
}

/** "Expected union value" says nothing to an operator; name the allowed values instead. */
function describe(schema: unknown, message: string): string {
  const anyOf = isRecord(schema) && Array.isArray(schema.anyOf) ? (schema.anyOf as unknown[]) : undefined;
  if (anyOf?.every((s) => isRecord(s) && "const" in s)) {
    return `expected one of ${anyOf.map((s) => JSON.stringify((s as Json).const)).join(", ")}`;
  }
  return message;
}

/** The four spec aliases pointing at one upstream server (UPSTREAM_BASE_URL, or the demo simulator). */
export function upstreamAliases(baseUrl: string, apiKeyEnv?: string): Json {
  const out: Json = {};
  for (const [name, spec] of Object.entries(SPEC_ALIASES)) {
    const { defaultModel, ...rest } = spec;
    out[name] = { ...rest, targets: [{ baseUrl, model: defaultModel, weight: 1, ...(apiKeyEnv ? { apiKeyEnv } : {}) }] };
  }
  return out;
}

/** "host:port", "[v6]:port" → the parts Bun.serve takes (the schema's pattern has checked the shape). */
export function listenAddress(listen: string): { hostname: string; port: number } {
  const at = listen.lastIndexOf(":");
  return { hostname: listen.slice(0, at).replace(/^\[|\]$/g, ""), port: Number(listen.slice(at + 1)) };
}

/** Config with secrets masked, for `config print`. */
export function maskConfig(c: Config): Config {
  const masked = structuredClone(c);
  if (masked.cursorSecret) masked.cursorSecret = "***";
  if (masked.databaseUrl) masked.databaseUrl = maskDatabaseUrl(masked.databaseUrl);
  return masked;
}

/**
 * A database URL with its credentials masked. A password may hold any
 * character unencoded ('/', '@', ':', '?', '#'), so the user information runs
 * to the last '@' (a host never holds one) and everything after the user's
 * first ':' is masked; when an '@' in the query makes that ambiguous, more is
 * masked, never less. Query parameters naming a password (libpq's `password`,
 * `sslpassword`) are masked too.
 */
export function maskDatabaseUrl(url: string): string {
  const scheme = url.indexOf("://");
  if (scheme === -1) return "***";
  const start = scheme + 3;
  let out = url;
  const at = url.lastIndexOf("@");
  if (at > start) {
    const userinfo = url.slice(start, at);
    const colon = userinfo.indexOf(":");
    if (colon !== -1) out = `${url.slice(0, start)}${userinfo.slice(0, colon)}:***${url.slice(at)}`;
  }
  return out.replace(/([?&][^=&#]*pass(?:word)?=)[^&#]*/gi, "$1***");
}
