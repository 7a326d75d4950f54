import { Elysia } from "elysia";
import type { Guard, Requirement } from "../auth/guard.ts";
import type { Caller } from "../auth/types.ts";
import { annotate } from "./context.ts";

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

export function authPlugin(guard: Guard) {
  return new Elysia({ name: "auth", seed: guard }).macro({
    auth: (requirement: Requirement) => ({
      async resolve({ request, set, server }) {
        const g = await guard(request.headers.get("authorization"), requirement, new RequestCaller(request, server));
        Object.assign(set.headers, g.headers);
        annotate(request, { orgId: g.principal.orgId, keyId: g.principal.keyId });
        return { principal: g.principal };
      },
    }),
  });
}
