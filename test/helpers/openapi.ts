import SwaggerParser from "@apidevtools/swagger-parser";
import { Ajv2020 } from "ajv/dist/2020.js";
import { isRecord } from "../../src/lib/guards.ts";

/**
 * The OpenAPI document as the tests that validate real answers against it
 * read it (openapi.test.ts, responses.test.ts, responses-endpoints.test.ts):
 * fetched from a running gateway and checked to be a valid document, and a
 * JSON Schema (draft 2020-12, the dialect of OpenAPI 3.1) validator holding
 * its component schemas.
 */

type Json = Record<string, unknown>;

/** The id prefix each component schema is registered under: `#/components/schemas/X` is `SCHEMAS` + X. */
export const SCHEMAS = "https://gateway.test/schemas/";

/** A copy with `#/components/schemas/X` refs made absolute (`SCHEMAS` + X), so they resolve outside the document. */
export function withAbsoluteRefs(node: unknown): unknown {
  if (Array.isArray(node)) return node.map(withAbsoluteRefs);
  if (!isRecord(node)) return node;
  const out: Json = {};
  for (const [k, v] of Object.entries(node)) {
    out[k] = k === "$ref" && typeof v === "string" ? v.replace("#/components/schemas/", SCHEMAS) : withAbsoluteRefs(v);
  }
  return out;
}

/** A gateway's /openapi.json, after SwaggerParser found it a valid OpenAPI document. */
export async function validOpenApi(gatewayUrl: string): Promise<Json> {
  const doc = (await (await fetch(`${gatewayUrl}/openapi.json`)).json()) as Json;
  // SwaggerParser dereferences in place: it is given a copy.
  await SwaggerParser.validate(structuredClone(doc) as never);
  return doc;
}

/**
 * A strict validator (all errors reported) with each component schema of
 * `doc` under `SCHEMAS` + its name, and the formats the document uses.
 */
export function componentValidator(doc: Json): Ajv2020 {
  const ajv = new Ajv2020({ strict: true, allErrors: true });
  ajv.addFormat("uuid", /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i);
  ajv.addFormat("date-time", /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$/);
  const schemas = isRecord(doc.components) ? doc.components.schemas : undefined;
  if (!isRecord(schemas)) throw new Error("the document has no components.schemas");
  for (const [name, schema] of Object.entries(schemas)) ajv.addSchema(withAbsoluteRefs(schema) as Json, `${SCHEMAS}${name}`);
  return ajv;
}

/** Throws (naming `label` and what failed) unless `body` is valid against the component schema `name`. */
export function expectSchema(ajv: Ajv2020, name: string, body: unknown, label = name): void {
  const validate = ajv.getSchema(`${SCHEMAS}${name}`);
  if (!validate) throw new Error(`no schema ${name}`);
  if (!validate(body)) throw new Error(`${label}: ${ajv.errorsText(validate.errors)}`);
}
