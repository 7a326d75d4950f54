import { sql } from "drizzle-orm";
import type { Database } from "../db/client.ts";
import { FieldError } from "../lib/errors.ts";
import { requireOrg, requireUuid } from "./service.ts";

export interface UsageRow {
  alias: string;
  key_id: string;
  requests: number;
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

/** Usage per alias and key since a time (default: everything), from the usage records. */
export async function usageReport(database: Database, orgId: string, since?: Date): Promise<UsageRow[]> {
  requireUuid("orgId", orgId);
  if (since && Number.isNaN(since.getTime())) throw new FieldError("since", (n) => `${n("since")} is not a valid ISO 8601 time`);
  const from = since ?? new Date(0);
  const rows = await database.rows<{ alias: string; key_id: string; requests: string | number; prompt: string | number; completion: string | number }>(sql`
    select alias, key_id::text as key_id, coalesce(sum(requests), 0) as requests,
           coalesce(sum(prompt_tokens), 0) as prompt, coalesce(sum(completion_tokens), 0) as completion
    from usage_events
    where org_id = ${orgId} and created_at >= ${from.toISOString()}::timestamptz
    group by alias, key_id
    order by alias, key_id`);
  if (rows.length === 0) await requireOrg(database, orgId);
  return rows.map((r) => ({
    alias: r.alias,
    key_id: r.key_id,
    requests: Number(r.requests),
    prompt_tokens: Number(r.prompt),
    completion_tokens: Number(r.completion),
    total_tokens: Number(r.prompt) + Number(r.completion),
  }));
}
