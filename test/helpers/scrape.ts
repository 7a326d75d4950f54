import { expect } from "bun:test";
import type { Gateway } from "../../src/server.ts";

/** A scrape of the gateway's /metrics (its own listener), checked to answer 200. */
export async function scrapeOf(g: Gateway): Promise<string> {
  if (!g.metricsUrl) throw new Error("metrics are not served");
  const res = await fetch(g.metricsUrl);
  expect(res.status).toBe(200);
  return res.text();
}

/** The sum of a scrape's samples of `name` whose labels include `labels` (0 when none). */
export function sample(text: string, name: string, labels: Record<string, string> = {}): number {
  let total = 0;
  for (const line of text.split("\n")) {
    if (!line.startsWith(name)) continue;
    const m = /^([a-z_:]+)(\{[^}]*\})? (\S+)$/.exec(line);
    if (!m || m[1] !== name) continue;
    const l = m[2] ?? "";
    if (Object.entries(labels).every(([k, v]) => l.includes(`${k}="${v}"`))) total += Number(m[3]);
  }
  return total;
}
