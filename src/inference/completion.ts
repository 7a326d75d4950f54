import { isRecord } from "../lib/guards.ts";
import { stringBytes } from "./tokens.ts";
import { choiceIndices, createdOf } from "./whole-answer.ts";

/**
 * A chat JSON answer from the upstream -> spec 2.3's shape (the non-streamed
 * chat answer): choices, messages, tool calls and logprobs in the shape the
 * SDKs read, and the generated text's bytes for the estimate when the
 * upstream reports no usage.
 */

/** A message's text fields passed through as sent. */
const PASSED_TEXT = ["reasoning_content", "reasoning", "refusal"] as const;

/**
 * A tool call in the shape the SDKs read (the openai SDK's and the Vercel AI
 * SDK's types: `id` a string, `type` "function", `function.name` and
 * `function.arguments` strings), or undefined for an entry that is not an
 * object (it carries no call). Arguments sent as a JSON object or array
 * (some OpenAI-compatible servers send them parsed) become their JSON text;
 * any other value that is not a string, "". A missing or non-string id is a
 * new `call_…`, a name that is not a string "". Other fields as sent.
 */
function shapeToolCall(call: unknown): Record<string, unknown> | undefined {
  if (!isRecord(call)) return undefined;
  const fn = isRecord(call.function) ? call.function : {};
  const args = fn.arguments;
  const text = typeof args === "string" ? args : typeof args === "object" && args !== null ? JSON.stringify(args) : "";
  const id = typeof call.id === "string" && call.id !== "" ? call.id : `call_${crypto.randomUUID().replaceAll("-", "").slice(0, 24)}`;
  return { ...call, id, type: "function", function: { ...fn, name: typeof fn.name === "string" ? fn.name : "", arguments: text } };
}

/** A logprob entry's bytes when they are a list of byte values, else null. */
const bytesOf = (v: unknown): number[] | null =>
  Array.isArray(v) && v.every((b) => typeof b === "number" && Number.isInteger(b) && b >= 0 && b <= 255) ? (v as number[]) : null;

/** One token's logprob as the SDKs read it ({token, logprob, bytes}), or undefined when it is no token with a finite logprob. */
function tokenLogprob(v: unknown): { token: string; logprob: number; bytes: number[] | null } | undefined {
  if (!isRecord(v) || typeof v.token !== "string" || typeof v.logprob !== "number" || !Number.isFinite(v.logprob)) return undefined;
  return { token: v.token, logprob: v.logprob, bytes: bytesOf(v.bytes) };
}

/** A list of logprob entries, each with its top_logprobs; entries that are no token left out; null when not a list. */
function logprobList(v: unknown): Record<string, unknown>[] | null {
  if (!Array.isArray(v)) return null;
  const out: Record<string, unknown>[] = [];
  for (const e of v) {
    const t = tokenLogprob(e);
    if (!t) continue;
    const top: unknown[] = [];
    const sent = (e as Record<string, unknown>).top_logprobs;
    if (Array.isArray(sent)) for (const x of sent) {
      const tt = tokenLogprob(x);
      if (tt) top.push(tt);
    }
    out.push({ ...t, top_logprobs: top });
  }
  return out;
}

/**
 * A choice's `logprobs` in the shape the SDKs read (`{content, refusal}`,
 * each a list of entries or null): null when it is not an object, and
 * entries that are not a token with a finite logprob left out, at either
 * depth. The Vercel AI SDK refuses a whole answer for one such entry.
 */
function shapeLogprobs(v: unknown): Record<string, unknown> | null {
  if (!isRecord(v)) return null;
  return { content: logprobList(v.content), refusal: logprobList(v.refusal) };
}

/** What a choice without a message object is read as (never written to). */
const NO_MESSAGE: Record<string, unknown> = Object.freeze({});

/**
 * Spec 2.3 with `model` = the alias; tool calls (their arguments as text),
 * finish reasons, reasoning text and requested logprobs pass through.
 * `message.refusal` and `logprobs` are always sent, null when the upstream
 * sent none, as OpenAI sends them.
 */
export function shapeCompletion(raw: unknown, alias: string): { out: Record<string, unknown>; completionBytes: number } | undefined {
  if (!isRecord(raw) || !Array.isArray(raw.choices)) return undefined;
  let completionBytes = 0;
  const choices: Record<string, unknown>[] = [];
  const sent: unknown[] = raw.choices;
  // One choice (the usual answer) is index 0 whatever it says: no list or set of indices made for it.
  const indices = sent.length > 1 ? choiceIndices(sent) : undefined;
  // Indexed loops, and a list of tool calls only for a message that has some: no closure, iterator or array a choice.
  for (let i = 0; i < sent.length; i++) {
    const c = sent[i];
    // An entry that is not an object carries no answer; an answer with none is no answer (unreadable).
    if (!isRecord(c)) continue;
    const choice = c;
    const m = isRecord(choice.message) ? choice.message : NO_MESSAGE;
    const content = typeof m.content === "string" ? m.content : null;
    completionBytes += stringBytes(content);
    const message: Record<string, unknown> = { role: "assistant", content, refusal: null };
    if (Array.isArray(m.tool_calls)) {
      const calls: Record<string, unknown>[] = [];
      for (const sent of m.tool_calls) {
        const call = shapeToolCall(sent);
        if (!call) continue;
        calls.push(call);
        // Each call's arguments (as text), as a stream of the same answer counts them (chunk-bytes.ts): the
        // call's JSON around them is the gateway's serialisation, not generated text. Before, that JSON
        // was counted too, so the same answer was charged ~16 tokens a call more whole than streamed.
        completionBytes += stringBytes((call.function as Record<string, unknown>).arguments);
      }
      if (calls.length > 0) message.tool_calls = calls;
    }
    for (let k = 0; k < PASSED_TEXT.length; k++) {
      const field = PASSED_TEXT[k] as (typeof PASSED_TEXT)[number];
      if (typeof m[field] === "string") message[field] = m[field];
    }
    // Generated text too, for the estimate when the upstream reports no usage; the reasoning once under either name.
    completionBytes += Math.max(stringBytes(m.reasoning_content), stringBytes(m.reasoning)) + stringBytes(m.refusal);
    choices.push({
      index: indices ? (indices[i] ?? i) : 0,
      message,
      logprobs: shapeLogprobs(choice.logprobs),
      finish_reason: typeof choice.finish_reason === "string" ? choice.finish_reason : "stop",
    });
  }
  if (choices.length === 0) return undefined;
  return {
    out: {
      id: typeof raw.id === "string" ? raw.id : `chatcmpl-${crypto.randomUUID().replaceAll("-", "")}`,
      object: "chat.completion",
      created: createdOf(raw.created),
      model: alias,
      choices,
    },
    completionBytes,
  };
}
