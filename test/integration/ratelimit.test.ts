import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import OpenAI from "openai";
import type { Gateway } from "../../src/server.ts";
import { bearer, errorOf, seedOrg, startTestGateway } from "../helpers/harness.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

let gw: Gateway;
beforeAll(async () => {
  gw = await startTestGateway();
});
afterAll(async () => {
  await gw.stop();
});

const me = (key: string) => fetch(`${gw.url}/v1/me`, { headers: bearer(key) });

describe("per-organisation rate limit", () => {
  test("the 61st request in a minute gets 429 rate_limit_error with the wait", async () => {
    const org = await seedOrg(gw.database);
    for (let i = 1; i <= 60; i++) {
      const res = await me(i % 2 ? org.personalKey : org.serviceKey); // both keys count against the organisation
      expect(res.status).toBe(200);
      expect(res.headers.get("x-ratelimit-limit-requests")).toBe("60");
      expect(res.headers.get("x-ratelimit-remaining-requests")).toBe(String(60 - i));
      expect(res.headers.get("x-ratelimit-reset-requests")).toMatch(/^\d+(\.\d+)?(ms|s|m\d+(\.\d+)?s)$|^0s$/);
    }
    const res = await me(org.personalKey);
    expect(res.status).toBe(429);
    const err = await errorOf(res);
    expect(err.code).toBe("rate_limit_error");
    expect(err.message).not.toContain("budget_exceeded");
    const retryAfter = Number(res.headers.get("retry-after"));
    const retryAfterMs = Number(res.headers.get("retry-after-ms"));
    expect(retryAfter).toBeGreaterThanOrEqual(1);
    expect(retryAfter).toBeLessThanOrEqual(60);
    expect(retryAfterMs).toBeGreaterThan(55_000);
    expect(Math.ceil(retryAfterMs / 1000)).toBe(retryAfter);
    expect(res.headers.get("x-ratelimit-remaining-requests")).toBe("0");
  });

  test("organisations are limited separately", async () => {
    const a = await seedOrg(gw.database);
    const b = await seedOrg(gw.database);
    for (let i = 0; i < 60; i++) await me(a.serviceKey);
    expect((await me(a.serviceKey)).status).toBe(429);
    expect((await me(b.serviceKey)).status).toBe(200);
  });

  test("the Ultra plan gets 300 per minute", async () => {
    const org = await seedOrg(gw.database, { plan: "Ultra" });
    const results = await Promise.all(Array.from({ length: 301 }, () => me(org.serviceKey).then((r) => r.status)));
    expect(results.filter((s) => s === 200)).toHaveLength(300);
    expect(results.filter((s) => s === 429)).toHaveLength(1);
  });

  test("unauthenticated requests do not consume an organisation's budget", async () => {
    const org = await seedOrg(gw.database);
    for (let i = 0; i < 70; i++) await fetch(`${gw.url}/v1/me`, { headers: bearer(`sk-gw-${"x".repeat(43)}`) });
    const res = await me(org.serviceKey);
    expect(res.headers.get("x-ratelimit-remaining-requests")).toBe("59");
  });
});

describe("rate-limit options and headers through the gateway", () => {
  test("rateLimit.instances divides each plan's limit: 3 instances enforce 20 of Standard's 60 each", async () => {
    const third = await startTestGateway({ rateLimit: { instances: 3, maxOrgs: 1000, windowMs: 60_000 } });
    try {
      const org = await seedOrg(third.database);
      const statuses: number[] = [];
      for (let i = 0; i < 21; i++) {
        const res = await fetch(`${third.url}/v1/me`, { headers: bearer(org.serviceKey) });
        if (i === 0) expect(res.headers.get("x-ratelimit-limit-requests")).toBe("20");
        statuses.push(res.status);
        await res.text();
      }
      expect(statuses.filter((s) => s === 200)).toHaveLength(20);
      expect(statuses.at(-1)).toBe(429);
    } finally {
      await third.stop();
    }
  });

  test("rateLimit.maxOrgs: a new organisation is refused (429, retry-after) while the table is full of live ones, admitted once one is idle", async () => {
    const small = await startTestGateway({ rateLimit: { instances: 1, maxOrgs: 2, windowMs: 1_000 } });
    try {
      const [a, b, c] = [await seedOrg(small.database), await seedOrg(small.database), await seedOrg(small.database)];
      const call = (key: string) => fetch(`${small.url}/v1/me`, { headers: bearer(key) });
      expect((await call(a.serviceKey)).status).toBe(200);
      expect((await call(b.serviceKey)).status).toBe(200);
      const refused = await call(c.serviceKey);
      expect(refused.status).toBe(429);
      expect((await errorOf(refused)).code).toBe("rate_limit_error");
      expect(Number(refused.headers.get("retry-after"))).toBeGreaterThanOrEqual(1);
      // Known organisations are unaffected.
      expect((await call(a.serviceKey)).status).toBe(200);
      // Once a and b have been idle for a window, c gets a slot.
      const deadline = Date.now() + 10_000;
      let status = 429;
      while (status === 429 && Date.now() < deadline) {
        await Bun.sleep(200);
        status = (await call(c.serviceKey)).status;
      }
      expect(status).toBe(200);
    } finally {
      await small.stop();
    }
  });

  test("organisations idle for a window are swept from the limiter (gateway_rate_limit_orgs falls back to 0)", async () => {
    const brief = await startTestGateway({ rateLimit: { instances: 1, maxOrgs: 1000, windowMs: 1_000 } });
    try {
      const org = await seedOrg(brief.database);
      const held = async () => {
        const text = await (await fetch(`${brief.metricsUrl}`)).text();
        return Number(/^gateway_rate_limit_orgs (\d+)$/m.exec(text)?.[1] ?? Number.NaN);
      };
      expect(await held()).toBe(0);
      expect((await fetch(`${brief.url}/v1/me`, { headers: bearer(org.serviceKey) })).status).toBe(200);
      expect(await held()).toBe(1);
      // No other organisation arrives (nothing forces room to be made): only the sweep can drop it.
      const deadline = Date.now() + 10_000;
      let n = 1;
      while (n !== 0 && Date.now() < deadline) {
        await Bun.sleep(200);
        n = await held();
      }
      expect(n).toBe(0);
    } finally {
      await brief.stop();
    }
  });

  test("a refusal's retry-after-ms, and the last admission's x-ratelimit-reset-requests, are the true wait: until the oldest admission in the window expires", async () => {
    // decisions.md, Rate limits: "a refusal's retry-after / retry-after-ms is the true wait"; the reset header is
    // "time until the next slot frees". The bounds come from the test's own clock around each request (the
    // gateway runs in this process, on the same clock), so a busy machine widens them and never breaks them.
    const W = 8_000;
    const g = await startTestGateway({ rateLimit: { instances: 1, maxOrgs: 1000, windowMs: W }, plans: { Standard: { requestsPerMinute: 3 }, Ultra: { requestsPerMinute: 300 } } });
    try {
      const org = await seedOrg(g.database);
      const call = async () => {
        const sent = Date.now();
        const res = await fetch(`${g.url}/v1/me`, { headers: bearer(org.serviceKey) });
        const text = await res.text();
        return { res, text, sent, done: Date.now() };
      };
      const first = await call();
      expect(first.res.status).toBe(200);
      // A gap, so that the oldest admission and the newest expire at clearly different times.
      await Bun.sleep(1_500);
      expect((await call()).res.status).toBe(200);
      const third = await call();
      expect(third.res.status).toBe(200);
      expect(third.res.headers.get("x-ratelimit-remaining-requests")).toBe("0");
      const refused = await call();
      expect(refused.res.status).toBe(429);
      // The message names the window configured, not the spec's minute.
      expect((JSON.parse(refused.text) as { error: { message: string } }).error.message).toStartWith("Rate limit reached: 3 requests per 8 s for this organisation.");
      // The first admission happened within [first.sent, first.done], the answer within [x.sent, x.done]: the
      // time until the first frees lies within these bounds (1 ms either side for the rounding up to whole ms).
      const bounds = (x: { sent: number; done: number }) => [first.sent + W - x.done - 1, first.done + W - x.sent + 1];
      const waitMs = Number(refused.res.headers.get("retry-after-ms"));
      const [lo = 0, hi = 0] = bounds(refused);
      expect({ waitMs, within: waitMs >= lo && waitMs <= hi }).toEqual({ waitMs, within: true });
      expect(Number(refused.res.headers.get("retry-after"))).toBe(Math.ceil(waitMs / 1000));
      const reset = durationMs(third.res.headers.get("x-ratelimit-reset-requests") ?? "");
      const [rlo = 0, rhi = 0] = bounds(third);
      expect({ reset, within: reset >= rlo && reset <= rhi }).toEqual({ reset, within: true });
      // Not too short either: once it has passed, a slot is free.
      await Bun.sleep(Math.max(0, refused.done + waitMs - Date.now()));
      expect((await call()).res.status).toBe(200);
    } finally {
      await g.stop();
    }
  });

  test("authenticated 400, 404 and 503 answers carry x-ratelimit-* and count against the window", async () => {
    // The test gateway's aliases point at a closed port: chat answers 503.
    const org = await seedOrg(gw.database);
    const chat = (body: unknown) =>
      fetch(`${gw.url}/v1/chat/completions`, { method: "POST", headers: bearer(org.serviceKey, { "content-type": "application/json" }), body: JSON.stringify(body) });
    const answers = [
      await chat({ model: "svc-fast", messages: [], bogus: 1 }),
      await chat({ model: "no-such-model", messages: [{ role: "user", content: "hi" }] }),
      await chat({ model: "svc-fast", messages: [{ role: "user", content: "hi" }] }),
    ];
    expect(answers.map((r) => r.status)).toEqual([400, 404, 503]);
    for (const [i, res] of answers.entries()) {
      expect(res.headers.get("x-ratelimit-limit-requests")).toBe("60");
      expect(res.headers.get("x-ratelimit-remaining-requests")).toBe(String(59 - i));
      expect(res.headers.get("x-ratelimit-reset-requests")).toMatch(/^[0-9.]+m?s$|^1m0s$/);
      await res.text();
    }
  });
});

describe("with the official SDK", () => {
  test("openai with retries waits for retry-after and then succeeds", async () => {
    // A 4-second window keeps the test short; the arithmetic is the same as for a minute.
    const fast = await startTestGateway({ rateLimit: { instances: 1, maxOrgs: 1000, windowMs: 4_000 } });
    try {
      const org = await seedOrg(fast.database);
      // Fill the window at once (in parallel, so a slow machine cannot let it slide meanwhile).
      const fill = () => Promise.all(Array.from({ length: 60 }, () => fetch(`${fast.url}/v1/models`, { headers: bearer(org.serviceKey) }).then((r) => r.status)));
      expect((await fill()).filter((s) => s === 200).length).toBe(60);
      const client = new OpenAI({ baseURL: `${fast.url}/v1`, apiKey: org.serviceKey, maxRetries: 3 });
      const started = Date.now();
      const page = await client.models.list();
      const waited = Date.now() - started;
      expect(page.data.length).toBeGreaterThan(0);
      // It got a 429, honoured retry-after-ms, and succeeded once a slot freed.
      expect(waited).toBeGreaterThanOrEqual(1_000);
      await Bun.sleep(4_100);
      await fill();
      const noRetry = new OpenAI({ baseURL: `${fast.url}/v1`, apiKey: org.serviceKey, maxRetries: 0 });
      const err = await noRetry.models.list().catch((e: unknown) => e);
      expect(err).toBeInstanceOf(OpenAI.RateLimitError);
    } finally {
      await fast.stop();
    }
  });
});

/** Milliseconds of a Go-style duration as OpenAI sends it ("250ms", "2.5s", "1m2.5s", "1h0m0s"); NaN otherwise. */
function durationMs(text: string): number {
  const m = /^(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+(?:\.\d+)?)s|(\d+)ms)?$/.exec(text);
  if (!m || text === "") return Number.NaN;
  const [, h = "0", min = "0", s = "0", ms = "0"] = m;
  return Number(h) * 3_600_000 + Number(min) * 60_000 + Math.round(Number(s) * 1000) + Number(ms);
}
