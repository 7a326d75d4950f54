/**
 * Faults: parsing them from the control endpoint, and applying those that act
 * before a response (status, hang, slow headers) as each inference request is
 * admitted. Faults that act on the body (drop, malformed) are applied by the
 * endpoint that writes it.
 */

import { isRecord } from "../lib/guards.ts";
import { Job, type SimState } from "./job.ts";
import type { Fault, FaultStatus } from "./types.ts";
import { errorResponse, GONE, nonNegInt, readJson } from "./wire.ts";

const BODY_HISTORY = 50;

const STATUS_FAULTS: ReadonlySet<number> = new Set<FaultStatus>([500, 503, 429, 400, 401, 403, 404, 405, 502, 504]);
const isFaultStatus = (v: unknown): v is FaultStatus => typeof v === "number" && STATUS_FAULTS.has(v);

export function parseFault(v: unknown): Fault | null | string {
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

/** Returns the fault to apply to this request, consuming one unit of a counted status fault. */
function takeFault(state: SimState): Fault | null {
  const f = state.fault;
  if (f?.kind === "status" && f.count !== undefined) {
    if (f.count <= 0) {
      state.fault = null;
      return null;
    }
    f.count--;
    if (f.count === 0) state.fault = null;
  }
  return f;
}

function recordBody(state: SimState, body: unknown, headers: Headers): void {
  const stats = state.stats;
  stats.requests++;
  stats.lastBody = body;
  stats.lastHeaders = headers;
  stats.bodies.push(body);
  if (stats.bodies.length > BODY_HISTORY) stats.bodies.shift();
}

/** Common prologue for inference endpoints: parse, record, then apply pre-response faults. */
export async function admit(
  state: SimState,
  req: Request,
): Promise<{ res: Response } | { job: Job; body: Record<string, unknown>; fault: Fault | null }> {
  const parsed = await readJson(req);
  if (!parsed.ok) return { res: errorResponse(state.cfg, 400, "Request body is not valid JSON") };
  if (!isRecord(parsed.value)) return { res: errorResponse(state.cfg, 400, "Request body must be a JSON object") };
  const body = parsed.value;
  recordBody(state, body, req.headers);

  const job = new Job(state);
  // The client may already be gone while we were reading its body.
  if (req.signal.aborted) {
    job.abort();
    return { res: GONE() };
  }
  req.signal.addEventListener("abort", () => job.abort(), { once: true });
  const f = takeFault(state);
  if (f?.kind === "status") {
    job.finish();
    return { res: errorResponse(state.cfg, f.status, f.message ?? `Simulated upstream failure (${f.status})`) };
  }
  if (f?.kind === "hang") {
    const res = await new Promise<Response>((resolve) => {
      job.onCancel = () => resolve(GONE());
    });
    return { res };
  }
  if (f?.kind === "slow-headers" && !(await job.wait(f.ms))) return { res: GONE() };
  return { job, body, fault: f };
}
