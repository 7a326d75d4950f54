import { describe, expect, test } from "bun:test";
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { MIGRATIONS } from "../../src/db/migrations.ts";

/**
 * drizzle-kit writes drizzle/NNNN_name.sql and lists it in
 * drizzle/meta/_journal.json; src/db/migrations.ts must import each one so
 * `bun build --compile` embeds it. A migration generated but not wired in
 * would be missing from the binary; this catches it before a release does.
 */

const ROOT = join(import.meta.dir, "../..");
const journal = JSON.parse(readFileSync(join(ROOT, "drizzle/meta/_journal.json"), "utf8")) as {
  dialect: string;
  entries: { idx: number; tag: string; breakpoints: boolean }[];
};
const source = readFileSync(join(ROOT, "src/db/migrations.ts"), "utf8");
const journalTags = journal.entries.map((e) => e.tag);
const sqlFiles = readdirSync(join(ROOT, "drizzle"))
  .filter((f) => f.endsWith(".sql"))
  .map((f) => f.slice(0, -4))
  .sort();
/** `import mNNNN from "../../drizzle/<tag>.sql" with { type: "text" }` */
const imported = [...source.matchAll(/from\s+"\.\.\/\.\.\/drizzle\/([^"]+)\.sql"\s+with\s+\{\s*type:\s*"text"\s*\}/g)].map((m) => m[1]);
/** Keys of the tag -> text table. */
const mapped = [...source.matchAll(/^\s*"([^"]+)":\s*m\d+,?\s*$/gm)].map((m) => m[1]);

describe("embedded migrations", () => {
  test("the journal is a postgres journal with consecutive entries and statement breakpoints", () => {
    expect(journal.dialect).toBe("postgresql");
    expect(journal.entries.map((e) => e.idx)).toEqual(journal.entries.map((_, i) => i));
    for (const e of journal.entries) expect(e.breakpoints).toBe(true);
    expect(new Set(journalTags).size).toBe(journalTags.length);
  });

  test("every journal entry is imported as text and mapped by its tag, and nothing else is", () => {
    expect([...imported].sort()).toEqual([...journalTags].sort());
    expect([...mapped].sort()).toEqual([...journalTags].sort());
  });

  test("every .sql file in drizzle/ is in the journal, and every entry has its file", () => {
    expect(sqlFiles).toEqual([...journalTags].sort());
  });

  test("MIGRATIONS follows the journal's order", () => {
    expect(MIGRATIONS.map((m) => m.tag)).toEqual(journalTags);
  });

  test("the embedded statements are exactly the files' statements", () => {
    for (const m of MIGRATIONS) {
      const text = readFileSync(join(ROOT, "drizzle", `${m.tag}.sql`), "utf8");
      const statements = text
        .split("--> statement-breakpoint")
        .map((s) => s.trim())
        .filter((s) => s.length > 0);
      expect(m.statements).toEqual(statements);
      expect(m.statements.length).toBeGreaterThan(0);
    }
  });

  test("the first migration loads pg_trgm (audit search needs it on both drivers)", () => {
    expect(MIGRATIONS[0]?.statements.join("\n")).toMatch(/create extension if not exists pg_trgm/i);
  });
});
