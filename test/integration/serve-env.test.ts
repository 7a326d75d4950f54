import { afterAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { cleanEnv, exitWithin, listeningUrl, removeScratch, scratchDir, startGatewayProcess } from "../helpers/process.ts";

// A gateway process starting the embedded database: seconds on a busy machine.
setDefaultTimeout(120_000);

/**
 * docs/decisions.md "The allocator": `serve` runs as the one process it was
 * started as, whatever its environment (no re-exec to set the allocator's
 * variable), and logs one warning at start when MIMALLOC_PURGE_HOLES is unset.
 * SIGTERM to that process stops the server gracefully.
 */

afterAll(() => removeScratch());

/** Processes whose parent is `pid` (from /proc). */
function childrenOf(pid: number): number[] {
  const kids: number[] = [];
  for (const name of readdirSync("/proc")) {
    if (!/^\d+$/.test(name)) continue;
    try {
      // Field 4 of stat(5), after the command name in parentheses.
      const ppid = Number(readFileSync(join("/proc", name, "stat"), "utf8").split(") ")[1]?.split(" ")[1]);
      if (ppid === pid) kids.push(Number(name));
    } catch {
      // exited meanwhile
    }
  }
  return kids;
}

describe.skipIf(process.platform !== "linux")("serve and the allocator setting", () => {
  // Empty counts as unset (README, Configuration), and the allocator reads it so too: `MIMALLOC_PURGE_HOLES=` in an
  // env file leaves the default (purge_holes 1, as MIMALLOC_VERBOSE=1 shows), so it warns as unset does.
  for (const holes of [undefined, "", "0", "1"]) {
    const warns = holes === undefined || holes === "";
    test(`MIMALLOC_PURGE_HOLES ${holes === undefined ? "unset" : `=${holes}`}: ${warns ? "one warning" : "no warning"}; one process, SIGTERM stops it`, async () => {
      const env = cleanEnv({ UPSTREAM_BASE_URL: "http://127.0.0.1:9/v1", LOG_LEVEL: "info", MIMALLOC_PURGE_HOLES: holes });
      const proc = startGatewayProcess(["serve", "--port", "0", "--data-dir", join(scratchDir(), "data")], { env });
      try {
        const url = await listeningUrl(proc);
        expect((await fetch(`${url}/healthz`)).status).toBe(200);
        // The process the test started serves; it started no second one.
        expect(childrenOf(proc.pid)).toEqual([]);
        const warnings = proc
          .stdout()
          .split("\n")
          .filter((l) => l.includes('"level":"warn"') && l.includes("MIMALLOC_PURGE_HOLES"));
        expect(warnings).toHaveLength(warns ? 1 : 0);
        if (warns) expect(warnings[0]).toContain("MIMALLOC_PURGE_HOLES=0");
        proc.kill("SIGTERM");
        expect(await exitWithin(proc, 30_000)).toBe(0);
        expect(proc.stdout()).toContain('"msg":"stopped"');
        // Still one warning: it is logged at start only.
        expect(proc.stdout().split("\n").filter((l) => l.includes("MIMALLOC_PURGE_HOLES"))).toHaveLength(warns ? 1 : 0);
      } finally {
        proc.kill("SIGKILL");
      }
    });
  }
});
