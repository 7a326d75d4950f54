/**
 * What importing modules leaves alive, after a full collection:
 * `bun bench/loaded-code.ts [module,module,…]` (no argument: a bare process;
 * `./src/server.ts`: everything the gateway loads).
 * A young collection's fixed work grows with the functions and structures a
 * process holds (docs/benchmarks.md, "Where the longer pause comes from"), so
 * this is what a dependency costs every collection, whatever it is used for.
 */
import { heapStats } from "bun:jsc";
import { resolve } from "node:path";

const modules = (process.argv[2] ?? "").split(",").filter((m) => m !== "");
// A path (./src/server.ts) is taken from the working directory, a package name as it is.
for (const m of modules) await import(m.startsWith(".") ? resolve(process.cwd(), m) : m);
Bun.gc(true);
const s = heapStats();
const n = (type: string) => s.objectTypeCounts[type] ?? 0;
console.log(
  `${(modules.join(",") || "(nothing)").padEnd(60)} function executables ${n("FunctionExecutable")}, unlinked ${n("UnlinkedFunctionExecutable")}, structures ${n("Structure")}, functions ${n("Function")}, cells ${s.objectCount}, heap ${(s.heapSize / 1e6).toFixed(1)} MB`,
);
