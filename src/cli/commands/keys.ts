import { UsageError, defineCommand, type Out } from "../command.ts";
import { config, isoTime, list, print, withDb } from "../context.ts";
import { type ExpiryRequest, createKey, keyLifetime, listKeys, revokeKey, rotateKey } from "../../admin/service.ts";
import { parseDuration } from "../../auth/keys.ts";
import { type Config, SPEC_ALIASES } from "../../config/schema.ts";

const EXPIRY_FLAGS = {
  "expires-at": { type: "string", value: "ISO", description: "expiry time, ISO 8601 (not with --expires-in)", field: "expiresAt" },
  "expires-in": { type: "string", value: "DURATION", description: "expiry from now: 90d, 24h, 30m (not with --expires-at)", field: "expiresInMs" },
} as const;

/** A key's id as the commands taking one call it. */
const KEY_ID = { name: "ID", description: "the key's id (UUID)", missing: "key ID", field: { name: "id", as: "key id" } };

/** --expires-at / --expires-in, or null when neither is given. */
function expiryFlags(values: { "expires-at"?: string | undefined; "expires-in"?: string | undefined }): ExpiryRequest | null {
  if (values["expires-at"] && values["expires-in"]) throw new UsageError("give --expires-at or --expires-in, not both");
  if (values["expires-at"]) return { at: isoTime(values["expires-at"], "--expires-at") };
  if (values["expires-in"]) {
    const ms = parseDuration(values["expires-in"]);
    if (ms === null || ms === 0) throw new UsageError("--expires-in takes a duration such as 90d, 24h, 30m");
    return { inMs: ms };
  }
  return null;
}

/**
 * Said once the key exists: before, the client said it and then, forwarded to a
 * running server (which runs the command again), the server said it too.
 */
function warnIfPast(expiry: ExpiryRequest | null, out: Out) {
  if (expiry && "at" in expiry && expiry.at.getTime() <= Date.now()) out.stderr("warning: --expires-at is in the past; the key is created already expired\n");
}

function knownModels(cfg: Config): string[] {
  return [...new Set([...Object.keys(SPEC_ALIASES), ...Object.keys(cfg.aliases)])];
}

export const keysCreate = defineCommand({
  group: "keys",
  name: "create",
  summary: "mint an API key; the secret is printed once and only its hash is stored",
  flags: {
    org: { type: "string", value: "UUID", description: "the organisation", required: true, field: "orgId" },
    user: { type: "string", value: "UUID", description: "the person a personal key belongs to (not for service keys)", field: "userId" },
    kind: { type: "string", value: "personal|service", description: "a person's key, or the organisation's", required: true, field: "kind" },
    scopes: { type: "string", value: "inference[,audit:read]", description: "comma-separated; audit:read only for service keys", required: true, field: "scopes" },
    models: { type: "string", value: "ALIAS[,ALIAS…]", description: "model aliases the key may use (default: all)", field: "models" },
    ...EXPIRY_FLAGS,
    name: { type: "string", value: "NAME", description: "a label for the key", field: "name" },
  },
  common: ["config", "data-dir", "json"],
  notes: ["Every key expires: by default after keys.defaultLifetime (365d), never later than keys.maxLifetime when that is set."],
  examples: [
    "gateway keys create --org 7f8f3c2a-1b2c-4d5e-8f90-123456789abc --kind service --scopes inference,audit:read --name backend",
    "gateway keys create --org 7f8f3c2a-1b2c-4d5e-8f90-123456789abc --user 0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d --kind personal --scopes inference --expires-in 90d --json",
  ],
  async run({ values }, { out }) {
    const cfg = await config(values);
    const expiry = expiryFlags(values);
    const models = list(values.models);
    // A given --models that names nothing (",", " ") must not mean "every model", as an absent one does.
    if (values.models !== undefined && models.length === 0) throw new UsageError(`--models names no model alias: ${JSON.stringify(values.models)}`);
    const input = {
      orgId: values.org,
      ...(values.user ? { userId: values.user } : {}),
      kind: values.kind,
      scopes: list(values.scopes),
      models,
      knownModels: knownModels(cfg),
      ...(expiry && "at" in expiry ? { expiresAt: expiry.at } : {}),
      ...(expiry && "inMs" in expiry ? { expiresInMs: expiry.inMs } : {}),
      lifetime: keyLifetime(cfg.keys),
      name: values.name ?? "",
      tag: cfg.keyTag,
    };
    const key = await withDb(cfg, out, (db) => createKey(db, input));
    warnIfPast(expiry, out);
    print(out, values.json, key, `created ${key.kind} key ${key.id}\n${key.key}\n(the key is shown only once; store it now)`);
    return 0;
  },
});

const listCmd = defineCommand({
  group: "keys",
  name: "list",
  summary: "an organisation's keys, newest first, without secrets",
  flags: {
    org: { type: "string", value: "UUID", description: "the organisation", required: true, field: "orgId" },
  },
  common: ["config", "data-dir", "json"],
  examples: ["gateway keys list --org 7f8f3c2a-1b2c-4d5e-8f90-123456789abc --json"],
  async run({ values }, { out }) {
    const cfg = await config(values);
    const rows = await withDb(cfg, out, (db) => listKeys(db, values.org));
    const human = rows
      .map((k) => `${k.id}  ${k.prefix}…  ${k.kind.padEnd(8)}  ${k.scopes.join(",")}  ${k.revoked_at ? "revoked" : `expires ${k.expires_at}`}`)
      .join("\n");
    print(out, values.json, rows, human || "no keys");
    return 0;
  },
});

const revoke = defineCommand({
  group: "keys",
  name: "revoke",
  summary: "revoke a key at once; revoking it again changes nothing",
  flags: {},
  positionals: [KEY_ID],
  common: ["config", "data-dir", "json"],
  examples: ["gateway keys revoke 5b0e7c9e-2f4d-4c1a-9d8e-0f1a2b3c4d5e"],
  async run({ values, positionals: [id = ""] }, { out }) {
    const cfg = await config(values);
    const k = await withDb(cfg, out, (db) => revokeKey(db, id));
    print(out, values.json, k, `revoked key ${k.id}`);
    return 0;
  },
});

const rotate = defineCommand({
  group: "keys",
  name: "rotate",
  summary: "a new secret for a key; the old secret works for a grace period",
  flags: {
    grace: { type: "string", value: "DURATION", description: "how long the old key keeps working: 24h (default), 30m, 0" },
    ...EXPIRY_FLAGS,
  },
  positionals: [KEY_ID],
  common: ["config", "data-dir", "json"],
  notes: ["The new key gets the old key's lifetime, counted from now, unless an expiry is given."],
  examples: ["gateway keys rotate 5b0e7c9e-2f4d-4c1a-9d8e-0f1a2b3c4d5e --grace 1h --json"],
  async run({ values, positionals: [id = ""] }, { out }) {
    const cfg = await config(values);
    const graceMs = values.grace === undefined ? 24 * 3_600_000 : values.grace === "0" ? 0 : parseDuration(values.grace);
    if (graceMs === null) throw new UsageError("--grace takes a duration such as 24h, 30m, 0");
    const expiry = expiryFlags(values);
    const lifetime = keyLifetime(cfg.keys);
    const k = await withDb(cfg, out, (db) => rotateKey(db, { id, graceMs, tag: cfg.keyTag, lifetime, ...(expiry ? { expiry } : {}) }));
    warnIfPast(expiry, out);
    // The old key never outlives its own expiry: a grace longer than what it had left is not what it gets.
    const graceEnd = Date.parse(k.created_at) + graceMs;
    const until = Date.parse(k.old_key_expires_at) < graceEnd ? `until ${k.old_key_expires_at}, when it expires` : `for ${values.grace ?? "24h"} more`;
    print(out, values.json, k, `rotated: new key ${k.id}\n${k.key}\n(the old key works ${until})`);
    return 0;
  },
});

export const keys = [keysCreate, listCmd, revoke, rotate];
