import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { sql } from "drizzle-orm";
import postgres from "postgres";
import { createKey, revokeKey, rotateKey } from "../../src/admin/service.ts";
import { encodeCursor } from "../../src/audit/cursor.ts";
import type { AuditPage } from "../../src/audit/query.ts";
import type { AuditEventView } from "../../src/audit/search.ts";
import { type AuditInput, type Category, recordAudit } from "../../src/audit/record.ts";
import { type Database, migrate, openDatabase } from "../../src/db/client.ts";
import type { Gateway } from "../../src/server.ts";
import { VERSION } from "../../src/lib/version.ts";
import { TEST_DATABASE_URL, bearer, errorOf, freshDatabase, seedOrg, startTestGateway, type SeededOrg } from "../helpers/harness.ts";
import { expectAuditPage } from "../helpers/spec-types.ts";
import { until } from "../helpers/poll.ts";
import { AUTH_CHANNEL } from "../../src/auth/verify.ts";
import { startSimulator } from "../../src/sim/index.ts";
import { testAliases, upstreamSettings } from "./inference-fixtures.ts";

// Servers, processes and PGlite start-up: more than the default 5 s per test on a busy machine.
setDefaultTimeout(30_000);

/**
 * GET /v1/audit-events through real HTTP. Each describe block works on its own
 * organisations, so blocks do not see each other's events. The gateway here
 * has a high request limit; the rate limit itself is tested in auth.test.ts.
 */

const HIGH_LIMITS = { plans: { Standard: { requestsPerMinute: 100_000 }, Ultra: { requestsPerMinute: 100_000 } } };
const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;

let gw: Gateway;
let db: Database;

beforeAll(async () => {
  gw = await startTestGateway(HIGH_LIMITS);
  db = gw.database;
});
afterAll(async () => {
  await gw.stop();
});

type Params = Record<string, string> | string;

function url(params: Params = {}): string {
  const qs = typeof params === "string" ? params : new URLSearchParams(params).toString();
  return `${gw.url}/v1/audit-events${qs ? `?${qs}` : ""}`;
}

async function get(key: string, params: Params = {}, headers: Record<string, string> = {}): Promise<Response> {
  return fetch(url(params), { headers: bearer(key, headers) });
}

/** One 200 page, every field checked against spec 2.6. */
async function page(key: string, params: Params = {}): Promise<AuditPage> {
  const res = await get(key, params);
  if (res.status !== 200) throw new Error(`expected 200, got ${res.status}: ${await res.text()}`);
  return expectAuditPage(await res.json());
}

/** Every page of a listing, following next_cursor; fails on a page loop. */
async function walk(key: string, params: Record<string, string>, limit: number): Promise<{ events: AuditEventView[]; pages: AuditPage[] }> {
  const pages: AuditPage[] = [];
  let cursor = "";
  do {
    const p = await page(key, { ...params, limit: String(limit), ...(cursor ? { cursor } : {}) });
    pages.push(p);
    cursor = p.next_cursor;
    if (pages.length > 1000) throw new Error("pagination does not end");
  } while (cursor !== "");
  return { events: pages.flatMap((p) => p.data), pages };
}

/** Order the API promises: created_at desc, then id desc (uuid text order = Postgres uuid order). */
function newestFirst(a: AuditEventView, b: AuditEventView): number {
  if (a.created_at !== b.created_at) return a.created_at < b.created_at ? 1 : -1;
  return a.id < b.id ? 1 : a.id > b.id ? -1 : 0;
}

/**
 * The fields `q` searches, one per line: q cannot hold a line break, so
 * `searchText(e).includes(q)` is true only when q lies within one field.
 */
function searchText(e: AuditEventView): string {
  return [e.action, e.actor.name, e.actor.email, ...e.targets.flatMap((t) => [t.name, t.email])].join("\n").toLowerCase();
}

// ---------------------------------------------------------------------------
// Fixture: 137 events over ~11 s, in groups of three sharing one created_at,
// several actors, categories, actions and targets.

const T0 = Date.parse("2025-03-01T12:00:00.000Z");
const FIXTURE_SIZE = 137;

interface Actors {
  alice: AuditInput["actor"];
  bob: AuditInput["actor"];
  chloe: AuditInput["actor"];
}

function actorsFor(): Actors {
  const a = (name: string, email: string): AuditInput["actor"] => ({ type: "user", id: crypto.randomUUID(), name, email, keyId: null });
  return {
    alice: a("Alice Martin", "alice.martin@acme.example"),
    bob: a("Bob Durand", "bob@acme.example"),
    chloe: a("Chloé Petit", "chloe@acme.example"),
  };
}

const KINDS: { category: Category; action: string }[] = [
  { category: "group", action: "group.member_added" },
  { category: "share", action: "share.created" },
  { category: "sso", action: "sso.configured" },
  { category: "security", action: "security.mfa_disabled" },
  { category: "member", action: "member.role_changed" },
  { category: "export", action: "export.requested" },
  { category: "governance", action: "governance.policy_updated" },
];

function fixture(orgId: string, actors: Actors, n = FIXTURE_SIZE): AuditInput[] {
  const people = [actors.alice, actors.bob, actors.chloe];
  const out: AuditInput[] = [];
  for (let i = 0; i < n; i++) {
    const kind = KINDS[i % KINDS.length] as (typeof KINDS)[number];
    const actor = people[i % 3 === 0 ? 0 : i % 5 === 0 ? 2 : 1] as AuditInput["actor"];
    const targetUser = people[(i + 1) % 3] as AuditInput["actor"];
    const targets =
      kind.category === "group"
        ? [{ key: "group_id", kind: "group", id: crypto.randomUUID(), name: "Research Team", email: "" }]
        : kind.category === "sso" || kind.category === "export" || kind.category === "governance"
          ? []
          : [{ key: "target_user_id", kind: "user", id: targetUser.id, name: targetUser.name, email: targetUser.email }];
    if (i === 11) targets.push({ key: "file_id", kind: "file", id: crypto.randomUUID(), name: "100%_done\\x", email: "" });
    out.push({
      orgId,
      id: crypto.randomUUID(),
      createdAt: new Date(T0 - Math.floor(i / 3) * 250),
      action: kind.action,
      category: kind.category,
      actor,
      targets,
      details: kind.category === "member" ? { target_user_id: targetUser.id, from: "member", to: "admin" } : {},
      origin: { ipPrefix: "203.0.113.0/24", userAgentSummary: "admin-ui/2.1" },
    });
  }
  return out;
}

async function seedFixture(org: SeededOrg, n = FIXTURE_SIZE) {
  const actors = actorsFor();
  const events = fixture(org.orgId, actors, n);
  await recordAudit(db.db, events);
  return { actors, events };
}

async function rawRequest(request: string): Promise<{ status: number; body: string }> {
  const { hostname, port } = new URL(gw.url);
  const text = await new Promise<string>((resolve, reject) => {
    let buf = "";
    const timer = setTimeout(() => reject(new Error("raw request timed out")), 5_000);
    void Bun.connect({
      hostname,
      port: Number(port),
      socket: {
        open(s) {
          s.write(request);
        },
        data(s, d) {
          buf += new TextDecoder().decode(d);
          const head = buf.indexOf("\r\n\r\n");
          const len = /content-length: (\d+)/i.exec(buf.slice(0, head));
          if (head !== -1 && len && buf.length >= head + 4 + Number(len[1])) {
            clearTimeout(timer);
            s.end();
            resolve(buf);
          }
        },
        close() {
          clearTimeout(timer);
          resolve(buf);
        },
      },
    });
  });
  const status = Number(text.split(" ")[1]);
  return { status, body: text.slice(text.indexOf("\r\n\r\n") + 4) };
}

async function expectInvalid(res: Response, param: string | null) {
  expect(res.status).toBe(400);
  expect(await res.json()).toEqual({ error: { message: expect.any(String), type: "invalid_request_error", param, code: "invalid_body" } });
}

// ---------------------------------------------------------------------------

describe("response", () => {
  let org: SeededOrg;
  let events: AuditInput[];
  beforeAll(async () => {
    org = await seedOrg(db);
    ({ events } = await seedFixture(org));
  });

  test("each event has exactly the spec 2.6 fields", async () => {
    const e = events[4] as AuditInput; // member.role_changed, with targets and details
    const p = await page(org.serviceKey, { action: "member.role_changed", from: (e.createdAt as Date).toISOString(), to: (e.createdAt as Date).toISOString() });
    expect(p.data).toEqual([
      {
        id: e.id as string,
        created_at: (e.createdAt as Date).toISOString(),
        action: "member.role_changed",
        category: "member",
        actor: { type: "user", id: e.actor.id, name: e.actor.name, email: e.actor.email, key_id: null },
        targets: e.targets ?? [],
        details: e.details ?? {},
        origin: { ip_prefix: "203.0.113.0/24", user_agent_summary: "admin-ui/2.1" },
      },
    ]);
    expect(p.next_cursor).toBe("");
  });

  test("the envelope is data + next_cursor, newest first, 50 by default", async () => {
    const res = await get(org.serviceKey);
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toContain("application/json");
    const body = expectAuditPage(await res.json());
    expect(Object.keys(body).sort()).toEqual(["data", "next_cursor"]);
    expect(body.data).toHaveLength(50);
    expect(body.next_cursor).toMatch(/^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]{22}$/);
    expect([...body.data].sort(newestFirst)).toEqual(body.data);
    for (const e of body.data) {
      expect(e.id).toMatch(UUID);
      expect(e.created_at).toMatch(/^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$/);
      expect(e.action).toMatch(/^[a-z_]+\.[a-z_.]+$/);
    }
  });

  test("limit 1 and limit 200 are accepted", async () => {
    expect((await page(org.serviceKey, { limit: "1" })).data).toHaveLength(1);
    const all = await page(org.serviceKey, { limit: "200" });
    // 137 fixture events + seedOrg's org.created, member.created and two api_key.created.
    expect(all.data).toHaveLength(FIXTURE_SIZE + 4);
    expect(all.next_cursor).toBe("");
  });

  test("rate-limit headers are sent on success", async () => {
    const res = await get(org.serviceKey, { limit: "1" });
    expect(res.headers.get("x-ratelimit-limit-requests")).toBe("100000");
  });
});

describe("filters", () => {
  let org: SeededOrg;
  let actors: Actors;
  let events: AuditInput[];
  let all: AuditEventView[];
  beforeAll(async () => {
    org = await seedOrg(db);
    ({ actors, events } = await seedFixture(org));
    all = (await page(org.serviceKey, { limit: "200" })).data;
    expect(all).toHaveLength(FIXTURE_SIZE + 4);
  });

  /** The endpoint returns exactly the events of `all` that match, in order, and at least one. */
  async function expectFiltered(params: Record<string, string>, matches: (e: AuditEventView) => boolean) {
    const got = (await page(org.serviceKey, { ...params, limit: "200" })).data;
    const want = all.filter(matches);
    expect(want.length).toBeGreaterThan(0);
    expect(want.length).toBeLessThan(all.length);
    for (const e of got) expect(matches(e)).toBe(true);
    expect(got.map((e) => e.id)).toEqual(want.map((e) => e.id));
  }

  test("actor_id", async () => {
    await expectFiltered({ actor_id: actors.alice.id }, (e) => e.actor.id === actors.alice.id);
    await expectFiltered({ actor_id: actors.bob.id.toUpperCase() }, (e) => e.actor.id === actors.bob.id);
  });

  test("category", async () => {
    for (const c of ["group", "security", "api_key", "member"]) await expectFiltered({ category: c }, (e) => e.category === c);
  });

  test("a category without events returns an empty page", async () => {
    expect(await page(org.serviceKey, { category: "scim" })).toEqual({ data: [], next_cursor: "" });
  });

  test("action", async () => {
    for (const a of ["share.created", "api_key.created", "org.created"]) await expectFiltered({ action: a }, (e) => e.action === a);
    expect((await page(org.serviceKey, { action: "share.deleted" })).data).toEqual([]);
  });

  test("q: case-insensitive over action names and the names and e-mails of actor and targets", async () => {
    const cases: [string, (e: AuditEventView) => boolean][] = [
      ["alice", (e) => e.actor.name === "Alice Martin" || e.targets.some((t) => t.name === "Alice Martin")],
      ["MARTIN", (e) => searchText(e).includes("martin")],
      ["research team", (e) => e.targets.some((t) => t.name === "Research Team")],
      ["bob@acme", (e) => e.actor.email === "bob@acme.example" || e.targets.some((t) => t.email === "bob@acme.example")],
      ["mfa_dis", (e) => e.action === "security.mfa_disabled"],
      ["chloé", (e) => searchText(e).includes("chloé")],
      ["Test User", (e) => e.action === "member.created"],
    ];
    for (const [q, matches] of cases) await expectFiltered({ q }, matches);
  });

  test("q: % _ and \\ match literally", async () => {
    await expectFiltered({ q: "%" }, (e) => searchText(e).includes("%"));
    await expectFiltered({ q: "0%_d" }, (e) => searchText(e).includes("0%_d"));
    await expectFiltered({ q: "_" }, (e) => searchText(e).includes("_"));
    await expectFiltered({ q: "e\\x" }, (e) => searchText(e).includes("e\\x"));
    expect((await page(org.serviceKey, { q: "1__%" })).data).toEqual([]);
  });

  test("q: paging through rare and common terms at small page sizes (both search plans)", async () => {
    // At limit 2 the index-order fast path reads only the newest 120 rows; terms
    // rarer than 3 in 120 there fall back to the trigram plan, common ones do not.
    for (const q of ["research", "100%", "alice", "api_key", "gateway-cli"]) {
      const want = all.filter((e) => searchText(e).includes(q.toLowerCase())).map((e) => e.id);
      expect(want.length).toBeGreaterThan(0);
      for (const limit of [2, 7]) expect((await walk(org.serviceKey, { q }, limit)).events.map((e) => e.id)).toEqual(want);
    }
  });

  test("q: a term in no event returns an empty page", async () => {
    expect(await page(org.serviceKey, { q: "zzz-nobody" })).toEqual({ data: [], next_cursor: "" });
  });

  test("from and to, alone and together", async () => {
    const mid = new Date(T0 - 5_000).toISOString();
    const early = new Date(T0 - 8_000).toISOString();
    await expectFiltered({ from: mid }, (e) => e.created_at >= mid);
    await expectFiltered({ to: mid }, (e) => e.created_at <= mid);
    await expectFiltered({ from: early, to: mid }, (e) => e.created_at >= early && e.created_at <= mid);
  });

  test("filters combine with AND", async () => {
    const from = new Date(T0 - 6_000).toISOString();
    await expectFiltered(
      { actor_id: actors.bob.id, category: "share", q: "alice", from },
      (e) => e.actor.id === actors.bob.id && e.category === "share" && searchText(e).includes("alice") && e.created_at >= from,
    );
    await expectFiltered({ action: "group.member_added", category: "group", actor_id: actors.alice.id }, (e) => e.action === "group.member_added" && e.actor.id === actors.alice.id);
    expect((await page(org.serviceKey, { action: "group.member_added", category: "share" })).data).toEqual([]);
  });

  test("an event's own created_at as from and to returns it (inclusive, millisecond precision)", async () => {
    for (const e of [events[0], events[7], events[100]] as AuditInput[]) {
      const at = (e.createdAt as Date).toISOString();
      const got = (await page(org.serviceKey, { from: at, to: at })).data;
      expect(got.map((x) => x.id)).toContain(e.id as string);
      for (const x of got) expect(x.created_at).toBe(at);
      // Exactly the events sharing that millisecond (groups of three).
      expect(got).toHaveLength(events.filter((x) => x.createdAt?.getTime() === e.createdAt?.getTime()).length);
    }
  });

  test("from and to accept other ISO 8601 spellings of the same instant", async () => {
    const e = events[5] as AuditInput; // T0 - 250 ms: 11:59:59.750Z
    const at = e.createdAt as Date;
    expect(at.toISOString()).toBe("2025-03-01T11:59:59.750Z");
    for (const [from, to] of [
      ["2025-03-01T13:59:59.750+02:00", "2025-03-01T13:59:59.750+02:00"],
      ["2025-03-01T06:59:59.750-0500", "2025-03-01T11:59:59.750000Z"],
      ["2025-03-01T11:59:59.75Z", "2025-03-01T12:59:59.750+01"],
    ] as const) {
      const got = (await page(org.serviceKey, { from, to })).data;
      expect(got.map((x) => x.id)).toContain(e.id as string);
      for (const x of got) expect(x.created_at).toBe(at.toISOString());
    }
    // An offset sent without percent-encoding its `+` (it arrives as a space).
    const unencoded = (await page(org.serviceKey, "from=2025-03-01T13:59:59.750+02:00&to=2025-03-01T13:59:59.750+0200")).data;
    expect(unencoded.map((x) => x.id)).toContain(e.id as string);
    // Without milliseconds: T0 itself has .000.
    const atT0 = (await page(org.serviceKey, { from: "2025-03-01T12:00:00Z", to: "2025-03-01T12:00:00Z" })).data;
    expect(atT0.map((x) => x.id).sort()).toEqual(events.slice(0, 3).map((x) => x.id as string).sort());
    const minutes = (await page(org.serviceKey, { from: "2025-03-01T11:59Z", to: "2025-03-01T12:00Z", limit: "200" })).data;
    expect(minutes.length).toBe(events.filter((x) => (x.createdAt as Date).getTime() >= T0 - 60_000).length);
  });

  test("sub-millisecond bounds round inward", async () => {
    const e = events[5] as AuditInput; // 11:59:59.750Z
    expect((await page(org.serviceKey, { from: "2025-03-01T11:59:59.750001Z", to: "2025-03-01T11:59:59.750001Z" })).data).toEqual([]);
    const justAfter = (await page(org.serviceKey, { from: "2025-03-01T11:59:59.749999Z", to: "2025-03-01T11:59:59.750999Z" })).data;
    expect(justAfter.map((x) => x.id)).toContain(e.id as string);
  });

  test("far-away bounds are accepted", async () => {
    expect((await page(org.serviceKey, { from: "0001-01-01T00:00:00+01:00", to: "9999-12-31T23:59:59.999-05:00", limit: "200" })).data).toHaveLength(all.length);
  });
});

describe("bounds beyond the years 0001-9999", () => {
  test("a bound past the first or last storable millisecond leaves out the event stored there", async () => {
    const org = await seedOrg(db);
    const actor = { type: "user", id: crypto.randomUUID(), name: "Edge", email: "", keyId: null };
    const first = crypto.randomUUID();
    const last = crypto.randomUUID();
    await recordAudit(db.db, [
      { orgId: org.orgId, id: first, createdAt: new Date("0001-01-01T00:00:00.000Z"), action: "org.created", category: "org", actor },
      { orgId: org.orgId, id: last, createdAt: new Date("9999-12-31T23:59:59.999Z"), action: "org.created", category: "org", actor },
    ]);
    const ids = async (params: Record<string, string>) => (await page(org.serviceKey, { ...params, q: "edge" })).data.map((e) => e.id);
    // Inclusive bounds on the events' own instants still find them.
    expect(await ids({ to: "0001-01-01T00:00:00Z" })).toEqual([first]);
    expect(await ids({ from: "9999-12-31T23:59:59.999Z" })).toEqual([last]);
    // One step beyond: nothing, not the event at the edge of the storable range.
    expect(await ids({ to: "0000-12-31T23:59:59.999Z" })).toEqual([]);
    expect(await ids({ to: "0001-01-01T00:00:00.000+00:01" })).toEqual([]);
    expect(await ids({ from: "9999-12-31T23:59:59.9991Z" })).toEqual([]);
    expect(await ids({ from: "9999-12-31T23:59:59.999-00:01" })).toEqual([]);
    expect(await ids({ from: "0000-06-01T00:00Z", to: "9999-12-31T23:59:59.9999Z" })).toEqual([last, first]);
  });
});

describe("q field boundaries", () => {
  let org: SeededOrg;
  beforeAll(async () => {
    org = await seedOrg(db);
  });

  test("q: matches within one field, never across two", async () => {
    const ada = { type: "user", id: crypto.randomUUID(), name: "Ada Lovelace", email: "ada.lovelace@acme.example", keyId: null };
    const grace = { key: "target_user_id", kind: "user", id: crypto.randomUUID(), name: "Grace Hopper", email: "grace@acme.example" };
    const id = crypto.randomUUID();
    await recordAudit(db.db, { orgId: org.orgId, id, action: "member.invited", category: "member", actor: ada, targets: [grace] });
    const ids = async (q: string) => (await page(org.serviceKey, { q, limit: "200" })).data.map((e) => e.id);
    for (const q of ["invited", "ada", "ADA LOVELACE", "lovelace@acme", "grace hopper", "member.inv"]) expect(await ids(q)).toContain(id);
    // Each of these spans two fields of the event (action|actor name|actor e-mail|target name|target e-mail).
    for (const q of ["invited ada", "member.invited ada", "lovelace ada", "lovelace ada.lovelace", "example grace", "hopper grace"]) {
      expect(await ids(q)).not.toContain(id);
    }
  });
});

describe("q folding: Greek final sigma, Unicode normalisation", () => {
  let org: SeededOrg;
  const person = (name: string, email = "") => ({ type: "user", id: crypto.randomUUID(), name, email, keyId: null });
  const target = (name: string) => ({ key: "target_user_id", kind: "user", id: crypto.randomUUID(), name, email: "" });
  /** One event per name, its id by name. Names are stored as given (NFC, NFD, compatibility forms). */
  const ids: Record<string, string> = {};
  beforeAll(async () => {
    org = await seedOrg(db);
    const events: [string, AuditInput["actor"], AuditInput["targets"]][] = [
      ["sisyphus", person("Σίσυφος"), [target("ΟΔΥΣΣΕΥΣ")]],
      ["chloe-nfc", person("Chlo\u00e9 Petit".normalize("NFC")), []],
      ["zoe-nfd", person("Zoe\u0301 Martin", "zoe\u0301@acme.example"), []],
      ["nbsp", person("Ada\u00a0Lovelace"), []],
      ["ligature", person("\ufb01nance-bot"), [target("Ｗｉｄｅ Ｃｏｒｐ")]],
      ["percent", person("Report"), [target("100%_done")]],
    ];
    for (const [label, actor, targets] of events) {
      ids[label] = crypto.randomUUID();
      await recordAudit(db.db, { orgId: org.orgId, id: ids[label], action: "member.invited", category: "member", actor, targets });
    }
  });
  async function found(q: string): Promise<string[]> {
    const got = (await page(org.serviceKey, { q, limit: "200" })).data.map((e) => e.id);
    return Object.keys(ids).filter((label) => got.includes(ids[label] as string));
  }

  test("a word-final sigma is one letter with σ: ΣΊΣΥΦΟΣ finds Σίσυφος, and lower case finds capitals", async () => {
    for (const q of ["ΣΊΣΥΦΟΣ", "Σίσυφος", "σίσυφος", "σίσυφοσ", "ΣΊΣ", "σίς", "ΟΔΥΣΣΕΥΣ", "οδυσσευς", "Οδυσσευσ", "ΣΣΕΥ"]) {
      expect({ q, found: await found(q) }).toEqual({ q, found: ["sisyphus"] });
    }
    expect(await found("σίσυφοςα")).toEqual([]);
  });

  test("q and the stored names match whatever their Unicode normal form (NFD as macOS writes it, NFC)", async () => {
    for (const q of ["Chloe\u0301", "CHLOE\u0301 PETIT", "chlo\u00e9", "CHLO\u00c9"]) expect({ q, found: await found(q) }).toEqual({ q, found: ["chloe-nfc"] });
    for (const q of ["zo\u00e9", "ZO\u00c9 MARTIN", "zoe\u0301", "zo\u00e9@acme"]) expect({ q, found: await found(q) }).toEqual({ q, found: ["zoe-nfd"] });
    expect(await found("zoe")).toEqual([]);
  });

  test("compatibility forms fold to their plain letters: full-width, ligatures, no-break space", async () => {
    for (const [q, label] of [
      ["ａｄａ ｌｏｖｅｌａｃｅ", "nbsp"],
      ["ada lovelace", "nbsp"],
      ["finance", "ligature"],
      ["\ufb01nance", "ligature"],
      ["wide corp", "ligature"],
      ["ＷＩＤＥ", "ligature"],
      ["１００％＿", "percent"],
      ["¹⁰⁰", "percent"], // the cost: superscripts are digits too
    ] as const) {
      expect({ q, found: await found(q) }).toEqual({ q, found: [label] });
    }
    // Folded before % and _ are escaped: a full-width ％ is a literal % too.
    expect(await found("1％0")).toEqual([]);
  });
});

describe("pagination", () => {
  let org: SeededOrg;
  let expected: string[];
  beforeAll(async () => {
    org = await seedOrg(db);
    await seedFixture(org);
    const rows = await db.rows<{ id: string }>(sql`select id::text as id from audit_events where org_id = ${org.orgId} order by created_at desc, id desc`);
    expected = rows.map((r) => r.id);
    expect(expected).toHaveLength(FIXTURE_SIZE + 4);
  });

  test("walking every page at limit 10 yields each event once, in order, with ties sharing created_at", async () => {
    const { events, pages } = await walk(org.serviceKey, {}, 10);
    expect(pages).toHaveLength(Math.ceil(expected.length / 10));
    for (const p of pages.slice(0, -1)) {
      expect(p.data).toHaveLength(10);
      expect(p.next_cursor).not.toBe("");
    }
    expect(pages.at(-1)?.next_cursor).toBe("");
    const ids = events.map((e) => e.id);
    expect(new Set(ids).size).toBe(ids.length);
    expect(ids).toEqual(expected);
    // Page boundaries fall inside groups of equal created_at too.
    const boundaryTies = pages.slice(0, -1).filter((p, i) => p.data.at(-1)?.created_at === pages[i + 1]?.data[0]?.created_at);
    expect(boundaryTies.length).toBeGreaterThan(0);
  });

  test("walking with a filter and an odd page size", async () => {
    const all = (await page(org.serviceKey, { category: "group", limit: "200" })).data.map((e) => e.id);
    const { events } = await walk(org.serviceKey, { category: "group" }, 3);
    expect(events.map((e) => e.id)).toEqual(all);
  });

  test("a full last page is not followed by an empty one", async () => {
    const n = expected.length;
    const one = await page(org.serviceKey, { limit: String(n) });
    expect(one.data).toHaveLength(n);
    expect(one.next_cursor).toBe("");
    const first = await page(org.serviceKey, { limit: String(n - 1) });
    expect(first.next_cursor).not.toBe("");
    const second = await page(org.serviceKey, { limit: "5", cursor: first.next_cursor });
    expect(second.data.map((e) => e.id)).toEqual([expected[n - 1] as string]);
    expect(second.next_cursor).toBe("");
  });

  test("the page size may change between pages", async () => {
    const p1 = await page(org.serviceKey, { limit: "7" });
    const p2 = await page(org.serviceKey, { limit: "20", cursor: p1.next_cursor });
    expect([...p1.data, ...p2.data].map((e) => e.id)).toEqual(expected.slice(0, 27));
  });

  test("events written after the first page do not shift later pages", async () => {
    const p1 = await page(org.serviceKey, { limit: "10" });
    await recordAudit(db.db, { orgId: org.orgId, action: "share.created", category: "share", actor: { type: "user", id: crypto.randomUUID(), name: "Late", email: "", keyId: null } });
    const p2 = await page(org.serviceKey, { limit: "10", cursor: p1.next_cursor });
    expect(p2.data.map((e) => e.id)).toEqual(expected.slice(10, 20));
  });
});

describe("cursor", () => {
  let a: SeededOrg;
  let b: SeededOrg;
  let cursor: string;
  beforeAll(async () => {
    a = await seedOrg(db);
    b = await seedOrg(db);
    await seedFixture(a, 30);
    await seedFixture(b, 30);
    cursor = (await page(a.serviceKey, { limit: "5" })).next_cursor;
    expect(cursor).not.toBe("");
  });

  test("a tampered cursor gets 400 invalid_body naming cursor", async () => {
    const [payload = "", tag = ""] = cursor.split(".");
    const flip = (s: string, i: number) => s.slice(0, i) + (s[i] === "A" ? "B" : "A") + s.slice(i + 1);
    const decoded = Buffer.from(payload, "base64url").toString("utf8");
    const moved = Buffer.from(decoded.replace(/\|(\d{4})-/, "|2099-"), "utf8").toString("base64url");
    for (const bad of [flip(payload, 3), `${payload}.${flip(tag, 0)}`, `${moved}.${tag}`, payload, "junk", `${cursor}x`, "a".repeat(300)]) {
      await expectInvalid(await get(a.serviceKey, { limit: "5", cursor: bad }), "cursor");
    }
  });

  test("a cursor signed with another secret is refused", async () => {
    const forged = encodeCursor({ createdAt: "2099-01-01T00:00:00.000Z", id: crypto.randomUUID() }, "anything", "not-the-gateway-secret");
    await expectInvalid(await get(a.serviceKey, { cursor: forged }), "cursor");
  });

  test("another organisation's cursor is refused", async () => {
    await expectInvalid(await get(b.serviceKey, { limit: "5", cursor }), "cursor");
  });

  test("a cursor used with other filters is refused", async () => {
    const others: Record<string, string>[] = [{ category: "group" }, { q: "alice" }, { from: "2025-01-01T00:00:00Z" }, { action: "share.created" }];
    for (const extra of others) {
      await expectInvalid(await get(a.serviceKey, { limit: "5", cursor, ...extra }), "cursor");
    }
    const filtered = (await page(a.serviceKey, { category: "share", limit: "2" })).next_cursor;
    await expectInvalid(await get(a.serviceKey, { cursor: filtered }), "cursor");
    await expectInvalid(await get(a.serviceKey, { cursor: filtered, category: "group" }), "cursor");
    expect((await get(a.serviceKey, { cursor: filtered, category: "share" })).status).toBe(200);
  });

  test("another spelling of the same filters keeps the cursor valid", async () => {
    const c = (await page(a.serviceKey, { from: "2025-03-01T11:59:58Z", limit: "2" })).next_cursor;
    expect(c).not.toBe("");
    expect((await get(a.serviceKey, { from: "2025-03-01T12:59:58.000+01:00", cursor: c })).status).toBe(200);
  });

  test("q in another case is the same search and keeps the cursor valid; another q does not", async () => {
    const first = await page(a.serviceKey, { q: "Alice", limit: "2" });
    expect(first.next_cursor).not.toBe("");
    const want = (await page(a.serviceKey, { q: "alice", limit: "200" })).data.map((e) => e.id).slice(2, 4);
    expect(want).toHaveLength(2);
    for (const q of ["alice", "ALICE", "aLiCe"]) {
      const next = await page(a.serviceKey, { q, limit: "2", cursor: first.next_cursor });
      expect({ q, ids: next.data.map((e) => e.id) }).toEqual({ q, ids: want });
    }
    for (const q of ["alic", "alice ", "Alice Martin"]) await expectInvalid(await get(a.serviceKey, { q, limit: "2", cursor: first.next_cursor }), "cursor");
    // Another normal form (NFD) or full-width spelling of q is the same search too.
    const chloe = await page(a.serviceKey, { q: "Chlo\u00e9", limit: "1" });
    expect(chloe.next_cursor).not.toBe("");
    for (const q of ["CHLOE\u0301", "ｃｈｌｏé"]) expect((await get(a.serviceKey, { q, limit: "1", cursor: chloe.next_cursor })).status).toBe(200);
    await expectInvalid(await get(a.serviceKey, { q: "chloe", limit: "1", cursor: chloe.next_cursor }), "cursor");
  });
});

describe("validation: 400 invalid_body naming the parameter", () => {
  let org: SeededOrg;
  beforeAll(async () => {
    org = await seedOrg(db);
  });

  const cases: [string, string][] = [
    ["from=yesterday", "from"],
    ["from=2025-01-01", "from"],
    ["from=2025-01-01T00:00:00", "from"],
    ["from=2025-13-01T00:00:00Z", "from"],
    ["from=2025-02-29T00:00:00Z", "from"],
    ["from=2025-01-01T24:00:00Z", "from"],
    ["from=2025-01-01T12:00:60Z", "from"],
    ["from=2025-01-01T12:00:00%2B25:00", "from"],
    ["from=1735689600", "from"],
    ["to=2025-01-01T00:00:00.Z", "to"],
    ["to=not-a-date", "to"],
    ["from=2025-01-02T00:00:00Z&to=2025-01-01T00:00:00Z", "from"],
    ["from=2025-01-01T00:00:00.001Z&to=2025-01-01T00:00:00Z", "from"],
    ["actor_id=abc", "actor_id"],
    ["actor_id=00000000-0000-0000-0000-00000000000", "actor_id"],
    ["category=nope", "category"],
    ["category=API_KEY", "category"],
    ["action=nodot", "action"],
    ["action=API_KEY.created", "action"],
    ["action=a..b", "action"],
    [`action=a.${"b".repeat(199)}`, "action"],
    [`q=${"x".repeat(201)}`, "q"],
    ["q=a%00b", "q"],
    ["q=caf%E9", "q"], // Latin-1, not UTF-8: it decodes to U+FFFD, and the search was for that
    ["q=%C3", "q"],
    ["q=%ED%A0%80", "q"],
    ["limit=5&%FF=1", "\uFFFD"],
    ["limit=0", "limit"],
    ["limit=201", "limit"],
    ["limit=1000", "limit"],
    ["limit=-1", "limit"],
    ["limit=1.5", "limit"],
    ["limit=1e2", "limit"],
    ["limit=ten", "limit"],
    ["limit=%205", "limit"],
    ["cursor=junk", "cursor"],
    ["foo=1", "foo"],
    ["Limit=5", "Limit"],
    ["actor=x", "actor"],
    ["category=group&category=share", "category"],
    ["limit=5&limit=5", "limit"],
    ["category=", "category"],
    ["q=", "q"],
    ["cursor=", "cursor"],
    ["limit=5&bogus", "bogus"],
    [`${"z".repeat(100)}=1`, "z".repeat(64)],
  ];
  for (const [qs, param] of cases) {
    test(`${qs.slice(0, 60)} → param ${param}`, async () => {
      await expectInvalid(await get(org.serviceKey, qs), param);
    });
  }

  test("q may hold U+FFFD itself, sent as UTF-8, and a % that starts no escape", async () => {
    for (const qs of ["q=%EF%BF%BD", "q=\uFFFD", "q=100%", "q=100%25", "q=%zz"]) {
      const res = await get(org.serviceKey, qs);
      expect({ qs, status: res.status }).toEqual({ qs, status: 200 });
    }
  });

  test("200 characters of q and every valid parameter at once are accepted", async () => {
    const res = await get(org.serviceKey, {
      from: "2025-01-01T00:00:00Z",
      to: "2025-12-31T23:59:59.999+01:00",
      actor_id: crypto.randomUUID(),
      category: "api_key",
      action: "api_key.created",
      q: "é".repeat(200),
      limit: "200",
    });
    expect(res.status).toBe(200);
    expect(await res.json()).toEqual({ data: [], next_cursor: "" });
  });

  test("a request body is refused (Content-Length or Transfer-Encoding)", async () => {
    const head = `GET /v1/audit-events HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer ${org.serviceKey}\r\nConnection: close\r\n`;
    for (const raw of [
      `${head}Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}`,
      `${head}Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n`,
    ]) {
      const res = await rawRequest(raw);
      expect(res.status).toBe(400);
      expect(JSON.parse(res.body)).toEqual({ error: { message: expect.any(String), type: "invalid_request_error", param: null, code: "invalid_body" } });
    }
    const ok = await rawRequest(`${head}Content-Length: 0\r\n\r\n`);
    expect(ok.status).toBe(200);
  });

  test("parameters are checked only after the key: an anonymous caller gets 401", async () => {
    const res = await fetch(url("limit=0&foo=1"));
    expect(res.status).toBe(401);
    expect((await errorOf(res)).code).toBe("unauthorized");
  });
});

describe("isolation between organisations", () => {
  test("an organisation sees only its own events, whatever the filters", async () => {
    const a = await seedOrg(db);
    const b = await seedOrg(db);
    const fa = await seedFixture(a, 20);
    const fb = await seedFixture(b, 20);
    const idsA = new Set(fa.events.map((e) => e.id));
    const idsB = new Set(fb.events.map((e) => e.id));
    const seenA = (await walk(a.serviceKey, {}, 7)).events;
    const seenB = (await walk(b.serviceKey, {}, 7)).events;
    expect(seenA).toHaveLength(24);
    expect(seenB).toHaveLength(24);
    for (const e of seenA) expect(idsB.has(e.id)).toBe(false);
    for (const e of seenB) expect(idsA.has(e.id)).toBe(false);
    for (const id of idsA) expect(seenA.some((e) => e.id === id)).toBe(true);
    // Filtering on the other organisation's actor or text finds nothing.
    expect((await page(b.serviceKey, { actor_id: fa.actors.alice.id })).data).toEqual([]);
    const orgNameA = seenA.find((e) => e.action === "org.created")?.targets[0]?.name ?? "";
    expect(orgNameA).not.toBe("");
    expect((await page(b.serviceKey, { q: orgNameA })).data).toEqual([]);
    expect((await page(a.serviceKey, { q: orgNameA })).data).toHaveLength(1);
  });
});

describe("append-only", () => {
  test("UPDATE, DELETE and TRUNCATE on audit_events are refused by the database", async () => {
    const org = await seedOrg(db);
    const [row] = await db.rows<{ id: string }>(sql`select id::text as id from audit_events where org_id = ${org.orgId} limit 1`);
    expect(row).toBeDefined();
    const statements = [
      sql`update audit_events set action = 'org.tampered' where id = ${row?.id}`,
      sql`delete from audit_events where id = ${row?.id}`,
      sql`truncate audit_events`,
    ];
    for (const stmt of statements) {
      // Inside a transaction that is rolled back in any case, so a broken trigger cannot wipe the shared test database.
      const failure = await db.db
        .transaction(async (tx) => {
          await tx.execute(stmt);
          throw new Error("statement was not refused");
        })
        .then(
          () => "committed",
          (e: Error) => `${e.message} ${e.cause instanceof Error ? e.cause.message : ""}`,
        );
      expect(failure).toMatch(/audit_events is append-only \((UPDATE|DELETE|TRUNCATE) refused\)/);
    }
    const after = await page(org.serviceKey, { limit: "200" });
    expect(after.data.map((e) => e.action).sort()).toEqual(["api_key.created", "api_key.created", "member.created", "org.created"]);
  });
});

describe("what the log holds", () => {
  test("no chat content, even when chat requests succeed, stream, or are refused after the key was read", async () => {
    // Spec 2.6 rule 1. Against a real (simulated) upstream, so the content really went
    // through the gateway; plus refusals that write security events for a known key.
    const sim = await startSimulator({ port: 0, ttftMs: 0, interTokenMs: 0, completionTokens: 5 });
    const withUpstream = await startTestGateway({ ...HIGH_LIMITS, aliases: testAliases(sim.url), upstream: upstreamSettings() });
    try {
      const org = await seedOrg(db);
      const marker = `secret-prompt-${crypto.randomUUID()}`;
      const post = (path: string, body: unknown, extra: Record<string, string> = {}) =>
        fetch(`${withUpstream.url}${path}`, {
          method: "POST",
          headers: bearer(org.personalKey, { "content-type": "application/json", ...extra }),
          body: JSON.stringify(body),
        });
      const chat = { model: "svc-fast", messages: [{ role: "user", content: marker }] };
      const answers = [
        await post("/v1/chat/completions", chat),
        await post("/v1/chat/completions", { ...chat, stream: true }),
        await post("/v1/embeddings", { model: "svc-embed", input: marker }),
      ];
      for (const r of answers) {
        expect(r.status).toBe(200);
        await r.arrayBuffer();
      }
      expect(JSON.stringify(sim.stats.lastBody)).toContain(marker);
      // A browser-looking request with a valid key writes security.browser_request_rejected.
      const browser = await post("/v1/chat/completions", chat, { origin: "https://evil.example" });
      expect(browser.status).toBe(403);
      await withUpstream.stop();
      // stop() waited for the security event's write.
      const events = await db.rows<{ n: number | string }>(
        sql`select count(*)::int as n from audit_events where org_id = ${org.orgId} and action = 'security.browser_request_rejected'`,
      );
      expect(Number(events[0]?.n)).toBe(1); // the security event is there…
      const leaked = await db.rows<{ n: number | string }>(sql`select count(*)::int as n from audit_events a where a::text like ${`%${marker}%`}`);
      expect(Number(leaked[0]?.n)).toBe(0); // …and holds no content
      const usage = await db.rows<{ n: number | string }>(sql`select count(*)::int as n from usage_events u where u::text like ${`%${marker}%`}`);
      expect(Number(usage[0]?.n)).toBe(0);
    } finally {
      await withUpstream.stop();
      await sim.stop();
    }
  });

  test("successful requests write no events (no sign-ins in the log)", async () => {
    const org = await seedOrg(db);
    const before = (await page(org.serviceKey, { limit: "200" })).data.length;
    for (let i = 0; i < 3; i++) {
      expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(org.personalKey) })).status).toBe(200);
      expect((await fetch(`${gw.url}/v1/models`, { headers: bearer(org.serviceKey) })).status).toBe(200);
      expect((await get(org.serviceKey)).status).toBe(200);
    }
    await Bun.sleep(100);
    const after = (await page(org.serviceKey, { limit: "200" })).data;
    expect(after.length).toBe(before);
    expect(after.some((e) => e.category === "auth")).toBe(false);
  });
});

describe("events the gateway writes on the host", () => {
  test("org, member and key events carry origin 127.0.0.0/8 and gateway-cli/<version>", async () => {
    const org = await seedOrg(db);
    const k = await createKey(db, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" });
    const rotated = await rotateKey(db, { id: k.id, graceMs: 0, tag: "gw" });
    await revokeKey(db, rotated.id);
    const events = (await page(org.serviceKey, { limit: "200" })).data;
    expect(events.map((e) => e.action).sort()).toEqual(
      ["api_key.created", "api_key.created", "api_key.created", "api_key.revoked", "api_key.rotated", "member.created", "org.created"].sort(),
    );
    for (const e of events) expect(e.origin).toEqual({ ip_prefix: "127.0.0.0/8", user_agent_summary: `gateway-cli/${VERSION}` });
  });
});

describe("key lifecycle events", () => {
  test("created, rotated and revoked keys appear through the endpoint", async () => {
    const org = await seedOrg(db);
    const k = await createKey(db, { orgId: org.orgId, kind: "service", name: "ci-pipeline", scopes: ["inference"], knownModels: [], tag: "gw" });
    const rotated = await rotateKey(db, { id: k.id, graceMs: 60_000, tag: "gw" });
    await revokeKey(db, rotated.id);

    const events = (await page(org.serviceKey, { category: "api_key", q: "ci-pipeline" })).data;
    expect(events.map((e) => e.action)).toEqual(["api_key.revoked", "api_key.rotated", "api_key.created"]);
    const [revoked, rot, created] = events as [AuditEventView, AuditEventView, AuditEventView];
    expect(created.targets).toEqual([{ key: "key_id", kind: "api_key", id: k.id, name: "ci-pipeline", email: "" }]);
    expect(created.details).toEqual({ key_id: k.id, kind: "service", scopes: ["inference"], expires_at: k.expires_at });
    expect(Date.parse(k.expires_at) - Date.parse(k.created_at)).toBe(365 * 86_400_000);
    expect(rot.targets.map((t) => t.id)).toEqual([k.id, rotated.id]);
    expect(rot.details.new_key_id).toBe(rotated.id);
    expect(revoked.targets[0]?.id).toBe(rotated.id);
    expect(revoked.actor).toEqual({ type: "system", id: "00000000-0000-0000-0000-000000000000", name: "gateway-cli", email: "", key_id: null });
    const byAction = (await page(org.serviceKey, { action: "api_key.revoked" })).data;
    expect(byAction.map((e) => e.id)).toEqual([revoked.id]);
  });
});

describe("an admin change, its audit event and its NOTIFY commit together", () => {
  test("a change whose commit fails leaves no event and sends no NOTIFY; the next, committed, sends its own", async () => {
    const fresh = await freshDatabase();
    const org = await seedOrg(fresh);
    const heard: string[] = [];
    const stop = await fresh.listen(AUTH_CHANNEL, (p) => heard.push(p), () => {});
    // Refused at COMMIT, after every statement of the change (its audit event, then its NOTIFY) has run:
    // a deferred constraint trigger on the revoked key's row.
    await fresh.rows(sql.raw(`create function h2_refuse_at_commit() returns trigger language plpgsql as $$ begin raise exception 'refused at commit'; end $$`));
    await fresh.rows(
      sql.raw(
        `create constraint trigger h2_refuse_at_commit after update on api_keys deferrable initially deferred for each row when (new.id = '${org.personalKeyId}') execute function h2_refuse_at_commit()`,
      ),
    );
    try {
      const refused = await revokeKey(fresh, org.personalKeyId).then(
        () => "committed",
        (e: Error) => `${e.message} ${(e.cause as Error | undefined)?.message ?? ""}`,
      );
      expect(refused).toContain("refused at commit");
      await revokeKey(fresh, org.serviceKeyId);
      // NOTIFYs arrive in commit order: once the second change's is here, one sent by the first would be too.
      await until(() => heard.includes(`key:${org.serviceKeyId}`), "the committed revocation's NOTIFY");
      const events = await fresh.rows<{ key: string }>(
        sql`select details->>'key_id' as key from audit_events where org_id = ${org.orgId} and action = 'api_key.revoked' order by created_at`,
      );
      const revoked = await fresh.rows<{ id: string }>(sql`select id from api_keys where org_id = ${org.orgId} and revoked_at is not null`);
      // Were the NOTIFY sent outside the change's transaction, key:<personal> would be heard though nothing changed.
      expect({ heard: heard.filter((p) => p.startsWith("key:")), events: events.map((e) => e.key), revoked: revoked.map((r) => r.id) }).toEqual({
        heard: [`key:${org.serviceKeyId}`],
        events: [org.serviceKeyId],
        revoked: [org.serviceKeyId],
      });
    } finally {
      await fresh.rows(sql.raw("drop trigger h2_refuse_at_commit on api_keys"));
      await fresh.rows(sql.raw("drop function h2_refuse_at_commit()"));
      await stop();
      await fresh.close();
    }
  });
});

describe("security events", () => {
  const orgIds: string[] = [];
  async function newOrg() {
    const o = await seedOrg(db);
    orgIds.push(o.orgId);
    return o;
  }

  /** Security events are written off the request path; poll briefly for them. */
  async function securityEvents(key: string, action: string, atLeast: number): Promise<AuditEventView[]> {
    let events: AuditEventView[] = [];
    for (let i = 0; i < 50; i++) {
      events = (await page(key, { action, limit: "200" })).data;
      if (events.length >= atLeast) break;
      await Bun.sleep(20);
    }
    return events;
  }

  test("an expired key presented twice gives one security.expired_key_used, with a /24 prefix", async () => {
    const org = await newOrg();
    const expired = await createKey(db, { orgId: org.orgId, kind: "service", name: "old-bot", scopes: ["inference", "audit:read"], knownModels: [], expiresAt: new Date(Date.now() - 1_000), tag: "gw" });
    const ua = { "user-agent": "openai-node/6.1.0 (linux; x64)" };
    expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(expired.key, ua) })).status).toBe(401);
    expect((await get(expired.key, {}, ua)).status).toBe(401);
    const events = await securityEvents(org.serviceKey, "security.expired_key_used", 1);
    await Bun.sleep(150);
    expect((await page(org.serviceKey, { action: "security.expired_key_used" })).data).toHaveLength(1);
    const e = events[0] as AuditEventView;
    expect(e.category).toBe("security");
    expect(e.actor.key_id).toBe(expired.id);
    expect(e.actor.name).toBe("old-bot");
    expect(e.targets).toEqual([{ key: "key_id", kind: "api_key", id: expired.id, name: "", email: "" }]);
    expect(e.origin).toEqual({ ip_prefix: "127.0.0.0/24", user_agent_summary: "openai-node/6.1" });
  });

  test("a revoked key presented repeatedly gives one security.revoked_key_used", async () => {
    const org = await newOrg();
    const k = await createKey(db, { orgId: org.orgId, kind: "service", scopes: ["inference"], knownModels: [], tag: "gw" });
    expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(k.key) })).status).toBe(200);
    await revokeKey(db, k.id);
    await Bun.sleep(100);
    for (let i = 0; i < 3; i++) expect((await fetch(`${gw.url}/v1/me`, { headers: bearer(k.key) })).status).toBe(401);
    const events = await securityEvents(org.serviceKey, "security.revoked_key_used", 1);
    await Bun.sleep(150);
    expect((await page(org.serviceKey, { action: "security.revoked_key_used" })).data).toHaveLength(1);
    expect(events[0]?.actor.key_id).toBe(k.id);
    expect(events[0]?.origin.ip_prefix).toBe("127.0.0.0/24");
  });

  test("a browser-looking request with a valid key gives security.browser_request_rejected", async () => {
    const org = await newOrg();
    expect((await get(org.serviceKey, {}, { origin: "https://evil.example" })).status).toBe(403);
    expect((await get(org.serviceKey, {}, { origin: "https://evil.example" })).status).toBe(403);
    const events = await securityEvents(org.serviceKey, "security.browser_request_rejected", 1);
    await Bun.sleep(150);
    expect((await page(org.serviceKey, { action: "security.browser_request_rejected" })).data).toHaveLength(1);
    expect(events[0]?.actor.key_id).toBe(org.serviceKeyId);
  });

  test("the events written from requests hold a network prefix, never a full address", async () => {
    const rows = await db.rows<{ p: string }>(
      sql`select distinct origin_ip_prefix as p from audit_events where org_id in (${sql.join(orgIds.map((id) => sql`${id}::uuid`), sql`, `)}) and category = 'security'`,
    );
    expect(rows.map((r) => r.p)).toEqual(["127.0.0.0/24"]);
  });
});

describe("database unreachable", () => {
  test("503 service_unavailable, once the key is cached", async () => {
    const own = await freshDatabase();
    const g = await startTestGateway({ ...HIGH_LIMITS, drainMs: 100 }, own);
    try {
      const org = await seedOrg(own);
      const res1 = await fetch(`${g.url}/v1/audit-events`, { headers: bearer(org.serviceKey) });
      expect(res1.status).toBe(200);
      await own.close();
      const res = await fetch(`${g.url}/v1/audit-events`, { headers: bearer(org.serviceKey) });
      expect(res.status).toBe(503);
      expect(await res.json()).toEqual({ error: { message: expect.any(String), type: "service_unavailable", param: null, code: "service_unavailable" } });
    } finally {
      await Promise.race([g.stop().catch(() => {}), Bun.sleep(3_000)]);
    }
  });
});

describe.skipIf(!TEST_DATABASE_URL)("(postgres) q on a database whose character type is C", () => {
  test("q is case-insensitive beyond ASCII: the database's lower() folds only A-Z there", async () => {
    const admin = postgres(TEST_DATABASE_URL ?? "", { max: 1, onnotice: () => {} });
    const name = `gw_ctype_c_${crypto.randomUUID().replaceAll("-", "").slice(0, 12)}`;
    await admin.unsafe(`create database "${name}" template template0 encoding 'UTF8' lc_collate 'C' lc_ctype 'C'`);
    const u = new URL(TEST_DATABASE_URL ?? "");
    u.pathname = `/${name}`;
    const own = await openDatabase({ databaseUrl: u.toString(), dataDir: "memory://", poolMax: 4 });
    await migrate(own);
    const g = await startTestGateway(HIGH_LIMITS, own);
    try {
      const org = await seedOrg(own);
      const chloe = { type: "user", id: crypto.randomUUID(), name: "Chloé Ørsted", email: "chloe@acme.example", keyId: null };
      const id = crypto.randomUUID();
      await recordAudit(own.db, { orgId: org.orgId, id, action: "member.invited", category: "member", actor: chloe, targets: [] });
      for (const q of ["chloé", "CHLOÉ", "Chloé ØRSTED", "ørsted"]) {
        const res = await fetch(`${g.url}/v1/audit-events?${new URLSearchParams({ q })}`, { headers: bearer(org.serviceKey) });
        expect({ q, ids: ((await res.json()) as AuditPage).data.map((e) => e.id) }).toEqual({ q, ids: [id] });
      }
    } finally {
      await g.stop();
      await own.close();
      await admin.unsafe(`drop database if exists "${name}" with (force)`);
      await admin.end({ timeout: 5 });
    }
  });
});

test.skipIf(!TEST_DATABASE_URL)("(postgres) the shared test database is Postgres", () => {
  expect(db.kind).toBe("postgres");
});
