import { isRecord } from "../lib/guards.ts";
import { sseDataOf } from "../lib/sse.ts";
import { deliveredTokens, utf8 } from "./tokens.ts";
import { type Counted, MAX_TOKEN_COUNT, type UsageBounds, countUsage } from "./usage.ts";

/**
 * A streamed request answered with one JSON document: servers that do not
 * stream (or ignore `stream: true`) send the whole chat completion, and some
 * send an error object with a 200. The completion becomes the SSE events a
 * streaming server would have sent (each choice's delta, its finish_reason,
 * the usage chunk, `[DONE]`), which the relay then reads as any other stream:
 * metered, bounded, model named by its alias, translated for the Responses
 * API. Before, the answer was held unread and the stream failed "ended
 * early", the client got an error and the generated tokens were not charged.
 */
/** The most a `created` may be: clients read it as an unsigned 32-bit count of seconds (async-openai's u32), up to 2106. */
const MAX_CREATED = 2 ** 32 - 1;

/**
 * An upstream answer's `created`, when it is a whole number of seconds from 0
 * to MAX_CREATED; else the time now. A number written as `1e+308`, or a
 * fraction, is no integer to a strict client (a u32 or i64 field).
 */
export function createdOf(v: unknown): number {
  return typeof v === "number" && Number.isInteger(v) && v >= 0 && v <= MAX_CREATED ? v : Math.floor(Date.now() / 1000);
}

/**
 * Each choice's `index` (undefined for an entry that is no object): its own when it is a whole number
 * below the number of choices and no earlier choice has it, else its position when no choice has that,
 * else the lowest index none has. Never two choices with one index: a server that numbers every choice
 * 0 had its choices merged into one by a client that keys them by index (the openai SDK's stream of an
 * answer sent whole).
 */
export function choiceIndices(all: readonly unknown[]): (number | undefined)[] {
  const out = new Array<number | undefined>(all.length).fill(undefined);
  const taken = new Set<number>();
  for (let i = 0; i < all.length; i++) {
    const c = all[i];
    if (!isRecord(c)) continue;
    const v = c.index;
    if (typeof v === "number" && Number.isInteger(v) && v >= 0 && v < all.length && !taken.has(v)) {
      out[i] = v;
      taken.add(v);
    }
  }
  let free = 0;
  for (let i = 0; i < all.length; i++) {
    if (out[i] !== undefined || !isRecord(all[i])) continue;
    let k = i;
    if (taken.has(k)) {
      while (taken.has(free)) free++;
      k = free;
    }
    out[i] = k;
    taken.add(k);
  }
  return out;
}

export type WholeAnswer = { events: Buffer } | { error: true } | undefined;

export function wholeAnswer(body: Buffer, alias: string): WholeAnswer {
  let v: unknown;
  try {
    v = JSON.parse(body.toString("utf8"));
  } catch {
    return undefined;
  }
  if (!isRecord(v)) return undefined;
  if (!Array.isArray(v.choices)) return "error" in v || v.object === "error" || "detail" in v ? { error: true } : undefined;
  // No choice that is an object: no answer (a JSON answer to a non-streamed request with none is unreadable too).
  const all: unknown[] = v.choices;
  if (!all.some(isRecord)) return undefined;
  const head = {
    id: typeof v.id === "string" ? v.id : "",
    object: "chat.completion.chunk",
    created: createdOf(v.created),
    model: alias,
  };
  const events: string[] = [];
  const event = (extra: Record<string, unknown>) => events.push(`data: ${JSON.stringify({ ...head, ...extra })}\n\n`);
  const indices = choiceIndices(all);
  all.forEach((c: unknown, i: number) => {
    if (!isRecord(c)) return;
    const choice = c;
    const index = indices[i] ?? i;
    const m = isRecord(choice.message) ? choice.message : {};
    const delta: Record<string, unknown> = { role: "assistant" };
    for (const k of ["content", "refusal", "reasoning_content", "reasoning"] as const) if (typeof m[k] === "string") delta[k] = m[k];
    if (Array.isArray(m.tool_calls) && m.tool_calls.length > 0) {
      delta.tool_calls = m.tool_calls.map((t: unknown, k: number) => (isRecord(t) ? { index: k, ...t } : { index: k }));
    }
    event({ choices: [{ index, delta, logprobs: choice.logprobs ?? null, finish_reason: null }] });
    event({ choices: [{ index, delta: {}, logprobs: null, finish_reason: typeof choice.finish_reason === "string" ? choice.finish_reason : "stop" }] });
  });
  if (isRecord(v.usage)) event({ choices: [], usage: v.usage });
  events.push("data: [DONE]\n\n");
  return { events: Buffer.from(events.join("")) };
}

interface Acc {
  content: string[];
  reasoning: string[];
  refusal: string[];
  calls: Map<number, { id?: unknown; type?: unknown; name: string; arguments: string }>;
  finish: string | null;
  logprobs: unknown[] | undefined;
}

/**
 * UTF-8 bytes of an answer's generated text up to and including its last usage report's event (`before`), and after it
 * (`after`); and its events of text, each at least one generated token (deliveredTokens, stream.ts): all of them
 * (`events`, with or without a report) and those after the report (`eventsAfter`).
 */
export interface ReportedText {
  before: number;
  after: number;
  events: number;
  eventsAfter: number;
}

/**
 * The other way round: a non-streamed request answered with SSE (a server
 * that streams whatever it is asked). The chunks are put together into the
 * chat completion they stand for (each choice's text, reasoning, refusal and
 * tool calls, its last finish_reason, the last usage), which is then shaped,
 * metered and bounded as any JSON answer. Undefined when the text is not SSE
 * chunks (no event with data, or data that is not a chunk); `{ error }` when
 * it carries an error event (`{"error"…}`, `{"object":"error"…}` or FastAPI's
 * `{"detail"…}`, as a JSON answer's error is read).
 *
 * The completion's `usage` is the upstream's last report as it sent it (with
 * the prompt count of an earlier report when it leaves that out): only
 * figures the upstream sent, so that a warning about them (usage.ts) names
 * nothing else. Text after that report (a server that reports on the first or
 * on every chunk and never sends a final one) is not in it: `reported` gets
 * the bytes of text before and after the report, and countTextAfterReport
 * adds the latter to the checked count, ~4 bytes a token, as the stream relay
 * adds text delivered after a report (stream.ts). Before, such an answer was
 * charged, and told, the count of the report alone (1 token for 404
 * characters, inference-usage.test.ts). `[DONE]` ends the answer, as it ends
 * a stream: text, usage and errors sent after it are dropped (before, they
 * were put into the answer and charged, or failed it).
 */
export function sseAsCompletion(text: string, reported?: ReportedText): Record<string, unknown> | { error: string } | undefined {
  const choices = new Map<number, Acc>();
  let head: Record<string, unknown> | undefined;
  let usage: Record<string, unknown> | undefined;
  /** UTF-8 bytes of generated text up to and including the last usage report's event, and after it (the estimates count bytes, tokens.ts). */
  let before = 0;
  let unreported = 0;
  /** Events of text in all, and since the last report. */
  let events = 0;
  let eventsUnreported = 0;
  // Read as the SSE standard reads it (lib/sse.ts): an event the body ends before its blank line is none.
  for (const data of sseDataOf(text)) {
    // [DONE] ends the answer: what follows is neither in it nor charged, as the stream relay drops it (stream.ts).
    if (data === "[DONE]") break;
    // Empty data is no chunk (as the chat relay passes it over).
    if (data === "") continue;
    let v: unknown;
    try {
      v = JSON.parse(data);
    } catch {
      return undefined;
    }
    if (!isRecord(v)) return undefined;
    // The three error shapes wholeAnswer and upstreamMessage read: vLLM's two and FastAPI's `detail`.
    if (!Array.isArray(v.choices)) return "error" in v || v.object === "error" || "detail" in v ? { error: data } : undefined;
    head ??= v;
    let bytes = 0;
    for (const c of v.choices) {
      if (!isRecord(c)) continue;
      const index = typeof c.index === "number" && Number.isSafeInteger(c.index) && c.index >= 0 && c.index < 128 ? c.index : 0;
      let acc = choices.get(index);
      if (!acc) {
        acc = { content: [], reasoning: [], refusal: [], calls: new Map(), finish: null, logprobs: undefined };
        choices.set(index, acc);
      }
      const d = isRecord(c.delta) ? c.delta : {};
      if (typeof d.content === "string") {
        acc.content.push(d.content);
        bytes += utf8(d.content);
      }
      const reasoning = typeof d.reasoning_content === "string" ? d.reasoning_content : d.reasoning;
      if (typeof reasoning === "string") {
        acc.reasoning.push(reasoning);
        bytes += utf8(reasoning);
      }
      if (typeof d.refusal === "string") {
        acc.refusal.push(d.refusal);
        bytes += utf8(d.refusal);
      }
      if (Array.isArray(d.tool_calls)) {
        for (const t of d.tool_calls) {
          if (!isRecord(t)) continue;
          const k = typeof t.index === "number" && Number.isSafeInteger(t.index) && t.index >= 0 && t.index < 128 ? t.index : 0;
          let call = acc.calls.get(k);
          if (!call) {
            call = { name: "", arguments: "" };
            acc.calls.set(k, call);
          }
          call.id ??= t.id;
          call.type ??= t.type;
          const fn = isRecord(t.function) ? t.function : {};
          if (typeof fn.name === "string") call.name += fn.name;
          // Arguments sent parsed (an object or an array) are their JSON text, as in any answer (decisions.md).
          const args = typeof fn.arguments === "string" ? fn.arguments : typeof fn.arguments === "object" && fn.arguments !== null ? JSON.stringify(fn.arguments) : "";
          call.arguments += args;
          bytes += utf8(args);
        }
      }
      if (typeof c.finish_reason === "string") acc.finish = c.finish_reason;
      if (isRecord(c.logprobs) && Array.isArray(c.logprobs.content)) {
        acc.logprobs ??= [];
        // One by one: spreading an array of any length into push() can overflow the stack.
        for (const lp of c.logprobs.content) acc.logprobs.push(lp);
      }
    }
    if (bytes > 0) {
      events++;
      eventsUnreported++;
    }
    // A report counts the text of its own event (as the relay counts it); what follows is not in it.
    if (isRecord(v.usage)) {
      // A report that leaves the prompt out (reported on the first chunk, the completion on the last) keeps the earlier count, as the relay does.
      usage = v.usage.prompt_tokens === undefined && usage?.prompt_tokens !== undefined ? { ...v.usage, prompt_tokens: usage.prompt_tokens } : v.usage;
      before += unreported + bytes;
      unreported = 0;
      eventsUnreported = 0;
    } else unreported += bytes;
  }
  if (!head) return undefined;
  if (reported) {
    reported.before = usage ? before : 0;
    reported.after = usage ? unreported : 0;
    reported.events = events;
    reported.eventsAfter = usage ? eventsUnreported : 0;
  }
  return {
    id: head.id,
    created: head.created,
    choices: [...choices.entries()]
      .sort(([a], [b]) => a - b)
      .map(([index, acc]) => {
        const message: Record<string, unknown> = { role: "assistant", content: acc.content.length > 0 ? acc.content.join("") : null };
        if (acc.reasoning.length > 0) message.reasoning_content = acc.reasoning.join("");
        if (acc.refusal.length > 0) message.refusal = acc.refusal.join("");
        if (acc.calls.size > 0) {
          message.tool_calls = [...acc.calls.entries()]
            .sort(([a], [b]) => a - b)
            .map(([, c]) => ({ id: c.id, type: c.type ?? "function", function: { name: c.name, arguments: c.arguments } }));
        }
        return { index, message, logprobs: acc.logprobs ? { content: acc.logprobs } : null, finish_reason: acc.finish ?? "stop" };
      }),
    ...(usage !== undefined ? { usage } : {}),
  };
}

/**
 * The counts of an answer whose last usage report text followed
 * (`reported.after` bytes): the report checked as the upstream sent it
 * (countUsage, the completion's estimate being the text before it, so a 0
 * sent before any text is a count, not a placeholder), then the text after
 * it added, ~4 bytes a token, never past the completion's bound: what the
 * relay charges a stream that did the same (stream.ts, service.ts). The
 * warnings `rejected` calls for name only what the upstream sent. Before,
 * the text was added to the report first and the sum checked, so a sum past
 * the bound was logged as "implausible usage" the upstream had sent (101
 * completion tokens, where it had sent 1).
 */
export function countTextAfterReport(usage: Record<string, unknown>, promptEstimate: number, reported: ReportedText, bounds: UsageBounds): Counted {
  const counted = countUsage(usage, { promptTokens: promptEstimate, completionTokens: deliveredTokens(reported.before, reported.events - reported.eventsAfter) }, bounds);
  const completionTokens = Math.min(bounds.completionTokens, MAX_TOKEN_COUNT, counted.completionTokens + deliveredTokens(reported.after, reported.eventsAfter));
  return { ...counted, completionTokens };
}
