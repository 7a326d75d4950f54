const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

export function isUuid(s: string): boolean {
  return UUID.test(s);
}

/** Actor id for changes made by the operator's CLI (no person behind a key). */
export const SYSTEM_ACTOR_ID = "00000000-0000-0000-0000-000000000000";
