// Replaced at build time by `bun build --define` (package.json "build"); dev runs say "-dev".
declare const GATEWAY_VERSION: string | undefined;
declare const GATEWAY_COMMIT: string | undefined;
export const VERSION = typeof GATEWAY_VERSION === "string" ? GATEWAY_VERSION : "0.1.0-dev";
export const COMMIT = typeof GATEWAY_COMMIT === "string" ? GATEWAY_COMMIT : "unknown";
