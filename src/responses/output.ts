/**
 * OpenAI's Response object, built from the gateway's own chat answers.
 *
 * The shapes below follow the `openai` SDK's `Response` type field for field
 * (test/unit/responses-output.test.ts checks that they are assignable to it).
 * `output_text` is sent although OpenAI's reference calls it SDK-only: the SDK
 * type declares it required, clients that read the raw JSON or the raw event
 * stream find it, and the SDKs recompute the same value. `store` is sent as
 * OpenAI's API does, although the SDK type does not declare it. Fields the SDK
 * declares as optional and non-nullable (`usage`, `user`) are left out rather
 * than sent as null.
 */
import { isRecord } from "../lib/guards.ts";

/**
 * Request fields a Response object echoes (OpenAI's Response type declares
 * them), as the client sent them, including those the gateway accepts and
 * ignores (a client reading its settings back finds what it asked for). A
 * value outside the SDK's enum is still forwarded where it is forwarded, but
 * echoed as null.
 */
export interface ResponseEcho {
  instructions: string | null;
  max_output_tokens: number | null;
  max_tool_calls: number | null;
  metadata: Record<string, string>;
  parallel_tool_calls: boolean;
  previous_response_id: string | null;
  prompt_cache_key: string | null;
  prompt_cache_retention: "in_memory" | "24h" | null;
  safety_identifier: string | null;
  temperature: number | null;
  top_logprobs: number | null;
  top_p: number | null;
  tool_choice:
    | "auto"
    | "none"
    | "required"
    | { type: "function"; name: string }
    | { type: "allowed_tools"; mode: "auto" | "required"; tools: Array<{ type: "function"; name: string } | { type: string }> };
  tools: Array<{ type: "function"; name: string; description: string | null; parameters: Record<string, unknown> | null; strict: boolean | null }>;
  text: {
    format:
      | { type: "text" }
      | { type: "json_object" }
      | { type: "json_schema"; name: string; schema: Record<string, unknown>; strict: boolean | null; description?: string };
    verbosity: "low" | "medium" | "high" | null;
  };
  /** `context` and `mode` only when sent (the SDK's `mode` is not nullable). */
  reasoning: { effort: string | null; summary: ReasoningSummary | null; context?: ReasoningContext | null; mode?: string };
  store: boolean;
  truncation: "disabled" | "auto";
  user: string | null;
}

export interface ResponseMeta {
  /** `resp_…` */
  id: string;
  /** Seconds. */
  createdAt: number;
  /** The alias the client asked for. */
  model: string;
  echo: ResponseEcho;
}

export type ItemStatus = "in_progress" | "completed" | "incomplete";

/** A token's log probability, as the Response's output_text part carries it. */
export interface Logprob {
  token: string;
  bytes: number[];
  logprob: number;
  top_logprobs: { token: string; bytes: number[]; logprob: number }[];
}

export interface OutputText {
  type: "output_text";
  text: string;
  annotations: never[];
  /** Filled only when the client asked (`include: ["message.output_text.logprobs"]`) and the upstream sent them. */
  logprobs: Logprob[];
}

/** Alternatives per token kept at most (OpenAI's own bound for top_logprobs). */
const MAX_TOP_LOGPROBS = 20;

const bytesOf = (e: Record<string, unknown>, token: string): number[] =>
  Array.isArray(e.bytes) && e.bytes.every((b) => Number.isInteger(b) && (b as number) >= 0 && (b as number) <= 255)
    ? (e.bytes as number[])
    : Array.from(Buffer.from(token, "utf8"));

/**
 * Chat's `choice.logprobs` (`{content: [{token, logprob, bytes, top_logprobs}]}`)
 * -> the Responses form; entries that are not a token with a finite number are
 * skipped, and [] when there are none.
 */
export function logprobsFromChat(v: unknown): Logprob[] {
  if (!isRecord(v) || !Array.isArray(v.content)) return [];
  const out: Logprob[] = [];
  for (const e of v.content) {
    if (!isRecord(e) || typeof e.token !== "string" || typeof e.logprob !== "number" || !Number.isFinite(e.logprob)) continue;
    const top: Logprob["top_logprobs"] = [];
    if (Array.isArray(e.top_logprobs)) {
      for (const t of e.top_logprobs) {
        if (top.length >= MAX_TOP_LOGPROBS) break;
        if (isRecord(t) && typeof t.token === "string" && typeof t.logprob === "number" && Number.isFinite(t.logprob)) {
          top.push({ token: t.token, bytes: bytesOf(t, t.token), logprob: t.logprob });
        }
      }
    }
    out.push({ token: e.token, bytes: bytesOf(e, e.token), logprob: e.logprob, top_logprobs: top });
  }
  return out;
}
export interface OutputRefusal {
  type: "refusal";
  refusal: string;
}
export interface ReasoningText {
  type: "reasoning_text";
  text: string;
}
export interface MessageItem {
  type: "message";
  id: string;
  status: ItemStatus;
  role: "assistant";
  content: Array<OutputText | OutputRefusal>;
}
export interface FunctionCallItem {
  type: "function_call";
  id: string;
  call_id: string;
  name: string;
  arguments: string;
  status: ItemStatus;
}
/** The upstream's reasoning text (vLLM's `reasoning_content` / `reasoning`), as OpenAI's open-weight models report it. */
export interface ReasoningItem {
  type: "reasoning";
  id: string;
  summary: never[];
  content: ReasoningText[];
  status: ItemStatus;
}
/** The output items of a Response (what previous_response_id replays and input_items lists are built from). */
export type OutputItem = MessageItem | FunctionCallItem | ReasoningItem;

export interface ResponseUsage {
  input_tokens: number;
  input_tokens_details: { cached_tokens: number; cache_write_tokens: number };
  output_tokens: number;
  output_tokens_details: { reasoning_tokens: number };
  total_tokens: number;
}

export type ReasoningSummary = "auto" | "concise" | "detailed";
export type ReasoningContext = "auto" | "current_turn" | "all_turns";

/** The efforts the SDK's `ReasoningEffort` names; any other value the client sent is forwarded but echoed as null. */
const EFFORTS = ["none", "minimal", "low", "medium", "high", "xhigh", "max"] as const;
type Effort = (typeof EFFORTS)[number];
const isEffort = (e: string | null): e is Effort => e !== null && (EFFORTS as readonly string[]).includes(e);

export type ResponseStatus = "in_progress" | "completed" | "incomplete" | "failed" | "cancelled";

/** A type, not an interface, so it is also a `Record<string, unknown>` (what the store takes). */
export type ResponseObject = {
  id: string;
  object: "response";
  created_at: number;
  status: ResponseStatus;
  background: boolean;
  completed_at: number | null;
  error: { code: "server_error"; message: string } | null;
  incomplete_details: { reason: "max_output_tokens" | "content_filter" } | null;
  instructions: string | null;
  max_output_tokens: number | null;
  max_tool_calls: number | null;
  model: string;
  output: OutputItem[];
  /** The text of the output's `output_text` parts, joined. */
  output_text: string;
  parallel_tool_calls: boolean;
  previous_response_id: string | null;
  prompt_cache_key: string | null;
  prompt_cache_retention: ResponseEcho["prompt_cache_retention"];
  reasoning: Omit<ResponseEcho["reasoning"], "effort"> & { effort: Effort | null };
  safety_identifier: string | null;
  /** The tier that served the request (OpenAI's meaning): the gateway has one. */
  service_tier: "default";
  store: boolean;
  temperature: number | null;
  text: ResponseEcho["text"];
  tool_choice: ResponseEcho["tool_choice"];
  tools: ResponseEcho["tools"];
  top_logprobs: number | null;
  top_p: number | null;
  truncation: "disabled" | "auto";
  usage?: ResponseUsage;
  user?: string;
  metadata: Record<string, string>;
  access_programs: null;
};

/** Per size, a buffer filled with fresh random bytes for each id (an id is only its hex string: no buffer per id). */
const randomBuffers: Buffer[] = [];
const hex = (bytes: number): string => {
  let b = randomBuffers[bytes];
  if (!b) {
    b = Buffer.alloc(bytes);
    randomBuffers[bytes] = b;
  }
  crypto.getRandomValues(b);
  return b.toString("hex");
};
/** Item ids: `msg_…`, `fc_…`, `rs_…` (OpenAI's prefixes) with 24 random bytes. */
export const itemId = (prefix: "msg" | "fc" | "rs"): string => `${prefix}_${hex(24)}`;

/**
 * A function_call's call_id: the upstream's tool call id, unless it sent none
 * or an earlier call of the same answer already has it (a server that numbers
 * its calls, a model that writes the ids itself); then a new `call_…`. The
 * SDKs key a response's calls by call_id (the openai SDK's stream helper
 * refuses a repeated one), and a client answers each call by its id.
 */
export function callIdFor(upstream: string | undefined, used: Set<string>): string {
  const id = upstream !== undefined && upstream !== "" && !used.has(upstream) ? upstream : `call_${hex(12)}`;
  used.add(id);
  return id;
}

/** A Response with no output yet (`response.created`), or the frame the final one is built in. */
export function responseShell(meta: ResponseMeta, status: ResponseStatus, output?: OutputItem[]): ResponseObject {
  const e = meta.echo;
  const r: ResponseObject = {
    id: meta.id,
    object: "response",
    created_at: meta.createdAt,
    status,
    background: false,
    completed_at: null,
    error: null,
    incomplete_details: null,
    instructions: e.instructions,
    max_output_tokens: e.max_output_tokens,
    max_tool_calls: e.max_tool_calls,
    model: meta.model,
    output: output ?? [],
    output_text: "",
    parallel_tool_calls: e.parallel_tool_calls,
    previous_response_id: e.previous_response_id,
    prompt_cache_key: e.prompt_cache_key,
    prompt_cache_retention: e.prompt_cache_retention,
    reasoning: { ...e.reasoning, effort: isEffort(e.reasoning.effort) ? e.reasoning.effort : null },
    safety_identifier: e.safety_identifier,
    service_tier: "default",
    store: e.store,
    temperature: e.temperature,
    text: e.text,
    tool_choice: e.tool_choice,
    tools: e.tools,
    top_logprobs: e.top_logprobs,
    top_p: e.top_p,
    truncation: e.truncation,
    metadata: e.metadata,
    access_programs: null,
  };
  if (e.user !== null) r.user = e.user;
  return r;
}

const count = (v: unknown): number => (typeof v === "number" && Number.isFinite(v) && v > 0 ? Math.floor(v) : 0);

/** Chat usage -> Responses usage; the upstream's cached, cache-write and reasoning token counts when it reports them. */
export function usageFromChat(u: unknown): ResponseUsage | undefined {
  if (!isRecord(u)) return undefined;
  const input = count(u.prompt_tokens);
  const output = count(u.completion_tokens);
  const cached = isRecord(u.prompt_tokens_details) ? count(u.prompt_tokens_details.cached_tokens) : 0;
  const written = isRecord(u.prompt_tokens_details) ? count(u.prompt_tokens_details.cache_write_tokens) : 0;
  const reasoning = isRecord(u.completion_tokens_details) ? count(u.completion_tokens_details.reasoning_tokens) : 0;
  return {
    input_tokens: input,
    input_tokens_details: { cached_tokens: Math.min(cached, input), cache_write_tokens: Math.min(written, input) },
    output_tokens: output,
    output_tokens_details: { reasoning_tokens: Math.min(reasoning, output) },
    total_tokens: input + output,
  };
}

/** How a chat finish_reason ends a Response. */
export function endOf(finishReason: unknown): { status: "completed" | "incomplete"; incomplete: ResponseObject["incomplete_details"] } {
  if (finishReason === "length") return { status: "incomplete", incomplete: { reason: "max_output_tokens" } };
  if (finishReason === "content_filter") return { status: "incomplete", incomplete: { reason: "content_filter" } };
  return { status: "completed", incomplete: null };
}

export function outputText(output: OutputItem[]): string {
  let text = "";
  for (const item of output) {
    if (item.type !== "message") continue;
    for (const part of item.content) if (part.type === "output_text") text += part.text;
  }
  return text;
}

/** Sets the end state of `r` (a shell whose output is filled in). */
export function finish(
  r: ResponseObject,
  status: ResponseStatus,
  fields: { incomplete?: ResponseObject["incomplete_details"]; usage?: ResponseUsage; error?: string },
): ResponseObject {
  r.status = status;
  r.output_text = outputText(r.output);
  // The SDK's type: "only present when the status is completed" (null for incomplete, failed, cancelled).
  if (status === "completed") r.completed_at = Math.floor(Date.now() / 1000);
  r.incomplete_details = fields.incomplete ?? null;
  if (fields.error !== undefined) r.error = { code: "server_error", message: fields.error };
  if (fields.usage) r.usage = fields.usage;
  return r;
}

const str = (v: unknown): string => (typeof v === "string" ? v : "");
/**
 * A chat tool call's `function.arguments` as the Response's text: a string as
 * sent; a JSON object or array (some OpenAI-compatible servers send the
 * arguments parsed) as its JSON text; anything else (null, a number) "".
 */
export const argumentsText = (v: unknown): string => (typeof v === "string" ? v : typeof v === "object" && v !== null ? JSON.stringify(v) : "");
/** vLLM names the field `reasoning_content` (older) or `reasoning` (newer). */
export const reasoningOf = (m: Record<string, unknown>): string => str(m.reasoning_content) || str(m.reasoning);

/** The gateway's own non-streamed chat.completion answer (already model = alias, with usage) -> a Response. */
export function responseFromChat(chat: Record<string, unknown>, meta: ResponseMeta): ResponseObject {
  const choice = Array.isArray(chat.choices) ? chat.choices.find((c) => isRecord(c) && (c.index ?? 0) === 0) : undefined;
  const message = isRecord(choice) && isRecord(choice.message) ? choice.message : {};
  const end = endOf(isRecord(choice) ? choice.finish_reason : undefined);
  const itemStatus: ItemStatus = end.status === "completed" ? "completed" : "incomplete";
  const r = responseShell(meta, end.status);

  const text = str(message.content);
  const refusal = str(message.refusal);
  const calls = Array.isArray(message.tool_calls) ? message.tool_calls.filter(isRecord) : [];
  // Only what was still being generated is cut short, as in the stream: the model writes reasoning, then
  // text, then tool calls, so an item followed by another kind had ended (completed) before the cut.
  const reasoning = reasoningOf(message);
  const reasoningStatus: ItemStatus = text || refusal || calls.length > 0 ? "completed" : itemStatus;
  if (reasoning) r.output.push({ type: "reasoning", id: itemId("rs"), summary: [], content: [{ type: "reasoning_text", text: reasoning }], status: reasoningStatus });

  if (text || refusal || calls.length === 0) {
    const content: MessageItem["content"] = [];
    if (text || !refusal) content.push({ type: "output_text", text, annotations: [], logprobs: logprobsFromChat(isRecord(choice) ? choice.logprobs : undefined) });
    if (refusal) content.push({ type: "refusal", refusal });
    r.output.push({ type: "message", id: itemId("msg"), status: calls.length > 0 ? "completed" : itemStatus, role: "assistant", content });
  }
  const callIds = new Set<string>();
  for (const call of calls) {
    const fn = isRecord(call.function) ? call.function : {};
    const callId = callIdFor(str(call.id), callIds);
    r.output.push({ type: "function_call", id: itemId("fc"), call_id: callId, name: str(fn.name), arguments: argumentsText(fn.arguments), status: itemStatus });
  }
  return finish(r, end.status, { incomplete: end.incomplete, usage: usageFromChat(chat.usage) });
}
