import type { Principal } from "../auth/types.ts";
import type { AliasConfig, Config } from "../config/schema.ts";
import { AppError } from "../lib/errors.ts";

/** Aliases a key may address: all configured ones, or the key's own list. */
export function allowedAliases(config: Config, p: Principal): string[] {
  const all = Object.keys(config.aliases);
  return p.models ? all.filter((a) => p.models?.includes(a)) : all;
}

/**
 * The alias a request names, if this key may call it on this endpoint. An
 * unknown alias, one outside the key's list, and one of the wrong kind all get
 * the same 404 (spec 7: "unknown model id, or a model this key may not
 * address"), so a key cannot probe which aliases exist beyond its own.
 */
export function resolveAlias(config: Config, name: string, p: Principal, kind: AliasConfig["kind"]): AliasConfig {
  const alias = Object.hasOwn(config.aliases, name) ? config.aliases[name] : undefined;
  if (!alias || alias.kind !== kind || (p.models && !p.models.includes(name))) {
    const what = kind === "chat" ? "chat model" : "embedding model";
    // The name as sent, but not a megabyte of it back.
    const shown = name.length > 128 ? `${name.slice(0, 128)}…` : name;
    throw new AppError(
      "model_not_found",
      `The ${what} '${shown}' does not exist or you do not have access to it. GET /v1/models lists the models this key may call.`,
      "model",
    );
  }
  return alias;
}
