import { isRecord } from "../lib/guards.ts";
import { DEFAULT_SIM_MODELS, type SimConfig, type SimOptions } from "./types.ts";
import { nonNegInt } from "./wire.ts";

export function applyConfigPatch(cfg: SimConfig, v: unknown): string | undefined {
  if (!isRecord(v)) return "config must be an object";
  for (const k of ["ttftMs", "interTokenMs", "completionTokens"] as const) {
    if (v[k] === undefined) continue;
    const n = nonNegInt(v[k]);
    if (n === undefined) return `${k} must be a non-negative number`;
    cfg[k] = n;
  }
  if (v.apiKey !== undefined) {
    if (v.apiKey !== null && typeof v.apiKey !== "string") return "apiKey must be a string or null";
    cfg.apiKey = v.apiKey ?? undefined;
  }
  if (v.models !== undefined) {
    if (!Array.isArray(v.models) || !v.models.every((m) => typeof m === "string")) return "models must be strings";
    cfg.models = v.models;
  }
  if (v.reasoning !== undefined) {
    if (v.reasoning !== null && typeof v.reasoning !== "string") return "reasoning must be a string or null";
    cfg.reasoning = v.reasoning ?? undefined;
  }
  if (v.errorFormat !== undefined) {
    if (v.errorFormat !== "legacy" && v.errorFormat !== "nested") return "errorFormat must be legacy or nested";
    cfg.errorFormat = v.errorFormat;
  }
  return undefined;
}

export function configFrom(opts: SimOptions): SimConfig {
  return {
    ttftMs: opts.ttftMs ?? 20,
    interTokenMs: opts.interTokenMs ?? 5,
    completionTokens: opts.completionTokens ?? 16,
    apiKey: opts.apiKey,
    models: [...(opts.models ?? DEFAULT_SIM_MODELS)],
    errorFormat: opts.errorFormat ?? "legacy",
    reasoning: opts.reasoning,
  };
}
