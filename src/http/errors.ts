import type { ErrorCode } from "../lib/errors.ts";

/**
 * The error table: what each domain error code (src/lib/errors.ts) answers on
 * the wire. This file alone decides the HTTP status and the body.
 *
 * Wire shape (spec 7 leaves it open; we use OpenAI's, which every SDK parses):
 *   {"error":{"message":"…","type":"…","param":null|"…","code":"<spec code>"}}
 */

/** Status and OpenAI-style `type` for each code. */
const TABLE: Record<ErrorCode, { status: number; type: string }> = {
  invalid_request_error: { status: 400, type: "invalid_request_error" },
  invalid_body: { status: 400, type: "invalid_request_error" },
  unauthorized: { status: 401, type: "authentication_error" },
  key_expired: { status: 401, type: "authentication_error" },
  scope_missing: { status: 403, type: "permission_error" },
  academy_only: { status: 403, type: "permission_error" },
  browser_request_rejected: { status: 403, type: "permission_error" },
  model_not_found: { status: 404, type: "invalid_request_error" },
  not_found: { status: 404, type: "invalid_request_error" },
  rate_limit_error: { status: 429, type: "rate_limit_error" },
  budget_exceeded: { status: 429, type: "insufficient_quota" },
  service_unavailable: { status: 503, type: "service_unavailable" },
  internal_error: { status: 500, type: "server_error" },
};

/** The HTTP status an error code answers with. */
export function statusOf(code: ErrorCode): number {
  return TABLE[code].status;
}

/** The codes answered with `status`, in the table's order (the OpenAPI document lists them per response). */
export function codesWithStatus(status: number): ErrorCode[] {
  return (Object.keys(TABLE) as ErrorCode[]).filter((c) => TABLE[c].status === status);
}

export function errorBody(code: ErrorCode, message: string, param: string | null = null) {
  return { error: { message, type: TABLE[code].type, param, code } };
}
