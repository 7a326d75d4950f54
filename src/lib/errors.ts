/** Bad input to an administrative operation (CLI exit code 2; nothing was written). */
export class InputError extends Error {}
