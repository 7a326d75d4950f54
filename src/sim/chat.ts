/** `POST /v1/chat/completions`: a JSON answer after the whole generation time, or an SSE stream token by token. */

import { isRecord } from "../lib/guards.ts";
import { admit } from "./faults.ts";
import type { Job, SimState } from "./job.ts";
import { type ChatPlan, planChat } from "./plan.ts";
import { DONE_BYTES, finishTail, MALFORMED_BYTES, ROLE_TAIL } from "./sse.ts";
import type { Fault, SimConfig } from "./types.ts";
import { DROP_FLUSH_MS, enc, errorResponse, finishJson, GONE, newId, nonNegInt, resetStream, SSE_HEADERS, usageOf } from "./wire.ts";

/**
 * vLLM's `n`: that many choices, each generated as the plan says (up to
 * max_tokens each), so the completion count is n times one choice's.
 */
function choiceCount(body: Record<string, unknown>): number {
  return Math.max(1, nonNegInt(body.n) ?? 1);
}

function streamChat(job: Job, cfg: SimConfig, plan: ChatPlan, fault: Fault | null, includeUsage: boolean, choices: number): Response {
  const id = newId("chatcmpl-");
  const created = Math.floor(Date.now() / 1000);
  const head = `{"id":"${id}","object":"chat.completion.chunk","created":${created},"model":${JSON.stringify(plan.model)}`;
  // One prefix per choice: vLLM sends each choice's tokens in chunks of their own, by index.
  const prefixes = Array.from({ length: choices }, (_, k) => enc.encode(`data: ${head},"choices":[{"index":${k},"delta":`));
  const tails = plan.tails;
  const n = tails.length;
  const dropAfter = fault?.kind === "drop-mid-stream" ? fault.afterChunks : -1;
  const malformed = fault?.kind === "malformed-sse";
  const interTokenMs = cfg.interTokenMs;

  let ctrl: ReadableStreamDefaultController<Uint8Array> | undefined;
  let next = -1; // -1 = role chunk pending, 0..n-1 = token tails
  let sent = 0;

  const drop = (): void => {
    // Let the bytes already enqueued reach the socket first; erroring in the
    // same tick would discard them (or even the response head).
    job.setTimeout(() => {
      job.finish();
      if (ctrl !== undefined) resetStream(ctrl);
    }, DROP_FLUSH_MS);
  };

  /** Enqueues one chunk per choice; returns false if the drop fault fired. */
  const push = (tail: Uint8Array): boolean => {
    if (ctrl === undefined) return false;
    for (const prefix of prefixes) {
      const buf = new Uint8Array(prefix.length + tail.length);
      buf.set(prefix, 0);
      buf.set(tail, prefix.length);
      ctrl.enqueue(buf);
    }
    if (++sent === dropAfter) {
      drop();
      return false;
    }
    return true;
  };

  const complete = (): void => {
    if (ctrl === undefined) return;
    if (!push(finishTail(plan.finishReason))) return;
    if (includeUsage) {
      ctrl.enqueue(enc.encode(`data: ${head},"choices":[],"usage":${JSON.stringify(usageOf(plan, choices))}}\n\n`));
    }
    ctrl.enqueue(DONE_BYTES);
    job.finish();
    ctrl.close();
  };

  // One step per token. vLLM emits the role chunk together with the first
  // token (at TTFT) while headers go out immediately, so TTFT measured by a
  // client is the arrival of the first content.
  const step = (): boolean => {
    if (job.done || ctrl === undefined) return false;
    if (next === -1) {
      if (dropAfter === 0) {
        drop();
        return false;
      }
      if (!push(ROLE_TAIL)) return false;
      if (malformed) ctrl.enqueue(MALFORMED_BYTES);
      next = 0;
    }
    if (next < n) {
      const tail = tails[next++];
      if (tail !== undefined && !push(tail)) return false;
    }
    if (next >= n) {
      complete();
      return false;
    }
    return true;
  };

  const firstTick = (): void => {
    if (!step()) return;
    if (interTokenMs <= 0) {
      while (step()) {
        // Drain synchronously: zero inter-token latency means one burst.
      }
      return;
    }
    job.setInterval(step, interTokenMs);
  };

  const body = new ReadableStream<Uint8Array>({
    start(c) {
      ctrl = c;
      job.onCancel = () => resetStream(c);
      if (cfg.ttftMs > 0) job.setTimeout(firstTick, cfg.ttftMs);
      else queueMicrotask(firstTick);
    },
    cancel() {
      job.abort();
    },
  });
  return new Response(body, { headers: SSE_HEADERS });
}

export async function chat(state: SimState, req: Request): Promise<Response> {
  const a = await admit(state, req);
  if ("res" in a) return a.res;
  const { job, body, fault: f } = a;
  const messages = body.messages;
  if (!Array.isArray(messages) || messages.length === 0) {
    job.finish();
    return errorResponse(state.cfg, 400, "messages must be a non-empty array");
  }
  const maxTokens = body.max_completion_tokens ?? body.max_tokens;
  if (maxTokens !== undefined && maxTokens !== null && !(typeof maxTokens === "number" && maxTokens >= 1)) {
    job.finish();
    return errorResponse(state.cfg, 400, "max_tokens must be at least 1");
  }
  const stream = body.stream === true;
  const plan = planChat(state.cfg, body, messages, stream);
  const choices = choiceCount(body);

  if (stream) {
    const so = body.stream_options;
    return streamChat(job, state.cfg, plan, f, isRecord(so) && so.include_usage === true, choices);
  }

  // Non-streamed latency approximates a full generation: TTFT + decode time.
  const latency = state.cfg.ttftMs + state.cfg.interTokenMs * Math.max(0, plan.completionTokens - 1);
  if (!(await job.wait(latency))) return GONE();
  const message =
    plan.tool !== undefined
      ? {
          role: "assistant",
          content: null,
          tool_calls: [
            { id: plan.tool.id, type: "function", function: { name: plan.tool.name, arguments: plan.tool.arguments } },
          ],
        }
      : { role: "assistant", content: plan.content, tool_calls: [] };
  const shown: Record<string, unknown> = { ...message };
  if (plan.refusal !== undefined) shown.refusal = plan.refusal;
  if (plan.reasoning !== undefined) shown.reasoning_content = plan.reasoning;
  return finishJson(job, f, {
    id: newId("chatcmpl-"),
    object: "chat.completion",
    created: Math.floor(Date.now() / 1000),
    model: plan.model,
    choices: Array.from({ length: choices }, (_, index) => ({
      index,
      message: shown,
      logprobs: plan.logprobs ? { content: plan.logprobs } : null,
      finish_reason: plan.finishReason,
      stop_reason: null,
    })),
    usage: usageOf(plan, choices),
    prompt_logprobs: null,
  });
}
