import { UsageError, defineCommand } from "../command.ts";
import { config, int, print, withDb } from "../context.ts";
import { createOrg, setOrg } from "../../admin/service.ts";

const create = defineCommand({
  group: "orgs",
  name: "create",
  summary: "create an organisation",
  flags: {
    name: { type: "string", value: "NAME", description: "the organisation's name", required: true, field: "name" },
    plan: { type: "string", value: "PLAN", description: "a configured plan (default: defaultPlan)", field: "plan" },
    "quota-tokens": { type: "string", value: "N|none", description: "tokens per quota window (default none: no quota)", field: "quotaTokens" },
    "quota-window": { type: "string", value: "hour|day|month", description: "the quota's period (default month)", field: "quotaWindow" },
    "academy-only": { type: "boolean", description: "an academy-only organisation: its keys get 403 academy_only on the platform API" },
  },
  common: ["config", "data-dir", "json"],
  notes: ["Writes org.created to the audit log in the same transaction."],
  examples: ["gateway orgs create --name Acme", "gateway orgs create --name Acme --plan Ultra --quota-tokens 5000000 --quota-window month --json"],
  async run({ values }, { out }) {
    const cfg = await config(values);
        const quota = values["quota-tokens"] === undefined || values["quota-tokens"] === "none" ? null : int(values["quota-tokens"], "--quota-tokens");
    const org = await withDb(cfg, out, (db) =>
      createOrg(db, {
        name: values.name,
        plan: values.plan ?? cfg.defaultPlan,
        plans: Object.keys(cfg.plans),
        quotaTokens: quota,
        ...(values["quota-window"] ? { quotaWindow: values["quota-window"] } : {}),
        academyOnly: values["academy-only"] ?? false,
      }),
    );
    print(out, values.json, org, `created organisation ${org.id} (${org.name}, plan ${org.plan})`);
    return 0;
  },
});

const set = defineCommand({
  group: "orgs",
  name: "set",
  summary: "change an organisation's plan, quota or access; each change is audited",
  flags: {
    id: { type: "string", value: "UUID", description: "the organisation", required: true, field: "id" },
    plan: { type: "string", value: "PLAN", description: "a configured plan", field: "plan" },
    "quota-tokens": { type: "string", value: "N|none", description: "tokens per quota window; none removes the quota", field: "quotaTokens" },
    "quota-window": { type: "string", value: "hour|day|month", description: "the quota's period", field: "quotaWindow" },
    "academy-only": { type: "string", value: "true|false", description: "whether the organisation is academy-only (403 academy_only on the platform API)", field: "academyOnly" },
  },
  common: ["config", "data-dir", "json"],
  notes: ["Only what is given changes; nothing given changes nothing and writes no audit event."],
  examples: ["gateway orgs set --id 7f8f3c2a-1b2c-4d5e-8f90-123456789abc --plan Ultra", "gateway orgs set --id 7f8f3c2a-1b2c-4d5e-8f90-123456789abc --quota-tokens none"],
  async run({ values }, { out }) {
    const cfg = await config(values);
    const q = values["quota-tokens"];
    const academy = values["academy-only"];
    if (academy !== undefined && academy !== "true" && academy !== "false") throw new UsageError("--academy-only takes true or false");
    const org = await withDb(cfg, out, (db) =>
      setOrg(db, {
        id: values.id,
        plans: Object.keys(cfg.plans),
        ...(values.plan !== undefined ? { plan: values.plan } : {}),
        ...(q !== undefined ? { quotaTokens: q === "none" ? null : int(q, "--quota-tokens") } : {}),
        ...(values["quota-window"] !== undefined ? { quotaWindow: values["quota-window"] } : {}),
        ...(academy !== undefined ? { academyOnly: academy === "true" } : {}),
      }),
    );
    print(out, values.json, org, `updated organisation ${org.id}: plan ${org.plan}, quota ${org.quota_tokens ?? "none"} per ${org.quota_window}`);
    return 0;
  },
});

export const orgs = [create, set];
