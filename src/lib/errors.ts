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
