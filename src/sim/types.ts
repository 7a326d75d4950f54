/** The simulator's public types and constants. */

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

/** The simulator's live settings: from the start options, patched over `POST /__sim/config`. */
export interface SimConfig {
  ttftMs: number;
  interTokenMs: number;
  completionTokens: number;
  apiKey: string | undefined;
  models: string[];
  errorFormat: "legacy" | "nested";
  reasoning: string | undefined;
}
