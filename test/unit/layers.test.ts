import { describe, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { dirname, join, relative, resolve } from "node:path";

/**
 * The layering rules of docs/architecture.md, checked over the real import
 * graph of src/ (every `import`/`export … from`, type-only ones included):
 * no import cycles, and only the routes files, src/http itself and the
 * server wiring import from src/http/.
 */

const ROOT = resolve(import.meta.dir, "../..");
const SRC = join(ROOT, "src");

const IMPORT = /(?:^|\n)\s*(?:import|export)\s[^;]*?from\s+"([^"]+)"|\bimport\(\s*"([^"]+)"\s*\)/g;

/**
 * src-relative path -> the src-relative modules it imports (relative
 * specifiers only: packages are not ours; files embedded from outside src/,
 * migrations and extension archives, are not modules).
 */
function importGraph(): Map<string, string[]> {
  const graph = new Map<string, string[]>();
  for (const file of new Bun.Glob("**/*.ts").scanSync(SRC)) {
    const text = readFileSync(join(SRC, file), "utf8");
    const deps: string[] = [];
    for (const m of text.matchAll(IMPORT)) {
      const spec = m[1] ?? m[2] ?? "";
      const target = relative(SRC, resolve(SRC, dirname(file), spec));
      if (spec.startsWith(".") && !target.startsWith("../")) deps.push(target);
    }
    graph.set(file, deps);
  }
  return graph;
}

/** Every cycle found by a depth-first walk, each as the path that closes it. */
function cycles(graph: Map<string, string[]>): string[][] {
  const found: string[][] = [];
  const state = new Map<string, "open" | "done">();
  const path: string[] = [];
  const visit = (n: string) => {
    state.set(n, "open");
    path.push(n);
    for (const d of graph.get(n) ?? []) {
      if (state.get(d) === "open") found.push([...path.slice(path.indexOf(d)), d]);
      else if (!state.has(d)) visit(d);
    }
    path.pop();
    state.set(n, "done");
  };
  for (const n of [...graph.keys()].sort()) if (!state.has(n)) visit(n);
  return found;
}

/** Who may import src/http/: the app itself, the routes files (each feature's HTTP face) and the server wiring. */
const mayImportHttp = (file: string) => file.startsWith("http/") || file.endsWith("/routes.ts") || file === "server.ts";

describe("layers", () => {
  const graph = importGraph();

  test("the walk sees the source tree and its imports", () => {
    expect(graph.size).toBeGreaterThan(50);
    expect(graph.get("server.ts")).toContain("http/app.ts");
    // Every relative import resolves to a file in the tree (a typo'd path would hide an edge).
    const missing = [...graph].flatMap(([f, deps]) => deps.filter((d) => !graph.has(d)).map((d) => `${f} -> ${d}`));
    expect(missing).toEqual([]);
  });

  test("no import cycles in src/", () => {
    expect(cycles(graph).map((c) => c.join(" -> "))).toEqual([]);
  });

  test("the cycle check finds a cycle when there is one", () => {
    const g = new Map([
      ["a.ts", ["b.ts"]],
      ["b.ts", ["c.ts"]],
      ["c.ts", ["a.ts"]],
      ["d.ts", ["a.ts"]],
    ]);
    expect(cycles(g)).toEqual([["a.ts", "b.ts", "c.ts", "a.ts"]]);
  });

  test("only routes files, src/http and the server wiring import src/http/", () => {
    const offending = [...graph].flatMap(([f, deps]) => (mayImportHttp(f) ? [] : deps.filter((d) => d.startsWith("http/")).map((d) => `${f} -> ${d}`)));
    expect(offending).toEqual([]);
  });
});
