import { describe, expect, setDefaultTimeout, test } from "bun:test";
import { copyFileSync, existsSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { BUN, ROOT, cleanEnv, removeScratch, run, scratchDir } from "../helpers/process.ts";

// Two cross-compiles (the first downloads Bun's runtime for each target) on a busy 2-core machine.
setDefaultTimeout(300_000);

/**
 * docs/operations.md: `bun run build:release` makes dist/gateway-linux-x64,
 * dist/gateway-linux-arm64 and dist/SHA256SUMS, the files an operator copies
 * onto a VM and checks. Nothing here needs a database, so it runs in the
 * embedded pass of CI only.
 */

const PKG_VERSION = ((await Bun.file(join(ROOT, "package.json")).json()) as { version: string }).version;
const DIST = join(ROOT, "dist");
const TARGETS = { "gateway-linux-x64": 0x3e, "gateway-linux-arm64": 0xb7 } as const;

const sha256 = (path: string) => new Bun.CryptoHasher("sha256").update(readFileSync(path)).digest("hex");

/** An ELF executable's e_machine (x86-64 0x3e, AArch64 0xb7), or -1 when the file is not a 64-bit little-endian ELF file. */
function elfMachine(path: string): number {
  const b = readFileSync(path).subarray(0, 20);
  if (b[0] !== 0x7f || b.toString("latin1", 1, 4) !== "ELF" || b[4] !== 2 || b[5] !== 1) return -1;
  return b.readUInt16LE(18);
}

describe.skipIf(Boolean(process.env.TEST_DATABASE_URL))("bun run build:release", () => {
  test("both Linux binaries, each for its machine, their SHA-256 in SHA256SUMS; the x64 one runs alone and says its version and commit", async () => {
    const startedAt = Date.now();
    const built = await run([BUN, "run", "build:release"], { cwd: ROOT, env: cleanEnv(), timeoutMs: 280_000 });
    expect(built.stderr + built.stdout).not.toContain("error:");
    expect(built.code).toBe(0);

    const sums = readFileSync(join(DIST, "SHA256SUMS"), "utf8");
    const listed = new Map(
      sums
        .trim()
        .split("\n")
        .map((line) => {
          const m = /^([0-9a-f]{64}) {2}(\S+)$/.exec(line);
          expect(m, `a sha256sum line: ${line}`).not.toBeNull();
          return [m?.[2] ?? "", m?.[1] ?? ""] as const;
        }),
    );
    expect([...listed.keys()].sort()).toEqual(Object.keys(TARGETS).sort());
    for (const [name, machine] of Object.entries(TARGETS)) {
      const path = join(DIST, name);
      expect(existsSync(path)).toBe(true);
      // Made by this run, not left over from an earlier one.
      expect(statSync(path).mtimeMs).toBeGreaterThanOrEqual(startedAt - 1_000);
      expect(statSync(path).mode & 0o111).not.toBe(0);
      expect(`${name}: ${elfMachine(path)}`).toBe(`${name}: ${machine}`);
      expect(listed.get(name)).toBe(sha256(path));
    }

    // This machine is x86-64: the x64 binary, copied alone into an empty folder, runs.
    const dir = scratchDir("gw-release-");
    try {
      const gw = join(dir, "gateway");
      copyFileSync(join(DIST, "gateway-linux-x64"), gw);
      const commit = (await run(["git", "rev-parse", "--short", "HEAD"], { cwd: ROOT })).stdout.trim();
      const v = await run([gw, "--version"], { cwd: dir, env: cleanEnv() });
      expect(v.code).toBe(0);
      expect(v.stdout).toContain(PKG_VERSION);
      if (commit) expect(v.stdout).toContain(commit);
    } finally {
      removeScratch();
    }
  });
});
