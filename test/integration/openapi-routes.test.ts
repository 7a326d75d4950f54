import { afterAll, beforeAll, expect, setDefaultTimeout, test } from "bun:test";
import type { Gateway } from "../../src/server.ts";
import { startTestGateway } from "../helpers/harness.ts";

setDefaultTimeout(60_000);

/**
 * The OpenAPI document lists exactly the routes the app serves: one route
 * list (the app's), and the document cannot gain or lose an operation unseen.
 * /metrics is on the main listener here (metrics.listen "main") so that the
 * app serves every documented path.
 */

let gw: Gateway;
let withResponses: Gateway;
beforeAll(async () => {
  gw = await startTestGateway({ metrics: { enabled: true, listen: "main" } });
  withResponses = await startTestGateway({ metrics: { enabled: true, listen: "main" }, responses: { enabled: true } });
}, 120_000);
afterAll(async () => {
  await gw.stop();
  await withResponses.stop();
});

async function compare(g: Gateway): Promise<string[]> {
  const doc = (await (await fetch(`${g.url}/openapi.json`)).json()) as { paths: Record<string, Record<string, unknown>> };
  const documented = Object.entries(doc.paths).flatMap(([path, ops]) => Object.keys(ops).map((m) => `${m.toUpperCase()} ${path}`));
  // The app writes path parameters as :id, OpenAPI as {id}.
  const served = g.routes.map((r) => `${r.method} ${r.path.replace(/:(\w+)/g, "{$1}")}`);
  expect([...new Set(served)].sort()).toEqual([...new Set(documented)].sort());
  return documented;
}

test("the document's operations are the app's routes", async () => {
  expect((await compare(gw)).filter((op) => op.includes("/v1/responses"))).toEqual([]);
});

test("with responses.enabled, the Responses operations are served and documented", async () => {
  expect((await compare(withResponses)).filter((op) => op.includes("/v1/responses")).sort()).toEqual([
    "DELETE /v1/responses/{id}",
    "GET /v1/responses/{id}",
    "GET /v1/responses/{id}/input_items",
    "POST /v1/responses",
    "POST /v1/responses/compact",
    "POST /v1/responses/input_tokens",
    "POST /v1/responses/{id}/cancel",
  ]);
});
