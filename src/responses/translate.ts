import { toolAnswerProblem } from "../inference/model.ts";
import { AppError } from "../lib/errors.ts";
import { isRecord } from "../lib/guards.ts";
import type { ResponseEcho } from "./output.ts";
import {
  type ContentPart,
  type InputItem,
  isFunctionTool,
  isItemReference,
  type MessageItem,
  type RequestItem,
  type ResponsesBody,
} from "./request.ts";

/**
 * A Responses request → the chat completions body the upstream gets (the
 * upstreams speak chat completions only), the request fields the Response
 * echoes, and the request's own input items in the form they are stored and
 * listed. Errors the chat service raises about the translated body name chat
 * fields (`messages[3].content[0]`, `max_tokens`); `responsesError` names the
 * Responses field they came from (`input[2].content[0]`, `max_output_tokens`).
 *
 * Forwarded: input/instructions (as messages), function tools (with
 * allowed_tools: the allowed ones; web search is not offered), tool_choice
 * (allowed_tools: its mode),
 * parallel_tool_calls, text.format (response_format), max_output_tokens
 * (max_tokens), temperature, top_p, reasoning.effort (vLLM's
 * reasoning_effort), user (or else safety_identifier, as user), moderation. Everything
 * else accepted is the gateway's own (store, metadata, previous_response_id)
 * or ignored (docs/decisions.md).
 */

/** An input item as stored and listed by GET /v1/responses/{id}/input_items: always with an id and a status. */
export type StoredItem = Record<string, unknown> & { id: string; type: string };

export interface Translation {
  chat: Record<string, unknown>;
  echo: ResponseEcho;
  inputItems: StoredItem[];
  /** The Responses field a chat field came from (null stays null). */
  param(chatParam: string | null): string | null;
}

type ChatMessage = Record<string, unknown> & { role: string };

const hex = () => crypto.randomUUID().replaceAll("-", "");
export const newItemId = (prefix: string) => `${prefix}_${hex()}`;

function textOf(content: string | ContentPart[]): string {
  if (typeof content === "string") return content;
  let s = "";
  for (const p of content) if (p.type === "output_text" || p.type === "input_text") s += p.text;
  return s;
}

function chatParts(content: string | ContentPart[]): string | Record<string, unknown>[] {
  if (typeof content === "string") return content;
  // One chat part per Responses part, so a part's index is the same on both sides (see param()).
  return content.map((p) => {
    if (p.type === "input_image") return { type: "image_url", image_url: { url: p.image_url ?? "", ...(p.detail ? { detail: p.detail } : {}) } };
    if (p.type === "refusal") return { type: "text", text: p.refusal };
    return { type: "text", text: p.text };
  });
}

/** References are replaced by the items they name before translation (routes.ts, `resolveReferences`). */
function resolvedItem(item: RequestItem): InputItem {
  if (isItemReference(item)) throw new Error(`item_reference '${item.id}' reached the translation unresolved`);
  return item;
}

/** The item in its stored form: string content becomes parts, ids are assigned. */
export function storedItem(item: InputItem): StoredItem {
  const type = item.type ?? "message";
  if (type === "message") {
    const m = item as MessageItem;
    const content =
      typeof m.content === "string"
        ? [m.role === "assistant" ? { type: "output_text", text: m.content, annotations: [] } : { type: "input_text", text: m.content }]
        : m.content;
    return { id: m.id ?? newItemId("msg"), type: "message", role: m.role, content, status: m.status ?? "completed" };
  }
  const id = item.id ?? newItemId(idPrefix(type));
  return { ...item, id, type, status: item.status ?? "completed" } as StoredItem;
}

const idPrefix = (type: string): string => (type === "message" ? "msg" : type === "function_call" ? "fc" : type === "function_call_output" ? "fco" : "rs");

/**
 * The request's input items as stored: each with an id of its own. An id the
 * request repeats (an item sent twice, the same item referenced twice) stays
 * on its first item and the repeats get new ones: the ids are the cursors of
 * the input items list (`after`, `before`), and a repeated one could not be
 * paged past (the SDK's auto-pagination asked for the same page forever).
 */
function storedItems(input: readonly InputItem[]): StoredItem[] {
  const seen = new Set<string>();
  return input.map((item) => {
    const stored = storedItem(item);
    if (seen.has(stored.id)) stored.id = newItemId(idPrefix(stored.type));
    seen.add(stored.id);
    return stored;
  });
}

/** The echo's text.format when the request sent none (only ever serialised). */
const TEXT_FORMAT: ResponseEcho["text"]["format"] = Object.freeze({ type: "text" as const });

const CACHE_RETENTIONS = ["in_memory", "24h"] as const;
const VERBOSITIES = ["low", "medium", "high"] as const;
const SUMMARIES = ["auto", "concise", "detailed"] as const;
const CONTEXTS = ["auto", "current_turn", "all_turns"] as const;

/** `v` when it is one of the values the SDK's Response type declares for the field, else null (it is echoed, not forwarded). */
function oneOf<V extends string>(v: string | null | undefined, values: readonly V[]): V | null {
  // A loop, not find(): a closure per call, three calls a request.
  for (let i = 0; i < values.length; i++) if (values[i] === v) return values[i] as V;
  return null;
}

/** The tools the model had: the function tools (web search is not offered). */
function echoTools(tools: ResponsesBody["tools"]): ResponseEcho["tools"] {
  const out: ResponseEcho["tools"] = [];
  for (let i = 0; tools && i < tools.length; i++) {
    const t = tools[i] as NonNullable<ResponsesBody["tools"]>[number];
    if (isFunctionTool(t)) out.push({ type: "function", name: t.name, description: t.description ?? null, parameters: t.parameters ?? null, strict: t.strict ?? null });
  }
  return out;
}

/**
 * `replay` is the stored conversation `previous_response_id` names (oldest
 * first: each response's input items, then its output items); it is sent
 * before this request's input.
 */
export function toChat(body: ResponsesBody, replay: readonly InputItem[], store: boolean): Translation {
  const conv = new Conversation();
  if (body.instructions) conv.push({ role: "system", content: body.instructions }, "instructions");
  for (let i = 0; i < replay.length; i++) conv.add(replay[i] as InputItem, "previous_response_id");
  // Indexed loops, not entries(): an iterator and a [j, item] pair per item are garbage every request makes.
  // The input as items is kept only to be stored (storedItems).
  const raw = body.input;
  const input: InputItem[] | undefined = store ? [] : undefined;
  if (typeof raw === "string") {
    input?.push({ role: "user", content: raw });
    conv.push({ role: "user", content: raw }, "input[0]");
  } else if (raw) {
    for (let j = 0; j < raw.length; j++) {
      const item = resolvedItem(raw[j] as RequestItem);
      input?.push(item);
      conv.add(item, `input[${j}]`);
    }
  }
  const { messages, origin } = conv;
  // Chat's rule for tool messages (model.ts), checked here to be worded for this request. An output replayed
  // from a chain whose older link is gone (deleted, expired, beyond the replay bound) answers a call no longer
  // sent: it is left out, or every later request of the conversation would be refused.
  for (let bad = toolAnswerProblem(messages); bad; bad = toolAnswerProblem(messages)) {
    const from = origin[bad.index] ?? "input";
    if (from !== "previous_response_id") throw outputWithoutCall(messages, bad.index, from);
    messages.splice(bad.index, 1);
    origin.splice(bad.index, 1);
  }
  if (messages.length === 0) throw new AppError("invalid_request_error", "The request has no messages: send input (or instructions).", "input");

  const chat: Record<string, unknown> = { model: body.model, messages };
  if (body.stream === true) chat.stream = true;
  const choice = body.tool_choice;
  // Function tools only (web search is not offered); with allowed_tools only the allowed ones (chat has no allow-list).
  const allowed =
    typeof choice === "object" && choice.type === "allowed_tools" ? new Set(choice.tools.flatMap((t) => ("name" in t && typeof t.name === "string" ? [t.name] : []))) : undefined;
  /** Per tool sent upstream: its index in the request's tools (see param()). */
  const toolOrigin: number[] = [];
  const tools = body.tools;
  if (tools && tools.length > 0) {
    const offered: Record<string, unknown>[] = [];
    for (let i = 0; i < tools.length; i++) {
      const t = tools[i] as (typeof tools)[number];
      if (!isFunctionTool(t) || (allowed && !allowed.has(t.name))) continue;
      offered.push({
        type: "function",
        function: {
          name: t.name,
          ...(t.description != null ? { description: t.description } : {}),
          ...(t.parameters != null ? { parameters: t.parameters } : {}),
          ...(t.strict != null ? { strict: t.strict } : {}),
        },
      });
      toolOrigin.push(i);
    }
    if (offered.length > 0) chat.tools = offered;
  }
  if (choice !== undefined) {
    chat.tool_choice = typeof choice === "string" ? choice : choice.type === "allowed_tools" ? choice.mode : { type: "function", function: { name: choice.name } };
  }
  if (body.parallel_tool_calls != null) chat.parallel_tool_calls = body.parallel_tool_calls;
  const format = body.text?.format;
  if (format?.type === "json_object") chat.response_format = { type: "json_object" };
  if (format?.type === "json_schema") {
    chat.response_format = {
      type: "json_schema",
      json_schema: {
        name: format.name,
        schema: format.schema,
        ...(format.strict != null ? { strict: format.strict } : {}),
        ...(format.description !== undefined ? { description: format.description } : {}),
      },
    };
  }
  if (body.max_output_tokens != null) chat.max_tokens = body.max_output_tokens;
  if (body.temperature != null) chat.temperature = body.temperature;
  if (body.top_p != null) chat.top_p = body.top_p;
  // Logprobs are asked for with include (top_logprobs alone only sizes them), as in OpenAI's API.
  if (body.include?.includes("message.output_text.logprobs")) {
    chat.logprobs = true;
    chat.top_logprobs = body.top_logprobs ?? 0;
  }
  if (body.reasoning?.effort != null) chat.reasoning_effort = body.reasoning.effort;
  if (body.moderation != null) chat.moderation = body.moderation;
  const user = body.user ?? body.safety_identifier;
  if (user != null) chat.user = user;

  const reasoning: ResponseEcho["reasoning"] = {
    effort: body.reasoning?.effort ?? null,
    summary: oneOf(body.reasoning?.summary ?? body.reasoning?.generate_summary, SUMMARIES),
  };
  // Set only when sent, in this order (the echo's keys are serialised in it).
  if (body.reasoning?.context != null) reasoning.context = oneOf(body.reasoning.context, CONTEXTS);
  if (body.reasoning?.mode != null) reasoning.mode = body.reasoning.mode;
  const echo: ResponseEcho = {
    instructions: body.instructions ?? null,
    max_output_tokens: body.max_output_tokens ?? null,
    max_tool_calls: body.max_tool_calls ?? null,
    metadata: body.metadata ?? {},
    parallel_tool_calls: body.parallel_tool_calls ?? true,
    previous_response_id: body.previous_response_id ?? null,
    prompt_cache_key: body.prompt_cache_key ?? null,
    prompt_cache_retention: oneOf(body.prompt_cache_retention, CACHE_RETENTIONS),
    safety_identifier: body.safety_identifier ?? null,
    temperature: body.temperature ?? null,
    top_logprobs: body.top_logprobs ?? null,
    top_p: body.top_p ?? null,
    tool_choice: choice ?? "auto",
    tools: echoTools(tools),
    text: {
      format:
        format?.type === "json_schema"
          ? {
              type: "json_schema",
              name: format.name,
              schema: format.schema,
              strict: format.strict ?? null,
              ...(format.description !== undefined ? { description: format.description } : {}),
            }
          : (format ?? TEXT_FORMAT),
      verbosity: oneOf(body.text?.verbosity, VERBOSITIES),
    },
    reasoning,
    store,
    truncation: body.truncation ?? "disabled",
    user: body.user ?? null,
  };

  // The stored form of the input (ids and all) only for a response that is stored: nothing reads it otherwise.
  return new ChatTranslation(chat, echo, input ? storedItems(input) : [], origin, toolOrigin);
}

/** A Translation as one object (its param() a shared method, not a closure per request). */
class ChatTranslation implements Translation {
  constructor(
    readonly chat: Record<string, unknown>,
    readonly echo: ResponseEcho,
    readonly inputItems: StoredItem[],
    private readonly origin: readonly string[],
    private readonly toolOrigin: readonly number[],
  ) {}

  param(chatParam: string | null): string | null {
    return responsesParam(chatParam, this.origin, this.toolOrigin);
  }
}

/**
 * The chat messages a request's items make, and per message where it came
 * from (`instructions`, `input[j]`, `previous_response_id`).
 */
class Conversation {
  readonly messages: ChatMessage[] = [];
  readonly origin: string[] = [];

  push(m: ChatMessage, from: string): void {
    this.messages.push(m);
    this.origin.push(from);
  }

  add(item: InputItem, from: string): void {
    const messages = this.messages;
    const type = item.type ?? "message";
    if (type === "message") {
      const m = item as MessageItem;
      if (m.role === "assistant") {
        const last = messages[messages.length - 1];
        // Text after the calls of its turn (an upstream that streamed its calls first) joins their
        // message: chat has one assistant message with both, and the outputs that follow answer it.
        if (last?.role === "assistant" && Array.isArray(last.tool_calls)) {
          const text = textOf(m.content);
          if (text !== "") last.content = typeof last.content === "string" ? last.content + text : text;
        } else this.push({ role: "assistant", content: textOf(m.content) }, from);
      } else this.push({ role: m.role === "developer" ? "system" : m.role, content: chatParts(m.content) }, from);
    } else if (type === "function_call") {
      const c = item as Extract<InputItem, { type: "function_call" }>;
      const call = { id: c.call_id, type: "function", function: { name: c.name, arguments: c.arguments } };
      // Calls of one turn share an assistant message (chat's shape for parallel calls).
      const last = messages[messages.length - 1];
      if (last?.role === "assistant") {
        // Appended, not copied: a turn of many calls is linear. The array is always this translation's own.
        if (Array.isArray(last.tool_calls)) last.tool_calls.push(call);
        else last.tool_calls = [call];
        if (last.content === "") last.content = null;
      } else this.push({ role: "assistant", content: null, tool_calls: [call] }, from);
    } else if (type === "function_call_output") {
      const o = item as Extract<InputItem, { type: "function_call_output" }>;
      // An empty list of parts is empty text: chat refuses a tool message whose content is [] (as OpenAI does).
      const content = typeof o.output === "string" ? o.output : o.output.length === 0 ? "" : o.output.map((p) => ({ type: "text", text: p.text }));
      this.push({ role: "tool", tool_call_id: o.call_id, content }, from);
    }
    // reasoning items: dropped (chat upstreams take no reasoning input).
  }
}

/** A function_call_output that answers no function_call just before it (other calls and outputs between), in OpenAI's Responses words. */
function outputWithoutCall(messages: readonly ChatMessage[], index: number, from: string): AppError {
  const id = messages[index]?.tool_call_id;
  const called = messages.slice(0, index).some((m) => Array.isArray(m.tool_calls) && m.tool_calls.some((c) => isRecord(c) && c.id === id));
  const shown = String(id).slice(0, 128);
  const message = called
    ? `Invalid '${from}': the function_call_output for call_id '${shown}' must follow its function_call, with only other function calls and their outputs between.`
    : `No tool call found for function call output with call_id ${shown}.`;
  return new AppError("invalid_request_error", message, from);
}

const RENAMES: [RegExp, string][] = [
  [/^max_(completion_)?tokens$/, "max_output_tokens"],
  [/^response_format(\.json_schema)?/, "text.format"],
  [/^reasoning_effort$/, "reasoning.effort"],
  [/^tool_choice\.function\.name$/, "tool_choice.name"],
  [/^stream_options.*$/, "stream"],
];

/**
 * A chat field's path → the Responses field it was translated from. `origin`:
 * per chat message, where it came from; `toolOrigin`: per chat tool, its index
 * in the request's tools (they differ when web search tools or allowed_tools
 * left some out).
 */
export function responsesParam(param: string | null, origin: readonly string[], toolOrigin: readonly number[] = []): string | null {
  if (param === null) return null;
  const tool = /^tools\[(\d+)\](?:\.function)?(.*)$/.exec(param);
  if (tool) return `tools[${toolOrigin[Number(tool[1])] ?? tool[1]}]${tool[2]}`;
  const m = /^messages\[(\d+)\](.*)$/.exec(param);
  if (m) {
    const from = origin[Number(m[1])] ?? "input";
    // Within an input item only content part paths line up (one chat part per Responses part).
    const rest = /^\.content\[\d+\]/.exec(m[2] ?? "")?.[0];
    return from.startsWith("input[") && rest ? from + rest : from;
  }
  if (param === "messages") return "input";
  for (const [re, to] of RENAMES) if (re.test(param)) return param.replace(re, to);
  return param;
}

/** A chat service error, re-worded for the Responses request it came from. */
export function responsesError(e: unknown, t: Translation): unknown {
  if (!(e instanceof AppError) || e.param === null) return e;
  const param = t.param(e.param);
  if (param === e.param) return e;
  return new AppError(e.code, e.message.replaceAll(e.param, param ?? ""), param, e.headers);
}
