import { type TSchema, Type as T } from "@sinclair/typebox";
import { CATEGORIES } from "../audit/record.ts";
import { ChatBodySchema, EmbeddingsBodySchema } from "../inference/model.ts";
import { InputTokensBodySchema, ResponsesBodySchema } from "../responses/request.ts";
import type { ErrorCode } from "../lib/errors.ts";
import { codesWithStatus } from "./errors.ts";

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
        refusal: T.Union([T.String(), T.Null()], { description: "null unless the model refused" }),
        tool_calls: T.Optional(
          T.Array(T.Object({ id: T.String(), type: T.Literal("function"), function: T.Object({ name: T.String(), arguments: T.String() }) })),
        ),
      }),
      logprobs: T.Union([T.Object({}, { additionalProperties: true }), T.Null()], { description: "null unless asked for with logprobs: true" }),
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

const Open = { additionalProperties: true } as const;
const ResponseObject = T.Object(
  {
    id: T.String({ pattern: "^resp_" }),
    object: T.Literal("response"),
    created_at: T.Integer({ description: "Unix time in seconds" }),
    status: T.Union([T.Literal("completed"), T.Literal("incomplete"), T.Literal("failed"), T.Literal("in_progress"), T.Literal("cancelled")], {
      description: "cancelled: a stream whose client went away (stored as it stood)",
    }),
    model: T.String({ description: "the alias used" }),
    output: T.Array(T.Object({ type: T.String({ description: "message, function_call or reasoning" }) }, Open)),
    usage: T.Optional(
      T.Object({ input_tokens: T.Integer(), output_tokens: T.Integer(), total_tokens: T.Integer() }, { ...Open, description: "absent until the upstream reported it" }),
    ),
  },
  { ...Open, description: "OpenAI's Response object; the request fields it echoes (instructions, tools, text, metadata, …) as OpenAI's type declares them" },
);
const ResponseDeleted = T.Object({ id: T.String(), object: T.Literal("response"), deleted: T.Literal(true) });
const ResponseInputTokens = T.Object(
  { object: T.Literal("response.input_tokens"), input_tokens: T.Integer({ minimum: 0 }) },
  {
    additionalProperties: false,
    description:
      "input_tokens is the gateway's estimate (~4 bytes of UTF-8 a token, the chat template's overhead per message, a flat price per image, the tools' JSON), not the model's tokenizer: the figure usage falls back on when an upstream reports none",
  },
);
const ResponseItemList = T.Object({
  object: T.Literal("list"),
  data: T.Array(T.Object({ id: T.String(), type: T.String({ description: "message, function_call, function_call_output or reasoning" }) }, Open)),
  first_id: T.Union([T.String(), T.Null()]),
  last_id: T.Union([T.String(), T.Null()]),
  has_more: T.Boolean(),
});

const Health = T.Object({ status: T.Literal("ok") }, { additionalProperties: false });
const Ready = T.Object({ status: T.Literal("ready") }, { additionalProperties: false });

/** JSON of a TypeBox schema: drops TypeBox's symbol keys. */
const json = (s: TSchema): Record<string, unknown> => JSON.parse(JSON.stringify(s));
const ref = (name: string) => ({ $ref: `#/components/schemas/${name}` });
const jsonContent = (name: string) => ({ "application/json": { schema: ref(name) } });

/**
 * Response headers, by what sets them: every answer has a request id; an
 * answer given after the key check (the guard admitted the key) carries the
 * rate-limit state; a 429 says when to retry; a streamed answer is not cached.
 */
const header = (description: string, schema: Record<string, unknown>, required = false) => ({ description, required, schema });
const digits = { type: "string", pattern: "^[0-9]+$" };
const HEADERS = {
  "x-request-id": header("The request's id: the client's own x-request-id when it is a safe token (and not a key), else one made here", { type: "string", minLength: 1 }, true),
  "x-ratelimit-limit-requests": header("Requests per minute this organisation may make on this instance", digits, true),
  "x-ratelimit-remaining-requests": header("Requests left in the current window", digits, true),
  "x-ratelimit-reset-requests": header("Time until the window has room again, as a duration (e.g. 1s, 250ms, 1m2.5s)", {
    type: "string",
    pattern: "^([0-9]+h)?([0-9]+m)?([0-9]+(\\.[0-9]+)?s|[0-9]+ms)$",
  }),
  "retry-after": header("Seconds to wait before retrying (whole, at least 1)", digits),
  "retry-after-ms": header("Milliseconds to wait before retrying (rate limit only)", digits),
  "x-should-retry": header("false on budget_exceeded: retrying does not help until the quota window resets", { type: "string", const: "false" }),
  "cache-control": header("no-cache on a text/event-stream answer", { type: "string", const: "no-cache" }),
  "x-accel-buffering": header("no on a text/event-stream answer, so proxies do not buffer the stream", { type: "string", const: "no" }),
} as const;
type HeaderName = keyof typeof HEADERS;

/** Headers declared for a response: `required` lists those always present, `optional` the rest. */
function headers(required: HeaderName[], optional: HeaderName[] = []) {
  const out: Record<string, unknown> = {};
  for (const n of required) out[n] = { ...HEADERS[n], required: true };
  for (const n of optional) out[n] = { ...HEADERS[n], required: false };
  return out;
}
const RATE: HeaderName[] = ["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"];

/** When a code is answered and what it carries, where that is worth saying; the codes and statuses come from src/http/errors.ts. */
const ERROR_NOTES: Partial<Record<ErrorCode, string>> = {
  invalid_request_error: "chat, embeddings: bad body, unknown parameter, body too large",
  invalid_body: "audit events",
  not_found: "a path or method this API does not have",
  rate_limit_error: "retry-after, retry-after-ms",
  budget_exceeded: "x-should-retry: false; retry-after when the quota window resets within a minute",
  internal_error: "a defect of ours; the request id identifies it in the logs",
  service_unavailable: "the model's upstream (with the rate-limit headers) or the key store (before the key check, without them) is unreachable",
};

/** The codes of one status, each with its note. */
function errorText(status: number): string {
  return codesWithStatus(status)
    .map((c) => (ERROR_NOTES[c] ? `${c} (${ERROR_NOTES[c]})` : c))
    .join(" or ");
}

/** Error answers of an endpoint behind the key check, each with the headers it really carries. */
function errors(...statuses: number[]) {
  const out: Record<string, unknown> = {};
  for (const s of statuses) {
    // 401 and 403 are answered by the key check itself, before any rate-limit state exists.
    const h =
      s === 401 || s === 403
        ? headers(["x-request-id"])
        : s === 429
          ? headers(["x-request-id", ...RATE], ["retry-after", "retry-after-ms", "x-should-retry"])
          : s === 503
            ? headers(["x-request-id"], [...RATE, "retry-after"])
            : s === 500
              ? headers(["x-request-id"], RATE)
              : headers(["x-request-id", ...RATE]);
    out[String(s)] = { description: errorText(s), headers: h, content: jsonContent("Error") };
  }
  return out;
}

/** 403 browser_request_rejected: the one refusal an endpoint without a key can give. */
const browserRejected = {
  "403": { description: "browser_request_rejected (an Origin, Cookie or Sec-Fetch-* header; Sec-Fetch-Mode: cors alone is Node.js, not a browser)", headers: headers(["x-request-id"]), content: jsonContent("Error") },
};

/** An admitted answer: the request id and the rate-limit state. */
const admitted = (description: string, content: Record<string, unknown>) => ({ description, headers: headers(["x-request-id", ...RATE]), content });

/**
 * The OpenAPI document. `info.version` is the API's version label (spec 9:
 * `v1`); the build that serves it is `x-gateway-version`.
 */
export function openApiDocument(buildVersion: string, opts: { responses?: boolean } = {}): Record<string, unknown> {
  const secured = { security: [{ bearer: [] }] };
  const doc = {
    openapi: "3.1.0",
    info: {
      title: "gateway: inference API and App API",
      version: "v1",
      "x-gateway-version": buildVersion,
      description:
        "OpenAI-compatible chat completions, embeddings and models on stable aliases, plus key inspection and the audit log. " +
        "Any path or method not listed here answers 404 `not_found` (components.responses.NotFound). " +
        "Every error has the body components.schemas.Error and an x-request-id header.",
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
        ...(opts.responses
          ? {
              ResponsesRequest: json(ResponsesBodySchema),
              Response: json(ResponseObject),
              ResponseDeleted: json(ResponseDeleted),
              ResponsesInputTokensRequest: json(InputTokensBodySchema),
              ResponseInputTokens: json(ResponseInputTokens),
              ResponseItemList: json(ResponseItemList),
            }
          : {}),
        Health: json(Health),
        Ready: json(Ready),
      },
      responses: {
        NotFound: {
          description: "not_found: a path or method this API does not have (asked before any key check)",
          headers: headers(["x-request-id"]),
          content: jsonContent("Error"),
        },
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
              description: "The completion (JSON), or with stream=true a text/event-stream of chunks (`data: <chunk>` events, then `data: [DONE]`)",
              headers: headers(["x-request-id", ...RATE], ["cache-control", "x-accel-buffering"]),
              content: {
                ...jsonContent("ChatCompletion"),
                "text/event-stream": {
                  schema: { type: "string", description: "`data: <ChatCompletionChunk JSON>` events, blank-line separated, ending with `data: [DONE]`" },
                  "x-event-schema": ref("ChatCompletionChunk"),
                },
              },
            },
            ...errors(400, 401, 403, 404, 429, 500, 503),
          },
        },
      },
      ...(opts.responses ? responsesPaths(secured) : {}),
      "/v1/embeddings": {
        post: {
          operationId: "createEmbedding",
          summary: "Create embeddings for text",
          ...secured,
          requestBody: { required: true, content: jsonContent("EmbeddingsRequest") },
          responses: { "200": admitted("Embeddings", jsonContent("EmbeddingList")), ...errors(400, 401, 403, 404, 429, 500, 503) },
        },
      },
      "/v1/models": {
        get: {
          operationId: "listModels",
          summary: "List the aliases this key may call",
          ...secured,
          responses: { "200": admitted("Model list", jsonContent("ModelList")), ...errors(401, 403, 429, 500, 503) },
        },
      },
      "/v1/me": {
        get: {
          operationId: "getKeyInfo",
          summary: "What the presented key is (the App API ping)",
          ...secured,
          responses: { "200": admitted("Key information", jsonContent("KeyInfo")), ...errors(401, 403, 429, 500, 503) },
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
          responses: { "200": admitted("A page of events", jsonContent("AuditEventList")), ...errors(400, 401, 403, 429, 500, 503) },
        },
      },
      "/healthz": {
        get: {
          operationId: "healthz",
          summary: "Alive",
          security: [],
          responses: { "200": { description: "ok", headers: headers(["x-request-id"]), content: jsonContent("Health") }, ...browserRejected },
        },
      },
      "/readyz": {
        get: {
          operationId: "readyz",
          summary: "Database reachable and migrations applied",
          security: [],
          responses: {
            "200": { description: "ready", headers: headers(["x-request-id"]), content: jsonContent("Ready") },
            ...browserRejected,
            "503": { description: "service_unavailable: not ready", headers: headers(["x-request-id"]), content: jsonContent("Error") },
          },
        },
      },
      "/openapi.json": {
        get: {
          operationId: "openapi",
          summary: "This document",
          security: [],
          responses: {
            "200": { description: "OpenAPI 3.1", headers: headers(["x-request-id"]), content: { "application/json": { schema: { type: "object" } } } },
            ...browserRejected,
          },
        },
      },
      "/metrics": {
        get: {
          operationId: "metrics",
          summary: "Prometheus metrics",
          description:
            'Served on the metrics listener (metrics.listen, 127.0.0.1:9464 by default), not on the public port; with metrics.listen "main" on the public port as well.',
          servers: [{ url: "http://127.0.0.1:9464", description: "the metrics listener (metrics.listen)" }],
          security: [],
          responses: {
            "200": {
              description: "Prometheus text exposition format 0.0.4",
              headers: headers([], ["x-request-id"]),
              content: { "text/plain": { schema: { type: "string", pattern: "^# HELP " } } },
            },
          },
        },
      },
    },
  };
  return doc;
}

/** The Responses API (config responses.enabled): listed only when it is served. */
function responsesPaths(secured: { security: { bearer: never[] }[] }) {
  const id = { name: "id", in: "path", required: true, schema: { type: "string" }, description: "resp_…" };
  const notStored = "not_found (no such response, or not this key's: deleted, expired, another owner's; also previous_response_id on create)";
  const withNotFound = (r: Record<string, unknown>) => ({ ...r, "404": { ...(r["404"] as Record<string, unknown>), description: notStored } });
  /** The one 400 an operation that reads no body answers. */
  const with400 = (r: Record<string, unknown>, why: string) => ({ ...r, "400": { ...(r["400"] as Record<string, unknown>), description: `invalid_request_error (${why})` } });
  return {
    "/v1/responses": {
      post: {
        operationId: "createResponse",
        summary: "Create a response (OpenAI's Responses API on the chat aliases), in one piece or streamed (server-sent events)",
        description:
          "Translated to a chat completion upstream. background, hosted tools, input_file parts, prompt and conversation are refused with 400 naming them. " +
          "With store (the default) the response is kept responses.retentionDays for retrieve and previous_response_id.",
        ...secured,
        requestBody: { required: true, content: jsonContent("ResponsesRequest") },
        responses: {
          "200": {
            description: "The Response (JSON), or with stream=true a text/event-stream of Responses events (`event: <type>` and `data: <json>`, each with a sequence_number)",
            headers: headers(["x-request-id", ...RATE], ["cache-control", "x-accel-buffering"]),
            content: { ...jsonContent("Response"), "text/event-stream": { schema: { type: "string" } } },
          },
          ...withNotFound(errors(400, 401, 403, 404, 429, 500, 503)),
        },
      },
    },
    "/v1/responses/{id}": {
      get: {
        operationId: "getResponse",
        summary: "A stored response (its owner only)",
        ...secured,
        parameters: [
          id,
          {
            name: "stream",
            in: "query",
            schema: { type: "boolean" },
            description: "true is 400: OpenAI streams only background responses, which this gateway does not run",
          },
        ],
        responses: { "200": admitted("The stored Response", jsonContent("Response")), ...withNotFound(errors(400, 401, 403, 404, 429, 500, 503)) },
      },
      delete: {
        operationId: "deleteResponse",
        summary: "Delete a stored response (its owner only)",
        ...secured,
        parameters: [id],
        responses: { "200": admitted("Deleted", jsonContent("ResponseDeleted")), ...withNotFound(errors(401, 403, 404, 429, 500, 503)) },
      },
    },
    "/v1/responses/input_tokens": {
      post: {
        operationId: "countResponseInputTokens",
        summary: "The input tokens a Responses request would have: the gateway's estimate (no tokenizer), nothing generated",
        description:
          "The request is validated and translated as POST /v1/responses does it (previous_response_id and item references included), with the fields of the SDK's InputTokenCountParams only. " +
          "Rate limited as every request with a key; not charged to the quota.",
        ...secured,
        requestBody: { required: true, content: jsonContent("ResponsesInputTokensRequest") },
        responses: { "200": admitted("The estimate", jsonContent("ResponseInputTokens")), ...withNotFound(errors(400, 401, 403, 404, 429, 500, 503)) },
      },
    },
    "/v1/responses/compact": {
      post: {
        operationId: "compactResponse",
        summary: "Not supported: always 400 after the key check",
        description:
          "OpenAI's compaction returns an encrypted item only OpenAI's models can read; the models here are served through chat completions. The body is not read.",
        ...secured,
        responses: with400(errors(400, 401, 403, 429, 500, 503), "always: compaction is not supported"),
      },
    },
    "/v1/responses/{id}/cancel": {
      post: {
        operationId: "cancelResponse",
        summary: "Cancel a background response: none runs here, so a stored response of the caller's is 400 (OpenAI's answer for one not created in background)",
        description: "Any body is ignored.",
        ...secured,
        parameters: [id],
        responses: with400(withNotFound(errors(400, 401, 403, 404, 429, 500, 503)), "a stored response of the caller's: none was created in background"),
      },
    },
    "/v1/responses/{id}/input_items": {
      get: {
        operationId: "listResponseInputItems",
        summary: "The input items of a stored response, cursor-paged",
        ...secured,
        parameters: [
          id,
          { name: "order", in: "query", schema: { type: "string", enum: ["asc", "desc"], default: "desc" } },
          { name: "limit", in: "query", schema: { type: "integer", minimum: 1, maximum: 100, default: 20 } },
          { name: "after", in: "query", schema: { type: "string" }, description: "an item id: the page after it" },
          { name: "before", in: "query", schema: { type: "string" }, description: "an item id: the page before it" },
        ],
        responses: { "200": admitted("A page of input items", jsonContent("ResponseItemList")), ...withNotFound(errors(400, 401, 403, 404, 429, 500, 503)) },
      },
    },
  };
}
