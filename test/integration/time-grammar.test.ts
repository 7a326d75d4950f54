import { beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { sql } from "drizzle-orm";
import { importAudit } from "../../src/audit/import.ts";
import type { Database } from "../../src/db/client.ts";
import { InputError } from "../../src/lib/errors.ts";
import { captureCli } from "../helpers/cli.ts";
import { rejectionOf, seedOrg, sharedDatabase } from "../helpers/harness.ts";

setDefaultTimeout(60_000);

/**
 * `gateway audit import` and the CLI's time flags read times in the audit
 * query's grammar (src/lib/time.ts): every zone form the query accepts, and
 * nothing without a zone.
 */

let database: Database;
let orgId: string;
let userId: string;

beforeAll(async () => {
  database = await sharedDatabase();
  ({ orgId, userId } = await seedOrg(database));
});

const line = (id: string, createdAt: string) =>
  JSON.stringify({
    org_id: orgId,
    id,
    created_at: createdAt,
    action: "member.invited",
    category: "member",
    actor: { type: "user", id: userId, name: "Ada", email: "ada@acme.example" },
    origin: { ip_prefix: "203.0.113.0/24", user_agent_summary: "Firefox/131.0" },
  });

async function storedAt(id: string): Promise<string> {
  const rows = await database.rows<{ created_at: Date | string }>(sql`select created_at from audit_events where id = ${id}`);
  return new Date(rows[0]?.created_at ?? 0).toISOString();
}

describe("audit import", () => {
  test("accepts every zone form of the query, +02 included", async () => {
    const want = "2025-03-01T11:59:59.750Z";
    const forms = ["2025-03-01T13:59:59.750+02:00", "2025-03-01T13:59:59.750+0200", "2025-03-01T13:59:59.750+02", "2025-03-01t11:59:59,750z"];
    const ids = forms.map(() => crypto.randomUUID());
    expect(await importAudit(database, forms.map((f, i) => line(ids[i] as string, f)).join("\n"))).toBe(forms.length);
    for (const id of ids) expect(await storedAt(id)).toBe(want);
  });

  test("refuses a time without a zone, a bare date and an impossible day, naming the line", async () => {
    for (const bad of ["2025-03-01T13:59:59", "2025-03-01", "2025-02-29T00:00:00Z", "0000-01-01T00:00:00Z"]) {
      const err = await rejectionOf(importAudit(database, `${line(crypto.randomUUID(), "2025-03-01T00:00:00Z")}\n${line(crypto.randomUUID(), bad)}`));
      expect(err).toBeInstanceOf(InputError);
      expect((err as Error).message).toStartWith("line 2: /created_at is not a valid time");
    }
  });
});

describe("CLI time flags", () => {
  const cli = (...args: string[]) => captureCli(args);

  test("--since refuses a time without a zone (it would depend on the machine's clock settings)", async () => {
    const r = await cli("usage", "report", "--org", orgId, "--since", "2025-03-01T13:59:59", "--data-dir", "memory://");
    expect(r.code).toBe(2);
    expect(r.stderr).toContain("--since is not an ISO 8601 time");
  });
});
