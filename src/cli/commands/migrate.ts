import { defineCommand } from "../command.ts";
import { config, print, withDb } from "../context.ts";
import { migrate as applyMigrations } from "../../db/client.ts";

export const migrate = defineCommand({
  group: "migrate",
  summary: "bring the database schema up to date (serve and the other commands do it too)",
  flags: {},
  common: ["config", "data-dir", "json"],
  notes: ["--json prints {\"applied\":[…]}, empty when the database is up to date."],
  examples: ["gateway migrate", "DATABASE_URL=postgres://gateway@db/gateway gateway migrate --json"],
  async run({ values }, { out }) {
    const cfg = await config(values);
    // withDb must not migrate first here, or `migrate` would always report "up to date".
    const applied = await withDb(cfg, (db) => applyMigrations(db), { migrate: false });
    print(out, values.json, { applied }, applied.length ? `applied: ${applied.join(", ")}` : "database is up to date");
    return 0;
  },
});
