import { Elysia } from "elysia";
import type { authPlugin } from "../http/auth.ts";
import type { Principal } from "../auth/types.ts";
import type { Config } from "../config/schema.ts";
import type { Database } from "../db/client.ts";
import { answered, liftIdleTimeout, readInferenceBody } from "../http/idle.ts";
import { AppError } from "../lib/errors.ts";
import { resolveAlias } from "../inference/aliases.ts";
import type { Logger } from "../lib/log.ts";
import { type ChatService, callChat } from "./chat-call.ts";
import { responsesTransform } from "./events.ts";
import { inputTokens } from "./input-tokens.ts";
import { listItems } from "./list.ts";
import { type ResponseMeta, responseFromChat } from "./output.ts";
import { type InputItem, isItemReference, parseInputTokensBody, parseResponsesBody, type RequestItem, type ResponsesBody } from "./request.ts";
import type { Bound } from "../db/bounded.ts";
import { createResponseStore, type ResponseStore } from "./store.ts";
import { writeSpacingFor } from "./store-queue.ts";
import { type Translation, newItemId, responsesError, toChat } from "./translate.ts";
import { resolvesWithin } from "../lib/within.ts";

/**
 * The Responses API (config `responses.enabled`): POST /v1/responses on the
 * chat aliases, and GET/DELETE /v1/responses/{id} with its input items when
 * responses are stored; POST /v1/responses/input_tokens (an estimate),
 * /v1/responses/{id}/cancel (nothing here runs in background, so nothing can
 * be cancelled) and /v1/responses/compact (refused). Mounted only when
 * enabled, so otherwise these paths are unknown routes (404) and absent from
 * /openapi.json.
 */

export interface ResponsesDeps {
  config: Config;
  database: Database;
  log: Logger;
  chat: ChatService;
  /** Stored-response reads out at once (default: a quarter of the pool). */
  readBound?: Bound;
}

const ID = /^resp_[A-Za-z0-9_-]{1,100}$/;
const JSON_TYPE = "application/json";
/** The longest an answer waits for its response to be stored (see save). */
const STORE_WAIT_MS = 5_000;

/** No stored conversation to replay (no previous_response_id). */
const NO_ITEMS: readonly InputItem[] = Object.freeze([]);
const ignoreFinal = (): undefined => undefined;

function notFound(id: string): AppError {
  return new AppError("not_found", `No response with id '${id}' was found.`);
}

/** Cancelling a response not created in background, in vLLM's words (OpenAI documents only that it fails), and why none is here. */
const NOT_CANCELLABLE =
  "Cannot cancel a synchronous response: only responses created with background: true can be cancelled, and this gateway runs no background responses (it refuses background). A response is complete when its answer has been sent; to stop one while it streams, close the connection.";

/**
 * OpenAI's compaction answers an encrypted item that only OpenAI's own models
 * can read back; a chat-completions upstream has no such thing to make or read.
 */
const NO_COMPACTION =
  "Compaction (POST /v1/responses/compact) is not supported by this gateway: OpenAI's compaction returns an encrypted item only OpenAI's own models can read, and the models here are served through chat completions. Send the conversation (shortened or summarised as you choose) as input, or chain responses with previous_response_id.";

export function createResponses(deps: ResponsesDeps) {
  const { config, log } = deps;
  const store: ResponseStore | undefined = config.responses.store
    ? createResponseStore(deps.database, {
        retentionDays: config.responses.retentionDays,
        log,
        maxReplayBytes: config.bodyLimitBytes,
        writeSpacingMs: writeSpacingFor(deps.database.kind),
        ...(deps.readBound ? { readBound: deps.readBound } : {}),
      })
    : undefined;


  /** The conversation previous_response_id names (callers skip the call, and its promise, when there is none). */
  async function replayed(p: Principal, previous: string): Promise<InputItem[]> {
    if (!store) {
      throw new AppError(
        "invalid_request_error",
        "previous_response_id cannot be used: this gateway does not store responses (responses.store is false). Send the whole conversation as input.",
        "previous_response_id",
      );
    }
    const items = ID.test(previous) ? await store.conversation(p, previous) : undefined;
    if (!items) throw new AppError("not_found", `Previous response with id '${previous}' not found.`, "previous_response_id");
    return items;
  }

  /**
   * The request's input with each item_reference replaced by the stored output
   * item it names: the caller's own, from an unexpired stored response (as
   * previous_response_id). The first reference (in input order) that cannot
   * be resolved is the error: 404 when no such item is this caller's, 400
   * when the responses holding the items referenced exceed bodyLimitBytes.
   */
  async function resolveReferences(p: Principal, input: RequestItem[]): Promise<ResponsesBody["input"]> {
    const ids = new Set<string>();
    let first = -1;
    for (const [j, item] of input.entries()) {
      if (!isItemReference(item)) continue;
      ids.add(item.id);
      if (first < 0) first = j;
    }
    if (ids.size === 0) return input;
    if (!store) {
      throw new AppError(
        "invalid_request_error",
        "item_reference cannot be used: this gateway does not store responses (responses.store is false). Send the items themselves.",
        `input[${first}]`,
      );
    }
    const { found, tooLarge } = await store.items(p, [...ids]);
    return input.map((item, j) => {
      if (!isItemReference(item)) return item;
      const hit = found.get(item.id);
      if (hit) return hit;
      if (tooLarge.has(item.id)) {
        throw new AppError(
          "invalid_request_error",
          `The stored responses holding the items referenced exceed ${config.bodyLimitBytes} bytes in all (the request body limit); '${item.id}' is beyond it. Send such items inline, or use previous_response_id.`,
          `input[${j}]`,
        );
      }
      throw new AppError(
        "not_found",
        `Item with id '${item.id}' not found. Only output items of this key's stored responses can be referenced, not those of responses created with store: false, deleted or expired.`,
        `input[${j}]`,
      );
    });
  }

  /**
   * The request translated (toChat) after the conversation it continues is
   * read, then its item references resolved. A request with neither (most)
   * is translated at once: no promise or await for them, no copy of its body.
   */
  function translated(p: Principal, body: ResponsesBody, storeIt: boolean): Translation | Promise<Translation> {
    const input = body.input;
    const references = Array.isArray(input) && input.some(isItemReference);
    if (body.previous_response_id == null && !references) return toChat(body, NO_ITEMS, storeIt);
    return translatedLater(p, body, storeIt);
  }

  async function translatedLater(p: Principal, body: ResponsesBody, storeIt: boolean): Promise<Translation> {
    const previous = body.previous_response_id;
    const replay = previous == null ? NO_ITEMS : await replayed(p, previous);
    const input = body.input;
    if (!Array.isArray(input) || !input.some(isItemReference)) return toChat(body, replay, storeIt);
    const resolved = await resolveReferences(p, input);
    return toChat({ ...body, input: resolved }, replay, storeIt);
  }

  /**
   * Resolves once the row is written or has failed (logged), or after
   * STORE_WAIT_MS: a database that hangs (a lock, a stalled connection) must
   * not hold the answer or the stream's end; the write goes on without us.
   */
  function save(p: Principal, meta: ResponseMeta, inputItems: Translation["inputItems"], response: object): Promise<void> {
    if (!store) return Promise.resolve();
    const written = store
      .save({ id: meta.id, principal: p, previousResponseId: meta.echo.previous_response_id, inputItems, response })
      .catch((e: unknown) => log.error("storing a response failed", { response_id: meta.id, err: e instanceof Error ? e.message : String(e) }));
    return resolvesWithin(written, STORE_WAIT_MS).then((inTime) => {
      if (!inTime) log.warn("storing a response is slow; answered without waiting for it", { response_id: meta.id, waited_ms: STORE_WAIT_MS });
    });
  }

  async function create(p: Principal, raw: unknown, request: Request, set: { headers: Record<string, string | number> }) {
    const body = parseResponsesBody(raw, config.responses.webSearch);
    // The model first, as chat checks it first: an unknown alias is 404 model_not_found whatever else the request says.
    resolveAlias(config, body.model, p, "chat");
    const storeIt = store !== undefined && body.store !== false;
    const tr = translated(p, body, storeIt);
    const t = tr instanceof Promise ? await tr : tr;
    const meta: ResponseMeta = { id: newItemId("resp"), createdAt: Math.floor(Date.now() / 1000), model: body.model, echo: t.echo };
    // A stream is translated inside the chat relay (one stream layer, not two). What it keeps for
    // the stream's life is the translation state and, when stored, the input items: not the chat body.
    const transform = t.chat.stream === true ? streamTransform(p, meta, storeIt ? t.inputItems : undefined) : undefined;
    let answer: Awaited<ReturnType<typeof callChat>>;
    try {
      answer = await callChat(deps.chat, p, t.chat, request, transform);
    } catch (e) {
      throw responsesError(e, t);
    }
    if (answer.kind === "gone") return answer.response;
    if (answer.kind === "json") {
      const response = responseFromChat(answer.completion, meta);
      // Written before the answer, so the client's next request (retrieve, previous_response_id) finds it on any instance.
      if (storeIt) await save(p, meta, t.inputItems, response);
      set.headers["content-type"] = JSON_TYPE;
      return JSON.stringify(response);
    }
    // Already the Responses events (the relay applied the transform).
    return new Response(answer.body, { headers: answer.headers });
  }

  /** POST /v1/responses/input_tokens: the request translated as create translates it, and its prompt estimated (input-tokens.ts). */
  async function count(p: Principal, raw: unknown) {
    const body = parseInputTokensBody(raw, config.responses.webSearch);
    const alias = resolveAlias(config, body.model, p, "chat");
    const t = await translated(p, body, false);
    return inputTokens(t, alias);
  }

  /**
   * Stored: the relay closes the stream only once the row is written, so a client that reads to the end can use the id at once.
   * Not stored: nothing to do with the final Response (one shared hook, no closure per stream).
   */
  function streamTransform(p: Principal, meta: ResponseMeta, inputItems: Translation["inputItems"] | undefined) {
    return responsesTransform(meta, inputItems ? (final) => save(p, meta, inputItems, final) : ignoreFinal);
  }

  function owned(p: Principal, id: string, part: "response" | "input_items" = "response") {
    if (!store || !ID.test(id)) throw notFound(id);
    return store.get(p, id, part).then((r) => {
      if (!r) throw notFound(id);
      return r;
    });
  }

  return {
    store,
    start() {
      store?.start();
    },
    stop: () => store?.stop(),
    routes: (auth: ReturnType<typeof authPlugin>) =>
      new Elysia({ name: "responses" })
        .use(auth)
        // Bodies are read after authentication (parse: "none"), as for chat.
        .post(
          "/v1/responses",
          async ({ principal, request, server, set }) => {
            let reply: Awaited<ReturnType<typeof create>> | undefined;
            try {
              const body = await readInferenceBody(request, server, config);
              // The body was read: the connection's idle timer is lifted while the model works (answered gives it back).
              liftIdleTimeout(request, server);
              reply = await create(principal, body, request, set);
              return reply;
            } finally {
              answered(request, reply);
            }
          },
          { auth: { scope: "inference" }, parse: "none" },
        )
        // Nothing is generated: the model's answer is not waited for, but the stored conversation may be read.
        .post(
          "/v1/responses/input_tokens",
          async ({ principal, request, server }) => {
            try {
              const body = await readInferenceBody(request, server, config);
              liftIdleTimeout(request, server);
              return await count(principal, body);
            } finally {
              answered(request, undefined);
            }
          },
          { auth: { scope: "inference" }, parse: "none" },
        )
        // After the key check, whatever the body (not read).
        .post(
          "/v1/responses/compact",
          () => {
            throw new AppError("invalid_request_error", NO_COMPACTION);
          },
          { auth: { scope: "inference" }, parse: "none" },
        )
        // Ownership as retrieve (another's, unknown, deleted or expired: 404); any body is ignored (not read).
        .post(
          "/v1/responses/:id/cancel",
          async ({ principal, params }) => {
            if (!store || !ID.test(params.id) || !(await store.owns(principal, params.id))) throw notFound(params.id);
            throw new AppError("invalid_request_error", NOT_CANCELLABLE);
          },
          { auth: { scope: "inference" }, parse: "none" },
        )
        .get(
          "/v1/responses/:id",
          async ({ principal, params, query, set }) => {
            const r = await owned(principal, params.id);
            // The SDK's retrieve({stream: true}) expects events; OpenAI streams only background
            // responses, which this gateway does not run. JSON here would read as an empty stream.
            if (query.stream !== undefined && query.stream !== "false") {
              throw new AppError(
                "invalid_request_error",
                "Streaming a stored response is only for background responses, which this gateway does not run; retrieve it without stream.",
                "stream",
              );
            }
            set.headers["content-type"] = JSON_TYPE;
            return JSON.stringify(r.response);
          },
          { auth: { scope: "inference" } },
        )
        .delete(
          "/v1/responses/:id",
          async ({ principal, params }) => {
            if (!store || !ID.test(params.id) || !(await store.remove(principal, params.id))) throw notFound(params.id);
            return { id: params.id, object: "response", deleted: true };
          },
          { auth: { scope: "inference" } },
        )
        .get(
          "/v1/responses/:id/input_items",
          // The raw query, not Elysia's parsed one: that keeps one of a repeated parameter's values without a word.
          async ({ principal, params, request }) => listItems((await owned(principal, params.id, "input_items")).inputItems, new URL(request.url).searchParams),
          { auth: { scope: "inference" } },
        ),
  };
}
