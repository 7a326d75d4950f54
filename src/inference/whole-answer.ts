import { isRecord } from "../lib/guards.ts";

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
  const head = {
    id: typeof v.id === "string" ? v.id : "",
    object: "chat.completion.chunk",
    created: typeof v.created === "number" && Number.isSafeInteger(v.created) ? v.created : Math.floor(Date.now() / 1000),
    model: alias,
  };
  const events: string[] = [];
  const event = (extra: Record<string, unknown>) => events.push(`data: ${JSON.stringify({ ...head, ...extra })}\n\n`);
  v.choices.forEach((c: unknown, i: number) => {
    const choice = isRecord(c) ? c : {};
    const index = typeof choice.index === "number" && Number.isSafeInteger(choice.index) ? choice.index : i;
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
