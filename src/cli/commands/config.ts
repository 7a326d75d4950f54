import { defineCommand } from "../command.ts";
import { config, print } from "../context.ts";
import { ConfigError, maskConfig, serveProblems } from "../../config/load.ts";

const check = defineCommand({
  group: "config",
  name: "check",
  summary: "validate the configuration and environment as serve reads them; exit 2 listing every problem",
  flags: {},
  common: ["config", "data-dir", "json"],
  examples: ["gateway config check --config /etc/gateway/config.json"],
  async run({ values }, { out }) {
    // What serve would refuse on it too (no upstream), so that "valid" means serve starts.
    const problems = serveProblems(await config(values));
    if (problems.length > 0) throw new ConfigError(problems);
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
