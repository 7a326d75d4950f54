import { type Static, type TObject, type TSchema, Type as T } from "@sinclair/typebox";
import { TypeCompiler } from "@sinclair/typebox/compiler";
import { type ValueError, ValueErrorType } from "@sinclair/typebox/errors";
import { Value } from "@sinclair/typebox/value";
import { AppError } from "../lib/errors.ts";
import { isRecord } from "../lib/guards.ts";
import { JSON_DEPTH_LIMIT, JsonValue } from "../lib/json-value.ts";

/**
 * Request bodies of spec 4.1 and 4.2, compiled once.
 *
 * "Unknown parameter" (spec 7) means a field outside the common
 * chat-completions format; every field of the official `openai` SDK's
 * ChatCompletionCreateParams (7.x) is known and passes through to the upstream
 * unchanged, plus three vLLM sampling extras that LangChain's `modelKwargs`
 * and the Vercel AI SDK's provider options commonly carry (top_k, min_p,
 * repetition_penalty). Fields the gateway acts on are typed precisely; the
 * rest get a type check only (ranges are the upstream's to enforce, and its
 * 4xx comes back as our 400 with its message). Every nested object is closed
 * too, to the fields the SDK's types declare: only the JSON Schemas a client
 * supplies (tool parameters, response_format's schema) are free-form.
 *
 * Messages and content parts are tagged unions (by `role`, by `type`). TypeBox
 * reports a failed union as one "Expected union value" at the union's path,
 * so we dispatch on the tag ourselves and validate each variant with its own
 * compiled check: `param` then names the exact field (`messages[2].tool_call_id`).
 */

const Nullable = <S extends TSchema>(s: S) => T.Union([s, T.Null()]);
/** Free-form JSON (client-supplied JSON Schemas): any value, nested at most JSON_DEPTH_LIMIT levels (lib/json-value.ts). */
const Loose = JsonValue;
const Strict = { additionalProperties: false } as const;

// ---------------------------------------------------------------------------
// Content parts
// ---------------------------------------------------------------------------

/** The SDK's explicit prompt-cache marker on a content part. */
const PromptCacheBreakpoint = T.Object({ mode: T.Literal("explicit"), ttl: T.Optional(T.String()) }, Strict);
const TextPart = T.Object({ type: T.Literal("text"), text: T.String(), prompt_cache_breakpoint: T.Optional(PromptCacheBreakpoint) }, Strict);
const RefusalPart = T.Object({ type: T.Literal("refusal"), refusal: T.String() }, Strict);
const ImagePart = T.Object(
  {
    type: T.Literal("image_url"),
    image_url: T.Object(
      {
        // A URL the upstream fetches (checked against private addresses, see image-url.ts), or the image inline as a data URL.
        url: T.String({ pattern: "^(https?://|data:image/)" }),
        detail: T.Optional(T.Union([T.Literal("auto"), T.Literal("low"), T.Literal("high"), T.Literal("original")])),
      },
      Strict,
    ),
    prompt_cache_breakpoint: T.Optional(PromptCacheBreakpoint),
  },
  Strict,
);

/** A content field before its parts are dispatched: a string, or a non-empty array of tagged objects (OpenAI refuses `[]`, in every role). */
const Parts = T.Array(T.Object({ type: T.String() }), { minItems: 1 });
const ContentOf = (nullable: boolean) => (nullable ? T.Union([T.String(), T.Null(), Parts]) : T.Union([T.String(), Parts]));

// ---------------------------------------------------------------------------
// Messages (spec 4.1: roles system, user, assistant, tool)
// ---------------------------------------------------------------------------

const FunctionCall = T.Object({ name: T.String(), arguments: T.String() }, Strict);
const ToolCall = T.Object({ id: T.String(), type: T.Literal("function"), function: FunctionCall }, Strict);
/** A citation in a previous reply (the SDK's ChatCompletionMessage.annotations), echoed back by clients. */
const Annotation = T.Object(
  {
    type: T.String(),
    url_citation: T.Optional(
      T.Object({ start_index: T.Integer(), end_index: T.Integer(), title: T.String(), url: T.String() }, Strict),
    ),
  },
  Strict,
);

const SystemMessage = T.Object({ role: T.Literal("system"), content: ContentOf(false), name: T.Optional(T.String()) }, Strict);
const UserMessage = T.Object({ role: T.Literal("user"), content: ContentOf(false), name: T.Optional(T.String()) }, Strict);
const AssistantMessage = T.Object(
  {
    role: T.Literal("assistant"),
    // null (or absent) when the turn is only tool calls: the tool round trip.
    content: T.Optional(ContentOf(true)),
    name: T.Optional(T.String()),
    tool_calls: T.Optional(T.Array(ToolCall)),
    // What a client echoes back when it appends the previous reply as-is
    // (`messages.push(completion.choices[0].message)`): the SDK's message type
    // and vLLM's reasoning fields.
    refusal: T.Optional(Nullable(T.String())),
    annotations: T.Optional(Nullable(T.Array(Annotation))),
    audio: T.Optional(Nullable(T.Object({ id: T.String() }, Strict))),
    function_call: T.Optional(Nullable(FunctionCall)),
    reasoning_content: T.Optional(Nullable(T.String())),
    reasoning: T.Optional(Nullable(T.String())),
  },
  Strict,
);
const ToolMessage = T.Object(
  { role: T.Literal("tool"), content: ContentOf(false), tool_call_id: T.String(), name: T.Optional(T.String()) },
  Strict,
);

export type SystemMessage = Static<typeof SystemMessage>;
export type UserMessage = Static<typeof UserMessage>;
export type AssistantMessage = Static<typeof AssistantMessage>;
export type ToolMessage = Static<typeof ToolMessage>;
export type ChatMessage = SystemMessage | UserMessage | AssistantMessage | ToolMessage;

// ---------------------------------------------------------------------------
// Chat completion body
// ---------------------------------------------------------------------------

const FunctionTool = T.Object(
  {
    type: T.Literal("function"),
    function: T.Object(
      {
        name: T.String({ minLength: 1 }),
        description: T.Optional(T.String()),
        // Arbitrary JSON Schema ($schema, additionalProperties, $defs, …): never validated inside.
        parameters: T.Optional(T.Record(T.String(), Loose)),
        strict: T.Optional(Nullable(T.Boolean())),
      },
      Strict,
    ),
  },
  Strict,
);

const ToolChoice = T.Union([
  T.Literal("auto"),
  T.Literal("none"),
  T.Literal("required"),
  T.Object({ type: T.Literal("function"), function: T.Object({ name: T.String({ minLength: 1 }) }, Strict) }, Strict),
]);

const ResponseFormat = T.Union([
  T.Object({ type: T.Literal("text") }, Strict),
  T.Object({ type: T.Literal("json_object") }, Strict),
  T.Object(
    {
      type: T.Literal("json_schema"),
      json_schema: T.Object(
        {
          name: T.String({ minLength: 1 }),
          description: T.Optional(T.String()),
          schema: T.Optional(T.Record(T.String(), Loose)),
          strict: T.Optional(Nullable(T.Boolean())),
        },
        Strict,
      ),
    },
    Strict,
  ),
]);

/**
 * Whole numbers that are forwarded: at most 2^53 − 1. Beyond it JSON.parse
 * rounds (9007199254740993 reads as …992), and from 1e21 JSON.stringify
 * writes `1e+21`, a float to the upstream's Python; inside it every integer
 * goes out as digits, whatever its spelling (1.0, 1e2).
 */
const MAX_WHOLE = Number.MAX_SAFE_INTEGER;
const PositiveInt = T.Integer({ minimum: 1, maximum: MAX_WHOLE });

/*
 * Nested objects of the SDK's ChatCompletionCreateParams, each closed like the
 * top level: an unknown field inside one is refused by its path
 * (`stream_options.evil_param`), not forwarded. Enumerations the gateway does
 * not act on are plain strings (the upstream judges the value).
 */
const StreamOptions = T.Object(
  { include_usage: T.Optional(Nullable(T.Boolean())), include_obfuscation: T.Optional(Nullable(T.Boolean())) },
  Strict,
);
const Prediction = T.Object({ type: T.Literal("content"), content: T.Union([T.String(), T.Array(TextPart)]) }, Strict);
const AudioParam = T.Object({ format: T.String(), voice: T.Union([T.String(), T.Object({ id: T.String() }, Strict)]) }, Strict);
const LegacyFunction = T.Object(
  { name: T.String({ minLength: 1 }), description: T.Optional(T.String()), parameters: T.Optional(T.Record(T.String(), Loose)) },
  Strict,
);
const LegacyFunctionCall = T.Union([T.Literal("none"), T.Literal("auto"), T.Object({ name: T.String({ minLength: 1 }) }, Strict)]);
const ModerationMode = T.Object({ mode: T.String() }, Strict);
/** OpenAI's moderated completions; the Responses API takes the same object and forwards it here. */
export const Moderation = T.Object(
  {
    model: T.String(),
    policy: T.Optional(Nullable(T.Object({ input: T.Optional(Nullable(ModerationMode)), output: T.Optional(Nullable(ModerationMode)) }, Strict))),
  },
  Strict,
);
const PromptCacheOptions = T.Object({ mode: T.Optional(T.String()), ttl: T.Optional(T.String()) }, Strict);
const WebSearchOptions = T.Object(
  {
    search_context_size: T.Optional(T.String()),
    user_location: T.Optional(
      Nullable(
        T.Object(
          {
            type: T.Literal("approximate"),
            approximate: T.Object(
              { city: T.Optional(T.String()), country: T.Optional(T.String()), region: T.Optional(T.String()), timezone: T.Optional(T.String()) },
              Strict,
            ),
          },
          Strict,
        ),
      ),
    ),
  },
  Strict,
);

/**
 * OpenAI's request metadata, on chat and the Responses API: 16 pairs, values
 * of at most 512 characters, keys of at most 64 (checkMetadataKeys: TypeBox
 * does not check a Record's key schema).
 */
export const Metadata = T.Record(T.String({ maxLength: 64 }), T.String({ maxLength: 512 }), { maxProperties: 16 });

/** The 64-character bound on metadata keys that the Metadata schema states but does not check. */
export function checkMetadataKeys(metadata: unknown): void {
  if (!isRecord(metadata)) return;
  for (const k in metadata) if (k.length > 64) throw invalid("metadata", "Invalid 'metadata': keys are at most 64 characters.");
}

const ChatBody = T.Object(
  {
    model: T.String({ minLength: 1 }),
    // Each item is dispatched by role afterwards (see checkMessage).
    messages: T.Array(T.Object({ role: T.String() }), { minItems: 1 }),
    stream: T.Optional(Nullable(T.Boolean())),
    stream_options: T.Optional(Nullable(StreamOptions)),
    temperature: T.Optional(Nullable(T.Number({ minimum: 0, maximum: 2 }))),
    max_tokens: T.Optional(Nullable(PositiveInt)),
    max_completion_tokens: T.Optional(Nullable(PositiveInt)),
    tools: T.Optional(T.Array(FunctionTool)),
    tool_choice: T.Optional(ToolChoice),
    parallel_tool_calls: T.Optional(Nullable(T.Boolean())),
    response_format: T.Optional(ResponseFormat),
    // Standard parameters, forwarded unchanged.
    // OpenAI's bounds (as on the Responses API): vLLM refuses outside them too, but in its words and with no `param`.
    top_p: T.Optional(Nullable(T.Number({ minimum: 0, maximum: 1 }))),
    // OpenAI's maximum: each choice is reserved against the quota, so n must stay a small multiplier.
    n: T.Optional(Nullable(T.Integer({ minimum: 1, maximum: 128 }))),
    // OpenAI's bound: vLLM takes any number and searches the new text for each at every token.
    stop: T.Optional(Nullable(T.Union([T.String(), T.Array(T.String(), { maxItems: 4 })]))),
    presence_penalty: T.Optional(Nullable(T.Number({ minimum: -2, maximum: 2 }))),
    frequency_penalty: T.Optional(Nullable(T.Number({ minimum: -2, maximum: 2 }))),
    // Token ids (checked in checkBounds: a Record's key schema is not) to -100..100, as OpenAI takes them.
    logit_bias: T.Optional(Nullable(T.Record(T.String(), T.Number({ minimum: -100, maximum: 100 })))),
    logprobs: T.Optional(Nullable(T.Boolean())),
    top_logprobs: T.Optional(Nullable(T.Integer({ minimum: 0, maximum: 20 }))),
    // Beyond 2^53 JSON.parse rounds: the upstream would get a different seed than the one sent.
    seed: T.Optional(Nullable(T.Integer({ minimum: -MAX_WHOLE, maximum: MAX_WHOLE }))),
    user: T.Optional(T.String()),
    reasoning_effort: T.Optional(Nullable(T.String())),
    metadata: T.Optional(Nullable(Metadata)),
    store: T.Optional(Nullable(T.Boolean())),
    modalities: T.Optional(Nullable(T.Array(T.String()))),
    service_tier: T.Optional(Nullable(T.String())),
    prediction: T.Optional(Nullable(Prediction)),
    audio: T.Optional(Nullable(AudioParam)),
    function_call: T.Optional(LegacyFunctionCall),
    functions: T.Optional(T.Array(LegacyFunction)),
    moderation: T.Optional(Nullable(Moderation)),
    prompt_cache_key: T.Optional(Nullable(T.String())),
    prompt_cache_options: T.Optional(PromptCacheOptions),
    prompt_cache_retention: T.Optional(Nullable(T.String())),
    safety_identifier: T.Optional(Nullable(T.String())),
    verbosity: T.Optional(Nullable(T.String())),
    web_search_options: T.Optional(WebSearchOptions),
    // vLLM sampling extras.
    // vLLM's: -1 (or 0) for no limit, else how many; an integer it reads as sent.
    top_k: T.Optional(Nullable(T.Integer({ minimum: -1, maximum: MAX_WHOLE }))),
    min_p: T.Optional(Nullable(T.Number())),
    repetition_penalty: T.Optional(Nullable(T.Number())),
  },
  Strict,
);

export type ChatBody = Omit<Static<typeof ChatBody>, "messages"> & { messages: ChatMessage[] };

// ---------------------------------------------------------------------------
// Embeddings body (spec 4.2)
// ---------------------------------------------------------------------------

/** Inputs one embeddings request may carry (OpenAI's bound). */
const MAX_EMBEDDING_INPUTS = 2048;
const TokenArray = T.Array(T.Integer({ minimum: 0, maximum: MAX_WHOLE }), { minItems: 1 });
const EmbeddingsBody = T.Object(
  {
    model: T.String({ minLength: 1 }),
    // LangChain and the Vercel AI SDK send arrays; token arrays are part of the format too.
    input: T.Union([
      T.String(),
      T.Array(T.String(), { minItems: 1, maxItems: MAX_EMBEDDING_INPUTS }),
      TokenArray,
      T.Array(TokenArray, { minItems: 1, maxItems: MAX_EMBEDDING_INPUTS }),
    ]),
    encoding_format: T.Optional(T.Union([T.Literal("float"), T.Literal("base64")])),
    dimensions: T.Optional(PositiveInt),
    user: T.Optional(T.String()),
  },
  Strict,
);

export type EmbeddingsBody = Static<typeof EmbeddingsBody>;

// ---------------------------------------------------------------------------
// Documentation (OpenAPI): the same bodies with messages and parts spelled out
// ---------------------------------------------------------------------------

const docContent = (parts: TSchema[], nullable: boolean) =>
  T.Union([T.String(), ...(nullable ? [T.Null()] : []), T.Array(parts.length === 1 ? (parts[0] as TSchema) : T.Union(parts), { minItems: 1 })]);

/** Spec 4.1 as clients see it; validation dispatches on `role` and `type` instead (see above) for precise `param`s. */
export const ChatBodySchema = T.Object(
  {
    ...ChatBody.properties,
    messages: T.Array(
      T.Union([
        T.Object({ ...SystemMessage.properties, content: docContent([TextPart], false) }, Strict),
        T.Object({ ...UserMessage.properties, content: docContent([TextPart, ImagePart], false) }, Strict),
        T.Object({ ...AssistantMessage.properties, content: T.Optional(docContent([TextPart, RefusalPart], true)) }, Strict),
        T.Object({ ...ToolMessage.properties, content: docContent([TextPart], false) }, Strict),
      ]),
      { minItems: 1, description: "The conversation in order; image parts only for aliases with the images capability" },
    ),
  },
  { ...Strict, description: "Unknown fields are refused at any depth (400 with param = the field's path, e.g. stream_options.evil_param); tool parameters and response_format schemas are free-form JSON Schema" },
);

/** Spec 4.2. */
export const EmbeddingsBodySchema = EmbeddingsBody;

// ---------------------------------------------------------------------------
// Compiled checks and error reporting
// ---------------------------------------------------------------------------

/** What `firstError` needs of a check: a TypeBox TypeCheck, or a closedCheck. */
export interface Checker {
  Check(value: unknown): boolean;
  Errors(value: unknown): Iterable<ValueError>;
}

/**
 * A closed object schema's check, for what every chat request sends (its body
 * and each message). TypeBox compiles `additionalProperties: false` into a list
 * of the value's keys, a closure, and for each key a new list of the known
 * ones: ~2 + n cells a check, ~9 of a one-message request's ~300. Here the
 * schema is compiled without it at its top level and the keys are looked up in
 * a Set: the same JSON values pass (a JSON object's keys are all its own and
 * enumerable, which is what `for…in` sees; test/unit/hot-path-oracles.test.ts
 * holds it to the strict check). A value that fails is described by the closed
 * schema's own errors, so what a refused request is told is unchanged.
 */
export function closedCheck(schema: TObject): Checker {
  const { additionalProperties: _, ...open } = schema;
  const strict = TypeCompiler.Compile(schema);
  const lenient = TypeCompiler.Compile(open as TObject);
  const known = new Set(Object.keys(schema.properties));
  return {
    Check: (value) => isRecord(value) && onlyKnownKeys(value, known) && lenient.Check(value),
    Errors: (value) => strict.Errors(value),
  };
}

function onlyKnownKeys(value: Record<string, unknown>, known: ReadonlySet<string>): boolean {
  for (const k in value) if (!known.has(k)) return false;
  return true;
}

const chatCheck = closedCheck(ChatBody);
/** The closed schemas checked by closedCheck, for the test that holds it to TypeBox's own strict check. */
export const CLOSED_SCHEMAS = { ChatBody, SystemMessage, UserMessage, AssistantMessage, ToolMessage } as const;
const embeddingsCheck = TypeCompiler.Compile(EmbeddingsBody);
const CHAT_KEYS = new Set(Object.keys(ChatBody.properties));
const EMBEDDINGS_KEYS = new Set(Object.keys(EmbeddingsBody.properties));

/** By role. A Map, not an object: a role named like an Object.prototype member ("toString") must find nothing. */
const messageChecks = new Map<string, Checker>([
  ["system", closedCheck(SystemMessage)],
  ["user", closedCheck(UserMessage)],
  ["assistant", closedCheck(AssistantMessage)],
  ["tool", closedCheck(ToolMessage)],
]);

const partChecks = {
  text: TypeCompiler.Compile(TextPart),
  refusal: TypeCompiler.Compile(RefusalPart),
  image_url: TypeCompiler.Compile(ImagePart),
};
type PartType = keyof typeof partChecks;

/** Part types each role may send (the common format; images only from the user). */
const PARTS_BY_ROLE: Record<string, readonly PartType[]> = {
  system: ["text"],
  user: ["text", "image_url"],
  assistant: ["text", "refusal"],
  tool: ["text"],
};

/** JSON pointer `/messages/0/content` → `messages[0].content`, the form OpenAI uses in `param`. */
export function paramOf(pointer: string): string {
  let out = "";
  for (const raw of pointer.split("/").slice(1)) {
    const seg = raw.replaceAll("~1", "/").replaceAll("~0", "~");
    out += /^\d+$/.test(seg) ? `[${seg}]` : out === "" ? seg : `.${seg}`;
  }
  return out;
}

function invalid(param: string | null, message: string): AppError {
  return new AppError("invalid_request_error", message, param);
}

function describe(e: ValueError, param: string): AppError {
  switch (e.type) {
    case ValueErrorType.ObjectAdditionalProperties:
      return invalid(param, `Unrecognized request argument supplied: ${param}`);
    case ValueErrorType.ObjectRequiredProperty:
      return invalid(param, `Missing required parameter: '${param}'.`);
    case ValueErrorType.Union:
      return invalid(param, `Invalid value for '${param}': not one of the accepted types or values.`);
    case ValueErrorType.ArrayMinItems:
      // OpenAI's wording for an empty `messages` or content array.
      if (Array.isArray(e.value) && e.value.length === 0) {
        const min = (e.schema as { minItems?: number }).minItems ?? 1;
        return invalid(param, `Invalid '${param}': empty array. Expected an array with minimum length ${min}, but got an empty array instead.`);
      }
      break;
    case ValueErrorType.Kind:
      // JsonValue (lib/json-value.ts) is the only custom kind: free-form JSON nested too deep.
      return invalid(param, `Invalid value for '${param}': arrays and objects nested more than ${JSON_DEPTH_LIMIT} levels deep.`);
  }
  return invalid(param, `Invalid value for '${param}': ${e.message.charAt(0).toLowerCase()}${e.message.slice(1)}.`);
}

/** The JS kind of a value in JSON Schema terms, to match it against union variants. */
function kindOf(v: unknown): string {
  if (v === null) return "null";
  if (Array.isArray(v)) return "array";
  if (typeof v === "number") return Number.isInteger(v) ? "integer" : "number";
  return typeof v;
}

function accepts(schema: TSchema, kind: string): boolean {
  const t = (schema as { type?: unknown }).type;
  if (t === undefined) return true;
  return t === kind || (t === "number" && kind === "integer");
}

/**
 * The variant of a failed union the value was evidently meant as: the only
 * one of its JSON kind, or, for tagged objects, the one whose `type` literal
 * matches. Undefined when that is ambiguous.
 */
function intendedVariant(e: ValueError): TSchema | undefined {
  const variants = (e.schema as { anyOf?: TSchema[] }).anyOf ?? [];
  const kind = kindOf(e.value);
  let candidates = variants.filter((v) => accepts(v, kind) && !("const" in v));
  if (candidates.length > 1 && kind === "object") {
    const tag = (e.value as Record<string, unknown>).type;
    candidates = candidates.filter((v) => (v as { properties?: Record<string, { const?: unknown }> }).properties?.type?.const === tag);
  }
  return candidates.length === 1 ? candidates[0] : undefined;
}

/**
 * How many of a value's errors are looked through for a wrong tag. TypeBox
 * describes each error it lists (message, path: ~2 µs), and a body at the
 * limit can hold millions (`[{},{},…]`): listing them all held the request
 * thread for 12 s. A real client's mistakes are a handful.
 */
const ERRORS_SCANNED = 256;

/**
 * The most useful of a value's errors: a wrong tag (`type`) before the fields
 * that tag would require (among the first ERRORS_SCANNED), and inside a union
 * the error of the intended variant rather than "Expected union value", so
 * `param` points at the field.
 */
function bestError(errors: Iterable<ValueError>): ValueError | undefined {
  let first: ValueError | undefined;
  let scanned = 0;
  for (const e of errors) {
    first ??= e;
    if (e.type === ValueErrorType.Literal && e.path.endsWith("/type")) return e;
    if (++scanned === ERRORS_SCANNED) break;
  }
  if (first?.type === ValueErrorType.Union) {
    const variant = intendedVariant(first);
    if (variant) {
      const inner = bestError(Value.Errors(variant, first.value));
      if (inner) return { ...inner, path: first.path + inner.path };
    }
  }
  return first;
}

/** The first error of `value` against a compiled check, as a 400 whose `param` is the field's path under `prefix` (a JSON pointer). */
export function firstError(check: Checker, value: unknown, prefix: string): AppError | undefined {
  // Valid bodies (the hot path) pay for one compiled check only.
  if (check.Check(value)) return undefined;
  const e = bestError(check.Errors(value));
  return e ? describe(e, paramOf(prefix + e.path)) : undefined;
}

function requireObject(body: unknown): Record<string, unknown> {
  if (!isRecord(body)) throw invalid(null, "The request body must be a JSON object.");
  return body;
}

/** Unknown top-level fields first, with OpenAI's wording, so the message names the field plainly. */
function rejectUnknown(body: Record<string, unknown>, known: ReadonlySet<string>): void {
  for (const k in body) if (!known.has(k)) throw invalid(k, `Unrecognized request argument supplied: ${k}`);
}

function checkMessage(m: { role: string }, i: number): void {
  const check = messageChecks.get(m.role);
  if (!check) throw invalid(`messages[${i}].role`, `Invalid value for 'messages[${i}].role': expected one of system, user, assistant, tool.`);
  const err = firstError(check, m, `/messages/${i}`);
  if (err) throw err;
  const content = (m as { content?: unknown }).content;
  if (!Array.isArray(content)) return;
  const allowed = PARTS_BY_ROLE[m.role] ?? [];
  for (const [j, part] of content.entries()) {
    const type = (part as { type: string }).type as PartType;
    const at = `messages[${i}].content[${j}]`;
    if (!allowed.includes(type)) {
      throw invalid(`${at}.type`, `Invalid value for '${at}.type': a ${m.role} message takes ${allowed.join(" or ")} parts.`);
    }
    const partErr = firstError(partChecks[type], part, `/messages/${i}/content/${j}`);
    if (partErr) throw partErr;
  }
}

const NO_TOOLS: readonly never[] = [];

/** OpenAI's function names: letters, digits, underscores and dashes, 1 to 64. */
const FUNCTION_NAME = /^[A-Za-z0-9_-]{1,64}$/;

/**
 * OpenAI's rules for tools that the schema cannot say: each function name is
 * FUNCTION_NAME; a tool_choice that requires a tool ("required", or one by
 * name) needs tools, and a named one must be among them. vLLM leaves names to
 * the chat template and words its own refusal of the rest, so the gateway
 * answers these itself, as OpenAI does. "auto" and "none" without tools pass.
 */
function checkTools(body: Static<typeof ChatBody>): void {
  const tools = body.tools ?? NO_TOOLS;
  for (let i = 0; i < tools.length; i++) {
    const t = tools[i] as (typeof tools)[number];
    if (!FUNCTION_NAME.test(t.function.name)) {
      const param = `tools[${i}].function.name`;
      throw new AppError("invalid_request_error", `Invalid '${param}': a function name is 1 to 64 letters, digits, underscores or dashes.`, param);
    }
  }
  const choice = body.tool_choice;
  if (choice !== "required" && typeof choice !== "object") return;
  if (tools.length === 0) throw new AppError("invalid_request_error", "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.", "tool_choice");
  if (typeof choice === "object" && !tools.some((t) => t.function.name === choice.function.name)) {
    const param = "tool_choice.function.name";
    throw new AppError("invalid_request_error", `Invalid '${param}': no function named '${choice.function.name}' is among 'tools'.`, param);
  }
}

/** A message as far as the tool-answer rule reads it (chat's, or the Responses API's translation). */
type ToolTurn = { role: string; tool_calls?: unknown; tool_call_id?: unknown };

/** Where OpenAI's tool-answer rule breaks: a tool message after no tool calls (`orphan`), or answering none of them (`unknown_id`). */
export interface ToolAnswerProblem {
  index: number;
  kind: "orphan" | "unknown_id";
}

/**
 * Up to this many calls in an assistant message, a tool message's id is found
 * by a scan (no allocation: the common case); beyond it, in a Set of the
 * calls' ids built once for that message, so a request of many calls and many
 * answers is linear, not calls × answers.
 */
const CALL_SCAN_MAX = 16;

function callIds(calls: readonly unknown[]): Set<unknown> {
  const ids = new Set<unknown>();
  for (const c of calls) if (isRecord(c)) ids.add(c.id);
  return ids;
}

/**
 * OpenAI's rule for tool messages: each answers a call of the assistant
 * message just before it, with only other tool messages between (parallel
 * calls are answered in any order). One pass over the messages, linear in
 * their calls and answers; the calls in force are the last assistant
 * message's, so nothing is allocated unless the rule breaks or that message
 * has more than CALL_SCAN_MAX calls. Whether every call is answered is not
 * checked.
 */
export function toolAnswerProblem(messages: readonly ToolTurn[]): ToolAnswerProblem | undefined {
  let calls: readonly unknown[] | undefined;
  let ids: Set<unknown> | undefined;
  for (let i = 0; i < messages.length; i++) {
    const m = messages[i] as ToolTurn;
    if (m.role !== "tool") {
      calls = m.role === "assistant" && Array.isArray(m.tool_calls) && m.tool_calls.length > 0 ? m.tool_calls : undefined;
      ids = undefined;
      continue;
    }
    if (calls === undefined) return { index: i, kind: "orphan" };
    if (calls.length > CALL_SCAN_MAX) {
      ids ??= callIds(calls);
      if (!ids.has(m.tool_call_id)) return { index: i, kind: "unknown_id" };
      continue;
    }
    let found = false;
    for (const c of calls) {
      if (isRecord(c) && c.id === m.tool_call_id) {
        found = true;
        break;
      }
    }
    if (!found) return { index: i, kind: "unknown_id" };
  }
  return undefined;
}

function checkToolAnswers(messages: readonly ChatMessage[]): void {
  const bad = toolAnswerProblem(messages);
  if (!bad) return;
  if (bad.kind === "orphan") {
    throw invalid(`messages[${bad.index}].role`, "Invalid parameter: messages with role 'tool' must be a response to a preceding message with 'tool_calls'.");
  }
  const id = String((messages[bad.index] as ToolMessage).tool_call_id).slice(0, 128);
  throw invalid(`messages[${bad.index}].tool_call_id`, `Invalid parameter: 'tool_call_id' of '${id}' not found in 'tool_calls' of previous message.`);
}

const TOKEN_ID = /^\d{1,10}$/;

/**
 * What the schema cannot say: logit_bias keys are token ids, metadata keys at
 * most 64 characters, stream_options only with stream, and a json_schema's
 * name is FUNCTION_NAME (OpenAI's rule for both).
 */
function checkBounds(body: Static<typeof ChatBody>): void {
  const format = body.response_format;
  if (format?.type === "json_schema" && !FUNCTION_NAME.test(format.json_schema.name)) {
    const param = "response_format.json_schema.name";
    throw invalid(param, `Invalid '${param}': a name is 1 to 64 letters, digits, underscores or dashes.`);
  }
  if (body.logit_bias) {
    for (const k in body.logit_bias) {
      if (!TOKEN_ID.test(k)) throw invalid("logit_bias", `Invalid 'logit_bias': keys are token ids (whole numbers), not '${k.slice(0, 40)}'.`);
    }
  }
  checkMetadataKeys(body.metadata);
  if (body.stream_options != null && body.stream !== true) {
    throw invalid("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.");
  }
}

/** Validates a chat completion body or throws AppError("invalid_request_error") with `param`. */
export function parseChatBody(raw: unknown): ChatBody {
  const body = requireObject(raw);
  rejectUnknown(body, CHAT_KEYS);
  const err = firstError(chatCheck, body, "");
  if (err) throw err;
  const value = body as Static<typeof ChatBody>;
  const messages = value.messages;
  for (let i = 0; i < messages.length; i++) checkMessage(messages[i] as { role: string }, i);
  checkToolAnswers(value.messages as ChatMessage[]);
  checkTools(value);
  checkBounds(value);
  return value as ChatBody;
}

const TOKEN_ID_RULE = `token ids are whole numbers from 0 to ${MAX_WHOLE}`;
const INPUT_FORMS = "a string, a list of strings, a list of token ids, or a list of token-id lists";
const isTokenId = (v: unknown) => typeof v === "number" && Number.isSafeInteger(v) && v >= 0;

/** Why an embeddings `input` that matched none of its forms is wrong, with the element's path: the union's own error says only that. */
function inputProblem(input: unknown): AppError {
  const wrong = (param: string, what: string) => invalid(param, `Invalid value for '${param}': ${what}.`);
  if (!Array.isArray(input)) return wrong("input", `expected ${INPUT_FORMS}`);
  if (input.length === 0) return wrong("input", "an empty list; send at least one input");
  if (input.length > MAX_EMBEDDING_INPUTS) return wrong("input", `at most ${MAX_EMBEDDING_INPUTS} inputs in one request, not ${input.length}`);
  if (input.every((v) => typeof v === "string")) return wrong("input", `expected ${INPUT_FORMS}`);
  if (input.every((v) => typeof v === "number")) {
    const i = input.findIndex((v) => !isTokenId(v));
    if (i >= 0) return wrong(`input[${i}]`, TOKEN_ID_RULE);
  }
  if (input.every(Array.isArray)) {
    for (const [i, list] of (input as unknown[][]).entries()) {
      if (list.length === 0) return wrong(`input[${i}]`, "an empty token list");
      const j = list.findIndex((v) => !isTokenId(v));
      if (j >= 0) return wrong(`input[${i}][${j}]`, TOKEN_ID_RULE);
    }
  }
  return wrong("input", `expected ${INPUT_FORMS}, not a mix`);
}

/** Validates an embeddings body or throws AppError("invalid_request_error") with `param`. */
export function parseEmbeddingsBody(raw: unknown): EmbeddingsBody {
  const body = requireObject(raw);
  rejectUnknown(body, EMBEDDINGS_KEYS);
  const err = firstError(embeddingsCheck, body, "");
  if (err) throw err.param === "input" && body.input !== undefined ? inputProblem(body.input) : err;
  return body as EmbeddingsBody;
}

/** Where the first image part is (`messages[1].content[0]`), for the alias's `images` capability; undefined if none. */
export function firstImage(messages: readonly ChatMessage[]): string | undefined {
  for (let i = 0; i < messages.length; i++) {
    const m = messages[i] as ChatMessage;
    const c = m.content;
    if (m.role !== "user" || !Array.isArray(c)) continue;
    for (let j = 0; j < c.length; j++) if ((c[j] as { type: string }).type === "image_url") return `messages[${i}].content[${j}]`;
  }
  return undefined;
}
