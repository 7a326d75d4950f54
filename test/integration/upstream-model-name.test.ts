import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import type { Gateway } from "../../src/server.ts";
import { type SeededOrg, startTestGateway } from "../helpers/harness.ts";
import { type HostileUpstream, hostileUpstream } from "../helpers/hostile-upstream.ts";
import { TEST_PLANS, arr, chatAlias, embedAlias, post, rec, seedTestOrg, spacedJson, sseData, upstreamSettings, userMessages } from "./inference-fixtures.ts";

// Servers and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * Spec 2.3: an answer's `model` is the alias the client called, never the
 * upstream's model name. vLLM answers with the model id it was sent (the
 * configured one), but other OpenAI-compatible servers name their own model
 * whatever the request said (Hugging Face TGI its loaded model id, llama.cpp's
 * server its alias, vLLM with a LoRA adapter the adapter): an upstream here
 * answers every request with `"model":<NAME>`, NAME any JSON value, written
 * with compact separators or Python's (`"model": …`), and every answer the
 * client gets, streamed or not, chat, embeddings or Responses, names the alias.
 */

/** What the upstream writes as its model: a JSON value's text. */
let name = '"some-other-name"';
/** Write the events as Python's json.dumps does by default (`", "`, `": "`). */
let spaced = false;

/** White space around every colon (`"model" : …`, tabs), written with spacedJson, when set: `spaced` then does not apply. */
let colon: string | undefined;
/** The answer's text, in the parts it is streamed in. */
let parts = ["Hel", "lo"];

const json = (v: unknown) => {
  if (colon !== undefined) return spacedJson(v, colon, " ").replaceAll('"__NAME__"', name);
  const s = JSON.stringify(v).replaceAll('"model":"__NAME__"', `"model":${name}`);
  // Only the separators between tokens: the test's strings hold no `":` or `",` of their own.
  return spaced ? s.replaceAll('":', '": ').replaceAll(',"', ', "') : s;
};

function chunk(delta: Record<string, unknown>, finish: string | null = null): string {
  return `data: ${json({ id: "c1", object: "chat.completion.chunk", created: 1, model: "__NAME__", choices: [{ index: 0, delta, logprobs: null, finish_reason: finish }] })}\n\n`;
}
function streamBody(): string {
  return (
    chunk({ role: "assistant", content: "" }) +
    parts.map((p) => chunk({ content: p })).join("") +
    chunk({}, "stop") +
    `data: ${json({ id: "c1", object: "chat.completion.chunk", created: 1, model: "__NAME__", choices: [], usage: { prompt_tokens: 3, completion_tokens: 2, total_tokens: 5 } })}\n\n` +
    "data: [DONE]\n\n"
  );
}
function completionBody(): string {
  return json({
    id: "c1",
    object: "chat.completion",
    created: 1,
    model: "__NAME__",
    choices: [{ index: 0, message: { role: "assistant", content: parts.join("") }, finish_reason: "stop" }],
    usage: { prompt_tokens: 3, completion_tokens: 2, total_tokens: 5 },
  });
}
function embeddingBody(): string {
  return json({ object: "list", data: [{ object: "embedding", index: 0, embedding: [0.5, 0.25] }], model: "__NAME__", usage: { prompt_tokens: 2, total_tokens: 2 } });
}

/** Whether the upstream answers a non-streamed chat request with SSE (a server that streams whatever it is asked). */
let sseForJson = false;

let up: HostileUpstream;
let gw: Gateway;
let org: SeededOrg;

beforeAll(async () => {
  up = hostileUpstream((c, request) => {
    const streamed = /"stream":true/.test(request);
    const [type, body] = request.startsWith("POST /v1/embeddings")
      ? ["application/json", embeddingBody()]
      : streamed || sseForJson
        ? ["text/event-stream", streamBody()]
        : ["application/json", completionBody()];
    c.write(`HTTP/1.1 200 OK\r\ncontent-type: ${type}\r\ncontent-length: ${Buffer.byteLength(body)}\r\n\r\n${body}`);
  });
  gw = await startTestGateway({
    aliases: {
      "svc-fast": chatAlias([{ baseUrl: up.url }]),
      // The configured upstream id is the alias itself: nothing to swap for a server that names what it was sent.
      "svc-same": chatAlias([{ baseUrl: up.url, model: "svc-same" }]),
      "svc-embed": embedAlias([{ baseUrl: up.url }]),
    },
    plans: TEST_PLANS,
    upstream: upstreamSettings({ attempts: 1 }),
    responses: { enabled: true },
  });
  org = await seedTestOrg(gw.database);
});
afterAll(async () => {
  await gw.stop();
  up.stop();
});

/** A non-streamed chat answer (JSON, whatever the upstream sent it as) names the alias and carries the text. */
async function jsonAnswerNamesAlias(): Promise<void> {
  const res = await chat("svc-fast");
  expect(res.status).toBe(200);
  const body = rec(await res.json());
  expect(body.model).toBe("svc-fast");
  expect(rec(rec(arr(body.choices)[0]).message).content).toBe(parts.join(""));
}

/** The upstream names its model NAME (a JSON value's text), compact or spaced, for the length of `run`. */
async function naming(value: string, space: boolean, run: () => Promise<void>): Promise<void> {
  [name, spaced] = [value, space];
  try {
    await run();
  } finally {
    [name, spaced] = ['"some-other-name"', false];
  }
}

/** Names an upstream that does not name the model it was sent may answer with. */
const NAMES = ['"some-other-name"', "null", '"ad\\"ap\\\\ter\\u00e9/x"', "7"];
const CASES = NAMES.flatMap((n) => [false, true].map((s) => [n, s] as const));

const chat = (model: string, body: Record<string, unknown> = {}) => post(gw, "/v1/chat/completions", org.personalKey, { model, messages: userMessages(), ...body });

describe("an upstream that names a model other than the configured one", () => {
  test("chat, streamed: every chunk names the alias (the usage chunk too), whatever value the upstream wrote and however spaced", async () => {
    /** Each case whose chunks named anything but the alias: what they named. */
    const wrong: string[] = [];
    for (const alias of ["svc-fast", "svc-same"]) {
      for (const [value, space] of CASES) {
        await naming(value, space, async () => {
          const res = await chat(alias, { stream: true, stream_options: { include_usage: true } });
          expect(res.status).toBe(200);
          const text = await res.text();
          const data = sseData(text);
          expect(data.at(-1)).toBe("[DONE]");
          const chunks = data.slice(0, -1).map((d) => rec(JSON.parse(d)));
          // Role, two text chunks, the finish and the usage chunk.
          expect(chunks.length).toBe(5);
          const models = chunks.map((c) => c.model);
          if (models.some((m) => m !== alias) || text.includes("some-other-name") || text.includes("ad\\")) {
            wrong.push(`${alias}, upstream ${value}${space ? " (spaced)" : ""}: ${JSON.stringify(models)}`);
          }
          expect(chunks.map((c) => arr(c.choices).map((k) => rec(rec(k).delta).content ?? "").join("")).join("")).toBe("Hello");
          expect(rec(chunks.at(-1)?.usage).total_tokens).toBe(5);
        });
      }
    }
    expect(wrong).toEqual([]);
  });

  test("white space before or after the colon (`\"model\" : …`, tabs): every chunk names the alias, streamed (chat), whole (JSON, SSE) and through the Responses API; a `\"model\":` in the text is text, left as sent", async () => {
    /** The text holds what looks like the key, escaped as every quote in a string is: it must reach the client as it is. */
    const text = ['He said "model": "mine"', ', then "model" : "x" and "model":\t"y"', " and {\"model\" : 1}"];
    /** Each case whose answer named anything but the alias, or whose text was changed: what it said. */
    const wrong: string[] = [];
    for (const c of [" : ", ":\t", "\t:\t", " :", "\t: ", ":\t "]) {
      for (const value of NAMES) {
        [name, colon, parts] = [value, c, text];
        try {
          const res = await chat("svc-fast", { stream: true, stream_options: { include_usage: true } });
          expect(res.status).toBe(200);
          const body = await res.text();
          const data = sseData(body);
          expect(data.at(-1)).toBe("[DONE]");
          const chunks = data.slice(0, -1).map((d) => rec(JSON.parse(d)));
          const models = chunks.map((k) => k.model);
          const said = chunks.map((k) => arr(k.choices).map((x) => rec(rec(x).delta).content ?? "").join("")).join("");
          if (models.some((m) => m !== "svc-fast") || body.includes("some-other-name") || body.includes("ad\\") || said !== text.join("")) {
            wrong.push(`streamed, ${JSON.stringify(c)}, upstream ${value}: ${JSON.stringify(models)} ${JSON.stringify(said)}`);
          }
          await jsonAnswerNamesAlias();
          sseForJson = true;
          await jsonAnswerNamesAlias();
          sseForJson = false;
          const responses = await post(gw, "/v1/responses", org.personalKey, { model: "svc-fast", input: "hi", store: false, stream: true });
          expect(responses.status).toBe(200);
          const events = await responses.text();
          if (events.includes("some-other-name") || events.includes("ad\\")) wrong.push(`Responses, ${JSON.stringify(c)}, upstream ${value}`);
        } finally {
          [name, colon, parts, sseForJson] = ['"some-other-name"', undefined, ["Hel", "lo"], false];
        }
      }
    }
    expect(wrong).toEqual([]);
  });

  test("chat, JSON: the answer names the alias", async () => {
    for (const [value, space] of CASES) {
      await naming(value, space, jsonAnswerNamesAlias);
    }
  });

  test("chat, JSON asked and answered with SSE: the answer names the alias", async () => {
    sseForJson = true;
    try {
      for (const [value, space] of CASES) {
        await naming(value, space, jsonAnswerNamesAlias);
      }
    } finally {
      sseForJson = false;
    }
  });

  test("embeddings: the answer names the alias", async () => {
    for (const [value, space] of CASES) {
      await naming(value, space, async () => {
        const res = await post(gw, "/v1/embeddings", org.personalKey, { model: "svc-embed", input: "hi" });
        expect(res.status).toBe(200);
        expect(rec(await res.json()).model).toBe("svc-embed");
      });
    }
  });

  test("Responses, JSON and streamed: every response object names the alias", async () => {
    await naming('"some-other-name"', false, async () => {
      const res = await post(gw, "/v1/responses", org.personalKey, { model: "svc-fast", input: "hi", store: false });
      expect(res.status).toBe(200);
      const body = rec(await res.json());
      expect(body.model).toBe("svc-fast");
      expect(JSON.stringify(body)).not.toContain("some-other-name");

      const streamed = await post(gw, "/v1/responses", org.personalKey, { model: "svc-fast", input: "hi", store: false, stream: true });
      expect(streamed.status).toBe(200);
      const text = await streamed.text();
      expect(text).not.toContain("some-other-name");
      const responses = text
        .split("\n\n")
        .filter((e) => e.includes("data: "))
        .map((e) => rec(JSON.parse(e.split("\n").find((l) => l.startsWith("data: "))?.slice(6) ?? "null")))
        .filter((e) => e.response !== undefined)
        .map((e) => rec(e.response).model);
      expect(responses.length).toBeGreaterThanOrEqual(3);
      expect(responses).toEqual(responses.map(() => "svc-fast"));
    });
  });
});
