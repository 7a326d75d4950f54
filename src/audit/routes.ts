import { Elysia } from "elysia";
import type { authPlugin } from "../http/auth.ts";
import { AppError } from "../lib/errors.ts";
import { type AuditReadDeps, readAuditEvents } from "./query.ts";

/** Spec 4.5 takes no body; any sign of one is refused rather than ignored. */
function rejectBody(headers: Headers): void {
  const length = headers.get("content-length");
  if ((length !== null && length.trim() !== "0") || headers.has("transfer-encoding")) {
    throw new AppError("invalid_body", "GET /v1/audit-events takes no request body; pass the filters as query parameters.");
  }
}

/**
 * GET /v1/audit-events: service keys with `audit:read` only (a personal key
 * gets scope_missing from the guard). The guard runs first (resolve), so an
 * unauthenticated caller never learns which parameters are valid.
 */
export function auditRoutes(deps: AuditReadDeps) {
  return (auth: ReturnType<typeof authPlugin>) =>
    new Elysia({ name: "audit" }).use(auth).get(
      "/v1/audit-events",
      ({ principal, request }) => {
        rejectBody(request.headers);
        const q = request.url.indexOf("?");
        return readAuditEvents(deps, principal.orgId, q === -1 ? "" : request.url.slice(q + 1));
      },
      // Spec 4.5's error list has no academy_only: an academy-only organisation's service key reads its log.
      { auth: { scope: "audit:read", kinds: ["service"], platformOnly: false }, parse: "none" },
    );
}
