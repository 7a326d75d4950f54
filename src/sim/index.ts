/**
 * A simulated vLLM-compatible upstream for tests, benchmarks and
 * `gateway simulate-upstream`: chat (JSON and SSE), embeddings, models, and
 * faults set over `/__sim/*` or `setFault`.
 *
 *   server.ts      Bun.serve, routing, /v1/models, /__sim/* control, start/stop
 *   chat.ts        /v1/chat/completions (JSON, and SSE streaming)
 *   plan.ts        what a chat request is answered with (text, tools, JSON, refusal)
 *   embeddings.ts  /v1/embeddings
 *   faults.ts      fault parsing and the pre-response faults on admission
 *   job.ts         one request's lifetime and timer; the state endpoints share
 *   sse.ts         pre-encoded SSE fragments
 *   wire.ts        ids, headers, error bodies, response endings
 *   config.ts      live settings and their patching
 *   types.ts       the public types and constants
 */

export { startSimulator } from "./server.ts";
export { DEFAULT_SIM_MODELS, type Fault, type FaultStatus, SIM_EMBEDDING_DIMS, type SimOptions, type SimStats, type Simulator } from "./types.ts";
