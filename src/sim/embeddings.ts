/** `POST /v1/embeddings`: unit vectors seeded by the input text, so equal inputs embed identically. */

import { admit } from "./faults.ts";
import type { SimState } from "./job.ts";
import { approxTokens } from "./plan.ts";
import { SIM_EMBEDDING_DIMS } from "./types.ts";
import { errorResponse, finishJson, GONE, newId, nonNegInt } from "./wire.ts";

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

export async function embeddings(state: SimState, req: Request): Promise<Response> {
  const a = await admit(state, req);
  if ("res" in a) return a.res;
  const { job, body, fault: f } = a;
  const inputs = parseEmbedInput(body.input);
  if (typeof inputs === "string") {
    job.finish();
    return errorResponse(state.cfg, 400, inputs);
  }
  const dims = body.dimensions === undefined || body.dimensions === null ? SIM_EMBEDDING_DIMS : nonNegInt(body.dimensions);
  if (dims === undefined || dims < 1) {
    job.finish();
    return errorResponse(state.cfg, 400, "dimensions must be a positive integer");
  }
  const base64 = body.encoding_format === "base64";
  if (!(await job.wait(state.cfg.ttftMs))) return GONE();

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
    model: typeof body.model === "string" ? body.model : (state.cfg.models[0] ?? "sim"),
    data,
    usage: { prompt_tokens: promptTokens, total_tokens: promptTokens, completion_tokens: 0, prompt_tokens_details: null },
  });
}
