import { Elysia } from "elysia";
import type { Guard, Requirement } from "../auth/guard.ts";
import { annotate } from "./context.ts";

/**
 * `{ auth: { scope: "inference" } }` on a route runs the guard and gives the
 * handler a typed `principal`. Routes that read a body use `parse: "none"` and
 * read it in the handler, so authentication always comes first.
 */
export function authPlugin(guard: Guard) {
  return new Elysia({ name: "auth", seed: guard }).macro({
    auth: (requirement: Requirement) => ({
      async resolve({ request, set, server }) {
        // Read only when a rejected key is audited: most requests never need the address.
        const meta = {
          get ip() {
            return server?.requestIP(request)?.address ?? null;
          },
          get userAgent() {
            return request.headers.get("user-agent");
          },
        };
        const g = await guard(request.headers.get("authorization"), requirement, meta);
        Object.assign(set.headers, g.headers);
        annotate(request, { orgId: g.principal.orgId, keyId: g.principal.keyId });
        return { principal: g.principal };
      },
    }),
  });
}
