import { afterAll, beforeAll } from "bun:test";
import { runCli } from "../../src/cli/index.ts";

export interface CliResult {
  code: number;
  stdout: string;
  stderr: string;
}

/** The CLI run in-process with its output captured (no child process: fast, and the same code path). */
export async function captureCli(args: string[]): Promise<CliResult> {
  const r = { stdout: "", stderr: "" };
  const code = await runCli(args, {
    stdout: (s) => {
      r.stdout += s;
    },
    stderr: (s) => {
      r.stderr += s;
    },
  });
  return { code, ...r };
}

/**
 * Keeps the named environment variables unset while the file's tests run
 * (runCli reads process.env: a developer's own settings must not leak in),
 * and gives them back afterwards. Call at the top level of a test file.
 */
export function withoutEnv(keys: readonly string[]): void {
  const saved = new Map<string, string | undefined>();
  beforeAll(() => {
    for (const k of keys) {
      saved.set(k, process.env[k]);
      delete process.env[k];
    }
  });
  afterAll(() => {
    for (const [k, v] of saved) if (v !== undefined) process.env[k] = v;
  });
}
