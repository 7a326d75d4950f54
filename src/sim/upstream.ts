/**
 * Simulated vLLM-compatible upstream used by tests, benchmarks and demo mode.
 *
 * Built on plain `Bun.serve` + `ReadableStream` rather than Elysia: the
 * benchmark pushes ~10k concurrent slow streams through this process, so the
 * hot path avoids routing layers, per-chunk JSON serialisation and
 * per-stream timer churn. The wire format mirrors vLLM's OpenAI server.
 */

import { isRecord } from "../lib/guards.ts";

export interface SimOptions {
  port?: number;
  hostname?: string;
  /** Delay before the first generated token (also the latency of embeddings). */
  ttftMs?: number;
  /** Delay between consecutive streamed tokens. 0 = emit everything at once. */
  interTokenMs?: number;
  /** Tokens generated per completion before max_tokens clipping. */
  completionTokens?: number;
  /** If set, every /v1/* request must carry `Authorization: Bearer <apiKey>`. */
  apiKey?: string;
  /** Model ids advertised by GET /v1/models (any id is accepted in requests). */
  models?: string[];
  /**
   * Error body shape. "legacy" = `{object:"error",message,type,param,code}`
   * (vLLM <= 0.10.1); "nested" = `{error:{message,type,param,code}}`
   * (current vLLM). Gateways meet both in the wild.
   */
  errorFormat?: "legacy" | "nested";
  /**
   * Reasoning text sent before every chat answer, as vLLM's reasoning parsers
   * do (`reasoning_content` in the message, or in deltas when streaming).
   */
  reasoning?: string;
}

/** Statuses a status fault may answer with: overload and failures, a bad request, and a misconfigured target's 401/403/404/405. */
export type FaultStatus = 500 | 503 | 429 | 400 | 401 | 403 | 404 | 405 | 502 | 504;

export type Fault =
  | { kind: "status"; status: FaultStatus; count?: number; message?: string }
  | { kind: "hang" }
  | { kind: "slow-headers"; ms: number }
  | { kind: "drop-mid-stream"; afterChunks: number }
  | { kind: "malformed-sse" }
  | { kind: "refuse" };

export interface SimStats {
  /** Inference requests (chat + embeddings) that reached the simulator. */
  requests: number;
  /** Inference requests whose client went away before the response finished. */
  aborts: number;
  /** Inference requests currently being served (including open streams). */
  inFlight: number;
  lastBody: unknown;
  /** The request headers of the most recent inference request, as received. */
  lastHeaders: Headers | undefined;
  /** Most recent parsed request bodies, oldest first, capped at 50. */
  bodies: unknown[];
}

export interface Simulator {
  port: number;
  /** Base URL including `/v1`, ready for an OpenAI client's baseURL. */
  url: string;
  stop(): Promise<void>;
  stats: SimStats;
  setFault(f: Fault | null): void;
  /** Clears stats and fault and restores the options given at start. */
  reset(): void;
}

export const DEFAULT_SIM_MODELS: readonly string[] = ["meta-llama/Llama-3.1-8B-Instruct", "BAAI/bge-m3"];
export const SIM_EMBEDDING_DIMS = 1024;
const MAX_MODEL_LEN = 32768;
const BODY_HISTORY = 50;
/** Grace period between the last bytes of a dropped response and the reset. */
const DROP_FLUSH_MS = 10;

interface Config {
  ttftMs: number;
  interTokenMs: number;
  completionTokens: number;
  apiKey: string | undefined;
  models: string[];
  errorFormat: "legacy" | "nested";
  reasoning: string | undefined;
}

type Usage = { prompt_tokens: number; completion_tokens: number; total_tokens: number };

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

const enc = new TextEncoder();

function nonNegInt(v: unknown): number | undefined {
  return typeof v === "number" && Number.isFinite(v) && v >= 0 ? Math.floor(v) : undefined;
}

const JSON_HEADERS = { "content-type": "application/json" };
const SSE_HEADERS = { "content-type": "text/event-stream; charset=utf-8" };

// Ids only need to be unique per process; a random stem plus a counter avoids
// a UUID allocation per request.
const idStem = Math.random().toString(16).slice(2, 10);
let idSeq = 0;
function newId(prefix: string): string {
  return `${prefix}${idStem}${(++idSeq).toString(16).padStart(8, "0")}`;
}

const ERROR_TYPES: Record<number, string> = {
  400: "BadRequestError",
  401: "AuthenticationError",
  403: "PermissionDeniedError",
  404: "NotFoundError",
  405: "MethodNotAllowedError",
  429: "RateLimitError",
  500: "InternalServerError",
  502: "BadGatewayError",
  503: "ServiceUnavailableError",
  504: "GatewayTimeoutError",
};

function errorResponse(cfg: Config, status: number, message: string): Response {
  const type = ERROR_TYPES[status] ?? "InternalServerError";
  const body =
    cfg.errorFormat === "nested"
      ? { error: { message, type, param: null, code: status } }
      : { object: "error", message, type, param: null, code: status };
  return Response.json(body, { status });
}

// ---------------------------------------------------------------------------
// Pre-encoded SSE fragments. A chunk on the wire is `prefix + tail`, where the
// prefix (id/created/model) is encoded once per stream and tails are shared
// across all streams, so each emitted chunk costs exactly one allocation.
// ---------------------------------------------------------------------------

const TAIL_OPEN = ',"logprobs":null,"finish_reason":';
const ROLE_TAIL = enc.encode(`{"role":"assistant","content":""}${TAIL_OPEN}null}]}\n\n`);
const DONE_BYTES = enc.encode("data: [DONE]\n\n");
const MALFORMED_BYTES = enc.encode("data: {not json\n\n");

const tokenText = (i: number): string => `token${i} `;
const contentTails: Uint8Array[] = [];
function contentTail(i: number): Uint8Array {
  let t = contentTails[i];
  if (t === undefined) {
    t = enc.encode(`{"content":"${tokenText(i)}"}${TAIL_OPEN}null}]}\n\n`);
    contentTails[i] = t;
  }
  return t;
}

const finishTails = new Map<string, Uint8Array>();
function finishTail(reason: string): Uint8Array {
  let t = finishTails.get(reason);
  if (t === undefined) {
    t = enc.encode(`{}${TAIL_OPEN}"${reason}"}]}\n\n`);
    finishTails.set(reason, t);
  }
  return t;
}

function deltaTail(delta: unknown): Uint8Array {
  return enc.encode(`${JSON.stringify(delta)}${TAIL_OPEN}null}]}\n\n`);
}

// ---------------------------------------------------------------------------
// Request interpretation
// ---------------------------------------------------------------------------

function messageText(content: unknown): string {
  if (typeof content === "string") return content;
  if (!Array.isArray(content)) return "";
  let s = "";
  for (const part of content) {
    if (isRecord(part) && typeof part.text === "string") s += part.text;
  }
  return s;
}

function approxTokens(chars: number): number {
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

interface ChatPlan {
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
function withReasoning(plan: ChatPlan, reasoning: string | undefined, stream: boolean): ChatPlan {
  if (!reasoning) return plan;
  const pieces = splitPieces(reasoning);
  return {
    ...plan,
    reasoning,
    tails: stream ? [...pieces.map((p) => deltaTail({ reasoning_content: p })), ...plan.tails] : plan.tails,
    completionTokens: plan.completionTokens + pieces.length,
  };
}

function planChat(cfg: Config, body: Record<string, unknown>, messages: unknown[], stream: boolean): ChatPlan {
  return withReasoning(planAnswer(cfg, body, messages, stream), cfg.reasoning, stream);
}

function planAnswer(cfg: Config, body: Record<string, unknown>, messages: unknown[], stream: boolean): ChatPlan {
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

function usageOf(plan: { promptTokens: number; completionTokens: number }): Usage {
  return {
    prompt_tokens: plan.promptTokens,
    completion_tokens: plan.completionTokens,
    total_tokens: plan.promptTokens + plan.completionTokens,
  };
}

// ---------------------------------------------------------------------------
// Embeddings
// ---------------------------------------------------------------------------

function fnv1a(s: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < s.length; i++) {
    h ^= s.charCodeAt(i);
    h = Math.imul(h, 0x01000193);
  }
  return h >>> 0;
}

/** Unit-length vector seeded by the text, so equal inputs embed identically. */
function embedVector(text: string, dims: number): Float32Array {
  let state = fnv1a(text) || 1;
  const v = new Float32Array(dims);
  let norm = 0;
  for (let i = 0; i < dims; i++) {
    // mulberry32: cheap, well-distributed, and deterministic across runs.
    state = (state + 0x6d2b79f5) | 0;
    let t = Math.imul(state ^ (state >>> 15), 1 | state);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    const x = ((t ^ (t >>> 14)) >>> 0) / 4294967296 - 0.5;
    v[i] = x;
    norm += x * x;
  }
  const inv = 1 / Math.sqrt(norm || 1);
  for (let i = 0; i < dims; i++) v[i] = (v[i] ?? 0) * inv;
  return v;
}

type EmbedInput = { key: string; tokens: number };

function parseEmbedInput(input: unknown): EmbedInput[] | string {
  const isTokenArray = (a: unknown): a is number[] => Array.isArray(a) && a.every((x) => typeof x === "number");
  if (typeof input === "string") return [{ key: input, tokens: Math.max(1, approxTokens(input.length)) }];
  if (isTokenArray(input) && input.length > 0) return [{ key: `tok:${input.join(",")}`, tokens: input.length }];
  if (Array.isArray(input) && input.length > 0) {
    const out: EmbedInput[] = [];
    for (const item of input) {
      if (typeof item === "string") out.push({ key: item, tokens: Math.max(1, approxTokens(item.length)) });
      else if (isTokenArray(item) && item.length > 0) out.push({ key: `tok:${item.join(",")}`, tokens: item.length });
      else return "input must be a string, an array of strings, or an array of token arrays";
    }
    return out;
  }
  return "input must be a non-empty string or array";
}

// ---------------------------------------------------------------------------
// Per-request lifecycle
// ---------------------------------------------------------------------------

interface SimState {
  stats: SimStats;
  active: Set<Job>;
}

/**
 * Tracks one inference request from arrival until it completes or the client
 * goes away. Owns at most one timer at a time so cancellation is a single
 * clear and nothing outlives the request.
 */
class Job {
  done = false;
  private timeout: ReturnType<typeof setTimeout> | undefined;
  private interval: ReturnType<typeof setInterval> | undefined;
  /** Extra teardown (resolve a pending wait, error a stream) run on abort/shutdown. */
  onCancel: (() => void) | undefined;

  constructor(private readonly sim: SimState) {
    sim.stats.inFlight++;
    sim.active.add(this);
  }

  setTimeout(fn: () => void, ms: number): void {
    this.clearTimers();
    this.timeout = setTimeout(fn, ms);
  }

  setInterval(fn: () => void, ms: number): void {
    this.clearTimers();
    this.interval = setInterval(fn, ms);
  }

  private clearTimers(): void {
    if (this.timeout !== undefined) clearTimeout(this.timeout);
    if (this.interval !== undefined) clearInterval(this.interval);
    this.timeout = undefined;
    this.interval = undefined;
  }

  private end(): void {
    this.done = true;
    this.clearTimers();
    this.sim.stats.inFlight--;
    this.sim.active.delete(this);
  }

  finish(): void {
    if (!this.done) this.end();
  }

  /** Client disconnected before we finished. */
  abort(): void {
    if (this.done) return;
    this.sim.stats.aborts++;
    this.end();
    this.runCancel();
  }

  /** Simulator is stopping/refusing; not the client's doing, so not an abort. */
  shutdown(): void {
    if (this.done) return;
    this.end();
    this.runCancel();
  }

  private runCancel(): void {
    const cb = this.onCancel;
    this.onCancel = undefined;
    cb?.();
  }

  /** Resolves true after `ms`, or false as soon as the request is cancelled. */
  wait(ms: number): Promise<boolean> {
    if (this.done) return Promise.resolve(false);
    if (ms <= 0) return Promise.resolve(true);
    return new Promise<boolean>((resolve) => {
      this.onCancel = () => resolve(false);
      this.setTimeout(() => {
        this.timeout = undefined;
        this.onCancel = undefined;
        resolve(true);
      }, ms);
    });
  }
}

// A response for a client that is already gone; Bun discards it.
const GONE = (): Response => new Response(null, { status: 499 });

// FastAPI's wording, which is what vLLM returns for routing misses.
const notAllowed = (): Response => Response.json({ detail: "Method Not Allowed" }, { status: 405 });

// ---------------------------------------------------------------------------
// Streaming
// ---------------------------------------------------------------------------

/** Aborts the HTTP response abruptly (TCP reset, no terminating chunk). */
function resetStream(c: ReadableStreamDefaultController<Uint8Array>): void {
  try {
    // An undefined reason makes Bun reset the connection without logging it.
    c.error(undefined);
  } catch {
    // Already closed or cancelled by the client.
  }
}

function streamChat(job: Job, cfg: Config, plan: ChatPlan, fault: Fault | null, includeUsage: boolean): Response {
  const id = newId("chatcmpl-");
  const created = Math.floor(Date.now() / 1000);
  const head = `{"id":"${id}","object":"chat.completion.chunk","created":${created},"model":${JSON.stringify(plan.model)}`;
  const prefix = enc.encode(`data: ${head},"choices":[{"index":0,"delta":`);
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

  /** Enqueues one chunk; returns false if the drop fault fired. */
  const push = (tail: Uint8Array): boolean => {
    if (ctrl === undefined) return false;
    const buf = new Uint8Array(prefix.length + tail.length);
    buf.set(prefix, 0);
    buf.set(tail, prefix.length);
    ctrl.enqueue(buf);
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
      ctrl.enqueue(enc.encode(`data: ${head},"choices":[],"usage":${JSON.stringify(usageOf(plan))}}\n\n`));
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

/** Non-streamed body that is cut off part-way, for drop-mid-stream on JSON endpoints. */
function truncatedBody(job: Job, json: string): Response {
  const part = enc.encode(json.slice(0, Math.max(1, Math.floor(json.length / 2))));
  const body = new ReadableStream<Uint8Array>({
    start(c) {
      c.enqueue(part);
      job.onCancel = () => resetStream(c);
      job.setTimeout(() => {
        job.finish();
        resetStream(c);
      }, DROP_FLUSH_MS);
    },
    cancel() {
      job.abort();
    },
  });
  return new Response(body, { headers: JSON_HEADERS });
}

function finishJson(job: Job, fault: Fault | null, payload: unknown): Response {
  if (fault?.kind === "malformed-sse") {
    job.finish();
    return new Response("{not json", { headers: JSON_HEADERS });
  }
  const json = JSON.stringify(payload);
  if (fault?.kind === "drop-mid-stream") return truncatedBody(job, json);
  job.finish();
  return new Response(json, { headers: JSON_HEADERS });
}

// ---------------------------------------------------------------------------
// Control-plane parsing
// ---------------------------------------------------------------------------

const STATUS_FAULTS: ReadonlySet<number> = new Set<FaultStatus>([500, 503, 429, 400, 401, 403, 404, 405, 502, 504]);
const isFaultStatus = (v: unknown): v is FaultStatus => typeof v === "number" && STATUS_FAULTS.has(v);

function parseFault(v: unknown): Fault | null | string {
  if (v === null) return null;
  if (!isRecord(v)) return "fault must be an object or null";
  switch (v.kind) {
    case "status": {
      const status = v.status;
      if (!isFaultStatus(status)) {
        return `status must be one of ${[...STATUS_FAULTS].join(", ")}`;
      }
      const f: Fault = { kind: "status", status };
      const count = nonNegInt(v.count);
      if (count !== undefined) f.count = count;
      if (typeof v.message === "string") f.message = v.message;
      return f;
    }
    case "hang":
    case "malformed-sse":
      return { kind: v.kind };
    case "slow-headers": {
      const ms = nonNegInt(v.ms);
      return ms === undefined ? "slow-headers needs ms" : { kind: "slow-headers", ms };
    }
    case "drop-mid-stream": {
      const afterChunks = nonNegInt(v.afterChunks);
      return afterChunks === undefined ? "drop-mid-stream needs afterChunks" : { kind: "drop-mid-stream", afterChunks };
    }
    case "refuse":
      return "refuse cannot be set over HTTP (it would close this very listener); call setFault or stop the simulator";
    default:
      return "unknown fault kind";
  }
}

function applyConfigPatch(cfg: Config, v: unknown): string | undefined {
  if (!isRecord(v)) return "config must be an object";
  for (const k of ["ttftMs", "interTokenMs", "completionTokens"] as const) {
    if (v[k] === undefined) continue;
    const n = nonNegInt(v[k]);
    if (n === undefined) return `${k} must be a non-negative number`;
    cfg[k] = n;
  }
  if (v.apiKey !== undefined) {
    if (v.apiKey !== null && typeof v.apiKey !== "string") return "apiKey must be a string or null";
    cfg.apiKey = v.apiKey ?? undefined;
  }
  if (v.models !== undefined) {
    if (!Array.isArray(v.models) || !v.models.every((m) => typeof m === "string")) return "models must be strings";
    cfg.models = v.models;
  }
  if (v.reasoning !== undefined) {
    if (v.reasoning !== null && typeof v.reasoning !== "string") return "reasoning must be a string or null";
    cfg.reasoning = v.reasoning ?? undefined;
  }
  if (v.errorFormat !== undefined) {
    if (v.errorFormat !== "legacy" && v.errorFormat !== "nested") return "errorFormat must be legacy or nested";
    cfg.errorFormat = v.errorFormat;
  }
  return undefined;
}

function configFrom(opts: SimOptions): Config {
  return {
    ttftMs: opts.ttftMs ?? 20,
    interTokenMs: opts.interTokenMs ?? 5,
    completionTokens: opts.completionTokens ?? 16,
    apiKey: opts.apiKey,
    models: [...(opts.models ?? DEFAULT_SIM_MODELS)],
    errorFormat: opts.errorFormat ?? "legacy",
    reasoning: opts.reasoning,
  };
}

// ---------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------

export function startSimulator(opts: SimOptions = {}): Promise<Simulator> {
  const hostname = opts.hostname ?? "127.0.0.1";
  let cfg = configFrom(opts);
  let fault: Fault | null = null;
  const stats: SimStats = { requests: 0, aborts: 0, inFlight: 0, lastBody: undefined, lastHeaders: undefined, bodies: [] };
  const state: SimState = { stats, active: new Set() };
  const modelsCreated = Math.floor(Date.now() / 1000);

  /** Returns the fault to apply to this request, consuming one unit of a counted status fault. */
  const takeFault = (): Fault | null => {
    const f = fault;
    if (f?.kind === "status" && f.count !== undefined) {
      if (f.count <= 0) {
        fault = null;
        return null;
      }
      f.count--;
      if (f.count === 0) fault = null;
    }
    return f;
  };

  const recordBody = (body: unknown, headers: Headers): void => {
    stats.requests++;
    stats.lastBody = body;
    stats.lastHeaders = headers;
    stats.bodies.push(body);
    if (stats.bodies.length > BODY_HISTORY) stats.bodies.shift();
  };

  const readJson = async (req: Request): Promise<{ ok: true; value: unknown } | { ok: false }> => {
    try {
      return { ok: true, value: JSON.parse(await req.text()) };
    } catch {
      return { ok: false };
    }
  };

  /** Common prologue for inference endpoints: parse, record, then apply pre-response faults. */
  const admit = async (
    req: Request,
  ): Promise<{ res: Response } | { job: Job; body: Record<string, unknown>; fault: Fault | null }> => {
    const parsed = await readJson(req);
    if (!parsed.ok) return { res: errorResponse(cfg, 400, "Request body is not valid JSON") };
    if (!isRecord(parsed.value)) return { res: errorResponse(cfg, 400, "Request body must be a JSON object") };
    const body = parsed.value;
    recordBody(body, req.headers);

    const job = new Job(state);
    // The client may already be gone while we were reading its body.
    if (req.signal.aborted) {
      job.abort();
      return { res: GONE() };
    }
    req.signal.addEventListener("abort", () => job.abort(), { once: true });
    const f = takeFault();
    if (f?.kind === "status") {
      job.finish();
      return { res: errorResponse(cfg, f.status, f.message ?? `Simulated upstream failure (${f.status})`) };
    }
    if (f?.kind === "hang") {
      const res = await new Promise<Response>((resolve) => {
        job.onCancel = () => resolve(GONE());
      });
      return { res };
    }
    if (f?.kind === "slow-headers" && !(await job.wait(f.ms))) return { res: GONE() };
    return { job, body, fault: f };
  };

  const chat = async (req: Request): Promise<Response> => {
    const a = await admit(req);
    if ("res" in a) return a.res;
    const { job, body, fault: f } = a;
    const messages = body.messages;
    if (!Array.isArray(messages) || messages.length === 0) {
      job.finish();
      return errorResponse(cfg, 400, "messages must be a non-empty array");
    }
    const maxTokens = body.max_completion_tokens ?? body.max_tokens;
    if (maxTokens !== undefined && maxTokens !== null && !(typeof maxTokens === "number" && maxTokens >= 1)) {
      job.finish();
      return errorResponse(cfg, 400, "max_tokens must be at least 1");
    }
    const stream = body.stream === true;
    const plan = planChat(cfg, body, messages, stream);

    if (stream) {
      const so = body.stream_options;
      return streamChat(job, cfg, plan, f, isRecord(so) && so.include_usage === true);
    }

    // Non-streamed latency approximates a full generation: TTFT + decode time.
    const latency = cfg.ttftMs + cfg.interTokenMs * Math.max(0, plan.completionTokens - 1);
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
      choices: [{ index: 0, message: shown, logprobs: plan.logprobs ? { content: plan.logprobs } : null, finish_reason: plan.finishReason, stop_reason: null }],
      usage: usageOf(plan),
      prompt_logprobs: null,
    });
  };

  const embeddings = async (req: Request): Promise<Response> => {
    const a = await admit(req);
    if ("res" in a) return a.res;
    const { job, body, fault: f } = a;
    const inputs = parseEmbedInput(body.input);
    if (typeof inputs === "string") {
      job.finish();
      return errorResponse(cfg, 400, inputs);
    }
    const dims = body.dimensions === undefined || body.dimensions === null ? SIM_EMBEDDING_DIMS : nonNegInt(body.dimensions);
    if (dims === undefined || dims < 1) {
      job.finish();
      return errorResponse(cfg, 400, "dimensions must be a positive integer");
    }
    const base64 = body.encoding_format === "base64";
    if (!(await job.wait(cfg.ttftMs))) return GONE();

    let promptTokens = 0;
    const data = inputs.map((inp, index) => {
      promptTokens += inp.tokens;
      const vec = embedVector(inp.key, dims);
      // Float32Array bytes are little-endian on every platform Bun ships for,
      // which is what the openai SDK's base64 decoder assumes.
      const embedding = base64 ? Buffer.from(vec.buffer, vec.byteOffset, vec.byteLength).toString("base64") : Array.from(vec);
      return { object: "embedding", index, embedding };
    });
    return finishJson(job, f, {
      id: newId("embd-"),
      object: "list",
      created: Math.floor(Date.now() / 1000),
      model: typeof body.model === "string" ? body.model : (cfg.models[0] ?? "sim"),
      data,
      usage: { prompt_tokens: promptTokens, total_tokens: promptTokens, completion_tokens: 0, prompt_tokens_details: null },
    });
  };

  const models = (): Response =>
    Response.json({
      object: "list",
      data: cfg.models.map((id) => ({
        id,
        object: "model",
        created: modelsCreated,
        owned_by: "vllm",
        root: id,
        parent: null,
        max_model_len: MAX_MODEL_LEN,
      })),
    });

  const statsJson = (): Response => Response.json({ ...stats, fault, config: { ...cfg, apiKey: cfg.apiKey === undefined ? null : "***" } });

  const control = async (req: Request, path: string): Promise<Response> => {
    if (path === "/__sim/stats" && req.method === "GET") return statsJson();
    if (path === "/__sim/config" && req.method === "GET") return statsJson();
    if (path === "/__sim/reset" && req.method === "POST") {
      sim.reset();
      return statsJson();
    }
    if ((path === "/__sim/fault" || path === "/__sim/config") && req.method === "POST") {
      const parsed = await readJson(req);
      if (!parsed.ok) return errorResponse(cfg, 400, "Request body is not valid JSON");
      if (path === "/__sim/fault") {
        const f = parseFault(parsed.value);
        if (typeof f === "string") return errorResponse(cfg, 400, f);
        sim.setFault(f);
      } else {
        const err = applyConfigPatch(cfg, parsed.value);
        if (err !== undefined) return errorResponse(cfg, 400, err);
      }
      return statsJson();
    }
    return Response.json({ detail: "Not Found" }, { status: 404 });
  };

  const handle = (req: Request): Response | Promise<Response> => {
    // Manual path extraction: new URL() per request is measurable at 10k rps.
    const url = req.url;
    const start = url.indexOf("/", url.indexOf("//") + 2);
    const q = url.indexOf("?", start);
    const path = q === -1 ? url.slice(start) : url.slice(start, q);

    if (path.startsWith("/__sim/")) return control(req, path);
    if (path === "/health") return new Response(null, { status: 200 });
    if (path.startsWith("/v1/")) {
      if (cfg.apiKey !== undefined && req.headers.get("authorization") !== `Bearer ${cfg.apiKey}`) {
        // Exactly what vLLM's --api-key middleware returns.
        return Response.json({ error: "Unauthorized" }, { status: 401 });
      }
      const method = req.method;
      if (path === "/v1/chat/completions") return method === "POST" ? chat(req) : notAllowed();
      if (path === "/v1/embeddings") return method === "POST" ? embeddings(req) : notAllowed();
      if (path === "/v1/models") return method === "GET" ? models() : notAllowed();
    }
    return Response.json({ detail: "Not Found" }, { status: 404 });
  };

  const listen = (port: number): ReturnType<typeof Bun.serve> =>
    Bun.serve({
      port,
      hostname,
      // Hang faults and slow benchmark streams must not be reaped by Bun's 10s default.
      idleTimeout: 0,
      development: false,
      fetch: handle,
      error: (e) => errorResponse(cfg, 500, e instanceof Error ? e.message : String(e)),
    });

  let server: ReturnType<typeof Bun.serve> | undefined = listen(opts.port ?? 0);
  const port = server.port ?? 0;

  const closeServer = async (): Promise<void> => {
    for (const job of [...state.active]) job.shutdown();
    const s = server;
    server = undefined;
    if (s !== undefined) await s.stop(true);
  };

  const sim: Simulator = {
    port,
    url: `http://${hostname}:${port}/v1`,
    stats,
    setFault(f) {
      if (f?.kind === "refuse") {
        fault = f;
        void closeServer();
        return;
      }
      // Leaving "refuse": come back on the same port so clients' base URLs stay valid.
      if (server === undefined && fault?.kind === "refuse") server = listen(port);
      // Copy so counted faults don't mutate the caller's object.
      fault = f === null ? null : { ...f };
    },
    reset() {
      sim.setFault(null);
      stats.requests = 0;
      stats.aborts = 0;
      stats.lastBody = undefined;
      stats.lastHeaders = undefined;
      stats.bodies.length = 0;
      cfg = configFrom(opts);
    },
    async stop() {
      fault = null;
      await closeServer();
    },
  };
  return Promise.resolve(sim);
}
