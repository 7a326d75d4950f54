import { type TSchema, Type as T } from "@sinclair/typebox";
import { CATEGORIES } from "../audit/record.ts";
import { ChatBodySchema, EmbeddingsBodySchema } from "../inference/model.ts";

/**
 * The OpenAPI 3.1 document, built from the same TypeBox schemas that validate
 * requests (TypeBox schemas are JSON Schema), plus response schemas written
 * from the spec's tables. Served at GET /openapi.json; needs no network.
 */

const ErrorBody = T.Object(
  {
    error: T.Object({
      message: T.String(),
      type: T.String({ description: "OpenAI-style error class" }),
      param: T.Union([T.String(), T.Null()]),
      code: T.String({ description: "the spec's error code, e.g. unauthorized, key_expired, budget_exceeded" }),
    }),
  },
  { description: "Every error, in OpenAI's wire shape" },
);

const Usage = T.Object({ prompt_tokens: T.Integer(), completion_tokens: T.Integer(), total_tokens: T.Integer() });

const ChatCompletion = T.Object({
  id: T.String(),
  object: T.Literal("chat.completion"),
  created: T.Integer({ description: "Unix time in seconds" }),
  model: T.String({ description: "the alias used" }),
  choices: T.Array(
    T.Object({
      index: T.Integer(),
      message: T.Object({
        role: T.Literal("assistant"),
        content: T.Union([T.String(), T.Null()]),
        tool_calls: T.Optional(
          T.Array(T.Object({ id: T.String(), type: T.Literal("function"), function: T.Object({ name: T.String(), arguments: T.String() }) })),
        ),
      }),
      finish_reason: T.String({ description: "stop, length, tool_calls, content_filter" }),
    }),
  ),
  usage: Usage,
});

const ChatCompletionChunk = T.Object(
  {
    id: T.String(),
    object: T.Literal("chat.completion.chunk"),
    created: T.Integer(),
    model: T.String(),
    choices: T.Array(T.Object({ index: T.Integer(), delta: T.Object({}, { additionalProperties: true }), finish_reason: T.Union([T.String(), T.Null()]) })),
    usage: T.Optional(T.Union([Usage, T.Null()])),
  },
  { description: "One `data:` event of a streamed completion; the stream ends with `data: [DONE]`" },
);

const EmbeddingList = T.Object({
  object: T.Literal("list"),
  data: T.Array(
    T.Object({
      object: T.Literal("embedding"),
      index: T.Integer(),
      embedding: T.Union([T.Array(T.Number()), T.String({ description: "base64 of little-endian float32 when encoding_format=base64" })]),
    }),
  ),
  model: T.String(),
  usage: T.Object({ prompt_tokens: T.Integer(), total_tokens: T.Integer() }),
});

const ModelList = T.Object({
  object: T.Literal("list"),
  data: T.Array(T.Object({ id: T.String(), object: T.Literal("model"), created: T.Integer(), owned_by: T.String() })),
});

const KeyInfo = T.Object({
  key: T.Object({
    id: T.String({ format: "uuid" }),
    kind: T.Union([T.Literal("personal"), T.Literal("service")]),
    scopes: T.Array(T.String()),
    expires_at: T.String({ format: "date-time", description: "ISO 8601 UTC with milliseconds; every key expires" }),
  }),
  organization: T.Object({ id: T.String({ format: "uuid" }), plan: T.String() }),
});

const Person = { id: T.String({ format: "uuid" }), name: T.String(), email: T.String() };
const AuditEvent = T.Object({
  id: T.String({ format: "uuid" }),
  created_at: T.String({ format: "date-time" }),
  action: T.String(),
  category: T.Union(CATEGORIES.map((c) => T.Literal(c))),
  actor: T.Object({ type: T.String(), ...Person, key_id: T.Union([T.String({ format: "uuid" }), T.Null()]) }),
  targets: T.Array(T.Object({ key: T.String(), kind: T.String(), ...Person })),
  details: T.Object({}, { additionalProperties: true }),
  origin: T.Object({ ip_prefix: T.String(), user_agent_summary: T.String() }),
});
const AuditEventList = T.Object({
  data: T.Array(AuditEvent),
  next_cursor: T.String({ description: "pass as `cursor` for the next page; empty string on the last page" }),
});

/** JSON of a TypeBox schema: drops TypeBox's symbol keys. */
const json = (s: TSchema): Record<string, unknown> => JSON.parse(JSON.stringify(s));
const ref = (name: string) => ({ $ref: `#/components/schemas/${name}` });
const jsonContent = (name: string) => ({ "application/json": { schema: ref(name) } });

const ERROR_TEXT: Record<number, string> = {
  400: "invalid_request_error / invalid_body",
  401: "unauthorized or key_expired",
  403: "scope_missing, academy_only or browser_request_rejected",
  404: "model_not_found",
  429: "rate_limit_error (see retry-after) or budget_exceeded",
  503: "service_unavailable",
};

function errors(...statuses: number[]) {
  const out: Record<string, unknown> = {};
  for (const s of statuses) out[String(s)] = { description: ERROR_TEXT[s], content: jsonContent("Error") };
  return out;
}

const rateHeaders = {
  "x-ratelimit-limit-requests": { schema: { type: "string" } },
  "x-ratelimit-remaining-requests": { schema: { type: "string" } },
  "x-ratelimit-reset-requests": { schema: { type: "string" } },
  "x-request-id": { schema: { type: "string" } },
};

export function openApiDocument(version: string): Record<string, unknown> {
  const secured = { security: [{ bearer: [] }] };
  return {
    openapi: "3.1.0",
    info: {
      title: "gateway: inference API and App API",
      version,
      description: "OpenAI-compatible chat completions, embeddings and models on stable aliases, plus key inspection and the audit log. API version v1.",
    },
    servers: [{ url: "/" }],
    components: {
      securitySchemes: { bearer: { type: "http", scheme: "bearer", description: "sk-<tag>-<secret>" } },
      schemas: {
        Error: json(ErrorBody),
        ChatCompletionRequest: json(ChatBodySchema),
        ChatCompletion: json(ChatCompletion),
        ChatCompletionChunk: json(ChatCompletionChunk),
        EmbeddingsRequest: json(EmbeddingsBodySchema),
        EmbeddingList: json(EmbeddingList),
        ModelList: json(ModelList),
        KeyInfo: json(KeyInfo),
        AuditEvent: json(AuditEvent),
        AuditEventList: json(AuditEventList),
      },
    },
    paths: {
      "/v1/chat/completions": {
        post: {
          operationId: "createChatCompletion",
          summary: "Create a chat completion, in one piece or streamed (server-sent events)",
          ...secured,
          requestBody: { required: true, content: jsonContent("ChatCompletionRequest") },
          responses: {
            "200": {
              description: "The completion (JSON), or with stream=true a text/event-stream of chunks",
              headers: rateHeaders,
              content: { ...jsonContent("ChatCompletion"), "text/event-stream": { schema: ref("ChatCompletionChunk") } },
            },
            ...errors(400, 401, 403, 404, 429, 503),
          },
        },
      },
      "/v1/embeddings": {
        post: {
          operationId: "createEmbedding",
          summary: "Create embeddings for text",
          ...secured,
          requestBody: { required: true, content: jsonContent("EmbeddingsRequest") },
          responses: { "200": { description: "Embeddings", headers: rateHeaders, content: jsonContent("EmbeddingList") }, ...errors(400, 401, 403, 404, 429, 503) },
        },
      },
      "/v1/models": {
        get: {
          operationId: "listModels",
          summary: "List the aliases this key may call",
          ...secured,
          responses: { "200": { description: "Model list", headers: rateHeaders, content: jsonContent("ModelList") }, ...errors(401, 403, 429) },
        },
      },
      "/v1/me": {
        get: {
          operationId: "getKeyInfo",
          summary: "What the presented key is (the App API ping)",
          ...secured,
          responses: { "200": { description: "Key information", headers: rateHeaders, content: jsonContent("KeyInfo") }, ...errors(401, 403, 429) },
        },
      },
      "/v1/audit-events": {
        get: {
          operationId: "listAuditEvents",
          summary: "The organisation's audit log, newest first (service keys with audit:read)",
          ...secured,
          parameters: [
            { name: "from", in: "query", schema: { type: "string", format: "date-time" }, description: "inclusive" },
            { name: "to", in: "query", schema: { type: "string", format: "date-time" }, description: "inclusive" },
            { name: "actor_id", in: "query", schema: { type: "string", format: "uuid" } },
            { name: "category", in: "query", schema: { type: "string", enum: [...CATEGORIES] } },
            { name: "action", in: "query", schema: { type: "string" } },
            { name: "q", in: "query", schema: { type: "string", maxLength: 200 }, description: "free text over action names and people's names and e-mails" },
            { name: "cursor", in: "query", schema: { type: "string" } },
            { name: "limit", in: "query", schema: { type: "integer", minimum: 1, maximum: 200, default: 50 } },
          ],
          responses: { "200": { description: "A page of events", headers: rateHeaders, content: jsonContent("AuditEventList") }, ...errors(400, 401, 403, 429, 503) },
        },
      },
      "/healthz": { get: { operationId: "healthz", summary: "Alive", security: [], responses: { "200": { description: "ok" } } } },
      "/readyz": {
        get: {
          operationId: "readyz",
          summary: "Database reachable and migrations applied",
          security: [],
          responses: { "200": { description: "ready" }, "503": { description: "not ready", content: jsonContent("Error") } },
        },
      },
      "/metrics": { get: { operationId: "metrics", summary: "Prometheus metrics", security: [], responses: { "200": { description: "text exposition format" } } } },
    },
  };
}
