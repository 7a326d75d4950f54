import { Kind, type TUnsafe, Type as T, TypeRegistry } from "@sinclair/typebox";

/**
 * Free-form JSON in a request body (tool parameters, JSON schemas, and the
 * Responses fields that take any JSON), as a TypeBox type: any JSON value
 * whose arrays and objects nest at most JSON_DEPTH_LIMIT levels.
 *
 * Why a limit: JSON.parse reads nesting of any depth (it does not recurse),
 * but JSON.stringify recurses and runs out of stack at a few tens of
 * thousands of levels, so a value that parsed would throw later, when the
 * request is serialised for the upstream or a response for the store (after
 * the answer was generated). Checked where the body is validated, it is a 400
 * naming the field. 128 is serde_json's default; Python's json (vLLM's) stops
 * near 1,000 levels of the whole body; no real schema comes near either.
 *
 * Only these fields can nest deeply: every other field of a body has a closed
 * schema of bounded depth. A body without free-form fields pays nothing.
 */
export const JSON_DEPTH_LIMIT = 128;

/** Whether `v`'s arrays and objects nest at most `levels` deep (a scalar: 0; `[]`, `{}`: 1). Recursion is bounded by `levels`. */
export function nestsWithin(v: unknown, levels: number): boolean {
  if (typeof v !== "object" || v === null) return true;
  if (levels === 0) return false;
  if (Array.isArray(v)) {
    for (const x of v) if (!nestsWithin(x, levels - 1)) return false;
    return true;
  }
  const o = v as Record<string, unknown>;
  for (const k in o) if (!nestsWithin(o[k], levels - 1)) return false;
  return true;
}

const JSON_VALUE_KIND = "JsonValue";
TypeRegistry.Set(JSON_VALUE_KIND, (_schema, value) => nestsWithin(value, JSON_DEPTH_LIMIT));

/** Any JSON value nested at most JSON_DEPTH_LIMIT levels (the description is what the OpenAPI document shows). */
export const JsonValue: TUnsafe<unknown> = T.Unsafe<unknown>({
  [Kind]: JSON_VALUE_KIND,
  description: `any JSON value; arrays and objects nested at most ${JSON_DEPTH_LIMIT} levels deep`,
});
