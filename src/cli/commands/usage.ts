import { defineCommand } from "../command.ts";
import { config, isoTime, print, withDb } from "../context.ts";
import { usageReport } from "../../admin/usage.ts";

const report = defineCommand({
  group: "usage",
  name: "report",
  summary: "requests and tokens per model alias and key",
  flags: {
    org: { type: "string", value: "UUID", description: "the organisation", required: true, field: "orgId" },
    since: { type: "string", value: "ISO", description: "count from this time, ISO 8601 (default: everything)", field: "since" },
  },
  common: ["config", "data-dir", "json"],
  examples: ["gateway usage report --org 7f8f3c2a-1b2c-4d5e-8f90-123456789abc --since 2026-01-01 --json"],
  async run({ values }, { out }) {
    const cfg = await config(values);
    const since = values.since === undefined ? undefined : isoTime(values.since, "--since");
    const rows = await withDb(cfg, out, (db) => usageReport(db, values.org, since));
    const human = rows.map((r) => `${r.alias.padEnd(14)} ${r.key_id}  ${String(r.requests).padStart(8)} req  ${String(r.total_tokens).padStart(12)} tokens`).join("\n");
    print(out, values.json, rows, human || "no usage");
    return 0;
  },
});

export const usage = [report];
