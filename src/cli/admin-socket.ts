import { AsyncLocalStorage } from "node:async_hooks";
import { chmodSync, existsSync, lstatSync, mkdirSync, unlinkSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import type { Config } from "../config/schema.ts";
import type { Database } from "../db/client.ts";

/**
 * Live administration on the embedded database. PGlite belongs to one
 * process, so while `gateway serve` runs, a CLI command on the same data
 * directory cannot open it. Instead the server listens on a Unix socket,
 * `admin/admin.sock` in the data directory, and runs the command in-process
 * against its own database; changes then invalidate its key cache directly.
 * Only the service's own user (or root) can ever connect: the socket's
 * directory is 0700 and ours, and the socket is 0600 from the moment it is
 * bound. With Postgres (DATABASE_URL) the CLI
 * talks to the database itself and this is not used.
 */

export const FORWARDABLE = new Set(["orgs", "users", "keys", "audit", "usage"]);

export function socketPath(dataDir: string): string {
  return join(resolve(dataDir), "admin", "admin.sock");
}

/** The socket's directory: ours alone (0700), never a link to somewhere else. */
function privateDirectory(dir: string): void {
  try {
    mkdirSync(dir, { mode: 0o700 });
  } catch (e) {
    if (!(e instanceof Error && "code" in e && e.code === "EEXIST")) throw e;
  }
  const st = lstatSync(dir);
  const uid = process.getuid?.();
  if (!st.isDirectory() || (uid !== undefined && st.uid !== uid)) {
    throw new Error(`admin socket directory ${dir} is not a directory of this user; remove it`);
  }
  // mkdir's mode passes through the umask, and an existing directory keeps its own.
  chmodSync(dir, 0o700);
}

/**
 * Set while the server runs a forwarded command: the CLI uses the server's
 * database and configuration, and `input` (a file the client read, e.g. for
 * `audit import`) instead of a path the server may not see.
 */
export const adminContext = new AsyncLocalStorage<{ database: Database; config: Config; input?: string }>();

export class ForwardToServer extends Error {
  /** File contents the command needs, read by the client (the service user may not be able to read the path). */
  input: string | undefined;
  /** `cause` is the DataDirLockedError, reported as is for commands that cannot be forwarded. */
  constructor(
    readonly socket: string,
    cause: Error,
  ) {
    super(`forward to ${socket}`, { cause });
  }
}

export interface CliResult {
  code: number;
  stdout: string;
  stderr: string;
}

export type CliRunner = (argv: string[], out: { stdout: (s: string) => void; stderr: (s: string) => void }) => Promise<number>;

/** Serve forwarded CLI commands on the data directory's socket; returns a stop function. */
export function serveAdminSocket(dataDir: string, database: Database, config: Config, run: CliRunner): () => void {
  const path = socketPath(dataDir);
  privateDirectory(dirname(path));
  // A socket file left by a killed process would make listen fail.
  if (existsSync(path)) unlinkSync(path);
  async function handle(req: Request): Promise<Response> {
    let argv: unknown;
    let input: unknown;
    try {
      ({ argv, input } = (await req.json()) as { argv?: unknown; input?: unknown });
    } catch {
      return Response.json({ code: 2, stdout: "", stderr: "error: bad admin request\n" }, { status: 400 });
    }
    if (input !== undefined && typeof input !== "string") {
      return Response.json({ code: 2, stdout: "", stderr: "error: bad admin request\n" }, { status: 400 });
    }
    if (!Array.isArray(argv) || !argv.every((a) => typeof a === "string") || !FORWARDABLE.has(argv[0] as string)) {
      return Response.json({ code: 2, stdout: "", stderr: "error: this command cannot run through the admin socket\n" }, { status: 400 });
    }
    let stdout = "";
    let stderr = "";
    const code = await adminContext.run({ database, config, ...(input !== undefined ? { input } : {}) }, () =>
      run(argv as string[], {
        stdout: (s) => {
          stdout += s;
        },
        stderr: (s) => {
          stderr += s;
        },
      }),
    );
    return Response.json({ code, stdout, stderr } satisfies CliResult);
  }
  // bind() creates the socket with the umask's mode: no moment with more than
  // 0600. (The umask is the process's: a file the database worker creates in
  // this instant is 0600 too, which is no loss.)
  const umask = process.umask(0o177);
  let server: ReturnType<typeof Bun.serve>;
  try {
    server = Bun.serve({ unix: path, fetch: handle });
  } finally {
    process.umask(umask);
  }
  return () => {
    server.stop(true);
    try {
      unlinkSync(path);
    } catch {
      // already gone
    }
  };
}

/** Run a CLI command in the server that owns the data directory. */
export async function forward(socket: string, argv: string[], input?: string): Promise<CliResult> {
  const res = await fetch("http://localhost/cli", {
    unix: socket,
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ argv, ...(input !== undefined ? { input } : {}) }),
  });
  return (await res.json()) as CliResult;
}
