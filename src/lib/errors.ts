/** Bad input to an administrative operation (CLI exit code 2; nothing was written). */
export class InputError extends Error {}

/** Names a field in a message: the field itself by default, a CLI flag (`--quota-window`) when the CLI prints it. */
export type FieldNamer = (field: string) => string;

/**
 * Bad input about one input field, said in the service's own words
 * ("quotaWindow must be one of hour, day, month") with the field machine-readable,
 * so each caller can name the field its own way (the CLI by its flag).
 */
export class FieldError extends InputError {
  constructor(
    readonly field: string,
    private readonly text: (name: FieldNamer) => string,
  ) {
    super(text((f) => f));
  }

  /** The message with every field named by `name`. */
  describe(name: FieldNamer): string {
    return this.text(name);
  }
}

/**
 * The codes a request can fail with (spec 7). The HTTP status and the wire
 * `type` of each are the HTTP layer's business (src/http/errors.ts).
 */
export type ErrorCode =
  | "invalid_request_error"
  | "invalid_body"
  | "unauthorized"
  | "key_expired"
  | "scope_missing"
  | "academy_only"
  | "browser_request_rejected"
  | "model_not_found"
  | "not_found"
  | "rate_limit_error"
  | "budget_exceeded"
  | "service_unavailable"
  | "internal_error";

/**
 * A refusal a caller is told about: a spec code, a message in plain words, the
 * offending parameter (if one) and headers the answer carries (retry hints).
 * Thrown by services; the app's one error mapper turns it into an answer.
 */
export class AppError extends Error {
  constructor(
    readonly code: ErrorCode,
    message: string,
    readonly param: string | null = null,
    readonly headers: Record<string, string> = {},
  ) {
    super(message);
  }
}
