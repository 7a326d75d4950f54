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
beforeAll(async () => {
  gw = await startTestGateway({ metrics: { enabled: true, listen: "main" } });
}, 120_000);
afterAll(async () => {
  await gw.stop();
});

test("the document's operations are the app's routes", async () => {
  const doc = (await (await fetch(`${gw.url}/openapi.json`)).json()) as { paths: Record<string, Record<string, unknown>> };
  const documented = Object.entries(doc.paths).flatMap(([path, ops]) => Object.keys(ops).map((m) => `${m.toUpperCase()} ${path}`));
  const served = gw.routes.map((r) => `${r.method} ${r.path}`);
  expect([...new Set(served)].sort()).toEqual([...new Set(documented)].sort());
});
