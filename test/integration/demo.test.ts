import { afterAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { readdirSync, statSync } from "node:fs";
import { join } from "node:path";
import { expectAuditPage } from "../helpers/spec-types.ts";
import { type Proc, cleanEnv, exitWithin, listeningUrl, removeScratch, scratchDir, startGatewayProcess } from "../helpers/process.ts";

// Each demo is a gateway process starting the embedded database: seconds each on a busy machine.
setDefaultTimeout(180_000);

/**
 * docs/decisions.md "Embedded database demo": `serve --demo` runs on an
 * in-memory database unless --data-dir is given, so every demo starts clean.
 * Through the real CLI: a second demo knows nothing of the first (its keys,
 * its requests, its audit events), and what earlier runs left where a
 * gateway would otherwise look (./data, GATEWAY_DATA_DIR, a config file's
 * dataDir, DATABASE_URL) is neither read nor changed.
 */

afterAll(() => removeScratch());

/** The events `serve --demo` seeds (spec 2.6 in full is checked by cli.test.ts). */
const SEEDED = ["api_key.created", "api_key.created", "group.created", "member.created", "member.invited", "member.role_changed", "org.created"].sort();

interface Demo {
  proc: Proc;
  url: string;
  orgId: string;
  personal: string;
  service: string;
}

async function startDemo(args: string[], opts: { cwd: string; env: Record<string, string> }): Promise<Demo> {
  const proc = startGatewayProcess(["serve", "--demo", "--port", "0", ...args], opts);
  try {
    const url = await listeningUrl(proc);
    const orgLine = await proc.waitForLine(/Demo organisation [0-9a-f-]{36} is ready/, 60_000);
    const key = async (re: RegExp) => /(sk-gw-[0-9A-Za-z]{43})/.exec(await proc.waitForLine(re))?.[1] ?? "";
    return {
      proc,
      url,
      orgId: /([0-9a-f-]{36})/.exec(orgLine)?.[1] ?? "",
      personal: await key(/personal key \(inference\):\s+sk-gw-/),
      service: await key(/service key\s+\(inference, audit:read\):\s+sk-gw-/),
    };
  } catch (e) {
    proc.kill("SIGKILL");
    throw e;
  }
}

async function stopDemo(demo: Demo): Promise<void> {
  demo.proc.kill("SIGTERM");
  expect(await exitWithin(demo.proc, 20_000)).toBe(0);
}

/** Use a demo the way its printed examples do: leaves a chat request's usage and a key's first use behind. */
async function useDemo(demo: Demo): Promise<void> {
  const res = await fetch(`${demo.url}/v1/chat/completions`, {
    method: "POST",
    headers: { authorization: `Bearer ${demo.personal}`, "content-type": "application/json" },
    body: JSON.stringify({ model: "svc-fast", max_tokens: 5, messages: [{ role: "user", content: "Hello!" }] }),
  });
  expect(res.status).toBe(200);
  await res.arrayBuffer();
}

/** What a fresh demo holds: its own organisation, only the events it seeded, and no earlier demo's keys. */
async function expectClean(demo: Demo, earlier: Demo[]): Promise<void> {
  const audit = await fetch(`${demo.url}/v1/audit-events?limit=200`, { headers: { authorization: `Bearer ${demo.service}` } });
  expect(audit.status).toBe(200);
  const events = expectAuditPage(await audit.json()).data;
  expect(events.map((e) => e.action).sort()).toEqual(SEEDED);
  // The audit log is per organisation: the one org.created in it is this demo's own.
  expect(events.find((e) => e.action === "org.created")?.targets[0]?.id).toBe(demo.orgId);
  for (const old of earlier) {
    expect(old.orgId).not.toBe(demo.orgId);
    for (const key of [old.personal, old.service]) {
      const me = await fetch(`${demo.url}/v1/me`, { headers: { authorization: `Bearer ${key}` } });
      expect(me.status).toBe(401);
      await me.arrayBuffer();
    }
  }
}

/** Every file under `dir` with its size and modification time. */
function snapshot(dir: string): Record<string, string> {
  const files: Record<string, string> = {};
  for (const name of readdirSync(dir, { recursive: true, encoding: "utf8" })) {
    const st = statSync(join(dir, name));
    if (st.isFile()) files[name] = `${st.size} ${st.mtimeMs}`;
  }
  return files;
}

describe("every demo starts clean (serve --demo, as processes)", () => {
  test("two demos in a row: the second knows nothing of the first, and neither leaves a file behind", async () => {
    const cwd = scratchDir();
    const env = cleanEnv({ LOG_LEVEL: "info" });
    const first = await startDemo([], { cwd, env });
    await useDemo(first);
    await expectClean(first, []);
    await stopDemo(first);
    const second = await startDemo([], { cwd, env });
    try {
      await expectClean(second, [first]);
    } finally {
      await stopDemo(second);
    }
    expect(readdirSync(cwd)).toEqual([]);
  });

  test("a leftover data directory (./data, GATEWAY_DATA_DIR, a config file's dataDir) and DATABASE_URL are neither used nor changed", async () => {
    const cwd = scratchDir();
    const env = cleanEnv({ LOG_LEVEL: "info" });
    // A demo kept on disk (--data-dir), where a gateway looks by default: ./data.
    const kept = await startDemo(["--data-dir", "data"], { cwd, env });
    await useDemo(kept);
    await stopDemo(kept);
    const leftover = join(cwd, "data");
    const before = snapshot(leftover);
    expect(Object.keys(before).length).toBeGreaterThan(0);

    // With nothing set, the default data directory is ./data: the demo does not open it.
    const plain = await startDemo([], { cwd, env });
    try {
      await expectClean(plain, [kept]);
    } finally {
      await stopDemo(plain);
    }

    // Pointed at it every other way, and at a Postgres that does not answer: still in memory, with a warning.
    const configPath = join(scratchDir(), "config.json");
    await Bun.write(configPath, JSON.stringify({ dataDir: leftover }));
    const pointed = await startDemo(["--config", configPath], {
      cwd,
      env: { ...env, GATEWAY_DATA_DIR: leftover, DATABASE_URL: "postgres://postgres@127.0.0.1:1/leftover" },
    });
    try {
      await expectClean(pointed, [kept, plain]);
      expect(pointed.proc.stdout()).toContain('"database":"pglite"');
      expect(pointed.proc.stdout()).toMatch(/"level":"warn","msg":"demo: the configured database \(DATABASE_URL \/ databaseUrl\) is not used/);
    } finally {
      await stopDemo(pointed);
    }
    // Not read, not locked, not written.
    expect(snapshot(leftover)).toEqual(before);
  });
});

describe("the demo's upstream (README: the built-in simulator, or the one configured)", () => {
  test("with UPSTREAM_BASE_URL set, or a config file's aliases, the demo's chat goes to that server; without either, to the built-in simulator", async () => {
    const seen: string[] = [];
    const upstream = Bun.serve({
      port: 0,
      hostname: "127.0.0.1",
      async fetch(req) {
        const body = (await req.json()) as { model: string };
        seen.push(body.model);
        return Response.json({
          id: "chatcmpl-own",
          object: "chat.completion",
          created: 1,
          model: body.model,
          choices: [{ index: 0, message: { role: "assistant", content: "from the configured upstream" }, finish_reason: "stop" }],
          usage: { prompt_tokens: 3, completion_tokens: 4, total_tokens: 7 },
        });
      },
    });
    try {
      const chat = async (demo: Demo) => {
        const res = await fetch(`${demo.url}/v1/chat/completions`, {
          method: "POST",
          headers: { authorization: `Bearer ${demo.personal}`, "content-type": "application/json" },
          body: JSON.stringify({ model: "svc-fast", max_tokens: 5, messages: [{ role: "user", content: "Hello!" }] }),
        });
        expect(res.status).toBe(200);
        return ((await res.json()) as { choices: { message: { content: string } }[] }).choices[0]?.message.content;
      };
      const configured = await startDemo([], { cwd: scratchDir(), env: cleanEnv({ LOG_LEVEL: "info", UPSTREAM_BASE_URL: `http://127.0.0.1:${upstream.port}/v1` }) });
      try {
        expect(await chat(configured)).toBe("from the configured upstream");
        expect(seen).toEqual(["svc-fast"]);
      } finally {
        await stopDemo(configured);
      }
      // A config file's aliases, without UPSTREAM_BASE_URL: the demo's chat goes there too, under the upstream's model id.
      const dir = scratchDir();
      const file = join(dir, "config.json");
      await Bun.write(file, JSON.stringify({ aliases: { "svc-fast": { targets: [{ baseUrl: `http://127.0.0.1:${upstream.port}/v1`, model: "acme/own-model" }] } } }));
      const fromFile = await startDemo(["--config", file], { cwd: dir, env: cleanEnv({ LOG_LEVEL: "info" }) });
      try {
        expect(await chat(fromFile)).toBe("from the configured upstream");
        expect(seen).toEqual(["svc-fast", "acme/own-model"]);
      } finally {
        await stopDemo(fromFile);
      }
      const simulated = await startDemo([], { cwd: scratchDir(), env: cleanEnv({ LOG_LEVEL: "info" }) });
      try {
        expect(await chat(simulated)).not.toBe("from the configured upstream");
        expect(seen).toEqual(["svc-fast", "acme/own-model"]);
      } finally {
        await stopDemo(simulated);
      }
    } finally {
      upstream.stop(true);
    }
  });
});
