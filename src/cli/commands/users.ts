import { defineCommand } from "../command.ts";
import { config, print, withDb } from "../context.ts";
import { createUser } from "../../admin/service.ts";

const create = defineCommand({
  group: "users",
  name: "create",
  summary: "add a person to an organisation (personal keys belong to one)",
  flags: {
    org: { type: "string", value: "UUID", description: "the organisation", required: true, field: "orgId" },
    name: { type: "string", value: "NAME", description: "the person's name", required: true, field: "name" },
    email: { type: "string", value: "EMAIL", description: "unique within the organisation, whatever its case; kept as typed", required: true, field: "email" },
    "academy-only": { type: "boolean", description: "an academy-only account: the person's keys get 403 academy_only on the platform API" },
  },
  common: ["config", "data-dir", "json"],
  notes: ["Writes member.created to the audit log in the same transaction."],
  examples: ['gateway users create --org 7f8f3c2a-1b2c-4d5e-8f90-123456789abc --name "Ada Lovelace" --email ada@acme.example'],
  async run({ values }, { out }) {
    const cfg = await config(values);
    const input = { orgId: values.org, name: values.name, email: values.email, academyOnly: values["academy-only"] ?? false };
    const user = await withDb(cfg, out, (db) => createUser(db, input));
    print(out, values.json, user, `created user ${user.id} (${user.email})`);
    return 0;
  },
});

export const users = [create];
