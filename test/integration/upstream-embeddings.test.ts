import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import OpenAI from "openai";
import type { Gateway } from "../../src/server.ts";
import { errorOf, type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { EMBED_MODEL, TEST_PLANS, arr, embedAlias, post, rec, seedTestOrg, upstreamSettings, usageEventsOf } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * An embeddings upstream whose answer breaks spec 2.4 (one entry per input,
 * `index` its position, `embedding` an array of numbers): the gateway must
 * not pass such an answer on as a 200 (a client zips vectors to its inputs
 * by position or index, and stores them in a column of fixed width). What
 * it can read as asked it rebuilds: entries in index order, and the vector
 * in the encoding the client asked for (docs/decisions.md, "Embedding
 * answers").
 */

/** What the scripted upstream answers next (its `data`), and the body it was sent. */
let answer: (body: Record<string, unknown>) => unknown;
let upstream: ReturnType<typeof Bun.serve>;
let gw: Gateway;
let org: SeededOrg;

const USAGE = { prompt_tokens: 4, total_tokens: 4 };

beforeAll(async () => {
  upstream = Bun.serve({
    port: 0,
    hostname: "127.0.0.1",
    async fetch(req) {
      const body = (await req.json()) as Record<string, unknown>;
      const data = answer(body);
      // A raw body (a string) as it is: JSON.stringify would write 1e400 as null.
      const text = typeof data === "string" ? `{"object":"list","model":"${EMBED_MODEL}","data":${data},"usage":${JSON.stringify(USAGE)}}` : JSON.stringify({ object: "list", model: EMBED_MODEL, data, usage: USAGE });
      return new Response(text, { headers: { "content-type": "application/json" } });
    },
  });
  gw = await startTestGateway({
    aliases: { "svc-embed": embedAlias([{ baseUrl: `http://127.0.0.1:${upstream.port}/v1` }]) },
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 1, breakerFailures: 1_000_000 }),
  });
  org = await seedTestOrg(gw.database);
});

afterAll(async () => {
  await gw.stop();
  upstream.stop(true);
});

const embed = (body: Record<string, unknown>, key = org.personalKey) => post(gw, "/v1/embeddings", key, { model: "svc-embed", ...body });
const entry = (index: unknown, embedding: unknown) => ({ object: "embedding", index, embedding });
/** Float32 little-endian bytes as base64, as the openai SDK decodes them. */
const b64 = (v: number[]) => Buffer.from(new Float32Array(v).buffer).toString("base64");

const usageRows = (orgId: string) => usageEventsOf(gw, orgId);

describe("an embeddings answer that is not one vector of numbers per input: 503, nothing charged", () => {
  const cases: [name: string, input: unknown, data: unknown, extra?: Record<string, unknown>][] = [
    ["fewer entries than inputs", ["a", "b"], [entry(0, [0.5, 0.5])]],
    ["more entries than inputs", ["a"], [entry(0, [0.5, 0.5]), entry(1, [0.5, 0.5])]],
    ["none for a token list", [[1, 2], [3]], []],
    ["an entry with no embedding", ["a", "b"], [entry(0, [0.5]), { object: "embedding", index: 1 }]],
    ["an embedding that is no array", ["a"], [entry(0, { x: 1 })]],
    ["an empty vector", ["a"], [entry(0, [])]],
    ["a vector with a string and a null", ["a"], [entry(0, [0.5, "0.5", null])]],
    ["a vector with a number beyond a double (1e400: Infinity, written as null)", ["a"], `[{"object":"embedding","index":0,"embedding":[0.5,1e400]}]`],
    ["two entries with the same index", ["a", "b"], [entry(0, [0.5]), entry(0, [0.25])]],
    ["an index past the inputs", ["a", "b"], [entry(0, [0.5]), entry(5, [0.25])]],
    ["an index that is not an integer", ["a", "b"], [entry(0, [0.5]), entry(1.5, [0.25])]],
    ["an index of 1e308", ["a", "b"], [entry(0, [0.5]), entry(1e308, [0.25])]],
    ["vectors of different lengths", ["a", "b"], [entry(0, [0.5, 0.5]), entry(1, [0.25])]],
    ["a vector of other dimensions than asked", ["a"], [entry(0, [0.5, 0.5, 0.5])], { dimensions: 2 }],
    ["base64 that is not base64", ["a"], [entry(0, "not base64!")]],
    ["base64 of a length that is no float32 vector", ["a"], [entry(0, Buffer.from([1, 2, 3]).toString("base64"))]],
    ["base64 of a NaN", ["a"], [entry(0, Buffer.from(new Float32Array([Number.NaN]).buffer).toString("base64"))], { encoding_format: "float" }],
    // Finite as a double, Infinity as a float32 (past 3.4028234663852886e38): base64 of it decodes to Infinity.
    ["base64 asked, a float beyond a float32 (1e39)", ["a"], [entry(0, [0.5, 1e39])], { encoding_format: "base64" }],
    ["base64 asked, a float beyond a float32 (-3.5e38)", ["a"], [entry(0, [-3.5e38, 0.5])], { encoding_format: "base64" }],
    ["floats asked, a float beyond a float32 (1e39): no embedding either", ["a"], [entry(0, [0.5, 1e39])], { encoding_format: "float" }],
  ];
  for (const [name, input, data, extra] of cases) {
    test(name, async () => {
      answer = () => data;
      const o = await seedTestOrg(gw.database);
      const res = await embed({ input, ...extra }, o.personalKey);
      expect(res.status).toBe(503);
      expect(await errorOf(res)).toMatchObject({ type: "service_unavailable", code: "service_unavailable", message: "The model 'svc-embed' sent an unreadable answer; retry with backoff." });
      const [row] = await usageRows(o.orgId);
      expect(row).toMatchObject({ status: 503, promptTokens: 0, completionTokens: 0 });
    });
  }
});

describe("an embeddings answer the gateway can read is rebuilt to spec 2.4", () => {
  test("entries in another order come in index order; entries without an index take their position", async () => {
    answer = () => [entry(2, [0.3]), entry(0, [0.1]), entry(1, [0.2])];
    const res = await embed({ input: ["a", "b", "c"] });
    expect(res.status).toBe(200);
    expect(arr(rec(await res.json()).data)).toEqual([entry(0, [0.1]), entry(1, [0.2]), entry(2, [0.3])]);
    answer = () => [{ embedding: [0.1] }, { embedding: [0.2] }];
    const positional = await embed({ input: ["a", "b"] });
    expect(arr(rec(await positional.json()).data)).toEqual([entry(0, [0.1]), entry(1, [0.2])]);
  });

  test("each input form counts its inputs: a string and a token list are one, a list of either one per item", async () => {
    answer = () => [entry(0, [0.5])];
    for (const input of ["a", [7, 8, 9], ["a"], [[7]]]) expect((await embed({ input })).status).toBe(200);
    answer = () => [entry(0, [0.5]), entry(1, [0.5])];
    for (const input of [["a", "b"], [[7], [8, 9]]]) expect((await embed({ input })).status).toBe(200);
  });

  test("base64 asked, floats answered: base64 of the float32 vector; floats asked (or the default), base64 answered: the numbers", async () => {
    const vector = [0.5, -0.25, 1, 0];
    answer = () => [entry(0, vector)];
    const asked64 = rec(await (await embed({ input: ["a"], encoding_format: "base64" })).json());
    expect(arr(asked64.data)).toEqual([entry(0, b64(vector))]);
    answer = () => [entry(0, b64(vector))];
    for (const format of [{ encoding_format: "float" }, {}]) {
      const res = rec(await (await embed({ input: ["a"], ...format })).json());
      expect(arr(res.data)).toEqual([entry(0, vector)]);
    }
    // As asked, the upstream's own form passes as sent.
    answer = (body) => [entry(0, body.encoding_format === "base64" ? b64(vector) : vector)];
    expect(arr(rec(await (await embed({ input: ["a"], encoding_format: "base64" })).json()).data)).toEqual([entry(0, b64(vector))]);
    expect(arr(rec(await (await embed({ input: ["a"], encoding_format: "float" })).json()).data)).toEqual([entry(0, vector)]);
  });

  test("the largest float32 (3.4028234663852886e38, and a double that rounds to it) is an answer: base64 of it decodes to it", async () => {
    const max = 3.4028234663852886e38;
    answer = () => [entry(0, [max, -3.4028235e38])];
    const res = rec(await (await embed({ input: ["a"], encoding_format: "base64" })).json());
    const bytes = Buffer.from(String(rec(arr(res.data)[0]).embedding), "base64");
    expect([bytes.readFloatLE(0), bytes.readFloatLE(4)]).toEqual([max, -max]);
  });

  test("the openai SDK gets its numbers whichever form the upstream answers in (it asks for base64 by default)", async () => {
    const client = new OpenAI({ apiKey: org.personalKey, baseURL: `${gw.url}/v1`, maxRetries: 0 });
    const vector = [0.5, -0.25];
    for (const form of [vector, b64(vector)]) {
      answer = () => [entry(0, form), entry(1, form)];
      const r = await client.embeddings.create({ model: "svc-embed", input: ["a", "b"] });
      expect(r.data.map((d) => d.embedding)).toEqual([vector, vector]);
      const explicit = await client.embeddings.create({ model: "svc-embed", input: ["a", "b"], encoding_format: "float" });
      expect(explicit.data.map((d) => d.embedding)).toEqual([vector, vector]);
    }
  });
});
