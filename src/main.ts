#!/usr/bin/env bun
import { runCli } from "./cli/index.ts";
import { relaunchWithRuntimeEnv, watchParent } from "./lib/runtime-env.ts";

// argv -> command; everything else lives in src/cli.
const argv = process.argv.slice(2);
if (argv[0] === "serve") {
  // An allocator option is read only at start (src/lib/runtime-env.ts).
  const relaunched = await relaunchWithRuntimeEnv();
  if (relaunched !== undefined) process.exit(relaunched);
  watchParent(() => process.kill(process.pid, "SIGTERM"));
}
process.exit(await runCli(argv));
