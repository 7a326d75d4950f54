import { isRecord } from "../lib/guards.ts";
import { contentTail, deltaTail, tokenText } from "./sse.ts";
import type { SimConfig } from "./types.ts";
import { enc, newId, nonNegInt } from "./wire.ts";

/**
 * What a chat request gets for an answer: deterministic text, a tool call,
 * JSON for a response format, or a refusal, with token counts a test can predict.
 */

function messageText(content: unknown): string {
  if (typeof content === "string") return content;
  if (!Array.isArray(content)) return "";
  let s = "";
  for (const part of content) {
    if (isRecord(part) && typeof part.text === "string") s += part.text;
  }
  return s;
}

export function approxTokens(chars: number): number {
  return Math.ceil(chars / 4);
}

/** Deterministic stand-in for a tokenizer: ~4 chars/token plus chat-template overhead. */
function estimatePromptTokens(body: Record<string, unknown>, messages: unknown[]): number {
  let tokens = 3;
  for (const m of messages) {
    tokens += 4;
    if (!isRecord(m)) continue;
    tokens += approxTokens(messageText(m.content).length);
    if (Array.isArray(m.content)) {
      for (const part of m.content) {
        // Image parts: a flat cost, like a low-detail image on OpenAI.
        if (isRecord(part) && part.type === "image_url") tokens += 85;
      }
    }
    if (m.tool_calls !== undefined) tokens += approxTokens(JSON.stringify(m.tool_calls).length);
  }
  if (Array.isArray(body.tools)) tokens += approxTokens(JSON.stringify(body.tools).length);
  return tokens;
}

interface ToolPick {
  name: string;
  parameters: unknown;
}

function pickTool(body: Record<string, unknown>, messages: unknown[]): ToolPick | undefined {
  const tools = Array.isArray(body.tools) ? body.tools : [];
  const fns: ToolPick[] = [];
  for (const t of tools) {
    if (isRecord(t) && isRecord(t.function) && typeof t.function.name === "string") {
      fns.push({ name: t.function.name, parameters: t.function.parameters });
    }
  }
  const first = fns[0];
  if (first === undefined) return undefined;
  const choice = body.tool_choice;
  if (choice === "none") return undefined;
  if (choice === "required") return first;
  if (isRecord(choice) && isRecord(choice.function) && typeof choice.function.name === "string") {
    const wanted = choice.function.name;
    return fns.find((f) => f.name === wanted) ?? { name: wanted, parameters: undefined };
  }
  // "auto": a real model decides; the simulator keys on an obvious trigger word
  // so tests can choose either path deterministically.
  const last = messages[messages.length - 1];
  if (isRecord(last) && last.role === "user" && /\bweather\b/i.test(messageText(last.content))) return first;
  return undefined;
}

/** Produces a value that satisfies common JSON-schema shapes, deterministically. */
function sampleFromSchema(schema: unknown, key: string, depth = 0): unknown {
  if (!isRecord(schema) || depth > 8) return sampleString(key);
  if ("const" in schema) return schema.const;
  if (Array.isArray(schema.enum) && schema.enum.length > 0) return schema.enum[0];
  for (const k of ["anyOf", "oneOf", "allOf"] as const) {
    const alts = schema[k];
    if (Array.isArray(alts) && alts.length > 0) return sampleFromSchema(alts[0], key, depth + 1);
  }
  let type = schema.type;
  if (Array.isArray(type)) type = type.find((t) => t !== "null") ?? "null";
  if (type === undefined && isRecord(schema.properties)) type = "object";
  switch (type) {
    case "object": {
      const out: Record<string, unknown> = {};
      if (isRecord(schema.properties)) {
        for (const [k, sub] of Object.entries(schema.properties)) out[k] = sampleFromSchema(sub, k, depth + 1);
      }
      return out;
    }
    case "array": {
      const n = Math.max(1, nonNegInt(schema.minItems) ?? 1);
      return Array.from({ length: n }, () => sampleFromSchema(schema.items, key, depth + 1));
    }
    case "integer":
      return typeof schema.minimum === "number" ? Math.ceil(schema.minimum) : 1;
    case "number":
      return typeof schema.minimum === "number" ? schema.minimum : 1.5;
    case "boolean":
      return true;
    case "null":
      return null;
    default:
      return sampleString(key);
  }
}

function sampleString(key: string): string {
  if (/location|city|place/i.test(key)) return "Paris";
  if (/unit/i.test(key)) return "celsius";
  return "sim";
}

/** Splits text into ~4-char pieces, mimicking token-granular streaming. */
function splitPieces(s: string): string[] {
  const out: string[] = [];
  for (let i = 0; i < s.length; i += 4) out.push(s.slice(i, i + 4));
  return out;
}

export interface ChatPlan {
  model: string;
  promptTokens: number;
  /** Exactly one of content / tool is set. */
  content: string | null;
  tool: { id: string; name: string; arguments: string } | undefined;
  /** Streaming tails, one per generated token (excluding role and finish chunks). */
  tails: Uint8Array[];
  completionTokens: number;
  finishReason: "stop" | "length" | "tool_calls";
  /** Set when the model declines (see planChat); content is then null. */
  refusal?: string;
  reasoning?: string;
  /** Per generated token, when the request asked for logprobs (plain text answers only). */
  logprobs?: TokenLogprob[];
}

interface TokenLogprob {
  token: string;
  logprob: number;
  bytes: number[];
  top_logprobs: { token: string; logprob: number; bytes: number[] }[];
}

const REFUSAL_TEXT = "I can't help with that.";

/** Deterministic logprobs for a token, with `top` alternatives (the token itself first). */
function logprobOf(token: string, top: number): TokenLogprob {
  const bytes = Array.from(enc.encode(token));
  const alts = Array.from({ length: top }, (_, k) => (k === 0 ? { token, logprob: -0.25, bytes } : { token: `alt${k}`, logprob: -1 - k, bytes: Array.from(enc.encode(`alt${k}`)) }));
  return { token, logprob: -0.25, bytes, top_logprobs: alts };
}

function logprobTail(delta: unknown, lp: TokenLogprob): Uint8Array {
  return enc.encode(`${JSON.stringify(delta)},"logprobs":${JSON.stringify({ content: [lp] })},"finish_reason":null}]}\n\n`);
}

/** Adds the configured reasoning before the answer: its own deltas first when streaming, and its tokens to the count. */
function withReasoning(plan: ChatPlan, pieces: string[], stream: boolean): ChatPlan {
  const reasoning = pieces.join("");
  return {
    ...plan,
    reasoning,
    tails: stream ? [...pieces.map((p) => deltaTail({ reasoning_content: p })), ...plan.tails] : plan.tails,
    completionTokens: plan.completionTokens + pieces.length,
  };
}

export function planChat(cfg: SimConfig, body: Record<string, unknown>, messages: unknown[], stream: boolean): ChatPlan {
  if (!cfg.reasoning) return planAnswer(cfg, body, messages, stream);
  // As vLLM's, reasoning tokens count within max_tokens: the reasoning comes first, the answer gets what is left.
  const limit = nonNegInt(body.max_completion_tokens) ?? nonNegInt(body.max_tokens);
  const pieces = splitPieces(cfg.reasoning);
  if (limit === undefined) return withReasoning(planAnswer(cfg, body, messages, stream), pieces, stream);
  if (limit <= pieces.length) {
    // Cut within the reasoning: no answer at all.
    const model = typeof body.model === "string" ? body.model : (cfg.models[0] ?? "sim");
    const cut: ChatPlan = { model, promptTokens: estimatePromptTokens(body, messages), content: "", tool: undefined, tails: [], completionTokens: 0, finishReason: "length" };
    return withReasoning(cut, pieces.slice(0, limit), stream);
  }
  return withReasoning(planAnswer(cfg, { ...body, max_tokens: limit - pieces.length, max_completion_tokens: undefined }, messages, stream), pieces, stream);
}

function planAnswer(cfg: SimConfig, body: Record<string, unknown>, messages: unknown[], stream: boolean): ChatPlan {
  const model = typeof body.model === "string" ? body.model : (cfg.models[0] ?? "sim");
  const promptTokens = estimatePromptTokens(body, messages);

  // A trigger word, like "weather" for tools: the model declines.
  const last = messages[messages.length - 1];
  if (isRecord(last) && last.role === "user" && /\brefuse\b/i.test(messageText(last.content))) {
    const pieces = splitPieces(REFUSAL_TEXT);
    return {
      model,
      promptTokens,
      content: null,
      tool: undefined,
      tails: stream ? pieces.map((p) => deltaTail({ refusal: p })) : [],
      completionTokens: pieces.length,
      finishReason: "stop",
      refusal: REFUSAL_TEXT,
    };
  }

  const tool = pickTool(body, messages);
  if (tool !== undefined) {
    const args = JSON.stringify(sampleFromSchema(tool.parameters, tool.name));
    const id = newId("call_");
    const tails: Uint8Array[] = [];
    if (stream) {
      // vLLM's tool parsers first announce id/name with empty arguments, then
      // stream argument text in token-sized fragments.
      tails.push(deltaTail({ tool_calls: [{ index: 0, id, type: "function", function: { name: tool.name, arguments: "" } }] }));
      for (const piece of splitPieces(args)) {
        tails.push(deltaTail({ tool_calls: [{ index: 0, function: { arguments: piece } }] }));
      }
    }
    return {
      model,
      promptTokens,
      content: null,
      tool: { id, name: tool.name, arguments: args },
      tails,
      completionTokens: 1 + splitPieces(args).length,
      finishReason: "tool_calls",
    };
  }

  const rf = body.response_format;
  if (isRecord(rf) && (rf.type === "json_object" || rf.type === "json_schema")) {
    // Stays valid JSON even when max_tokens is small: structured-output tests
    // care about parseability, not truncation behaviour.
    const schema = rf.type === "json_schema" && isRecord(rf.json_schema) ? rf.json_schema.schema : undefined;
    const value =
      schema !== undefined
        ? sampleFromSchema(schema, "result")
        : { answer: Array.from({ length: Math.min(cfg.completionTokens, 8) }, (_, i) => `token${i}`).join(" ") };
    const content = JSON.stringify(value);
    const pieces = splitPieces(content);
    return {
      model,
      promptTokens,
      content,
      tool: undefined,
      tails: stream ? pieces.map((p) => deltaTail({ content: p })) : [],
      completionTokens: pieces.length,
      finishReason: "stop",
    };
  }

  // vLLM gives max_completion_tokens precedence over the legacy max_tokens.
  const limit = nonNegInt(body.max_completion_tokens) ?? nonNegInt(body.max_tokens);
  const n = limit !== undefined ? Math.min(limit, cfg.completionTokens) : cfg.completionTokens;
  const tails: Uint8Array[] = [];
  let content = "";
  // Logprobs only when asked for, so the common path keeps its shared, pre-encoded tails.
  const logprobs = body.logprobs === true ? Array.from({ length: n }, (_, i) => logprobOf(tokenText(i), nonNegInt(body.top_logprobs) ?? 0)) : undefined;
  if (stream) {
    for (let i = 0; i < n; i++) {
      const lp = logprobs?.[i];
      tails.push(lp ? logprobTail({ content: tokenText(i) }, lp) : contentTail(i));
    }
  }
  else for (let i = 0; i < n; i++) content += tokenText(i);
  return {
    model,
    promptTokens,
    content,
    tool: undefined,
    tails,
    completionTokens: n,
    finishReason: n < cfg.completionTokens ? "length" : "stop",
    ...(logprobs ? { logprobs } : {}),
  };
}
