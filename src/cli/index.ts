import { DrizzleQueryError } from "drizzle-orm";
import { FORWARDABLE, ForwardToServer, forward } from "./admin-socket.ts";
import { type Command, type Context, type Out, UsageError } from "./command.ts";
import { COMMANDS } from "./commands/index.ts";
import { commandHelp, groupHelp, groupUsage, topHelp } from "./help.ts";
import { ConfigError } from "../config/load.ts";
import { DataDirLockedError } from "../db/client.ts";
import { FieldError, InputError } from "../lib/errors.ts";
import { COMMIT, VERSION } from "../lib/version.ts";

/**
 * `gateway <command> …`: finds the command in the table (src/cli/commands/),
 * answers `--help` at every level from the same table, runs the command, and
 * turns what it throws into an exit code: 0 ok, 2 bad arguments or
 * configuration (message on stderr, nothing written), 1 a runtime failure.
 */

const defaultOut: Out = { stdout: (s) => process.stdout.write(s), stderr: (s) => process.stderr.write(s) };

const isHelp = (a: string | undefined) => a === "--help" || a === "-h";

/** `--help` anywhere among a command's own arguments (before a `--`) asks for its usage. */
function wantsHelp(args: readonly string[]): boolean {
  const end = args.indexOf("--");
  return (end === -1 ? args : args.slice(0, end)).some(isHelp);
}

/** The usage text for `gateway help [group [command]]`; the whole list for anything it does not know. */
function helpFor([group, name]: readonly string[]): string {
  const inGroup = COMMANDS.filter((c) => c.group === group);
  const only = inGroup.length === 1 && inGroup[0]?.name === undefined ? inGroup[0] : undefined;
  const c = only ?? inGroup.find((c) => c.name !== undefined && c.name === name);
  if (c) return commandHelp(c);
  if (group !== undefined && inGroup.length > 0) return groupHelp(group, inGroup);
  return topHelp(COMMANDS);
}

export async function runCli(argv: string[], out: Out = defaultOut): Promise<number> {
  const ctx: Context = { out, runCli };
  const [first, ...rest] = argv;
  let cmd: Command | undefined;
  try {
    if (first === undefined || isHelp(first)) {
      out.stdout(`${topHelp(COMMANDS)}\n`);
      return 0;
    }
    if (first === "help") {
      out.stdout(`${helpFor(rest)}\n`);
      return 0;
    }
    if (first === "--version" || first === "-v" || first === "version") {
      out.stdout(`gateway ${VERSION} (${COMMIT})\n`);
      return 0;
    }
    const group = COMMANDS.filter((c) => c.group === first);
    if (group.length === 0) throw new UsageError(`unknown command ${JSON.stringify(first)}; see gateway --help`);
    let args = rest;
    cmd = group.find((c) => c.name === undefined);
    if (!cmd) {
      const [sub, ...more] = rest;
      if (isHelp(sub)) {
        out.stdout(`${groupHelp(first, group)}\n`);
        return 0;
      }
      cmd = group.find((c) => c.name === sub);
      if (!cmd) throw new UsageError(groupUsage(first, group));
      args = more;
    }
    if (wantsHelp(args)) {
      out.stdout(`${commandHelp(cmd)}\n`);
      return 0;
    }
    return await cmd.execute(args, ctx);
  } catch (e) {
    if (e instanceof FieldError) {
      // A service names the field; the user typed a flag.
      out.stderr(`error: ${cmd ? cmd.describe(e) : e.message}\n`);
      return 2;
    }
    if (e instanceof ConfigError || e instanceof InputError) {
      out.stderr(`error: ${e.message}\n`);
      return 2;
    }
    if (e instanceof ForwardToServer) {
      // Only the admin commands run inside the server; `migrate` and the rest get the lock error.
      if (!FORWARDABLE.has(first ?? "")) {
        out.stderr(`error: ${e.cause instanceof Error ? e.cause.message : e.message}\n`);
        return 1;
      }
      let r: Awaited<ReturnType<typeof forward>>;
      try {
        r = await forward(e.socket, argv, e.input);
      } catch (err) {
        // A socket left by a killed server, or a server still starting: say so in one line, with the lock's advice.
        out.stderr(`error: the admin socket ${e.socket} does not answer (${reason(err)}); ${e.cause instanceof Error ? e.cause.message : ""}\n`);
        return 1;
      }
      out.stdout(r.stdout);
      out.stderr(r.stderr);
      return r.code;
    }
    if (e instanceof DataDirLockedError) {
      out.stderr(`error: ${e.message}\n`);
      return 1;
    }
    // Anything else (database unreachable, port in use, a bug): one clear line for
    // the operator and exit 1; the stack (and a failed query) only when asked for.
    out.stderr(`error: ${process.env.LOG_LEVEL === "debug" ? debugDetail(e) : reason(e)}\n`);
    return 1;
  }
}

/**
 * A runtime failure in one line. drizzle wraps a database error as "Failed
 * query: <sql> params: <values>" over several lines, with the database's own
 * reason only in `cause`: the reason is what the operator needs.
 */
function reason(e: unknown): string {
  const inner = e instanceof DrizzleQueryError && e.cause instanceof Error ? e.cause : e;
  return (inner instanceof Error ? inner.message : String(inner)).replace(/\s*\n\s*/g, " ");
}

function debugDetail(e: unknown): string {
  if (!(e instanceof Error)) return String(e);
  const own = e.stack ?? e.message;
  return e instanceof DrizzleQueryError && e.cause instanceof Error ? `${e.cause.message}\n${own}\ncaused by: ${e.cause.stack ?? e.cause.message}` : own;
}
