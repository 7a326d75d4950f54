#!/usr/bin/env bun
import { runCli } from "./cli/index.ts";
import { relaunchWithFetchCap, watchParent } from "./inference/fetchcap.ts";

// argv -> command; everything else lives in src/cli.
const argv = process.argv.slice(2);
if (argv[0] === "serve") {
  // Bun's fetch allows 256 upstream requests in flight unless started with a higher cap (src/inference/fetchcap.ts).
  const relaunched = await relaunchWithFetchCap();
  if (relaunched !== undefined) process.exit(relaunched);
  watchParent(() => process.kill(process.pid, "SIGTERM"));
}
process.exit(await runCli(argv));
