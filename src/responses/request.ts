import { type Static, type TSchema, Type as T } from "@sinclair/typebox";
import { TypeCompiler, type TypeCheck } from "@sinclair/typebox/compiler";
import { AppError } from "../lib/errors.ts";
import { checkMetadataKeys, firstError, Metadata, Moderation } from "../inference/model.ts";
import { isRecord } from "../lib/guards.ts";
import { JsonValue } from "../lib/json-value.ts";

/**
 * The body of POST /v1/responses, compiled once. Like chat (spec 7), a field
 * outside the format is refused with 400 and its path in `param`; every field
 * the official `openai` SDK and the OpenAI Agents SDK send is known (some are
 * accepted and ignored: docs/decisions.md says which). Items and content parts
 * are dispatched on `type` (as chat dispatches on `role`) so that `param`
 * names the exact field (`input[2].content[0].text`).
 *
 * What the gateway cannot do is refused by name: `background`, hosted tools
 * (`file_search`, `code_interpreter`, …; web search too unless the operator
 * set `responses.webSearch: "ignore"`, see WebSearchTool), `input_file` parts and `file_id` images
 * (there is no files API), reusable `prompt`s, `conversation`s and access
 * programs other than the standard one.
 */

const Nullable = <S extends TSchema>(s: S) => T.Union([s, T.Null()]);
const Strict = { additionalProperties: false } as const;
/** Free-form JSON: nested at most JSON_DEPTH_LIMIT levels (lib/json-value.ts), as every T.Unknown-like field here. */
const Json = T.Record(T.String(), JsonValue);

// ---------------------------------------------------------------------------
// Content parts
// ---------------------------------------------------------------------------

/** OpenAI's prompt-caching hint on a part: accepted and ignored, like the other prompt_cache_* fields (chat upstreams cache on their own). */
const CacheBreakpoint = T.Optional(Nullable(T.Object({ mode: T.Literal("explicit"), ttl: T.Optional(Nullable(T.String())) }, Strict)));
const InputText = T.Object({ type: T.Literal("input_text"), text: T.String(), prompt_cache_breakpoint: CacheBreakpoint }, Strict);
const InputImage = T.Object(
  {
    type: T.Literal("input_image"),
    // A URL the upstream fetches (checked like chat's image URLs) or a data URL.
    image_url: T.Optional(Nullable(T.String({ pattern: "^(https?://|data:image/)" }))),
    file_id: T.Optional(Nullable(T.String())),
    detail: T.Optional(T.Union([T.Literal("auto"), T.Literal("low"), T.Literal("high"), T.Literal("original")])),
    prompt_cache_breakpoint: CacheBreakpoint,
  },
  Strict,
);
/** What an assistant message echoed back from a previous output carries. */
const OutputText = T.Object(
  { type: T.Literal("output_text"), text: T.String(), annotations: T.Optional(T.Array(JsonValue)), logprobs: T.Optional(Nullable(T.Array(JsonValue))) },
  Strict,
);
const Refusal = T.Object({ type: T.Literal("refusal"), refusal: T.String() }, Strict);

const PART_CHECKS: Record<string, TypeCheck<TSchema>> = {
  input_text: TypeCompiler.Compile(InputText),
  input_image: TypeCompiler.Compile(InputImage),
  output_text: TypeCompiler.Compile(OutputText),
  refusal: TypeCompiler.Compile(Refusal),
};
/** Part types per role: images only from the user; assistants echo output text (or plain input text). */
const PARTS_BY_ROLE: Record<string, readonly string[]> = {
  user: ["input_text", "input_image"],
  system: ["input_text"],
  developer: ["input_text"],
  assistant: ["output_text", "refusal", "input_text"],
};

export type InputTextPart = Static<typeof InputText>;
export type InputImagePart = Static<typeof InputImage>;
export type OutputTextPart = Static<typeof OutputText>;
export type RefusalPart = Static<typeof Refusal>;
export type ContentPart = InputTextPart | InputImagePart | OutputTextPart | RefusalPart;

// ---------------------------------------------------------------------------
// Input items
// ---------------------------------------------------------------------------

const Status = T.Optional(Nullable(T.String()));
const Parts = T.Array(T.Object({ type: T.String() }));

const MessageItem = T.Object(
  {
    type: T.Optional(T.Literal("message")),
    role: T.Union([T.Literal("user"), T.Literal("system"), T.Literal("developer"), T.Literal("assistant")]),
    content: T.Union([T.String(), Parts]),
    // Present when a previous output message is echoed back (the Agents SDK does).
    id: T.Optional(Nullable(T.String())),
    status: Status,
    phase: T.Optional(Nullable(T.String())),
  },
  Strict,
);
const FunctionCallItem = T.Object(
  {
    type: T.Literal("function_call"),
    call_id: T.String({ minLength: 1 }),
    name: T.String({ minLength: 1 }),
    arguments: T.String(),
    id: T.Optional(Nullable(T.String())),
    status: Status,
    namespace: T.Optional(Nullable(T.String())),
    // The Agents SDK's programmatic tool calling echoes who made the call; nothing to forward.
    caller: T.Optional(JsonValue),
    // A call of an asynchronous tool (the SDK's ResponseFunctionToolCall; the tool's own `async` is accepted too): nothing to forward.
    async: T.Optional(Nullable(T.Boolean())),
  },
  Strict,
);
const FunctionCallOutputItem = T.Object(
  {
    type: T.Literal("function_call_output"),
    call_id: T.String({ minLength: 1 }),
    output: T.Union([T.String(), T.Array(InputText)]),
    id: T.Optional(Nullable(T.String())),
    status: Status,
    caller: T.Optional(JsonValue),
    // The tool that produced the output (the SDK's type): the call_id already says which call it answers.
    name: T.Optional(Nullable(T.String())),
    namespace: T.Optional(Nullable(T.String())),
  },
  Strict,
);
/** Reasoning items are accepted and dropped: chat upstreams take no reasoning input. */
const ReasoningItem = T.Object(
  {
    type: T.Literal("reasoning"),
    id: T.Optional(Nullable(T.String())),
    summary: T.Optional(T.Array(JsonValue)),
    content: T.Optional(Nullable(T.Array(JsonValue))),
    encrypted_content: T.Optional(Nullable(T.String())),
    status: Status,
  },
  Strict,
);

/**
 * An item of a stored response named by its id (OpenAI's ItemReference; `type`
 * may be left out). The Vercel AI SDK sends earlier turns' output this way
 * when it stores responses (its default). Resolved before translation
 * (routes.ts): nothing downstream sees a reference.
 */
const ItemReference = T.Object(
  { type: T.Optional(Nullable(T.Literal("item_reference"))), id: T.String({ minLength: 1, maxLength: 128, pattern: "^[A-Za-z0-9_-]+$" }) },
  Strict,
);

/** By item type. A Map, not an object: a type named like an Object.prototype member ("constructor") must find nothing. */
const ITEM_CHECKS = new Map<string, TypeCheck<TSchema>>([
  ["item_reference", TypeCompiler.Compile(ItemReference)],
  ["message", TypeCompiler.Compile(MessageItem)],
  ["function_call", TypeCompiler.Compile(FunctionCallItem)],
  ["function_call_output", TypeCompiler.Compile(FunctionCallOutputItem)],
  ["reasoning", TypeCompiler.Compile(ReasoningItem)],
]);

export type MessageItem = Omit<Static<typeof MessageItem>, "content"> & { content: string | ContentPart[] };
export type FunctionCallItem = Static<typeof FunctionCallItem>;
export type FunctionCallOutputItem = Static<typeof FunctionCallOutputItem>;
export type ReasoningItem = Static<typeof ReasoningItem>;
export type InputItem = (MessageItem & { type?: "message" }) | FunctionCallItem | FunctionCallOutputItem | ReasoningItem;
export type ItemReference = Static<typeof ItemReference>;
/** An item of a request's input: an item, or a reference to a stored one. */
export type RequestItem = InputItem | ItemReference;

// ---------------------------------------------------------------------------
// Tools, tool choice, text format
// ---------------------------------------------------------------------------

const FunctionTool = T.Object(
  {
    type: T.Literal("function"),
    name: T.String({ minLength: 1 }),
    description: T.Optional(Nullable(T.String())),
    // Arbitrary JSON Schema ($schema, additionalProperties, …): never validated inside.
    parameters: T.Optional(Nullable(Json)),
    strict: T.Optional(Nullable(T.Boolean())),
    // Declared by the SDK's FunctionTool and sent by the Agents SDK when configured: tool search
    // (defer_loading), callers from hosted code (allowed_callers), asynchronous tools and the output's
    // schema. A chat upstream has none of these: accepted and not forwarded; the tool is offered as is.
    defer_loading: T.Optional(T.Boolean()),
    allowed_callers: T.Optional(Nullable(T.Array(T.String()))),
    async: T.Optional(T.Boolean()),
    output_schema: T.Optional(Nullable(Json)),
  },
  Strict,
);
const functionToolCheck = TypeCompiler.Compile(FunctionTool);
export type FunctionTool = Static<typeof FunctionTool>;

/** OpenAI's web search tools (WebSearchTool, WebSearchPreviewTool), by every name the SDK gives them. */
const WEB_SEARCH_TYPES: readonly string[] = ["web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11"];
export const isWebSearchType = (type: unknown): boolean => typeof type === "string" && WEB_SEARCH_TYPES.includes(type);
/**
 * A web search tool, with `responses.webSearch: "ignore"` (refused otherwise):
 * accepted and not offered to the model (the gateway has no
 * search; with `auto`, an answer without a search is one the API may give).
 * Codex CLI sends one by default. Its settings are not used, so not checked
 * beyond being bounded JSON: the SDKs send fields the SDK's types do not
 * declare (Codex `search_content_types` on `web_search`, the Vercel AI SDK
 * `filters.blocked_domains`).
 */
const WebSearchTool = T.Object({ type: T.String() }, { additionalProperties: JsonValue });
const webSearchToolCheck = TypeCompiler.Compile(WebSearchTool);
export type WebSearchTool = { type: string } & Record<string, unknown>;

const FunctionChoice = T.Object({ type: T.Literal("function"), name: T.String({ minLength: 1 }) }, Strict);
const functionChoiceCheck = TypeCompiler.Compile(FunctionChoice);
/**
 * OpenAI's ToolChoiceAllowed (the Vercel AI SDK's `allowedTools`): the model may
 * call only these of the request's tools, as `mode` says. Function tools by
 * name; a web search entry allows nothing (there is no search); other hosted
 * entries are refused as hosted tools are.
 */
const AllowedFunction = T.Object({ type: T.Literal("function"), name: T.String({ minLength: 1 }) }, Strict);
const AllowedWebSearch = T.Object({ type: T.String() }, Strict);
const allowedFunctionCheck = TypeCompiler.Compile(AllowedFunction);
const allowedWebSearchCheck = TypeCompiler.Compile(AllowedWebSearch);
const AllowedChoice = T.Object(
  {
    type: T.Literal("allowed_tools"),
    mode: T.Union([T.Literal("auto"), T.Literal("required")]),
    // Each entry checked by its type afterwards (checkToolChoice).
    tools: T.Array(T.Object({ type: T.String() }), { minItems: 1 }),
  },
  Strict,
);
const allowedChoiceCheck = TypeCompiler.Compile(AllowedChoice);
export type AllowedToolChoice = { type: "allowed_tools"; mode: "auto" | "required"; tools: Array<Static<typeof AllowedFunction> | Static<typeof AllowedWebSearch>> };
const ToolChoice = T.Union([T.Literal("auto"), T.Literal("none"), T.Literal("required"), FunctionChoice]);

const TextFormat = T.Union([
  T.Object({ type: T.Literal("text") }, Strict),
  T.Object({ type: T.Literal("json_object") }, Strict),
  T.Object(
    {
      type: T.Literal("json_schema"),
      name: T.String({ minLength: 1 }),
      schema: Json,
      strict: T.Optional(Nullable(T.Boolean())),
      description: T.Optional(T.String()),
    },
    Strict,
  ),
]);

// ---------------------------------------------------------------------------
// The body
// ---------------------------------------------------------------------------

/** OpenAI refuses a smaller max_output_tokens; no SDK sends one by default. */
const MIN_OUTPUT_TOKENS = 16;

const Body = T.Object(
  {
    model: T.String({ minLength: 1 }),
    // Dispatched by item type afterwards (parseResponsesBody).
    input: T.Optional(T.Union([T.String(), T.Array(T.Object({}))])),
    instructions: T.Optional(Nullable(T.String())),
    previous_response_id: T.Optional(Nullable(T.String({ minLength: 1, maxLength: 128 }))),
    store: T.Optional(Nullable(T.Boolean())),
    stream: T.Optional(Nullable(T.Boolean())),
    stream_options: T.Optional(Nullable(T.Object({ include_obfuscation: T.Optional(Nullable(T.Boolean())) }, Strict))),
    background: T.Optional(Nullable(T.Boolean())),
    // Dispatched by tool type afterwards: function tools pass, web search as the operator chose, other hosted tools are refused by name.
    tools: T.Optional(T.Array(T.Object({ type: T.String() }))),
    tool_choice: T.Optional(T.Union([ToolChoice, AllowedChoice, T.Object({ type: T.String() })])),
    parallel_tool_calls: T.Optional(Nullable(T.Boolean())),
    // Echoed in the Response: at most 2^53 − 1, so it is echoed as sent, in digits (inference/model.ts, MAX_WHOLE).
    max_tool_calls: T.Optional(Nullable(T.Integer({ minimum: 1, maximum: Number.MAX_SAFE_INTEGER }))),
    text: T.Optional(Nullable(T.Object({ format: T.Optional(Nullable(TextFormat)), verbosity: T.Optional(Nullable(T.String())) }, Strict))),
    // OpenAI's least value (checked first in parseResponsesBody, in OpenAI's words).
    max_output_tokens: T.Optional(Nullable(T.Integer({ minimum: MIN_OUTPUT_TOKENS, maximum: Number.MAX_SAFE_INTEGER }))),
    temperature: T.Optional(Nullable(T.Number({ minimum: 0, maximum: 2 }))),
    // OpenAI's bound (a probability mass); forwarded, so the upstream never has to word the refusal.
    top_p: T.Optional(Nullable(T.Number({ minimum: 0, maximum: 1 }))),
    // OpenAI's bound, as chat's top_logprobs.
    top_logprobs: T.Optional(Nullable(T.Integer({ minimum: 0, maximum: 20 }))),
    reasoning: T.Optional(
      Nullable(
        T.Object(
          {
            effort: T.Optional(Nullable(T.String())),
            summary: T.Optional(Nullable(T.String())),
            generate_summary: T.Optional(Nullable(T.String())),
            // Which turns' reasoning the model sees, and OpenAI's reasoning modes: accepted, echoed and ignored
            // (reasoning items never go upstream); the Vercel AI SDK sends them when asked to.
            context: T.Optional(Nullable(T.String())),
            mode: T.Optional(Nullable(T.String())),
          },
          Strict,
        ),
      ),
    ),
    user: T.Optional(Nullable(T.String())),
    // OpenAI's bound.
    safety_identifier: T.Optional(Nullable(T.String({ maxLength: 128 }))),
    metadata: T.Optional(Nullable(Metadata)),
    include: T.Optional(Nullable(T.Array(T.String()))),
    truncation: T.Optional(Nullable(T.Union([T.Literal("auto"), T.Literal("disabled")]))),
    service_tier: T.Optional(Nullable(T.String())),
    prompt_cache_key: T.Optional(Nullable(T.String())),
    prompt_cache_retention: T.Optional(Nullable(T.String())),
    // The SDK's shapes, closed: OpenAI's prompt cache and server-side compaction, which a chat upstream has not.
    prompt_cache_options: T.Optional(
      Nullable(
        T.Object(
          {
            comparison_response_id: T.Optional(Nullable(T.String())),
            mode: T.Optional(T.String()),
            prewarm: T.Optional(T.Boolean()),
            ttl: T.Optional(T.String()),
          },
          Strict,
        ),
      ),
    ),
    context_management: T.Optional(Nullable(T.Array(T.Object({ type: T.String(), compact_threshold: T.Optional(Nullable(T.Number())) }, Strict)))),
    // Chat's moderation object (the SDK declares the same on both): forwarded as chat's, the upstream judges it.
    moderation: T.Optional(Nullable(Moderation)),
    // Image context compression, a hint to OpenAI's servers: accepted and ignored.
    image: T.Optional(Nullable(T.Object({ context_compression: T.Optional(T.String()) }, Strict))),
    // OpenAI's access programs: only the standard one, what every request here gets (parseResponsesBody).
    access_programs: T.Optional(Nullable(T.Object({ cyber: T.Optional(T.String()) }, Strict))),
    // Features this gateway does not have: accepted only when empty (parseResponsesBody says so otherwise).
    prompt: T.Optional(T.Null()),
    conversation: T.Optional(T.Null()),
  },
  { ...Strict, description: "Unknown fields are refused at any depth (400 with param = the field's path); tool parameters and text.format schemas are free-form JSON Schema" },
);

export type ResponsesBody = Omit<Static<typeof Body>, "input" | "tools" | "tool_choice"> & {
  input?: string | RequestItem[];
  tools?: (FunctionTool | WebSearchTool)[];
  tool_choice?: Static<typeof ToolChoice> | AllowedToolChoice;
};

export const isFunctionTool = (t: FunctionTool | WebSearchTool): t is FunctionTool => t.type === "function";

/** For the OpenAPI document. */
export const ResponsesBodySchema = Body;

const bodyCheck = TypeCompiler.Compile(Body);
const BODY_KEYS = new Set(Object.keys(Body.properties));

function invalid(param: string, message: string): AppError {
  return new AppError("invalid_request_error", message, param);
}

function checkParts(role: string, content: unknown[], j: number): void {
  const at = `input[${j}]`;
  const allowed = PARTS_BY_ROLE[role] ?? [];
  for (const [k, part] of content.entries()) {
    const type = isRecord(part) ? part.type : undefined;
    const p = `${at}.content[${k}]`;
    if (type === "input_file") throw invalid(p, `'${p}' is an input_file part: this gateway has no files API; send the text or image inline.`);
    if (typeof type !== "string" || !allowed.includes(type)) {
      throw invalid(`${p}.type`, `Invalid value for '${p}.type': a ${role} message takes ${allowed.join(" or ")} parts.`);
    }
    const check = PART_CHECKS[type];
    const err = check && firstError(check, part, `/input/${j}/content/${k}`);
    if (err) throw err;
    if (type === "input_image" && isRecord(part)) {
      if (part.file_id != null) throw invalid(`${p}.file_id`, `'${p}.file_id': this gateway has no files API; send image_url (an https or data URL).`);
      if (typeof part.image_url !== "string") throw invalid(`${p}.image_url`, `Missing required parameter: '${p}.image_url'.`);
    }
  }
}

/** The item's type, with OpenAI's defaults: a typeless item with a role is a message, one without is a reference. */
function itemType(item: Record<string, unknown>): unknown {
  if (item.type !== undefined && item.type !== null) return item.type;
  return "role" in item ? "message" : "item_reference";
}

export function isItemReference(item: RequestItem): item is ItemReference {
  return itemType(item) === "item_reference";
}

function checkItem(item: Record<string, unknown>, j: number): void {
  const at = `input[${j}]`;
  const type = itemType(item);
  const check = typeof type === "string" ? ITEM_CHECKS.get(type) : undefined;
  if (!check) {
    throw invalid(
      `${at}.type`,
      `Invalid value for '${at}.type': ${JSON.stringify(type)} is not supported here; input items are message, function_call, function_call_output, reasoning or item_reference.`,
    );
  }
  if (type === "function_call_output" && Array.isArray(item.output)) {
    for (const [k, part] of item.output.entries()) {
      const partType = isRecord(part) ? part.type : undefined;
      if (partType === "input_image" || partType === "input_file") {
        throw invalid(
          `${at}.output[${k}].type`,
          `'${at}.output[${k}]' is ${partType}: a tool's output can carry only text here, because chat-completions upstreams take only text in tool results. Send the ${partType === "input_image" ? "image" : "file"} in a user message after it.`,
        );
      }
    }
  }
  const err = firstError(check, item, `/input/${j}`);
  if (err) throw err;
  if (type === "message" && Array.isArray(item.content)) checkParts(String(item.role), item.content, j);
}

/**
 * A stored item (an earlier request's input, or an earlier answer's output) is
 * replayed only if it is still a valid input item: a row written by another
 * version, or damaged, must not break the request that replays it.
 */
export function isReplayable(item: unknown): item is InputItem {
  // A stored item is an item, never a reference to one.
  if (!isRecord(item) || itemType(item) === "item_reference") return false;
  try {
    checkItem(item, 0);
    return true;
  } catch {
    return false;
  }
}

/**
 * The most different items one request may reference (item_reference). Each is
 * looked up in the stored responses; OpenAI documents no bound. Far above what
 * a client sends (the Vercel AI SDK references each earlier turn's output
 * items: a few per turn), far below the ~1,000,000 a 16 MiB body can carry.
 */
export const MAX_ITEM_REFERENCES = 10_000;

function checkInput(input: Record<string, unknown>[]): void {
  let referenced: Set<unknown> | undefined;
  for (const [j, item] of input.entries()) {
    checkItem(item, j);
    if (itemType(item) !== "item_reference") continue;
    referenced ??= new Set();
    referenced.add(item.id);
    if (referenced.size > MAX_ITEM_REFERENCES) {
      throw invalid(
        `input[${j}]`,
        `A request may reference at most ${MAX_ITEM_REFERENCES} different items (item_reference); 'input[${j}]' is one more. Send the items themselves, or use previous_response_id.`,
      );
    }
  }
}

const HOSTED = "this gateway serves function tools only (no hosted tools such as file_search or code_interpreter)";

/** What the operator chose for web search tools (config `responses.webSearch`). */
export type WebSearchPolicy = "refuse" | "ignore";

function checkTools(tools: Record<string, unknown>[], webSearch: WebSearchPolicy): void {
  for (const [i, tool] of tools.entries()) {
    const search = isWebSearchType(tool.type);
    if (tool.type !== "function" && !search) throw invalid(`tools[${i}].type`, `The tool type '${String(tool.type)}' is not supported: ${HOSTED}.`);
    if (search && webSearch === "refuse") {
      throw invalid(
        `tools[${i}].type`,
        `The tool type '${String(tool.type)}' is not supported: this gateway runs no web search. Send the request without it (Codex CLI: web_search = "disabled" in its config.toml).`,
      );
    }
    const err = firstError(search ? webSearchToolCheck : functionToolCheck, tool, `/tools/${i}`);
    if (err) throw err;
  }
}

/** Names shown in a message: the first few, each cut short (they come from the client). */
function someNames(names: ReadonlySet<string>): string {
  const shown: string[] = [];
  for (const n of names) {
    if (shown.length === 5) return `${shown.join(", ")}, …`;
    shown.push(`'${n.slice(0, 64)}'`);
  }
  return shown.join(", ");
}

/** A tool_choice object (`tools` already checked): a function by name, or allowed_tools naming at least one of the request's function tools. */
function checkToolChoice(choice: Record<string, unknown>, tools: readonly Record<string, unknown>[]): void {
  if (choice.type === "allowed_tools") {
    const err = firstError(allowedChoiceCheck, choice, "/tool_choice");
    if (err) throw err;
    // A set: each tool is looked up once (a list made this tools × names, 10^10 steps for a body of 100,000 of each).
    const allowed = new Set<string>();
    for (const [i, entry] of (choice.tools as Record<string, unknown>[]).entries()) {
      const search = isWebSearchType(entry.type);
      if (entry.type !== "function" && !search) throw invalid(`tool_choice.tools[${i}].type`, `The allowed tool type '${String(entry.type)}' is not supported: ${HOSTED}.`);
      const e = firstError(search ? allowedWebSearchCheck : allowedFunctionCheck, entry, `/tool_choice/tools/${i}`);
      if (e) throw e;
      if (!search) allowed.add(String(entry.name));
    }
    // Names that are not among the tools allow nothing more (the Vercel AI SDK sends such a name with a warning); none at all allows nothing.
    if (!tools.some((t) => t.type === "function" && allowed.has(String(t.name)))) {
      const which = allowed.size === 0 ? "The allowed tools name no function tool (web search is not offered)" : `None of the allowed tools (${someNames(allowed)}) is one of this request's function tools`;
      throw invalid("tool_choice.tools", `${which}: name function tools from 'tools'.`);
    }
    return;
  }
  if (choice.type !== "function") {
    throw invalid("tool_choice", `The tool_choice type '${String(choice.type)}' is not supported: name a function tool, allowed_tools, or auto, none or required.`);
  }
  const err = firstError(functionChoiceCheck, choice, "/tool_choice");
  if (err) throw err;
}

/**
 * `tool_choice: "required"` with tools that are all web search tools (accepted
 * under `ignore`, not offered): the model would be sent none. Chat's rule
 * would then say tool_choice "is only allowed when 'tools' are specified",
 * untrue of this request; without any tools it is right, and chat says it.
 */
function checkRequired(tools: readonly Record<string, unknown>[]): void {
  if (tools.length === 0 || tools.some((t) => t.type === "function")) return;
  throw invalid(
    "tool_choice",
    "Invalid value for 'tool_choice': 'required' needs a function tool the model can call, and this request's tools are web search tools only, which this gateway does not offer to the model (it runs no web search). Add a function tool, or send tool_choice 'auto'.",
  );
}

/**
 * Validates a Responses body or throws a 400 AppError whose `param` names the
 * field in the Responses format. `webSearch`: a web search tool is refused
 * (the default), or accepted and not offered to the model (`ignore`).
 */
export function parseResponsesBody(raw: unknown, webSearch: WebSearchPolicy = "refuse"): ResponsesBody {
  if (!isRecord(raw)) throw new AppError("invalid_request_error", "The request body must be a JSON object.");
  for (const k in raw) if (!BODY_KEYS.has(k)) throw invalid(k, `Unrecognized request argument supplied: ${k}`);
  return checkBody(raw, webSearch);
}

/**
 * The body of POST /v1/responses/input_tokens: the fields of the SDK's
 * InputTokenCountParams, each checked as POST /v1/responses checks it (the
 * same schema and rules); create's other fields (stream, store,
 * max_output_tokens, …) are unknown parameters there, as in OpenAI's API.
 * `personality` (a style preset of OpenAI's models, at most 64 characters)
 * is accepted and ignored: it changes no count of the gateway's.
 */
const MAX_PERSONALITY = 64;
const InputTokensBody = T.Object(
  {
    model: Body.properties.model,
    input: Body.properties.input,
    instructions: Body.properties.instructions,
    previous_response_id: Body.properties.previous_response_id,
    conversation: Body.properties.conversation,
    tools: Body.properties.tools,
    tool_choice: Body.properties.tool_choice,
    parallel_tool_calls: Body.properties.parallel_tool_calls,
    reasoning: Body.properties.reasoning,
    text: Body.properties.text,
    truncation: Body.properties.truncation,
    personality: T.Optional(T.String({ maxLength: MAX_PERSONALITY })),
  },
  { ...Strict, description: "The fields of POST /v1/responses that a count takes, each checked as there; unknown fields (create's stream, store, max_output_tokens, …) are refused" },
);
const COUNT_KEYS = new Set(Object.keys(InputTokensBody.properties));

/** For the OpenAPI document. */
export const InputTokensBodySchema = InputTokensBody;

export function parseInputTokensBody(raw: unknown, webSearch: WebSearchPolicy = "refuse"): ResponsesBody {
  if (!isRecord(raw)) throw new AppError("invalid_request_error", "The request body must be a JSON object.");
  for (const k in raw) if (!COUNT_KEYS.has(k)) throw invalid(k, `Unrecognized request argument supplied: ${k}`);
  const { personality, ...rest } = raw;
  if (personality !== undefined && (typeof personality !== "string" || personality.length > MAX_PERSONALITY)) {
    throw invalid("personality", `Invalid 'personality': expected a string of at most ${MAX_PERSONALITY} characters.`);
  }
  return checkBody(rest, webSearch);
}

/** The checks after the top-level keys: the schema, then the rules it cannot say. */
function checkBody(raw: Record<string, unknown>, webSearch: WebSearchPolicy): ResponsesBody {
  if (raw.prompt != null) throw invalid("prompt", "Reusable prompts are not supported by this gateway: send the instructions and input in the request.");
  if (raw.conversation != null) {
    throw invalid("conversation", "Conversations are not supported by this gateway: chain responses with previous_response_id instead.");
  }
  const max = raw.max_output_tokens;
  if (typeof max === "number" && Number.isInteger(max) && max < MIN_OUTPUT_TOKENS) {
    throw invalid(
      "max_output_tokens",
      `Invalid 'max_output_tokens': integer below minimum value. Expected a value >= ${MIN_OUTPUT_TOKENS}, but got ${max} instead.`,
    );
  }
  const err = firstError(bodyCheck, raw, "");
  if (err) throw err;
  checkMetadataKeys(raw.metadata);
  // As on chat (and OpenAI's Responses API): options for a stream that was not asked for are a mistake, not a no-op.
  if (raw.stream_options != null && raw.stream !== true) {
    throw invalid("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.");
  }
  if (isRecord(raw.prompt_cache_options) && raw.prompt_cache_options.prewarm === true) {
    throw invalid(
      "prompt_cache_options.prewarm",
      "This gateway cannot prewarm a prompt cache without generating an answer: send the request without prewarm (the upstream caches prompts on its own).",
    );
  }
  const cyber = isRecord(raw.access_programs) ? raw.access_programs.cyber : undefined;
  if (cyber !== undefined && cyber !== "standard") {
    throw invalid(
      "access_programs.cyber",
      `The access program '${String(cyber)}' is not available through this gateway: it has only the standard one; send the request without access_programs.`,
    );
  }
  if (raw.background === true) throw invalid("background", "Background responses are not supported by this gateway; send the request without background (streaming keeps long answers alive).");
  if (Array.isArray(raw.input)) checkInput(raw.input as Record<string, unknown>[]);
  if (Array.isArray(raw.tools)) checkTools(raw.tools as Record<string, unknown>[], webSearch);
  if (isRecord(raw.tool_choice)) checkToolChoice(raw.tool_choice, Array.isArray(raw.tools) ? (raw.tools as Record<string, unknown>[]) : []);
  if (raw.tool_choice === "required") checkRequired(Array.isArray(raw.tools) ? (raw.tools as Record<string, unknown>[]) : []);
  if (raw.input === undefined && raw.previous_response_id == null) throw invalid("input", "Missing required parameter: 'input'.");
  return raw as ResponsesBody;
}
