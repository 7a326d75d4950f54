import type { AliasConfig, Config } from "../../src/config/schema.ts";
import { eq } from "drizzle-orm";
import type { Database } from "../../src/db/client.ts";
import { usageEvents } from "../../src/db/schema.ts";
import type { Gateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { seedOrg, type SeededOrg } from "../helpers/harness.ts";

/**
 * Shared pieces of the inference tests. Aliases point at simulators under
 * upstream model ids that differ from the alias, so the tests see the id
 * swapped in both directions.
 */

export const CHAT_MODEL = "meta-llama/Llama-3.1-8B-Instruct";
export const EMBED_MODEL = "BAAI/bge-m3";

export interface TargetSpec {
  baseUrl: string;
  model?: string;
  weight?: number;
}

export function chatAlias(targets: TargetSpec[], extra: Partial<AliasConfig> = {}): AliasConfig {
  return {
    kind: "chat",
    contextWindow: 128_000,
    capabilities: ["images", "tools"],
    ownedBy: "gateway",
    targets: targets.map((t) => ({ baseUrl: t.baseUrl, model: t.model ?? CHAT_MODEL, weight: t.weight ?? 1 })),
    ...extra,
  };
}

export function embedAlias(targets: TargetSpec[]): AliasConfig {
  return {
    kind: "embedding",
    capabilities: [],
    ownedBy: "gateway",
    dimensions: 1024,
    targets: targets.map((t) => ({ baseUrl: t.baseUrl, model: t.model ?? EMBED_MODEL, weight: t.weight ?? 1 })),
  };
}

/** svc-fast (images, tools), svc-text (neither, 4096-token window), svc-smart, svc-embed: all on one simulator. */
export function testAliases(simUrl: string): Record<string, AliasConfig> {
  return {
    "svc-fast": chatAlias([{ baseUrl: simUrl }]),
    "svc-smart": chatAlias([{ baseUrl: simUrl }], { contextWindow: 180_000 }),
    "svc-text": chatAlias([{ baseUrl: simUrl }], { capabilities: [], contextWindow: 4096 }),
    "svc-embed": embedAlias([{ baseUrl: simUrl }]),
  };
}

/** The test aliases' simulator and a second one behind "svc-slow", paced as a test file needs. */
export interface SimulatorPair {
  sim: Simulator;
  slow: Simulator;
  /** testAliases on `sim`, and "svc-slow" on `slow`. */
  aliases: Record<string, AliasConfig>;
  /** Both back to their start options, stats cleared (after each test). */
  reset(): void;
  stop(): Promise<void>;
}

/** `sim` answers 5 tokens at once; `slow` as `pace` says. */
export async function startSimulatorPair(pace: { ttftMs: number; interTokenMs: number; completionTokens: number }): Promise<SimulatorPair> {
  const sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 5 });
  const slow = await startSimulator({ port: 0, ...pace });
  return {
    sim,
    slow,
    aliases: { ...testAliases(sim.url), "svc-slow": chatAlias([{ baseUrl: slow.url }]) },
    reset() {
      sim.reset();
      slow.reset();
    },
    async stop() {
      await sim.stop();
      await slow.stop();
    },
  };
}

export function upstreamSettings(over: Partial<Config["upstream"]> = {}, timeouts: Partial<Config["upstream"]["timeouts"]> = {}): Config["upstream"] {
  return {
    attempts: 3,
    backoffMs: 1,
    breakerFailures: 5,
    breakerCooldownMs: 30_000,
    maxResponseBytes: 8 * 1024 * 1024,
    ...over,
    timeouts: { connectMs: 2_000, firstByteMs: 10_000, idleMs: 10_000, ...timeouts },
  };
}

/** A plan whose rate never binds, so tests can send as many requests as they like. */
export const TEST_PLANS = {
  Standard: { requestsPerMinute: 60 },
  Ultra: { requestsPerMinute: 300 },
  Test: { requestsPerMinute: 1_000_000 },
  Tiny: { requestsPerMinute: 2 },
};

export function seedTestOrg(database: Database, opts: Parameters<typeof seedOrg>[1] = {}): Promise<SeededOrg> {
  return seedOrg(database, { plan: "Test", plans: Object.keys(TEST_PLANS), ...opts });
}

export function post(gw: Gateway, path: string, key: string | undefined, body: unknown, init: RequestInit = {}): Promise<Response> {
  const headers: Record<string, string> = { "content-type": "application/json" };
  if (key) headers.authorization = `Bearer ${key}`;
  return fetch(`${gw.url}${path}`, {
    method: "POST",
    body: typeof body === "string" ? body : JSON.stringify(body),
    ...init,
    headers: { ...headers, ...(init.headers as Record<string, string> | undefined) },
  });
}

export const userMessages = (text = "hi") => [{ role: "user", content: text }];

/** An organisation's usage records, once the gateway's buffered usage is written. */
export async function usageEventsOf(gw: Gateway, orgId: string) {
  await gw.quota.flush();
  return gw.database.db.select().from(usageEvents).where(eq(usageEvents.orgId, orgId));
}

/** The same, as status and token counts. */
export async function chargesOf(gw: Gateway, orgId: string) {
  return (await usageEventsOf(gw, orgId)).map((r) => ({ status: r.status, prompt: r.promptTokens, completion: r.completionTokens }));
}

/** A chat request on svc-fast with `body` merged in, given up after 30 s. */
export const chatOn = (gw: Gateway, key: string, body: Record<string, unknown> = {}): Promise<Response> =>
  post(gw, "/v1/chat/completions", key, { model: "svc-fast", messages: userMessages(), ...body }, { signal: AbortSignal.timeout(30_000) });

/** What the simulator answers with `completionTokens: 6`. */
export const SIX_TOKEN_TEXT = "token0 token1 token2 token3 token4 token5 ";
/** The simulator's prompt count for one user message "Say hi": 3 + 4 per message + ceil(6 / 4). */
export const SAY_HI_PROMPT_TOKENS = 9;

/** The `data:` payloads of an SSE body, in order. */
export function sseData(text: string): string[] {
  return text
    .split("\n\n")
    .filter((e) => e.length > 0)
    .map((e) => {
      if (!e.startsWith("data: ")) throw new Error(`not an SSE data event: ${JSON.stringify(e)}`);
      return e.slice(6);
    });
}

export function rec(v: unknown): Record<string, unknown> {
  if (typeof v !== "object" || v === null || Array.isArray(v)) throw new Error(`expected an object, got ${JSON.stringify(v)}`);
  return v as Record<string, unknown>;
}

export function arr(v: unknown): unknown[] {
  if (!Array.isArray(v)) throw new Error(`expected an array, got ${JSON.stringify(v)}`);
  return v;
}

/** Polls until `check` holds (the simulator sees aborts asynchronously); the deadline is generous for a busy machine. */
export async function eventually(check: () => boolean, ms = 10_000): Promise<void> {
  const until = performance.now() + ms;
  while (!check()) {
    if (performance.now() > until) throw new Error("condition not met in time");
    await Bun.sleep(5);
  }
}

/**
 * JSON with white space around its separators, as a server may write it (all
 * of it valid JSON): `colon` for each key's colon (`" : "`, `":\t"`),
 * `comma` the white space after each comma, `pad` inside each brace and bracket. Only
 * between tokens: a string's own text is written as JSON.stringify writes it.
 */
export function spacedJson(v: unknown, colon = " : ", comma = " ", pad = ""): string {
  const s = (x: unknown): string => {
    if (Array.isArray(x)) return `[${pad}${x.map(s).join(`,${comma}`)}${pad}]`;
    if (x !== null && typeof x === "object") {
      return `{${pad}${Object.entries(x)
        .map(([k, y]) => `${JSON.stringify(k)}${colon}${s(y)}`)
        .join(`,${comma}`)}${pad}}`;
    }
    return JSON.stringify(x);
  };
  return s(v);
}
