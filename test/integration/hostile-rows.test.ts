import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { type SQL, sql } from "drizzle-orm";
import { type Database, migrate, openDatabase } from "../../src/db/client.ts";
import { createLogger } from "../../src/lib/log.ts";
import { type Gateway, startGateway } from "../../src/server.ts";
import { type Simulator, startSimulator } from "../../src/sim/index.ts";
import { TEST_DATABASE_URL, type SeededOrg, bearer, errorOf, freshDatabase, sharedDatabase, testConfig } from "../helpers/harness.ts";
import { createScratchDatabase } from "../helpers/process.ts";
import { TEST_PLANS, post, seedTestOrg, testAliases, upstreamSettings } from "./inference-fixtures.ts";

setDefaultTimeout(30_000);

/**
 * Rows read from the database are hostile until checked (docs/decisions.md,
 * "Rows read from the database"): an operator may hand-edit them, another
 * version may have written them, a restore may be partial. Each case writes an
 * odd row with SQL, past the application's own rules (not past a constraint
 * of the schema), and asks through real HTTP: that record alone fails, with a
 * clear answer, logged once with its id; never a 500 for everyone, a crash, a
 * hang or a grant of access the row does not give.
 */

let sim: Simulator;
let gw: Gateway;
let db: Database;
const logged: string[] = [];

beforeAll(async () => {
  sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 4 });
  db = await sharedDatabase();
  const config = await testConfig({ aliases: testAliases(sim.url), plans: TEST_PLANS, upstream: upstreamSettings(), responses: { enabled: true } });
  gw = await startGateway({ config, database: db, log: createLogger("warn", (line) => logged.push(line)) });
});
afterEach(() => sim.reset());
afterAll(async () => {
  await gw.stop();
  await sim.stop();
});

const get = (path: string, key: string) => fetch(`${gw.url}${path}`, { headers: bearer(key) });
const chat = (key: string, extra: Record<string, unknown> = {}) =>
  post(gw, "/v1/chat/completions", key, { model: "svc-fast", messages: [{ role: "user", content: "hi" }], ...extra });

async function failure(res: Response): Promise<{ status: number; code: string; message: string }> {
  const err = await errorOf(res);
  return { status: res.status, code: err.code, message: err.message };
}

/** Log lines (parsed) whose message contains `msg` and that name `id` anywhere. */
function linesAbout(msg: string, id: string): Record<string, unknown>[] {
  return logged
    .filter((l) => l.includes(id))
    .map((l) => JSON.parse(l) as Record<string, unknown>)
    .filter((l) => String(l.msg).includes(msg));
}

/** A fresh organisation whose personal key's row is then changed by `set` (before the key is first used, so nothing is cached). */
async function withKeyRow(set: SQL, which: "personal" | "service" = "personal"): Promise<SeededOrg> {
  const org = await seedTestOrg(db);
  await db.rows(sql`update api_keys set ${set} where id = ${which === "personal" ? org.personalKeyId : org.serviceKeyId}`);
  return org;
}

describe("api_keys rows", () => {
  // Seen failing before: -infinity and dates before year 1 read as Invalid Date, whose comparison with now is
  // false, so the key was valid (200 on /v1/me and chat); infinity and years past 275760 made /v1/me 500.
  test("an expiry out of JavaScript's range: before it (-infinity, 4713 BC) is expired; after it (infinity, year 294276) reads as 9999-12-31", async () => {
    for (const past of ["-infinity", "4713-01-01 BC"]) {
      const org = await withKeyRow(sql`expires_at = ${past}::timestamptz`);
      expect(await failure(await get("/v1/me", org.personalKey))).toMatchObject({ status: 401, code: "key_expired" });
      expect(await failure(await chat(org.personalKey))).toMatchObject({ status: 401, code: "key_expired" });
    }
    for (const future of ["infinity", "294276-01-01"]) {
      const org = await withKeyRow(sql`expires_at = ${future}::timestamptz`);
      const me = await get("/v1/me", org.personalKey);
      expect(me.status).toBe(200);
      expect(((await me.json()) as { key: { expires_at: string } }).key.expires_at).toBe("9999-12-31T23:59:59.999Z");
    }
  });

  test("a set revoked_at is a revocation, whatever its value (infinity, the future, 4713 BC)", async () => {
    // The epoch too: its epoch milliseconds are 0, read as "not set" by a falsy check.
    for (const at of ["infinity", "-infinity", "2999-01-01", "4713-01-01 BC", "1970-01-01 00:00:00+00"]) {
      const org = await withKeyRow(sql`revoked_at = ${at}::timestamptz`);
      expect(await failure(await get("/v1/me", org.personalKey))).toMatchObject({ status: 401, code: "unauthorized" });
    }
  });

  // Seen failing before: /v1/me answered scopes ["inference", null, "inference", "bogus"] (postgres.js: "NULL").
  test("scopes: unknown, null and repeated values are dropped; none left is 403 scope_missing everywhere", async () => {
    const org = await withKeyRow(sql`scopes = '{inference,NULL,inference,bogus,"audit:read"}'::text[]`);
    const me = await get("/v1/me", org.personalKey);
    expect(me.status).toBe(200);
    // audit:read stays listed (a personal key's audit:read opens nothing: the audit log takes service keys only).
    expect(((await me.json()) as { key: { scopes: string[] } }).key.scopes).toEqual(["inference", "audit:read"]);
    expect(await failure(await get("/v1/audit-events", org.personalKey))).toMatchObject({ status: 403, code: "scope_missing" });
    expect(linesAbout("API key row", org.personalKeyId)).toHaveLength(1);

    const none = await withKeyRow(sql`scopes = '{bogus}'::text[]`);
    expect(await failure(await get("/v1/me", none.personalKey))).toMatchObject({ status: 403, code: "scope_missing" });
    expect(await failure(await chat(none.personalKey))).toMatchObject({ status: 403, code: "scope_missing" });
    const empty = await withKeyRow(sql`scopes = '{}'::text[]`);
    expect(await failure(await get("/v1/me", empty.personalKey))).toMatchObject({ status: 403, code: "scope_missing" });
  });

  // Seen failing before: each of these keys was served (200 on /v1/me, "kind": "admin" for the first).
  test("a key whose kind or owner is inconsistent is refused alone (401, logged once with its id); its organisation's other keys still work", async () => {
    const other = await seedTestOrg(db);
    const cases: [string, SeededOrg][] = [
      ["kind", await withKeyRow(sql`kind = 'admin'`)],
      ["personal key without a user", await withKeyRow(sql`user_id = null`)],
      ["user of another organisation", await withKeyRow(sql`user_id = ${other.userId}`)],
      ["service key with a user", await withKeyRow(sql`user_id = (select user_id from api_keys k where k.org_id = api_keys.org_id and k.kind = 'personal')`, "service")],
    ];
    const gone = await seedTestOrg(db);
    // The foreign key forbids it; a partial restore without constraints (replica mode) does not.
    await db.db.transaction(async (tx) => {
      await tx.execute(sql`set local session_replication_role = replica`);
      await tx.execute(sql`delete from users where id = ${gone.userId}`);
    });
    cases.push(["user row gone", gone]);
    for (const [what, org] of cases) {
      const key = what === "service key with a user" ? org.serviceKey : org.personalKey;
      const keyId = what === "service key with a user" ? org.serviceKeyId : org.personalKeyId;
      for (let i = 0; i < 2; i++) {
        const f = await failure(await get("/v1/me", key));
        expect({ what, ...f }).toMatchObject({ what, status: 401, code: "unauthorized" });
        expect(f.message).toContain("record is damaged");
      }
      expect({ what, lines: linesAbout("API key row", keyId).length }).toEqual({ what, lines: 1 });
      const sibling = what === "service key with a user" ? org.personalKey : org.serviceKey;
      if (what !== "user row gone") expect({ what, status: (await get("/v1/me", sibling)).status }).toEqual({ what, status: 200 });
    }
  });

  test("models: an unknown alias matches nothing, nulls and repeats are dropped; an empty list opens no model; a list past 1,000 entries is refused", async () => {
    const org = await withKeyRow(sql`models = '{svc-fast,NULL,svc-fast,no-such-alias}'::text[]`);
    expect((await chat(org.personalKey)).status).toBe(200);
    expect(await failure(await chat(org.personalKey, { model: "svc-smart" }))).toMatchObject({ status: 404, code: "model_not_found" });
    const listed = (await (await get("/v1/models", org.personalKey)).json()) as { data: { id: string }[] };
    expect(listed.data.map((m) => m.id)).toEqual(["svc-fast"]);

    const empty = await withKeyRow(sql`models = '{}'::text[]`);
    expect(await failure(await chat(empty.personalKey))).toMatchObject({ status: 404, code: "model_not_found" });

    const huge = await withKeyRow(sql`models = array_append((select array_agg('m' || g) from generate_series(1, 100000) g), 'svc-fast')`);
    const f = await failure(await chat(huge.personalKey));
    expect(f).toMatchObject({ status: 401, code: "unauthorized" });
    expect(f.message).toContain("record is damaged");
    // The bound exactly (decisions.md: "a `models` list longer than 1,000"): 1,000 entries serve, 1,001 do not.
    const most = await withKeyRow(sql`models = array_append((select array_agg('m' || g) from generate_series(1, 999) g), 'svc-fast')`);
    expect((await chat(most.personalKey)).status).toBe(200);
    const past = await withKeyRow(sql`models = array_append((select array_agg('m' || g) from generate_series(1, 1000) g), 'svc-fast')`);
    expect(await failure(await chat(past.personalKey))).toMatchObject({ status: 401, code: "unauthorized" });
  });
});

/** A fresh organisation (plan Test, never rate limited) whose row is then changed by `set`. */
async function withOrgRow(set: SQL, opts: Parameters<typeof seedTestOrg>[1] = {}): Promise<SeededOrg> {
  const org = await seedTestOrg(db, opts);
  await db.rows(sql`update organizations set ${set} where id = ${org.orgId}`);
  return org;
}

describe("organizations rows", () => {
  // Seen failing before: the limit was the default plan's, but nothing said why (no log line).
  test("a plan not in the configuration is rate limited as the default plan (documented), logged once with the organisation's id", async () => {
    for (const plan of ["Gold", "__proto__", "constructor", "toString", ""]) {
      const org = await withOrgRow(sql`plan = ${plan}`);
      for (let i = 0; i < 2; i++) {
        const res = await get("/v1/me", org.serviceKey);
        expect({ plan, status: res.status, limit: res.headers.get("x-ratelimit-limit-requests") }).toEqual({ plan, status: 200, limit: "60" });
      }
      expect({ plan, lines: linesAbout("organization row", org.orgId).length }).toEqual({ plan, lines: 1 });
    }
  });

  test("the default plan is the configuration's defaultPlan, not Standard's 60: an unknown plan gets its limit", async () => {
    // The test above runs with defaultPlan Standard, whose 60 is also the built-in fallback: this one tells them apart.
    const config = await testConfig({ aliases: testAliases(sim.url), plans: { ...TEST_PLANS, Tiny: { requestsPerMinute: 7 } }, defaultPlan: "Tiny" });
    const tiny = await startGateway({ config, database: db, log: createLogger("silent") });
    try {
      const org = await withOrgRow(sql`plan = 'Gold'`);
      const statuses: number[] = [];
      for (let i = 0; i < 8; i++) {
        const res = await fetch(`${tiny.url}/v1/me`, { headers: bearer(org.serviceKey) });
        expect(res.headers.get("x-ratelimit-limit-requests")).toBe("7");
        statuses.push(res.status);
        await res.arrayBuffer();
      }
      expect(statuses).toEqual([200, 200, 200, 200, 200, 200, 200, 429]);
    } finally {
      await tiny.stop();
    }
  });

  // Seen failing before: the refusal said "a usage quota of 100 tokens per fortnight", and "of -5 tokens".
  test("a quota window not hour, day or month is a month; a negative quota is 0; one past 2^53 is unlimited in practice", async () => {
    const fortnight = await withOrgRow(sql`quota_window = 'fortnight'`, { quotaTokens: 100 });
    const f = await failure(await chat(fortnight.personalKey, { max_tokens: 1_000 }));
    expect(f).toMatchObject({ status: 429, code: "budget_exceeded" });
    expect(f.message).toContain("100 tokens per month");
    expect(linesAbout("organization row", fortnight.orgId)).toHaveLength(1);

    const negative = await withOrgRow(sql`quota_tokens = -5`);
    const n = await failure(await chat(negative.personalKey));
    expect(n).toMatchObject({ status: 429, code: "budget_exceeded" });
    expect(n.message).toContain("quota of 0 tokens");

    const huge = await withOrgRow(sql`quota_tokens = 9223372036854775807`);
    for (let i = 0; i < 2; i++) expect((await chat(huge.personalKey)).status).toBe(200);
  });
});

describe("usage_counters rows", () => {
  const monthStart = () => new Date(Date.UTC(new Date().getUTCFullYear(), new Date().getUTCMonth(), 1)).toISOString();

  // Seen failing before: used = -10^12 counted as 10^12 tokens free, and two requests using 905 tokens each of a 1,000 quota were served.
  test("a negative used or leased is set to 0 (logged once): it never adds to the quota", async () => {
    for (const column of ["used", "leased"]) {
      const org = await seedTestOrg(db, { quotaTokens: 2_000 });
      await db.rows(sql`insert into usage_counters (org_id, window_start, used, leased) values (${org.orgId}, ${monthStart()}, ${column === "used" ? -1e12 : 0}, ${column === "leased" ? -1e12 : 0})`);
      // Each reserves about 1,430 tokens (the prompt's bound and 900) and uses about 905 (the simulator answers up to
      // max_tokens): the first fits the quota, the second does not.
      await fetch(`${sim.url.replace(/\/v1$/, "")}/__sim/config`, { method: "POST", body: JSON.stringify({ completionTokens: 100_000 }) });
      expect((await chat(org.personalKey, { max_tokens: 900 })).status).toBe(200);
      const f = await failure(await chat(org.personalKey, { max_tokens: 900 }));
      expect({ column, ...f }).toMatchObject({ column, status: 429, code: "budget_exceeded" });
      expect((await chat(org.personalKey, { max_tokens: 50 })).status).toBe(200);
      expect(linesAbout("usage_counters row", org.orgId)).toHaveLength(1);
    }
  });

  test("used beyond the quota refuses; a window starting in the future does not count", async () => {
    const spent = await seedTestOrg(db, { quotaTokens: 1_000 });
    await db.rows(sql`insert into usage_counters (org_id, window_start, used) values (${spent.orgId}, ${monthStart()}, 9223372036854775807)`);
    expect(await failure(await chat(spent.personalKey, { max_tokens: 10 }))).toMatchObject({ status: 429, code: "budget_exceeded" });

    const future = await seedTestOrg(db, { quotaTokens: 1_000 });
    await db.rows(sql`insert into usage_counters (org_id, window_start, used, leased) values (${future.orgId}, ${new Date(Date.now() + 40 * 86_400_000).toISOString()}, 5000, 5000)`);
    expect((await chat(future.personalKey, { max_tokens: 100 })).status).toBe(200);
  });
});

describe("responses rows", () => {
  const create = (key: string, body: Record<string, unknown>) => post(gw, "/v1/responses", key, { model: "svc-fast", ...body });
  async function made(key: string, body: Record<string, unknown>): Promise<string> {
    const res = await create(key, body);
    expect(res.status).toBe(200);
    return String(((await res.json()) as { id: string }).id);
  }
  const upstreamMessages = () => (sim.stats.lastBody as { messages: { role: string; content: unknown }[] }).messages;

  // Seen failing before: the replay went round the cycle until the depth bound (1,000 responses: a, b, a, b, …).
  test("a previous_response_id chain with a cycle (A -> B -> A) is replayed once round, each response once", async () => {
    const org = await seedTestOrg(db);
    const a = await made(org.personalKey, { input: "a" });
    const b = await made(org.personalKey, { input: "b", previous_response_id: a });
    await db.rows(sql`update responses set previous_response_id = ${b} where id = ${a}`);
    expect((await create(org.personalKey, { input: "c", previous_response_id: b })).status).toBe(200);
    const users = upstreamMessages().filter((m) => m.role === "user");
    const text = (c: unknown) => (typeof c === "string" ? c : (c as { text: string }[]).map((p) => p.text).join(""));
    expect(users.map((m) => text(m.content))).toEqual(["a", "b", "c"]);
    expect((await get(`/v1/responses/${a}`, org.personalKey)).status).toBe(200);
  });

  // Seen failing before: GET answered 200 with the other id's body, or with {"object": "list"}.
  test("a stored Response of the wrong shape (another id, not a response) is 404 on retrieve, logged once with its id; its input items and the caller's other responses still read", async () => {
    const org = await seedTestOrg(db);
    const kept = await made(org.personalKey, { input: "kept" });
    for (const body of [`{"id":"resp_someone_else","object":"response","output":[]}`, `{"object":"list","data":[]}`]) {
      const id = await made(org.personalKey, { input: "x" });
      await db.rows(sql`update responses set response = ${body} where id = ${id}`);
      for (let i = 0; i < 2; i++) expect(await failure(await get(`/v1/responses/${id}`, org.personalKey))).toMatchObject({ status: 404, code: "not_found" });
      // Its input items are readable, and listed.
      expect((await get(`/v1/responses/${id}/input_items`, org.personalKey)).status).toBe(200);
      expect(linesAbout("stored response", id)).toHaveLength(1);
    }
    expect((await get(`/v1/responses/${kept}`, org.personalKey)).status).toBe(200);
  });

  // Seen failing before: the 65 MiB row was read and answered whole (200), and replayed whole.
  test("a stored row past 64 MiB is not read: 404 on retrieve and input items, left out of a replay", async () => {
    const org = await seedTestOrg(db);
    const id = await made(org.personalKey, { input: "big" });
    await db.rows(
      sql`update responses set response = '{"id":"' || id || '","object":"response","output":[],"pad":"' || repeat('x', 65 * 1024 * 1024) || '"}' where id = ${id}`,
    );
    expect(await failure(await get(`/v1/responses/${id}`, org.personalKey))).toMatchObject({ status: 404, code: "not_found" });
    expect(await failure(await get(`/v1/responses/${id}/input_items`, org.personalKey))).toMatchObject({ status: 404, code: "not_found" });
    expect((await create(org.personalKey, { input: "next", previous_response_id: id })).status).toBe(200);
    expect(upstreamMessages()).toEqual([{ role: "user", content: "next" }]);
    expect(linesAbout("stored response", id).length).toBeGreaterThanOrEqual(1);
  });
});

/** An audit row written past recordAudit's rules: `targets` and `details` as given (JSON text), `created_at` as given (Postgres text) or now. */
async function oddAuditRow(orgId: string, action: string, targets: string, details: string, createdAt?: string): Promise<string> {
  const [row] = await db.rows<{ id: string }>(sql`
    insert into audit_events (org_id, created_at, action, category, actor_type, actor_id, actor_name, actor_email, targets, details, origin_ip_prefix, origin_user_agent_summary, search_text)
    values (${orgId}, coalesce(${createdAt ?? null}::timestamptz, now()), ${action}, 'org', 'system', gen_random_uuid(), 'gateway', '', ${targets}::jsonb, ${details}::jsonb, '', '', ${action}) returning id`);
  return String(row?.id);
}

describe("audit_events rows", () => {
  // Seen failing before: the whole page was 503 service_unavailable (targets.map of an object), and a page
  // answered details as an array or a string where the spec has an object.
  test("targets or details of an unexpected shape: the row is listed with what is readable, every page still reads", async () => {
    const org = await seedTestOrg(db);
    const odd: [string, string][] = [
      ["{}", "[]"],
      ['"text"', '"text"'],
      ['[null, 5, {"key": 1, "kind": "api_key", "id": "x"}]', "null"],
      ['[{"key":"key_id","kind":"api_key","id":"k","name":"n","email":"e"}]', "42"],
    ];
    const ids: string[] = [];
    for (const [i, [targets, details]] of odd.entries()) ids.push(await oddAuditRow(org.orgId, `org.odd_${i}`, targets, details));
    const seen: { id: string; targets: unknown[]; details: unknown }[] = [];
    let cursor = "";
    for (let pages = 0; pages < 20; pages++) {
      const res = await get(`/v1/audit-events?limit=1${cursor ? `&cursor=${cursor}` : ""}`, org.serviceKey);
      expect(res.status).toBe(200);
      const page = (await res.json()) as { data: { id: string; targets: unknown[]; details: unknown }[]; next_cursor: string };
      seen.push(...page.data);
      cursor = page.next_cursor;
      if (!cursor) break;
    }
    const byId = new Map(seen.map((e) => [e.id, e]));
    for (const id of ids) {
      const e = byId.get(id);
      expect(e).toBeDefined();
      expect(Array.isArray(e?.targets)).toBe(true);
      expect(typeof e?.details === "object" && e?.details !== null && !Array.isArray(e?.details)).toBe(true);
      expect(linesAbout("audit event row", id)).toHaveLength(1);
    }
    expect(byId.get(ids[2] as string)?.targets).toEqual([{ key: "", kind: "api_key", id: "x", name: "", email: "" }]);
    expect(byId.get(ids[3] as string)?.targets).toEqual([{ key: "key_id", kind: "api_key", id: "k", name: "n", email: "e" }]);
  });

  // Seen failing before: every page holding such a row was 503 service_unavailable (the time could be neither
  // shown nor put in a cursor), and so was every page after it: the rest of the log could not be read.
  test("a created_at outside years 0001-9999 (±infinity, year 10000 or 294276, BC): listed clamped, logged once; paging lists every row exactly once", async () => {
    const org = await seedTestOrg(db);
    const late = "9999-12-31T23:59:59.999Z";
    const early = "0001-01-01T00:00:00.000Z";
    // Newest first, as stored; two rows share some odd instants so the id tie-break is crossed too. Year 1 is
    // in range but was misread too (the driver's Date reads "0001-01-01 00:00:00+00" as 2001).
    const expected: { id: string; shown: string; odd: boolean }[] = [];
    for (const [i, [stored, shown]] of (
      [
        ["infinity", late],
        ["infinity", late],
        ["294276-12-31 23:59:59.999Z", late],
        ["10000-01-01 00:00:00.001Z", late],
        ["10000-01-01 00:00:00.001Z", late],
        ["9999-12-31 23:59:59.999Z", late],
        ["2024-05-01 12:00:00.123Z", "2024-05-01T12:00:00.123Z"],
        ["0001-01-01 00:00:00Z", early],
        ["0001-12-31 23:59:59.999Z BC", early],
        ["0001-12-31 23:59:59.999Z BC", early],
        ["4714-11-24 00:00:00Z BC", early],
        ["-infinity", early],
        ["-infinity", early],
      ] as const
    ).entries()) {
      expected.push({ id: await oddAuditRow(org.orgId, `org.time_${i}`, "[]", "{}", stored), shown, odd: !stored.startsWith(shown.slice(0, 10)) });
    }
    const sorted = (await db.rows<{ id: string }>(sql`select id from audit_events where org_id = ${org.orgId} order by created_at desc, id desc`)).map((r) => r.id);
    const shownOf = new Map(expected.map((e) => [e.id, e.shown]));
    for (const query of ["", "&q=org.time"]) {
      for (const limit of [1, 2, 5]) {
        const seen: { id: string; created_at: string }[] = [];
        let cursor = "";
        for (let pages = 0; pages < 30; pages++) {
          const res = await get(`/v1/audit-events?limit=${limit}${query}${cursor ? `&cursor=${cursor}` : ""}`, org.serviceKey);
          expect({ query, limit, pages, status: res.status }).toEqual({ query, limit, pages, status: 200 });
          const page = (await res.json()) as { data: { id: string; created_at: string }[]; next_cursor: string };
          seen.push(...page.data);
          cursor = page.next_cursor;
          if (!cursor) break;
        }
        // Every row once, in stored order; q leaves out the organisation's own events from seeding.
        const want = query ? sorted.filter((id) => shownOf.has(id)) : sorted;
        expect({ query, limit, ids: seen.map((e) => e.id) }).toEqual({ query, limit, ids: want });
        const ours = seen.filter((e) => shownOf.has(e.id));
        expect(ours.map((e) => e.created_at)).toEqual(ours.map((e) => shownOf.get(e.id) ?? ""));
      }
    }
    for (const { id, odd } of expected) expect({ id, lines: linesAbout("audit event row", id).length }).toEqual({ id, lines: odd ? 1 : 0 });
  });
});

describe("audit_events times as the database gives them", () => {
  // decisions.md, Rows read from the database: "Times are read in SQL as epoch milliseconds, not from the driver's
  // Date, which read years 0001–0099 as 19xx/20xx (listed wrong, and a cursor there jumped) and a server
  // TimeZone's local-mean-time offsets (`-04:56:02`) as invalid."
  test("years 0001-0099, and a server TimeZone whose old offsets are local mean time (America/New_York before 1883): listed as stored, every page reads, each row once", async () => {
    const scratch = TEST_DATABASE_URL ? await createScratchDatabase(TEST_DATABASE_URL, "gw_tz") : undefined;
    const database = scratch ? await openDatabase({ databaseUrl: scratch.url, dataDir: "memory://", poolMax: 4 }) : await freshDatabase();
    let g: Gateway | undefined;
    let db2: Database | undefined;
    try {
      if (scratch) {
        // Every session of the gateway's pool opens with it (a server or database setting, as an operator's would be).
        await database.rows(sql.raw(`alter database "${new URL(scratch.url).pathname.slice(1)}" set timezone to 'America/New_York'`));
        await database.close();
      } else {
        // The embedded database has one session: the setting holds for everything the gateway asks.
        await database.rows(sql`set timezone to 'America/New_York'`);
      }
      db2 = scratch ? await openDatabase({ databaseUrl: scratch.url, dataDir: "memory://", poolMax: 4 }) : database;
      if (scratch) await migrate(db2);
      const [tz] = await db2.rows<{ tz: string }>(sql`select current_setting('TimeZone') as tz`);
      expect(tz?.tz).toBe("America/New_York");
      // What the driver would be handed for the oldest rows: an offset in seconds, which a JavaScript Date cannot read.
      const [lmt] = await db2.rows<{ t: string }>(sql`select '1850-03-01T12:00:00Z'::timestamptz::text as t`);
      expect(lmt?.t).toBe("1850-03-01 07:03:58-04:56:02");
      const org = await seedTestOrg(db2);
      const stored = ["1850-03-01T12:00:00.000Z", "1800-01-01T00:00:00.001Z", "0099-12-31T23:59:59.999Z", "0050-06-15T12:34:56.789Z", "0001-01-01T00:00:00.000Z"];
      const ids = new Map<string, string>();
      for (const [i, at] of stored.entries()) {
        const [row] = await db2.rows<{ id: string }>(sql`
          insert into audit_events (org_id, created_at, action, category, actor_type, actor_id, actor_name, actor_email, targets, details, origin_ip_prefix, origin_user_agent_summary, search_text)
          values (${org.orgId}, ${at}::timestamptz, ${`org.tz_${i}`}, 'org', 'system', gen_random_uuid(), 'gateway', '', '[]'::jsonb, '{}'::jsonb, '', '', ${`org.tz_${i}`}) returning id`);
        ids.set(String(row?.id), at);
      }
      const config = await testConfig({ aliases: testAliases(sim.url), plans: TEST_PLANS });
      g = await startGateway({ config, database: db2, log: createLogger("silent") });
      for (const limit of [1, 2, 200]) {
        const seen: { id: string; created_at: string }[] = [];
        let cursor = "";
        for (let pages = 0; pages < 20; pages++) {
          const res = await fetch(`${g.url}/v1/audit-events?q=org.tz_&limit=${limit}${cursor ? `&cursor=${cursor}` : ""}`, { headers: bearer(org.serviceKey) });
          expect({ limit, pages, status: res.status }).toEqual({ limit, pages, status: 200 });
          const page = (await res.json()) as { data: { id: string; created_at: string }[]; next_cursor: string };
          seen.push(...page.data);
          cursor = page.next_cursor;
          if (!cursor) break;
        }
        // Newest first, each once, each at the time stored.
        expect({ limit, listed: seen.map((e) => e.created_at) }).toEqual({ limit, listed: stored });
        expect(seen.map((e) => ids.get(e.id))).toEqual(stored);
      }
    } finally {
      await g?.stop();
      // On Postgres the first handle was closed once the setting was made; the gateway's is db2.
      await (scratch ? db2?.close() : database.close());
      await scratch?.drop();
    }
  });
});

describe("settings rows", () => {
  // Seen failing before: with an empty secret every page that had a next one was 500 (encodeCursor threw).
  test("a malformed cursor secret (empty, too short) is replaced at start, logged; audit paging works", async () => {
    const org = await seedTestOrg(db);
    for (let i = 0; i < 3; i++) await oddAuditRow(org.orgId, `org.page_${i}`, "[]", "{}");
    for (const value of ["", "short"]) {
      await db.rows(sql`insert into settings (key, value) values ('cursor_secret', ${value}) on conflict (key) do update set value = excluded.value`);
      const lines: string[] = [];
      const config = await testConfig({ aliases: testAliases(sim.url), plans: TEST_PLANS });
      const second = await startGateway({ config, database: db, log: createLogger("warn", (line) => lines.push(line)) });
      try {
        const first = await fetch(`${second.url}/v1/audit-events?limit=1`, { headers: bearer(org.serviceKey) });
        expect({ value, status: first.status }).toEqual({ value, status: 200 });
        const cursor = ((await first.json()) as { next_cursor: string }).next_cursor;
        expect(cursor).not.toBe("");
        expect((await fetch(`${second.url}/v1/audit-events?limit=1&cursor=${cursor}`, { headers: bearer(org.serviceKey) })).status).toBe(200);
        expect(lines.filter((l) => l.includes("cursor_secret"))).toHaveLength(1);
        const [row] = await db.rows<{ value: string }>(sql`select value from settings where key = 'cursor_secret'`);
        expect(row?.value.length).toBeGreaterThanOrEqual(32);
      } finally {
        await second.stop();
      }
    }
  });

  // decisions.md, Settings: "a stored `cursor_secret` that is not 32 to 1,024 characters … is replaced at start".
  test("a cursor secret of 32 or 1,024 characters is kept; of 31 or 1,025 it is replaced", async () => {
    for (const [length, kept] of [
      [31, false],
      [32, true],
      [1_024, true],
      [1_025, false],
    ] as const) {
      const value = "k".repeat(length);
      await db.rows(sql`insert into settings (key, value) values ('cursor_secret', ${value}) on conflict (key) do update set value = excluded.value`);
      const config = await testConfig({ aliases: testAliases(sim.url), plans: TEST_PLANS });
      const second = await startGateway({ config, database: db, log: createLogger("silent") });
      try {
        const [row] = await db.rows<{ value: string }>(sql`select value from settings where key = 'cursor_secret'`);
        expect({ length, kept: row?.value === value }).toEqual({ length, kept });
      } finally {
        await second.stop();
      }
    }
  });
});
