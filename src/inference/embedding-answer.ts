/**
 * An upstream's embeddings `data` -> spec 2.4's: one entry per input, in
 * index order, each vector in the encoding the client asked for. The answer
 * is hostile input like any other: an entry missing, one too many, an index
 * repeated or past the inputs, a vector that is not numbers (a string, a
 * null, 1e400, which JSON.parse reads as Infinity and JSON.stringify writes
 * as null, 1e39, a float32's Infinity), vectors of different lengths or of other dimensions than asked,
 * base64 that is not a float32 vector: none is an answer to the request, and
 * `embeddingData` returns undefined for it (the caller answers 503, as for
 * any unreadable answer). A client zips the vectors to its inputs and stores
 * them in a column of fixed width; a wrong answer passed on as a 200 is
 * stored wrong, where a 503 is retried.
 *
 * A vector sent in the other encoding than asked is converted: floats to
 * base64 (float32, little-endian, as OpenAI's API and the openai SDKs read
 * it) when base64 was asked, base64 to numbers otherwise. An upstream that
 * ignores encoding_format then still gives the client the form it asked for.
 */
import { isRecord } from "../lib/guards.ts";
import type { EmbeddingsBody } from "./model.ts";

export interface EmbeddingEntry {
  object: "embedding";
  index: number;
  embedding: number[] | string;
}

/** How many vectors the request asks for: a string or a token list is one input, a list of either one per item. */
export function embeddingInputs(input: EmbeddingsBody["input"]): number {
  if (typeof input === "string") return 1;
  return typeof input[0] === "number" ? 1 : input.length;
}

/** Standard base64 with its padding, as OpenAI and vLLM write a vector. */
const BASE64 = /^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/;

/** The float32 vector a base64 string holds, or undefined when it is none (not base64, no whole float, empty, not finite). */
function decoded(s: string): number[] | undefined {
  if (s.length === 0 || !BASE64.test(s)) return undefined;
  const bytes = Buffer.from(s, "base64");
  if (bytes.length === 0 || bytes.length % 4 !== 0) return undefined;
  const out = new Array<number>(bytes.length / 4);
  for (let i = 0; i < out.length; i++) {
    const x = bytes.readFloatLE(i * 4);
    if (!Number.isFinite(x)) return undefined;
    out[i] = x;
  }
  return out;
}

/**
 * Whether v is a non-empty array of numbers finite as float32s: one past
 * ±3.4028234663852886e38 once rounded to a float32 (1e39, finite as a
 * double) is Infinity in the base64 a client decodes, and no embedding any
 * model of float32 (or narrower) weights makes, so no answer in either
 * encoding (the same upstream answer is one or not whatever was asked).
 */
function isVector(v: unknown): v is number[] {
  if (!Array.isArray(v) || v.length === 0) return false;
  for (let i = 0; i < v.length; i++) {
    const x = v[i];
    if (typeof x !== "number" || !Number.isFinite(Math.fround(x))) return false;
  }
  return true;
}

/** A vector of numbers as base64 of its float32 little-endian bytes. */
function encoded(v: number[]): string {
  const bytes = Buffer.allocUnsafe(v.length * 4);
  for (let i = 0; i < v.length; i++) bytes.writeFloatLE(v[i] as number, i * 4);
  return bytes.toString("base64");
}

/**
 * The entries to answer with, or undefined when `data` is not one vector per
 * input. An entry's `index` must be an integer from 0 to inputs - 1, each
 * once; an entry without one takes its position.
 */
export function embeddingData(data: unknown[], body: EmbeddingsBody): EmbeddingEntry[] | undefined {
  const inputs = embeddingInputs(body.input);
  if (data.length !== inputs) return undefined;
  const base64 = body.encoding_format === "base64";
  const out = new Array<EmbeddingEntry | undefined>(inputs).fill(undefined);
  let dims = body.dimensions;
  for (let i = 0; i < data.length; i++) {
    const e = data[i];
    if (!isRecord(e)) return undefined;
    const index = e.index === undefined || e.index === null ? i : e.index;
    if (typeof index !== "number" || !Number.isInteger(index) || index < 0 || index >= inputs || out[index] !== undefined) return undefined;
    const sent = e.embedding;
    let vector: number[] | undefined;
    let text: string | undefined;
    if (typeof sent === "string") {
      vector = decoded(sent);
      if (vector && base64) text = sent;
    } else if (isVector(sent)) vector = sent;
    if (!vector) return undefined;
    dims ??= vector.length;
    if (vector.length !== dims) return undefined;
    out[index] = { object: "embedding", index, embedding: base64 ? (text ?? encoded(vector)) : vector };
  }
  return out as EmbeddingEntry[];
}
