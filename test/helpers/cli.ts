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
