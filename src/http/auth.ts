import { Elysia } from "elysia";
import type { Guard, Guarded, Requirement } from "../auth/guard.ts";
import type { Caller, Principal } from "../auth/types.ts";
import { stateOf } from "./context.ts";

/**
 * `{ auth: { scope: "inference" } }` on a route runs the guard and gives the
 * handler a typed `principal`. Routes that read a body use `parse: "none"` and
 * read it in the handler, so authentication always comes first.
 */
/**
 * The caller as a rejected key's audit event records it, read only when one
 * is written: most requests never need the address. A class, so a request
 * allocates one small object rather than an object literal with two getters.
 */
class RequestCaller implements Caller {
  constructor(
    private readonly request: Request,
    private readonly server: { requestIP(r: Request): { address: string } | null } | null,
  ) {}
  get ip(): string | null {
    return this.server?.requestIP(this.request)?.address ?? null;
  }
  get userAgent(): string | null {
    return this.request.headers.get("user-agent");
  }
}

/** What a request that passed the guard carries on: its rate-limit headers, its access-log fields, its principal. */
type Admitted = { principal: Principal };

function admitted(g: Guarded, request: Request, set: { headers: Record<string, string | number> }): Admitted {
  Object.assign(set.headers, g.headers);
  const state = stateOf(request);
  if (state) {
    state.orgId = g.principal.orgId;
    state.keyId = g.principal.keyId;
  }
  return { principal: g.principal };
}

export function authPlugin(guard: Guard) {
  return new Elysia({ name: "auth", seed: guard }).macro({
    auth: (requirement: Requirement) => ({
      // Not async: a key the cache holds (the steady state) is checked without a promise.
      resolve({ request, set, server }): Admitted | Promise<Admitted> {
        const authorization = request.headers.get("authorization");
        const caller = new RequestCaller(request, server);
        const g = guard.cached(authorization, requirement, caller);
        if (g) return admitted(g, request, set);
        return guard(authorization, requirement, caller).then((looked) => admitted(looked, request, set));
      },
    }),
  });
}
