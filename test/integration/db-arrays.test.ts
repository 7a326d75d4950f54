import { describe, expect, test } from "bun:test";
import { sql } from "drizzle-orm";
import { pgArray } from "../../src/db/arrays.ts";
import { sharedDatabase } from "../helpers/harness.ts";

describe("pgArray", () => {
  test("quotes and escapes strings, writes null as NULL and numbers as they are", () => {
    expect(pgArray(["a", 'b"c', "d\\e", "NULL", null, ""])).toBe('{"a","b\\"c","d\\\\e","NULL",NULL,""}');
    expect(pgArray([1, 2.5, true])).toBe("{1,2.5,true}");
    expect(pgArray([])).toBe("{}");
  });

  test("round-trips through the database: JSON text, nulls, the string NULL, commas and braces", async () => {
    const db = await sharedDatabase();
    const values = ['{"k":"v \\" \\\\ , }"}', null, "NULL", "a,b", "{x}", "ünï€😀"];
    const rows = await db.rows<{ v: string | null }>(sql`select v from unnest(${pgArray(values)}::text[]) with ordinality as t(v, n) order by n`);
    expect(rows.map((r) => r.v)).toEqual(values);
  });
});
