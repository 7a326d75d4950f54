import { defineCommand } from "../command.ts";
import { config, print } from "../context.ts";
import { maskConfig } from "../../config/load.ts";

const check = defineCommand({
  group: "config",
  name: "check",
  summary: "validate the configuration and environment; exit 2 listing every problem",
  flags: {},
  common: ["config", "data-dir", "json"],
  examples: ["gateway config check --config /etc/gateway/config.json"],
  async run({ values }, { out }) {
    await config(values);
    print(out, values.json, { ok: true }, "configuration is valid");
    return 0;
  },
});

const printCmd = defineCommand({
  group: "config",
  name: "print",
  summary: "the effective configuration as JSON, secrets masked",
  flags: {},
  common: ["config", "data-dir"],
  examples: ["gateway config print --config /etc/gateway/config.json"],
  async run({ values }, { out }) {
    const cfg = await config(values);
    out.stdout(`${JSON.stringify(maskConfig(cfg), null, 2)}\n`);
    return 0;
  },
});

export const configCommands = [check, printCmd];
