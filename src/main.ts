#!/usr/bin/env bun
import { runCli } from "./cli/index.ts";
import { relaunchWithRuntimeEnv, watchParent } from "./inference/fetchcap.ts";

// argv -> command; everything else lives in src/cli.
const argv = process.argv.slice(2);
if (argv[0] === "serve") {
  // Bun's fetch cap and an allocator option are read only at start (src/inference/fetchcap.ts).
  const relaunched = await relaunchWithRuntimeEnv();
  if (relaunched !== undefined) process.exit(relaunched);
  watchParent(() => process.kill(process.pid, "SIGTERM"));
}
process.exit(await runCli(argv));
