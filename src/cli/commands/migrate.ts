import { defineCommand } from "../command.ts";
import { config, print, withDb } from "../context.ts";
import { migrate as applyMigrations, unknownMigrations } from "../../db/client.ts";

export const migrate = defineCommand({
  group: "migrate",
  summary: "bring the database schema up to date (serve and the other commands do it too)",
  flags: {},
  common: ["config", "data-dir", "json"],
  notes: [
    "--json prints {\"applied\":[…],\"unknown\":[…]}: the migrations it applied (none when the database is up to date) and those the database has that this gateway does not know.",
    "A database a newer release migrated is left as it is: a warning on stderr names its newest migration and this gateway's, and the exit code is 0.",
  ],
  examples: ["gateway migrate", "DATABASE_URL=postgres://gateway@db/gateway gateway migrate --json"],
  async run({ values }, { out }) {
    const cfg = await config(values);
    // withDb must not migrate first here, or `migrate` would always report "up to date".
    const { applied, ahead } = await withDb(cfg, out, async (db) => ({ applied: await applyMigrations(db), ahead: await unknownMigrations(db) }), { migrate: false });
    // Exit 0 all the same: the units run `migrate` before `serve`, and an older release must still start (docs/decisions.md).
    if (ahead) out.stderr(`warning: ${ahead.message}\n`);
    print(out, values.json, { applied, unknown: ahead?.unknown ?? [] }, applied.length ? `applied: ${applied.join(", ")}` : "database is up to date");
    return 0;
  },
});
