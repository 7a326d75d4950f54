import type { Command } from "../command.ts";
import { audit } from "./audit.ts";
import { configCommands } from "./config.ts";
import { keys } from "./keys.ts";
import { migrate } from "./migrate.ts";
import { orgs } from "./orgs.ts";
import { serve } from "./serve.ts";
import { simulateUpstream } from "./simulate-upstream.ts";
import { usage } from "./usage.ts";
import { users } from "./users.ts";

/** Every command, in the order `gateway --help` lists them. */
export const COMMANDS: readonly Command[] = [serve, migrate, ...orgs, ...users, ...keys, ...audit, ...usage, ...configCommands, simulateUpstream];
