#!/usr/bin/env bun
import { runCli } from "./cli/index.ts";

// argv -> command; everything else lives in src/cli.
process.exit(await runCli(process.argv.slice(2)));
