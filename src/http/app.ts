import { type AnyElysia, Elysia } from "elysia";
import { authPlugin } from "./auth.ts";
import { type Guard, RateLimited } from "../auth/guard.ts";
import type { KeyVerifier } from "../auth/verify.ts";
import type { SecurityAuditor } from "../auth/security.ts";
import type { Logger } from "../lib/log.ts";
import { type Metrics, methodLabel, routeLabeler } from "../metrics/registry.ts";
import { beginRequest, type RequestState, requestIdOf, stateOf } from "./context.ts";
import { AppError } from "../lib/errors.ts";
import { errorBody, statusOf } from "./errors.ts";

export interface AppDeps {
  guard: Guard;
  verifier: KeyVerifier;
  security: SecurityAuditor;
  log: Logger;
  accessLog: boolean;
  metrics: Metrics;
  /**
   * The OpenAPI document served at GET /openapi.json, as JSON text: written
   * once at start, so the process holds one string rather than the
   * document's ~1,900 objects, and no request serialises it again.
   */
  openapi: string;
  /** Serve GET /metrics on the main listener. */
  metricsRoute: boolean;
  /** Database reachable and migrations applied. */
  ready: () => Promise<boolean>;
  /** Feature modules (inference, audit, …), each an Elysia plugin built with `authPlugin`. */
  // biome-ignore: each module is a differently-typed Elysia instance; the app only mounts them.
  modules: ((auth: ReturnType<typeof authPlugin>) => AnyElysia)[];
}

/**
 * The cookies load balancers and CDNs set for themselves (stickiness, bot
 * management): AWS ALB and classic ELB, Cloudflare, Google Cloud's load
 * balancer, ingress-nginx's affinity cookie, HAProxy's and F5's (BIG-IP names
 * it BIGipServer<pool>, a pool's partition path written with ~: BIGipServer~Common~web). HTTP clients
 * with a cookie jar (httpx, under the openai Python SDK) send them back on
 * every call behind such a proxy; they are no session.
 */
const INFRASTRUCTURE_COOKIE = /^(?:AWSALB|AWSALBCORS|AWSALBTG|AWSALBTGCORS|AWSELB|AWSELBCORS|__cf_bm|__cflb|_cfuvid|GCLB|INGRESSCOOKIE|SERVERID|BIGipServer[\w.~-]{1,128})$/;

/** A Cookie header that names at least one cookie, every one of them a proxy's own. */
function onlyInfrastructureCookies(header: string): boolean {
  let any = false;
  for (const pair of header.split(";")) {
    const eq = pair.indexOf("=");
    const name = (eq === -1 ? pair : pair.slice(0, eq)).trim();
    if (name === "") continue;
    if (!INFRASTRUCTURE_COOKIE.test(name)) return false;
    any = true;
  }
  return any;
}

/**
 * Spec 5.2: any of these marks a browser; keys are for server-to-server use
 * only. Fetch metadata is any `Sec-Fetch-*` header but one: `Sec-Fetch-Mode:
 * cors` alone is what Node.js's built-in fetch (undici) sends on every request,
 * so the SDKs on Node (openai, LangChain, the AI SDK) would all be refused. A
 * browser never sends it alone: its fetch metadata always includes
 * `Sec-Fetch-Site` (and its cross-origin requests an `Origin`).
 */
export function looksLikeBrowser(h: Headers): boolean {
  if (h.has("origin")) return true;
  const cookie = h.get("cookie");
  if (cookie !== null && !onlyInfrastructureCookies(cookie)) return true;
  for (const name of h.keys()) {
    if (name.startsWith("sec-fetch-") && (name !== "sec-fetch-mode" || h.get(name)?.trim().toLowerCase() !== "cors")) return true;
  }
  return false;
}

function hasBody(h: Headers): boolean {
  const length = h.get("content-length");
  return (length !== null && length.trim() !== "0") || h.has("transfer-encoding");
}

/** Paths whose 400s are `invalid_body` (spec 7); everything else says `invalid_request_error`. */
function validationCode(path: string) {
  return path.startsWith("/v1/audit-events") ? "invalid_body" : "invalid_request_error";
}

/**
 * What a key or token pasted into a URL path looks like: a key `sk-<tag>-…` (ours
 * or another service's), `Bearer` and its token, a JWT. The token runs to the
 * end of the path (or its query): it may hold `/`.
 */
const SECRET_IN_PATH = /(?<![A-Za-z0-9])sk-[\w-]*|(bearer(?:%20|%09|%3A|[\s+:=])+)[^?#&]+|eyJ[\w-]*\.[\w-]+(?:\.[\w-]*)?/gi;

/** How many times a path's escapes are decoded over, for a key encoded twice or more (`%2573k-…`). */
const DECODE_ROUNDS = 3;
const ESCAPE = /%[0-9A-Fa-f]{2}/;

/**
 * A path with its percent-escapes decoded (each `%XX` one character, its byte
 * as Latin-1: every key, `Bearer` and JWT character is ASCII), `DECODE_ROUNDS`
 * times over, and where each of its characters came from in the path as sent:
 * `from[i]`..`to[i]` (the escape a decoded character was, whole). A malformed
 * escape (`%ZZ`, a `%` at the end) is kept as its characters: this never
 * throws, as decodeURIComponent would. A `?`, `#` or `&` that was an escape
 * is no separator (SECRET_IN_PATH's bearer token runs past it): it becomes
 * `\u001a`, which is in no key, no JWT, and ends no token.
 */
function decodedPath(path: string): { text: string; from: number[]; to: number[] } {
  let text = path;
  let from = Array.from(path, (_, i) => i);
  let to = from.map((i) => i + 1);
  for (let round = 0; round < DECODE_ROUNDS && ESCAPE.test(text); round++) {
    let next = "";
    const nextFrom: number[] = [];
    const nextTo: number[] = [];
    for (let i = 0; i < text.length; i++) {
      const hex = text[i] === "%" ? text.slice(i + 1, i + 3) : "";
      const code = hex.length === 2 && /^[0-9A-Fa-f]{2}$/.test(hex) ? Number.parseInt(hex, 16) : -1;
      if (code < 0) {
        next += text[i];
        nextFrom.push(from[i] as number);
        nextTo.push(to[i] as number);
        continue;
      }
      const c = String.fromCharCode(code);
      next += c === "?" || c === "#" || c === "&" ? "\u001a" : c;
      nextFrom.push(from[i] as number);
      nextTo.push(to[i + 2] as number);
      i += 2;
    }
    [text, from, to] = [next, nextFrom, nextTo];
  }
  return { text, from, to };
}

/**
 * A request path as a log line may hold it (operations.md: a log never holds a
 * key): keys and tokens in it masked, the rest kept so a 404 stays readable.
 * Found in the path with its percent-escapes decoded (`sk%2D…`, `%73k-…`, a
 * secret with `%5F` in it, `%42earer%20…`, encoded twice over), and masked
 * in the path as sent: what is around them stays as it came.
 */
export function loggablePath(path: string): string {
  if (!path.includes("%")) return path.replace(SECRET_IN_PATH, (m, bearer: string | undefined) => maskOf(m, bearer));
  const { text, from, to } = decodedPath(path);
  let out = "";
  let kept = 0;
  for (const m of text.matchAll(SECRET_IN_PATH)) {
    const start = from[m.index] as number;
    // The bearer word and its separator as they were sent (`Bearer%20`, `%42earer+`).
    const bearer = m[1] === undefined ? undefined : path.slice(start, to[m.index + m[1].length - 1]);
    out += path.slice(kept, start) + maskOf(m[0], bearer);
    kept = to[m.index + m[0].length - 1] as number;
  }
  return out + path.slice(kept);
}

/** What stands for a key or token found in a path: `sk-…redacted`, the bearer word and `…redacted`, or `…redacted`. */
function maskOf(found: string, bearer: string | undefined): string {
  return bearer !== undefined ? `${bearer}…redacted` : found.slice(0, 3).toLowerCase() === "sk-" ? "sk-…redacted" : "…redacted";
}

export function createApp(deps: AppDeps) {
  const { log, metrics, openapi } = deps;
  const auth = authPlugin(deps.guard);
  // Set once every route is mounted (below): the app's own route list is the label set.
  let routeLabel = routeLabeler([]);

  const accessLine = (method: string, route: string, status: number, s: RequestState) =>
    log.info("request", {
      request_id: s.id,
      method,
      route,
      status,
      latency_ms: Math.round((performance.now() - s.start) * 100) / 100,
      org_id: s.orgId,
      key_id: s.keyId,
      alias: s.alias,
      prompt_tokens: s.promptTokens,
      completion_tokens: s.completionTokens,
      streamed: s.streamed,
      error: s.errorCode,
    });

  const app = new Elysia({
    normalize: false,
    // Elysia's default finds the path by searching for '/' from the URL's 11th
    // character, assuming a host of at least 4 ("http://a.bc"): with `Host: api`
    // it cut "/v1" off (a 404 and its access line named the wrong path). From the
    // 7th, past "http://", is right for every host; the gateway serves plain HTTP.
    handler: { standardHostname: false },
  })
    // Registered first: hooks apply only to routes added after them.
    .onError(({ error, code, set, request, path }) => {
      const state = stateOf(request);
      let err: AppError;
      if (error instanceof AppError) err = error;
      else if (code === "NOT_FOUND") err = new AppError("not_found", `No route for ${request.method} ${path}.`);
      else if (code === "PARSE") err = new AppError(validationCode(path), "Request body is not valid JSON.");
      else if (code === "VALIDATION") err = new AppError(validationCode(path), "Request does not match the endpoint's schema.");
      else {
        log.error("unhandled error", { request_id: state?.id, path: loggablePath(path), err: error instanceof Error ? error.stack : String(error) });
        err = new AppError("internal_error", "Internal error; the request id identifies it in the logs.");
      }
      if (state) {
        state.errorCode = err.code;
        state.rateLimited = err instanceof RateLimited;
      }
      set.status = statusOf(err.code);
      Object.assign(set.headers, err.headers);
      // Refused before its body was read (e.g. 401 on a 40 MB upload): close
      // rather than receive and discard the body to keep the connection.
      if (hasBody(request.headers) && !request.bodyUsed) set.headers.connection = "close";
      set.headers["content-type"] = "application/json";
      return errorBody(err.code, err.message, err.param);
    })
    .onRequest(({ request, set, server }) => {
      const id = requestIdOf(request.headers.get("x-request-id"));
      beginRequest(request, id, performance.now());
      set.headers["x-request-id"] = id;
      // No GET here reads a body: answer, then close, rather than receive and discard one.
      if (request.method === "GET" && hasBody(request.headers)) set.headers.connection = "close";
      if (looksLikeBrowser(request.headers)) {
        const authz = request.headers.get("authorization");
        if (authz) {
          // Record the attempt against a valid key (off the request path, rate-limited).
          const meta = { ip: server?.requestIP(request)?.address ?? null, userAgent: request.headers.get("user-agent") };
          void deps.guard.peek(authz, meta).then((p) => p && deps.security.keyRejected(p, "security.browser_request_rejected", meta));
        }
        throw new AppError(
          "browser_request_rejected",
          "Browser requests are not accepted: API keys are for server-to-server use only. Call this API from your backend.",
        );
      }
    })
    .onAfterResponse(({ request, set, path, route: served }) => {
      const s = stateOf(request);
      if (!s) return;
      const status = s.status ?? (typeof set.status === "number" ? set.status : 200);
      // The pattern of the route that served it (`/v1/responses/:id`; `/v1/models` for `/v1/models/`);
      // a request refused before routing (the browser rule) has none, and is labelled by its path.
      const route = routeLabel(served ?? path);
      const seconds = (performance.now() - s.start) / 1000;
      metrics.requests.inc({ route, method: methodLabel(request.method), status, code: s.errorCode ?? "" });
      metrics.duration.record(route, seconds);
      if (s.rateLimited) metrics.rateLimited.inc();
      else if (s.errorCode === "budget_exceeded") metrics.budgetExceeded.inc();
      if (!deps.accessLog) return;
      // A stream is logged when it ends: its real duration, outcome and tokens (the metrics above time the headers).
      const logged = loggablePath(path);
      if (s.ended) void s.ended.then((outcome) => accessLine(request.method, logged, outcome, s));
      else accessLine(request.method, logged, status, s);
    })
    .get("/healthz", () => ({ status: "ok" }))
    .get("/openapi.json", ({ set }) => {
      set.headers["content-type"] = "application/json";
      return openapi;
    })
    .get("/readyz", async ({ set }) => {
      if (await deps.ready()) return { status: "ready" };
      set.status = 503;
      return errorBody("service_unavailable", "Not ready: the database is unreachable or migrations are pending.");
    });

  if (deps.metricsRoute) {
    app.get("/metrics", async ({ set }) => {
      set.headers["content-type"] = metrics.registry.contentType;
      return metrics.registry.metrics();
    });
  }
  for (const mod of deps.modules) app.use(mod(auth));
  routeLabel = routeLabeler(app.routes.map((r) => r.path));
  return app;
}

export type App = ReturnType<typeof createApp>;
