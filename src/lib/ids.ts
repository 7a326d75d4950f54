/** A UUID of any version, either case: JSON Schema `pattern` text (import lines) and the test below. */
export const UUID_PATTERN = "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$";
const UUID = new RegExp(UUID_PATTERN);

export function isUuid(s: string): boolean {
  return UUID.test(s);
}

/** Actor id for changes made by the operator's CLI (no person behind a key). */
export const SYSTEM_ACTOR_ID = "00000000-0000-0000-0000-000000000000";
