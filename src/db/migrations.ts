/**
 * drizzle-kit's output, embedded in the executable: the SQL files are imported
 * as text so `bun build --compile` carries them. test/unit/migrations.test.ts
 * fails when drizzle/meta/_journal.json lists a file that is not imported here.
 */
import journal from "../../drizzle/meta/_journal.json";
import m0000 from "../../drizzle/0000_extensions.sql" with { type: "text" };
import m0001 from "../../drizzle/0001_init.sql" with { type: "text" };
import m0002 from "../../drizzle/0002_audit_append_only.sql" with { type: "text" };
import m0003 from "../../drizzle/0003_usage_batches.sql" with { type: "text" };
import m0004 from "../../drizzle/0004_audit_org_search.sql" with { type: "text" };
import m0005 from "../../drizzle/0005_keys_expire_search_fields.sql" with { type: "text" };
import m0006 from "../../drizzle/0006_usage_dead_letters_lease_wanted.sql" with { type: "text" };
import m0007 from "../../drizzle/0007_responses.sql" with { type: "text" };
import m0008 from "../../drizzle/0008_usage_events_requests.sql" with { type: "text" };
import m0009 from "../../drizzle/0009_responses_output_item_ids.sql" with { type: "text" };
import m0010 from "../../drizzle/0010_audit_search_fold.sql" with { type: "text" };
import m0011 from "../../drizzle/0011_responses_item_ids_no_pending_list.sql" with { type: "text" };

const SQL: Record<string, string> = {
  "0000_extensions": m0000,
  "0001_init": m0001,
  "0002_audit_append_only": m0002,
  "0003_usage_batches": m0003,
  "0004_audit_org_search": m0004,
  "0005_keys_expire_search_fields": m0005,
  "0006_usage_dead_letters_lease_wanted": m0006,
  "0007_responses": m0007,
  "0008_usage_events_requests": m0008,
  "0009_responses_output_item_ids": m0009,
  "0010_audit_search_fold": m0010,
  "0011_responses_item_ids_no_pending_list": m0011,
};

export interface Migration {
  tag: string;
  statements: string[];
}

export const MIGRATIONS: Migration[] = journal.entries.map((e) => {
  const text = SQL[e.tag];
  if (text === undefined) throw new Error(`migration ${e.tag} is in the journal but not embedded (src/db/migrations.ts)`);
  return {
    tag: e.tag,
    statements: text
      .split("--> statement-breakpoint")
      .map((s) => s.trim())
      .filter((s) => s.length > 0),
  };
});
