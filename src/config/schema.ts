import { type Static, Type as T } from "@sinclair/typebox";

/**
 * The one configuration schema. A config file may set any subset; everything
 * else takes the defaults written here, so this file is also the reference for
 * every option (README "Configuration" mirrors it).
 */

/**
 * A duration in milliseconds. Timers take at most 2^31 - 1 ms (~24.8 days):
 * a longer one fires after 1 ms (Bun, like Node), so drainMs 3e9 would end the
 * drain at once. Longer values are refused instead.
 */
const MAX_TIMER_MS = 2 ** 31 - 1;
function Ms(options: { minimum: number; default: number; description?: string }) {
  return T.Integer({ ...options, maximum: MAX_TIMER_MS });
}

/**
 * A whole number the gateway can count with exactly: at most 2^53 - 1 unless
 * a smaller maximum is given. JSON reads 1e300 as an integer, and counts,
 * sizes and limits beyond 2^53 lose their units (n + 1 === n).
 */
function Int(options: { minimum: number; maximum?: number; default?: number; description?: string }) {
  return T.Integer({ maximum: Number.MAX_SAFE_INTEGER, ...options });
}

const Target = T.Object(
  {
    baseUrl: T.String({ description: "Upstream OpenAI-compatible base URL, e.g. http://10.0.0.5:8000/v1" }),
    model: T.String({ description: "Upstream model id sent in the request body" }),
    apiKeyEnv: T.Optional(T.String({ description: "Name of the env variable holding the upstream API key" })),
    // Bounded so that weights add up to a finite total (two of 1e308 made Infinity, and the weighted choice then always took the last target).
    weight: T.Number({ minimum: 0, maximum: 1_000_000, default: 1, description: "Share of the alias's traffic (0: a standby), at most 1,000,000" }),
  },
  { additionalProperties: false },
);

const Timeouts = T.Object(
  {
    connectMs: Ms({ minimum: 1, default: 5_000 }),
    firstByteMs: Ms({ minimum: 1, default: 60_000, description: "Time to the upstream's response headers" }),
    idleMs: Ms({ minimum: 1, default: 60_000, description: "Longest silence inside a stream" }),
  },
  { additionalProperties: false, default: {} },
);

export const Capability = T.Union([T.Literal("images"), T.Literal("tools")]);

/** Exported for load.ts, which applies its defaults itself (see there). */
export const Alias = T.Object(
  {
    kind: T.Union([T.Literal("chat"), T.Literal("embedding")]),
    contextWindow: T.Optional(Int({ minimum: 1 })),
    imageTokens: T.Optional(
      Int({ minimum: 1, description: "The most prompt tokens one image can cost on this model; the quota reserves this per image (default 2048)" }),
    ),
    capabilities: T.Array(Capability, { default: [] }),
    ownedBy: T.String({ default: "gateway" }),
    dimensions: T.Optional(Int({ minimum: 1 })),
    targets: T.Array(Target, { minItems: 1 }),
    timeouts: T.Optional(Timeouts),
  },
  { additionalProperties: false },
);

const Plan = T.Object({ requestsPerMinute: Int({ minimum: 1 }) }, { additionalProperties: false });

export const ConfigSchema = T.Object(
  {
    host: T.String({ default: "127.0.0.1" }),
    port: Int({ minimum: 0, maximum: 65535, default: 8080 }),
    reusePort: T.Boolean({
      default: false,
      description: "Share the port with other instances on this host (SO_REUSEPORT); needs databaseUrl. Off: a taken port is an error",
    }),
    dataDir: T.String({ default: "./data", description: "Embedded database directory (when databaseUrl is unset)" }),
    databaseUrl: T.Optional(T.String({ pattern: "^postgres(ql)?://" })),
    dbPoolMax: Int({ minimum: 1, maximum: 200, default: 10 }),
    logLevel: T.Union([T.Literal("debug"), T.Literal("info"), T.Literal("warn"), T.Literal("error"), T.Literal("silent")], {
      default: "info",
    }),
    accessLog: T.Boolean({ default: true }),
    bodyLimitBytes: Int({ minimum: 1024, default: 16 * 1024 * 1024 }),
    drainMs: Ms({ minimum: 0, default: 30_000, description: "How long in-flight requests may finish after SIGTERM" }),
    idleTimeoutS: Int({
      minimum: 1,
      maximum: 255,
      default: 60,
      description: "Seconds a connection may sit idle (keep-alive, or a request body that stops arriving); not applied to inference responses",
    }),
    keyTag: T.String({ pattern: "^[a-z0-9]{1,12}$", default: "gw", description: "Keys look like sk-<keyTag>-<secret>" }),
    cursorSecret: T.Optional(T.String({ minLength: 32 })),
    keyCache: T.Object(
      {
        ttlMs: Ms({ minimum: 0, default: 60_000 }),
        max: Int({ minimum: 1, default: 100_000 }),
        negativeTtlMs: Ms({ minimum: 0, default: 5_000 }),
        negativeMax: Int({ minimum: 1, default: 10_000 }),
        unknownPerPrefixPerMin: Int({
          minimum: 1,
          default: 60,
          description: "Lookups of keys not in the cache a minute per client /24 or /48 (found keys do not count); beyond it 429",
        }),
        unknownPerMin: Int({ minimum: 1, default: 6_000, description: "The same budget for all clients together" }),
      },
      { additionalProperties: false, default: {} },
    ),
    keys: T.Object(
      {
        defaultLifetime: T.String({
          pattern: "^[1-9][0-9]{0,5}[smhd]$",
          default: "365d",
          description: "Lifetime of a key created or rotated without an explicit expiry, e.g. 365d, 12h",
        }),
        maxLifetime: T.Optional(
          T.String({ pattern: "^[1-9][0-9]{0,5}[smhd]$", description: "Longest lifetime a key may be given; longer requests are refused" }),
        ),
      },
      { additionalProperties: false, default: {} },
    ),
    defaultPlan: T.String({ default: "Standard" }),
    plans: T.Record(T.String({ minLength: 1 }), Plan, { default: {} }),
    rateLimit: T.Object(
      {
        instances: Int({ minimum: 1, default: 1, description: "Gateway instances sharing the load; limits are divided by it" }),
        maxOrgs: Int({ minimum: 1, default: 100_000 }),
        windowMs: Ms({ minimum: 1_000, default: 60_000, description: "Rolling window; the spec's limits are per minute" }),
      },
      { additionalProperties: false, default: {} },
    ),
    quota: T.Object(
      {
        leaseTokens: Int({ minimum: 1, default: 20_000, description: "Tokens an instance takes from the shared quota at a time" }),
        defaultMaxTokens: Int({
          minimum: 1,
          default: 4_096,
          description: "For an organisation with a quota, the completion bound of each choice of a request that sets none (reserved, and sent upstream as max_tokens)",
        }),
        flushMs: Ms({ minimum: 10, default: 1_000 }),
        maxBuffered: Int({ minimum: 1, default: 1_000_000 }),
      },
      { additionalProperties: false, default: {} },
    ),
    upstream: T.Object(
      {
        attempts: Int({ minimum: 1, maximum: 10, default: 3 }),
        backoffMs: Ms({ minimum: 0, default: 50 }),
        breakerFailures: Int({ minimum: 1, default: 5 }),
        breakerCooldownMs: Ms({ minimum: 1, default: 30_000 }),
        maxResponseBytes: Int({
          minimum: 1024,
          default: 8 * 1024 * 1024,
          description: "Largest non-streamed answer or error body read from an upstream (embeddings get at least what their input count needs), and the most delta text a Responses API stream holds",
        }),
        timeouts: Timeouts,
        // Image URLs the inference servers are asked to fetch (src/inference/image-url.ts).
        imageUrls: T.Optional(
          T.Object(
            {
              allowPrivate: T.Boolean({ default: false, description: "Let image URLs name loopback, private, link-local and metadata hosts" }),
              allow: T.Array(T.String(), { default: [], description: "Host names, addresses or CIDRs image URLs may name although internal" }),
              resolveTimeoutMs: Ms({ minimum: 1, default: 2_000, description: "Deadline for resolving a request's image hosts" }),
            },
            { additionalProperties: false, default: {} },
          ),
        ),
      },
      { additionalProperties: false, default: {} },
    ),
    metrics: T.Object(
      {
        enabled: T.Boolean({ default: true }),
        listen: T.String({
          pattern: "^(main|[^\\s]+:\\d{1,5})$",
          default: "127.0.0.1:9464",
          description: 'host:port of a listener of its own for /metrics (port 0: any free port), or "main" to serve it on the public port',
        }),
      },
      { additionalProperties: false, default: {} },
    ),
    responses: T.Object(
      {
        enabled: T.Boolean({
          default: false,
          description: "Serve the Responses API (/v1/responses) on the chat aliases; off: those paths answer 404 like any unknown route",
        }),
        store: T.Boolean({
          default: true,
          description: "Keep responses (their input, output, usage, metadata) in the database for retrieve and previous_response_id; false: never stored",
        }),
        retentionDays: Int({ minimum: 1, maximum: 3650, default: 30, description: "Days a stored response is kept; expired rows are deleted in the background" }),
        webSearch: T.Union([T.Literal("refuse"), T.Literal("ignore")], {
          default: "refuse",
          description:
            "Web search tools (web_search, web_search_preview) in a request: refuse (400 naming the tool) or ignore (accepted and not offered to the model, which answers without a search; Codex CLI sends one by default)",
        }),
      },
      { additionalProperties: false, default: {} },
    ),
    // additionalProperties: false, or a key not matching the pattern would pass unvalidated.
    aliases: T.Record(T.String({ pattern: "^[A-Za-z0-9._:-]{1,64}$" }), Alias, { default: {}, additionalProperties: false }),
  },
  { additionalProperties: false },
);

export type Config = Static<typeof ConfigSchema>;
export type AliasConfig = Static<typeof Alias>;
export type TargetConfig = Static<typeof Target>;
export type TimeoutsConfig = Static<typeof Timeouts>;

/** Spec 2.1: the alias table. Upstream model ids are the operator's to set. */
export const SPEC_ALIASES: Record<string, Omit<AliasConfig, "targets"> & { defaultModel: string }> = {
  "svc-fast": { kind: "chat", contextWindow: 128_000, capabilities: ["images", "tools"], ownedBy: "gateway", defaultModel: "svc-fast" },
  "svc-smart": { kind: "chat", contextWindow: 180_000, capabilities: ["images", "tools"], ownedBy: "gateway", defaultModel: "svc-smart" },
  "svc-bigthink": {
    kind: "chat",
    contextWindow: 250_000,
    capabilities: ["images", "tools"],
    ownedBy: "gateway",
    defaultModel: "svc-bigthink",
    timeouts: { connectMs: 5_000, firstByteMs: 600_000, idleMs: 300_000 },
  },
  "svc-embed": { kind: "embedding", capabilities: [], ownedBy: "gateway", dimensions: 1024, defaultModel: "svc-embed" },
};

export const DEFAULT_PLANS: Record<string, { requestsPerMinute: number }> = {
  Standard: { requestsPerMinute: 60 },
  Ultra: { requestsPerMinute: 300 },
};
