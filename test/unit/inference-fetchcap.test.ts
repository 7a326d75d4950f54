import { expect, test } from "bun:test";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { FETCH_CONCURRENCY, fetchCapRaised, missingRuntimeEnv } from "../../src/inference/fetchcap.ts";

test("fetchCapRaised accepts only values Bun honours", () => {
  expect(fetchCapRaised({})).toBe(false);
  expect(fetchCapRaised({ BUN_CONFIG_MAX_HTTP_REQUESTS: "256" })).toBe(false);
  expect(fetchCapRaised({ BUN_CONFIG_MAX_HTTP_REQUESTS: "65536" })).toBe(false);
  expect(fetchCapRaised({ BUN_CONFIG_MAX_HTTP_REQUESTS: "16384" })).toBe(true);
});

test("missingRuntimeEnv adds only what the operator did not set", () => {
  expect(missingRuntimeEnv({})).toEqual({ BUN_CONFIG_MAX_HTTP_REQUESTS: String(FETCH_CONCURRENCY), MIMALLOC_PURGE_HOLES: "0" });
  expect(missingRuntimeEnv({ BUN_CONFIG_MAX_HTTP_REQUESTS: "4096", MIMALLOC_PURGE_HOLES: "1" })).toEqual({});
  expect(missingRuntimeEnv({ BUN_CONFIG_MAX_HTTP_REQUESTS: "4096" })).toEqual({ MIMALLOC_PURGE_HOLES: "0" });
  expect(missingRuntimeEnv({ BUN_CONFIG_MAX_HTTP_REQUESTS: "100", MIMALLOC_PURGE_HOLES: "0" })).toEqual({ BUN_CONFIG_MAX_HTTP_REQUESTS: String(FETCH_CONCURRENCY) });
});

test("relaunchWithRuntimeEnv re-executes once with the runtime variables set and returns the child's exit code", async () => {
  const dir = mkdtempSync(join(tmpdir(), "fetchcap-"));
  const script = join(dir, "main.ts");
  const helper = join(import.meta.dir, "../../src/inference/fetchcap.ts");
  writeFileSync(
    script,
    `import { relaunchWithRuntimeEnv } from ${JSON.stringify(helper)};
const code = await relaunchWithRuntimeEnv();
if (code !== undefined) process.exit(code);
console.log(JSON.stringify({ cap: process.env.BUN_CONFIG_MAX_HTTP_REQUESTS, holes: process.env.MIMALLOC_PURGE_HOLES, relaunched: process.env.GATEWAY_PARENT_PID !== undefined, args: process.argv.slice(2) }));
process.exit(7);`,
  );
  const env = { ...process.env };
  delete env.BUN_CONFIG_MAX_HTTP_REQUESTS;
  delete env.MIMALLOC_PURGE_HOLES;
  delete env.GATEWAY_PARENT_PID;
  const r = Bun.spawnSync([process.execPath, script, "serve", "--port", "0"], { env });
  expect(r.exitCode).toBe(7);
  expect(JSON.parse(r.stdout.toString())).toEqual({ cap: String(FETCH_CONCURRENCY), holes: "0", relaunched: true, args: ["serve", "--port", "0"] });
  // With both set by the operator there is no second process.
  const own = Bun.spawnSync([process.execPath, script, "serve"], { env: { ...env, BUN_CONFIG_MAX_HTTP_REQUESTS: "4096", MIMALLOC_PURGE_HOLES: "1" } });
  expect(own.exitCode).toBe(7);
  expect(JSON.parse(own.stdout.toString())).toEqual({ cap: "4096", holes: "1", relaunched: false, args: ["serve"] });
});
