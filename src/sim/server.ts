/**
 * The simulator's HTTP server: routing, `/v1/models`, the `/__sim/*` control
 * endpoints, and start/stop/refuse.
 *
 * Built on plain `Bun.serve` + `ReadableStream` rather than Elysia: the
 * benchmark pushes ~10k concurrent slow streams through this process, so the
 * hot path avoids routing layers, per-chunk JSON serialisation and
 * per-stream timer churn. The wire format mirrors vLLM's OpenAI server.
 */

import { chat } from "./chat.ts";
import { applyConfigPatch, configFrom } from "./config.ts";
import { embeddings } from "./embeddings.ts";
import { parseFault } from "./faults.ts";
import type { SimState } from "./job.ts";
import type { SimOptions, SimStats, Simulator } from "./types.ts";
import { errorResponse, notAllowed, readJson } from "./wire.ts";

const MAX_MODEL_LEN = 32768;

export function startSimulator(opts: SimOptions = {}): Promise<Simulator> {
  const hostname = opts.hostname ?? "127.0.0.1";
  const stats: SimStats = { requests: 0, aborts: 0, inFlight: 0, lastBody: undefined, lastHeaders: undefined, bodies: [] };
  const state: SimState = { cfg: configFrom(opts), fault: null, stats, active: new Set() };
  const modelsCreated = Math.floor(Date.now() / 1000);

  const models = (): Response =>
    Response.json({
      object: "list",
      data: state.cfg.models.map((id) => ({
        id,
        object: "model",
        created: modelsCreated,
        owned_by: "vllm",
        root: id,
        parent: null,
        max_model_len: MAX_MODEL_LEN,
      })),
    });

  const statsJson = (): Response =>
    Response.json({ ...stats, fault: state.fault, config: { ...state.cfg, apiKey: state.cfg.apiKey === undefined ? null : "***" } });

  const control = async (req: Request, path: string): Promise<Response> => {
    if (path === "/__sim/stats" && req.method === "GET") return statsJson();
    if (path === "/__sim/config" && req.method === "GET") return statsJson();
    if (path === "/__sim/reset" && req.method === "POST") {
      sim.reset();
      return statsJson();
    }
    if ((path === "/__sim/fault" || path === "/__sim/config") && req.method === "POST") {
      const parsed = await readJson(req);
      if (!parsed.ok) return errorResponse(state.cfg, 400, "Request body is not valid JSON");
      if (path === "/__sim/fault") {
        const f = parseFault(parsed.value);
        if (typeof f === "string") return errorResponse(state.cfg, 400, f);
        sim.setFault(f);
      } else {
        const err = applyConfigPatch(state.cfg, parsed.value);
        if (err !== undefined) return errorResponse(state.cfg, 400, err);
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
      const apiKey = state.cfg.apiKey;
      if (apiKey !== undefined && req.headers.get("authorization") !== `Bearer ${apiKey}`) {
        // Exactly what vLLM's --api-key middleware returns.
        return Response.json({ error: "Unauthorized" }, { status: 401 });
      }
      const method = req.method;
      if (path === "/v1/chat/completions") return method === "POST" ? chat(state, req) : notAllowed();
      if (path === "/v1/embeddings") return method === "POST" ? embeddings(state, req) : notAllowed();
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
      error: (e) => errorResponse(state.cfg, 500, e instanceof Error ? e.message : String(e)),
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
        state.fault = f;
        void closeServer();
        return;
      }
      // Leaving "refuse": come back on the same port so clients' base URLs stay valid.
      if (server === undefined && state.fault?.kind === "refuse") server = listen(port);
      // Copy so counted faults don't mutate the caller's object.
      state.fault = f === null ? null : { ...f };
    },
    reset() {
      sim.setFault(null);
      stats.requests = 0;
      stats.aborts = 0;
      stats.lastBody = undefined;
      stats.lastHeaders = undefined;
      stats.bodies.length = 0;
      state.cfg = configFrom(opts);
    },
    async stop() {
      state.fault = null;
      await closeServer();
    },
  };
  return Promise.resolve(sim);
}
