import { existsSync, rmSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { ForwardToServer, adminContext, socketPath } from "./admin-socket.ts";
import { UsageError, type Out } from "./command.ts";
import { loadConfig } from "../config/load.ts";
import type { Config } from "../config/schema.ts";
import { type Database, DataDirLockedError, migrate, openDatabase, unknownMigrations } from "../db/client.ts";
import { InputError } from "../lib/errors.ts";
import { inStorableRange, parseInstantOrDate } from "../lib/time.ts";

/** What the commands share: configuration, the database, output, and flag values. */

export async function config(values: { config?: string | undefined; "data-dir"?: string | undefined }, extra: Partial<Config> = {}): Promise<Config> {
  // A command forwarded to the running server uses the server's own configuration.
  const served = adminContext.getStore();
  if (served) return served.config;
  return loadConfig({
    env: process.env,
    file: values.config,
    overrides: { ...(values["data-dir"] ? { dataDir: values["data-dir"] } : {}), ...extra },
  });
}

/**
 * What opening the embedded database in `dataDir` would create: the topmost
 * missing directory of its path, or its `pg` directory. Removed again when
 * the command is refused (exit 2: nothing written), so a refused command
 * leaves no database behind, in a mistyped --data-dir least of all.
 */
function embeddedCreates(cfg: Config): string | undefined {
  if (cfg.databaseUrl || cfg.dataDir.startsWith("memory://")) return undefined;
  let dir = resolve(cfg.dataDir);
  if (existsSync(dir)) return existsSync(join(dir, "pg")) ? undefined : join(dir, "pg");
  while (!existsSync(dirname(dir)) && dirname(dir) !== dir) dir = dirname(dir);
  return dir;
}

/**
 * Open the database, bring its schema up to date (unless the command is
 * `migrate` itself), run, close. A database a newer release migrated gets the
 * warning `migrate` prints, on stderr, before the command runs; the command
 * and its exit code are unchanged (docs/decisions.md: Command line). A
 * command forwarded to the running server says nothing: `serve` logged it.
 */
export async function withDb<T>(cfg: Config, out: Out, fn: (db: Database) => Promise<T>, opts: { migrate: boolean } = { migrate: true }): Promise<T> {
  const served = adminContext.getStore();
  if (served) return fn(served.database);
  const creates = embeddedCreates(cfg);
  let refused = false;
  let database: Database;
  try {
    database = await openDatabase({ databaseUrl: cfg.databaseUrl, dataDir: cfg.dataDir, poolMax: 2 });
  } catch (e) {
    // The embedded database is held by a running server: run the command there.
    if (e instanceof DataDirLockedError && !cfg.databaseUrl && existsSync(socketPath(cfg.dataDir))) throw new ForwardToServer(socketPath(cfg.dataDir), e);
    throw e;
  }
  try {
    if (opts.migrate) {
      await migrate(database);
      const ahead = await unknownMigrations(database);
      if (ahead) out.stderr(`warning: ${ahead.message}\n`);
    }
    return await fn(database);
  } catch (e) {
    refused = e instanceof InputError;
    throw e;
  } finally {
    await database.close();
    if (refused && creates) rmSync(creates, { recursive: true, force: true });
  }
}

export function print(out: Out, json: boolean | undefined, value: unknown, human: string) {
  out.stdout(json ? `${JSON.stringify(value)}\n` : `${human}\n`);
}

export function int(v: string, flag: string): number {
  if (!/^\d{1,15}$/.test(v)) throw new UsageError(`${flag} must be a whole number, got ${JSON.stringify(v)}`);
  return Number(v);
}

/** An ISO 8601 time given on the command line (a date first; JS parses much else loosely). */
/** An ISO 8601 time given on the command line: the audit query's grammar, or a bare date (UTC midnight). */
export function isoTime(v: string, flag: string): Date {
  const t = parseInstantOrDate(v);
  if (!t || !inStorableRange(t)) throw new UsageError(`${flag} is not an ISO 8601 time: ${JSON.stringify(v)}`);
  return new Date(t.ms);
}

export function list(v: string | undefined): string[] {
  return (v ?? "")
    .split(",")
    .map((s) => s.trim())
    .filter(Boolean);
}

/**
 * The signals that stop a long-running command gracefully. SIGHUP is one: it
 * is what closing the terminal (an SSH session) sends a command running in
 * its foreground, and its default action killed `serve` outright, losing the
 * usage not yet written and stranding its quota leases. There is no
 * configuration to reload on it (docs/decisions.md: Shutdown).
 */
const STOP_SIGNALS = ["SIGTERM", "SIGINT", "SIGHUP"] as const;

/**
 * Resolves with the first stop signal. With `again`, the handlers stay: each
 * later stop signal calls it (counting from 2) instead of taking the signal's
 * default action, which killed the process in the middle of its graceful
 * stop (docs/decisions.md: Shutdown). Without it, the handlers go with the
 * first signal, and a second one kills (`simulate-upstream`: nothing to lose).
 */
export function waitForSignal(again?: (sig: string, count: number) => void): Promise<string> {
  return new Promise((resolve) => {
    let count = 0;
    const on = (sig: string) => {
      count++;
      if (count === 1) {
        if (!again) for (const s of STOP_SIGNALS) process.off(s, on);
        resolve(sig);
      } else again?.(sig, count);
    };
    for (const s of STOP_SIGNALS) process.on(s, on);
  });
}
