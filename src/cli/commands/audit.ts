import { ForwardToServer, adminContext } from "../admin-socket.ts";
import { UsageError, defineCommand } from "../command.ts";
import { config, print, withDb } from "../context.ts";
import { importAudit } from "../../audit/import.ts";

const importCmd = defineCommand({
  group: "audit",
  name: "import",
  summary: "import audit events from JSON lines, all or none",
  flags: {},
  positionals: [{ name: "FILE", description: "one event a line: org_id plus the spec 2.6 fields (id and created_at optional)", missing: "FILE" }],
  common: ["config", "data-dir", "json"],
  notes: ["A bad line is reported with its number and nothing is imported."],
  examples: ["gateway audit import events.jsonl --json"],
  async run({ values, positionals: [file = ""] }, { out }) {
    // Forwarded to a running server: the client already read the file (the
    // service's user may not see the path, nor share the client's cwd).
    const forwarded = adminContext.getStore()?.input;
    const f = Bun.file(file);
    if (forwarded === undefined && !(await f.exists())) throw new UsageError(`no such file: ${file}`);
    const cfg = await config(values);
    const text = forwarded ?? (await f.text());
    const n = await withDb(cfg, out, (db) => importAudit(db, text)).catch((e: unknown) => {
      if (e instanceof ForwardToServer) e.input = text;
      throw e;
    });
    print(out, values.json, { imported: n }, `imported ${n} events`);
    return 0;
  },
});

export const audit = [importCmd];
