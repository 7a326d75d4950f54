import { expect, test } from "bun:test";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { FETCH_CONCURRENCY, fetchCapRaised } from "../../src/inference/fetchcap.ts";

test("fetchCapRaised accepts only values Bun honours", () => {
  expect(fetchCapRaised({})).toBe(false);
  expect(fetchCapRaised({ BUN_CONFIG_MAX_HTTP_REQUESTS: "256" })).toBe(false);
  expect(fetchCapRaised({ BUN_CONFIG_MAX_HTTP_REQUESTS: "65536" })).toBe(false);
  expect(fetchCapRaised({ BUN_CONFIG_MAX_HTTP_REQUESTS: "16384" })).toBe(true);
});

test("relaunchWithFetchCap re-executes once with the cap raised and returns the child's exit code", async () => {
  const dir = mkdtempSync(join(tmpdir(), "fetchcap-"));
  const script = join(dir, "main.ts");
  const helper = join(import.meta.dir, "../../src/inference/fetchcap.ts");
  writeFileSync(
    script,
    `import { relaunchWithFetchCap } from ${JSON.stringify(helper)};
const code = await relaunchWithFetchCap();
if (code !== undefined) process.exit(code);
console.log(JSON.stringify({ cap: process.env.BUN_CONFIG_MAX_HTTP_REQUESTS, args: process.argv.slice(2) }));
process.exit(7);`,
  );
  const env = { ...process.env };
  delete env.BUN_CONFIG_MAX_HTTP_REQUESTS;
  const r = Bun.spawnSync([process.execPath, script, "serve", "--port", "0"], { env });
  expect(r.exitCode).toBe(7);
  expect(JSON.parse(r.stdout.toString())).toEqual({ cap: String(FETCH_CONCURRENCY), args: ["serve", "--port", "0"] });
});
