import { existsSync, readdirSync, statSync } from "node:fs";
import { join } from "node:path";
import { BUN, ROOT, cleanEnv, run } from "./process.ts";

/**
 * The compiled executable, dist/gateway: built once (or reused when it is
 * newer than every source), so the e2e files and CI's two `bun test` runs
 * compile it once.
 */

export const DIST = join(ROOT, "dist/gateway");

function newestSource(): number {
  let newest = 0;
  const walk = (p: string) => {
    const s = statSync(p);
    if (s.isDirectory()) {
      for (const e of readdirSync(p)) walk(join(p, e));
    } else newest = Math.max(newest, s.mtimeMs);
  };
  for (const p of ["src", "drizzle", "package.json", "bun.lock", "tsconfig.json"]) {
    if (existsSync(join(ROOT, p))) walk(join(ROOT, p));
  }
  return newest;
}

let building: Promise<string> | undefined;
export function ensureBinary(): Promise<string> {
  building ??= (async () => {
    if (existsSync(DIST) && statSync(DIST).mtimeMs > newestSource()) return DIST;
    const r = await run([BUN, "run", "build"], { cwd: ROOT, env: cleanEnv(), timeoutMs: 180_000 });
    if (r.code !== 0) throw new Error(`bun run build failed (${r.code}):\n${r.stdout}\n${r.stderr}`);
    return DIST;
  })();
  return building;
}
