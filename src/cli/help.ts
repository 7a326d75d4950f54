import { COMMON_FLAGS, type Command, type FlagSpec, commandPath } from "./command.ts";
import { VERSION } from "../lib/version.ts";

/** Usage texts, all generated from the command table. */

function flagLabel(name: string, f: FlagSpec): string {
  return f.type === "boolean" ? `--${name}` : `--${name} ${f.value ?? "VALUE"}`;
}

/** `gateway keys create --org UUID --kind personal|service --scopes … [options]`: what must be given, then the rest. */
export function synopsis(c: Command): string {
  const required = Object.entries(c.flags)
    .filter(([, f]) => f.required)
    .map(([n, f]) => flagLabel(n, f));
  const optional = Object.values(c.flags).some((f) => !f.required) || c.common.length > 0;
  return ["gateway", commandPath(c), ...c.positionals.map((p) => p.name), ...required, ...(optional ? ["[options]"] : [])].join(" ");
}

function table(rows: [string, string][]): string[] {
  const width = Math.min(34, Math.max(...rows.map(([l]) => l.length)) + 2);
  return rows.map(([l, r]) => (l.length + 2 > width ? `  ${l}\n  ${" ".repeat(width)}${r}` : `  ${l.padEnd(width)}${r}`));
}

/** `gateway keys create --help`. */
export function commandHelp(c: Command): string {
  const args: [string, string][] = c.positionals.map((p) => [p.name, `${p.description} (required)`]);
  const opts: [string, string][] = [
    ...Object.entries(c.flags).map(([n, f]): [string, string] => [flagLabel(n, f), f.required ? `${f.description} (required)` : f.description]),
    ...c.common.map((n): [string, string] => [flagLabel(n, COMMON_FLAGS[n]), COMMON_FLAGS[n].description]),
    ["--help", COMMON_FLAGS.help.description],
  ];
  const lines = [`gateway ${commandPath(c)}: ${c.summary}`, "", `Usage: ${synopsis(c)}`];
  if (args.length) lines.push("", "Arguments:", ...table(args));
  lines.push("", "Options:", ...table(opts));
  if (c.notes.length) lines.push("", ...c.notes);
  if (c.examples.length) lines.push("", "Examples:", ...c.examples.map((e) => `  ${e}`));
  return lines.join("\n");
}

/** `gateway keys --help`: the group's commands with their synopses. */
export function groupHelp(group: string, commands: readonly Command[]): string {
  const lines = [`Usage: gateway ${group} <command> [options]`, "", "Commands:"];
  for (const c of commands) lines.push(`  ${synopsis(c)}`, `      ${c.summary}`);
  lines.push("", `Run gateway ${group} <command> --help for a command's options and examples.`);
  return lines.join("\n");
}

/** The one-line answer to a group without (or with an unknown) subcommand. */
export function groupUsage(group: string, commands: readonly Command[]): string {
  const [only] = commands;
  if (only && commands.length === 1) return `usage: ${synopsis(only)}; see gateway ${commandPath(only)} --help`;
  return `usage: gateway ${group} ${commands.map((c) => c.name).join("|")} …; see gateway ${group} --help`;
}

/** `gateway --help`: every command in the table, one line each. */
export function topHelp(commands: readonly Command[]): string {
  return [
    `gateway ${VERSION}: an OpenAI-compatible inference gateway with a small App API`,
    "",
    "Usage: gateway <command> [options]",
    "",
    "Commands:",
    ...table(commands.map((c) => [commandPath(c), c.summary])),
    "",
    "Run gateway <command> --help for a command's options and examples.",
    "Every command reads --config FILE (or GATEWAY_CONFIG), DATABASE_URL (Postgres) or",
    "--data-dir / GATEWAY_DATA_DIR (embedded database, default ./data).",
    "Options: --help, --version. Exit codes: 0 ok, 1 failure, 2 bad arguments or configuration.",
  ].join("\n");
}
