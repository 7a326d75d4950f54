import { expect, test } from "bun:test";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { missingRuntimeEnv } from "../../src/lib/runtime-env.ts";

test("missingRuntimeEnv adds only what the operator did not set", () => {
  expect(missingRuntimeEnv({})).toEqual({ MIMALLOC_PURGE_HOLES: "0" });
  expect(missingRuntimeEnv({ MIMALLOC_PURGE_HOLES: "1" })).toEqual({});
  expect(missingRuntimeEnv({ MIMALLOC_PURGE_HOLES: "0" })).toEqual({});
});

test("relaunchWithRuntimeEnv re-executes once with the runtime variables set and returns the child's exit code", async () => {
  const dir = mkdtempSync(join(tmpdir(), "runtime-env-"));
  const script = join(dir, "main.ts");
  const helper = join(import.meta.dir, "../../src/lib/runtime-env.ts");
  writeFileSync(
    script,
    `import { relaunchWithRuntimeEnv } from ${JSON.stringify(helper)};
const code = await relaunchWithRuntimeEnv();
if (code !== undefined) process.exit(code);
console.log(JSON.stringify({ holes: process.env.MIMALLOC_PURGE_HOLES, relaunched: process.env.GATEWAY_PARENT_PID !== undefined, args: process.argv.slice(2) }));
process.exit(7);`,
  );
  const env = { ...process.env };
  delete env.MIMALLOC_PURGE_HOLES;
  delete env.GATEWAY_PARENT_PID;
  const r = Bun.spawnSync([process.execPath, script, "serve", "--port", "0"], { env });
  expect(r.exitCode).toBe(7);
  expect(JSON.parse(r.stdout.toString())).toEqual({ holes: "0", relaunched: true, args: ["serve", "--port", "0"] });
  // With it set by the operator there is no second process.
  const own = Bun.spawnSync([process.execPath, script, "serve"], { env: { ...env, MIMALLOC_PURGE_HOLES: "1" } });
  expect(own.exitCode).toBe(7);
  expect(JSON.parse(own.stdout.toString())).toEqual({ holes: "1", relaunched: false, args: ["serve"] });
});
