import { parseArgs } from "node:util";
import type { CliRunner } from "./admin-socket.ts";
import { type FieldError, InputError } from "../lib/errors.ts";

/**
 * The command table's types. Each command is declared once (name, summary,
 * flags, positionals, examples) and that one declaration drives parsing
 * (util.parseArgs), the "missing --flag" checks, its `--help` text, the
 * group and top-level help, and the naming of service errors in flags.
 */

/** Bad arguments: exit 2, the message on stderr, nothing written. */
export class UsageError extends InputError {}

export type Out = { stdout: (s: string) => void; stderr: (s: string) => void };

export interface Context {
  out: Out;
  /** The whole CLI: `serve` hands it to the admin socket, which runs forwarded commands with it. */
  runCli: CliRunner;
}

export interface FlagSpec {
  type: "string" | "boolean";
  /** What the value looks like, for the usage line (`UUID`, `hour|day|month`, `DURATION`). */
  value?: string;
  description: string;
  /** Checked before the command runs: absent or empty is "missing --flag". */
  required?: boolean;
  /** The service input field this flag feeds: a service error about that field is printed with the flag's name. */
  field?: string;
}

export interface PositionalSpec {
  name: string;
  description: string;
  /** Absent is "missing <missing>". */
  missing: string;
  /** The service input field this argument feeds, and how a message names it. */
  field?: { name: string; as: string };
}

export type Flags = Record<string, FlagSpec>;

/** Accepted by every command (`--json` and `--help` matter only where the command says so). */
export const COMMON_FLAGS = {
  config: { type: "string", value: "FILE", description: "configuration file (or GATEWAY_CONFIG)" },
  "data-dir": { type: "string", value: "DIR", description: "embedded database directory (or GATEWAY_DATA_DIR; default ./data)" },
  json: { type: "boolean", description: "print only JSON on stdout" },
  help: { type: "boolean", description: "print this command's usage and exit" },
} as const satisfies Flags;

type CommonName = keyof typeof COMMON_FLAGS;

type ValueOf<S extends FlagSpec> = S["type"] extends "boolean" ? boolean : string;
/** Parsed flag values: a required flag is always there (parse checks it), the rest may be absent. */
export type Values<F extends Flags> = { [K in keyof F as F[K] extends { required: true } ? K : never]: ValueOf<F[K]> } & {
  [K in keyof F as F[K] extends { required: true } ? never : K]?: ValueOf<F[K]>;
} & { [K in CommonName]?: ValueOf<(typeof COMMON_FLAGS)[K]> };

export interface Parsed<F extends Flags> {
  values: Values<F>;
  positionals: string[];
}

interface CommandSpec<F extends Flags> {
  /** `keys`, or a command without subcommands (`serve`). */
  group: string;
  /** `create`; absent for a command without subcommands. */
  name?: string;
  summary: string;
  flags: F;
  positionals?: readonly PositionalSpec[];
  /** The common flags its help lists (all of them are accepted everywhere). */
  common: readonly CommonName[];
  /** Lines of prose after the options. */
  notes?: readonly string[];
  examples: readonly string[];
  run(input: Parsed<F>, ctx: Context): Promise<number>;
}

/** A command with its flag types erased, as the table holds it. */
export interface Command {
  group: string;
  name: string | undefined;
  summary: string;
  flags: Flags;
  positionals: readonly PositionalSpec[];
  common: readonly CommonName[];
  notes: readonly string[];
  examples: readonly string[];
  /** Parse `args` (what follows the command's name), check required flags and arguments, run. */
  execute(args: string[], ctx: Context): Promise<number>;
  /** A service error's message with its field called by this command's flag for it. */
  describe(e: FieldError): string;
}

export function defineCommand<const F extends Flags>(spec: CommandSpec<F>): Command {
  const positionals = spec.positionals ?? [];
  const names = new Map<string, string>();
  for (const [flag, f] of Object.entries(spec.flags)) if (f.field) names.set(f.field, `--${flag}`);
  for (const p of positionals) if (p.field) names.set(p.field.name, p.field.as);
  return {
    group: spec.group,
    name: spec.name,
    summary: spec.summary,
    flags: spec.flags,
    positionals,
    common: spec.common,
    notes: spec.notes ?? [],
    examples: spec.examples,
    execute: (args, ctx) => spec.run(parse(spec.flags, positionals, args), ctx),
    describe: (e) => e.describe((field) => names.get(field) ?? field),
  };
}

function parse<F extends Flags>(flags: F, positionals: readonly PositionalSpec[], args: string[]): Parsed<F> {
  const options: Record<string, { type: "string" | "boolean" }> = {};
  for (const [name, f] of Object.entries({ ...COMMON_FLAGS, ...flags })) options[name] = { type: f.type };
  let parsed: ReturnType<typeof parseArgs<{ args: string[]; options: typeof options; allowPositionals: true; strict: true; tokens: true }>>;
  try {
    parsed = parseArgs({ args, options, allowPositionals: true, strict: true, tokens: true });
  } catch (e) {
    throw new UsageError(e instanceof Error ? e.message : String(e));
  }
  // parseArgs keeps the last of a repeated flag; a script that says two things means neither.
  const seen = new Set<string>();
  for (const t of parsed.tokens) {
    if (t.kind !== "option") continue;
    if (seen.has(t.name)) throw new UsageError(`--${t.name} given more than once`);
    seen.add(t.name);
  }
  if (parsed.positionals.length > positionals.length) {
    throw new UsageError(`unexpected argument ${JSON.stringify(parsed.positionals[positionals.length])}`);
  }
  for (const [name, f] of Object.entries(flags)) {
    const v = parsed.values[name];
    if (f.required && (v === undefined || v === "")) throw new UsageError(`missing --${name}`);
  }
  // An empty value is not the flag's absence: `--models "$MODELS"` with an empty
  // variable would otherwise mint a key for every model.
  for (const [name, v] of Object.entries(parsed.values)) {
    if (v === "") throw new UsageError(`--${name} needs a value`);
  }
  positionals.forEach((p, i) => {
    if (!parsed.positionals[i]) throw new UsageError(`missing ${p.missing}`);
  });
  // parseArgs types its values from `options`, which is built at run time from F.
  return { values: parsed.values as Values<F>, positionals: parsed.positionals };
}

/** `gateway keys create`, `gateway serve`. */
export function commandPath(c: { group: string; name: string | undefined }): string {
  return c.name ? `${c.group} ${c.name}` : c.group;
}
