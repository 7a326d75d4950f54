/**
 * Audit-log read benchmark (issue 3): seeds N events over 200 organisations,
 * then times GET /v1/audit-events through the HTTP endpoint of an in-process
 * gateway and prints p50/p95 per query shape.
 *
 *   bun run bench:audit                                # PGlite in memory, 50,000 events
 *   DATABASE_URL=postgres://… bun run bench:audit      # Postgres, 1,000,000 events
 *   bun run bench:audit -- --events 200000 --runs 50
 *
 * Options: --events N, --runs N (timed runs per query, default 50),
 * --warmup N (default 5). On Postgres the events are written into the given
 * database: use a throwaway one. A second run on the same database reuses the
 * seeded organisations (and their events) instead of seeding again.
 *
 * The data: one "big" organisation holds 20% of the events (so page 1,000 at
 * 50 per page exists once N ≥ 250k), the other 199 share the rest. Each
 * organisation has 50 people with names from a small pool and its own e-mail
 * domain (`@org<n>.example`); half of the events have a user target. Events are spread over a
 * year, three at a time sharing one created_at.
 */
import { parseArgs } from "node:util";
import { sql } from "drizzle-orm";
import { createKey } from "../src/admin/service.ts";
import { CATEGORIES } from "../src/audit/record.ts";
import type { AuditPage } from "../src/audit/query.ts";
import { loadConfig } from "../src/config/load.ts";
import type { Config } from "../src/config/schema.ts";
import { type Database, migrate, openDatabase } from "../src/db/client.ts";
import { createLogger } from "../src/lib/log.ts";
import { startGateway } from "../src/server.ts";

const { values: args } = parseArgs({
  args: Bun.argv.slice(2),
  options: {
    events: { type: "string" },
    runs: { type: "string", default: "50" },
    warmup: { type: "string", default: "5" },
  },
});

const ORGS = 200;
const databaseUrl = process.env.DATABASE_URL;
const events = Number(args.events ?? (databaseUrl ? 1_000_000 : 50_000));
const runs = Number(args.runs);
const warmup = Number(args.warmup);
for (const [name, n] of [["--events", events], ["--runs", runs], ["--warmup", warmup]] as const) {
  if (!Number.isSafeInteger(n) || n < 0) throw new Error(`${name} must be a whole number`);
}

const FIRST = ["Alice", "Bruno", "Chloé", "David", "Emma", "Farid", "Gaëlle", "Hugo", "Inès", "Jules", "Karim", "Léa", "Marc", "Nina", "Olivier", "Paula", "Quentin", "Rosa", "Simon", "Tara"];
const LAST = ["Martin", "Bernard", "Dubois", "Thomas", "Robert", "Richard", "Petit", "Durand", "Leroy", "Moreau", "Simon", "Laurent", "Lefebvre", "Michel", "Garcia", "David", "Bertrand", "Roux", "Vincent", "Fournier"];
const VERBS = ["created", "updated", "deleted"];

const pgArray = (xs: readonly string[]) => `{${xs.map((x) => `"${x}"`).join(",")}}`;

async function seed(database: Database): Promise<void> {
  const existing = await database.rows<{ n: number }>(sql`select count(*)::int as n from organizations where name like 'bench-org-%'`);
  if ((existing[0]?.n ?? 0) >= ORGS) {
    const [row] = await database.rows<{ n: number }>(
      sql`select count(*)::int as n from audit_events where org_id in (select id from organizations where name like 'bench-org-%')`,
    );
    console.log(`reusing ${ORGS} bench organisations with ${row?.n ?? 0} events (seeded earlier)`);
    return;
  }
  await database.db.execute(
    sql`insert into organizations (name, plan) select 'bench-org-' || lpad(g::text, 3, '0'), 'Standard' from generate_series(0, ${ORGS - 1}) g`,
  );
  const first = pgArray(FIRST);
  const last = pgArray(LAST);
  const cats = pgArray(CATEGORIES);
  const verbs = pgArray(VERBS);
  const chunk = 100_000;
  const t0 = performance.now();
  for (let lo = 1; lo <= events; lo += chunk) {
    const hi = Math.min(events, lo + chunk - 1);
    // One statement per chunk: rows are generated in SQL, so no data crosses
    // the wire. Organisation 0 gets every fifth event; the rest go round-robin.
    await database.db.execute(sql`
      with orgs as (
        select id, (row_number() over (order by name) - 1)::int as idx from organizations where name like 'bench-org-%'
      ),
      g as (
        select g,
               case when g % 5 = 0 then 0 else 1 + g % ${ORGS - 1} end as org_idx,
               (hashint4(g) & 2147483647) % 50 as actor_idx,
               (hashint4(-g) & 2147483647) % 50 as target_idx,
               (${cats}::text[])[1 + g % ${CATEGORIES.length}] as category,
               (${verbs}::text[])[1 + (g / ${CATEGORIES.length}) % ${VERBS.length}] as verb
        from generate_series(${lo}::int, ${hi}::int) g
      ),
      p as (
        select g.*, o.id as org_id,
               (${first}::text[])[1 + g.actor_idx % 20] || ' ' || (${last}::text[])[1 + (g.actor_idx * 7) % 20] as actor_name,
               lower((${first}::text[])[1 + g.actor_idx % 20]) || '.' || g.actor_idx || '@org' || g.org_idx || '.example' as actor_email,
               (${first}::text[])[1 + g.target_idx % 20] || ' ' || (${last}::text[])[1 + (g.target_idx * 7) % 20] as target_name,
               'member' || g.target_idx || '@org' || g.org_idx || '.example' as target_email
        from g join orgs o on o.idx = g.org_idx
      )
      insert into audit_events (org_id, created_at, action, category, actor_type, actor_id, actor_name, actor_email,
                                actor_key_id, targets, details, origin_ip_prefix, origin_user_agent_summary, search_text)
      select org_id,
             timestamptz '2025-01-01T00:00:00Z' + ((g / 3) * (31536000000.0 / ${events}) * 3) * interval '1 millisecond',
             category || '.' || verb,
             category,
             'user',
             md5(org_id::text || ':' || actor_idx)::uuid,
             actor_name,
             actor_email,
             null,
             case when g % 2 = 0
                  then jsonb_build_array(jsonb_build_object('key', 'target_user_id', 'kind', 'user',
                         'id', md5(org_id::text || ':' || target_idx)::uuid, 'name', target_name, 'email', target_email))
                  else '[]'::jsonb end,
             '{}'::jsonb,
             '203.0.113.0/24',
             'bench/1.0',
             lower(category || '.' || verb || ' ' || actor_name || ' ' || actor_email
                   || case when g % 2 = 0 then ' ' || target_name || ' ' || target_email else '' end)
      from p`);
    process.stdout.write(`\rseeded ${hi.toLocaleString("en")} / ${events.toLocaleString("en")} events (${((performance.now() - t0) / 1000).toFixed(1)} s)`);
  }
  process.stdout.write("\n");
  const ta = performance.now();
  await database.db.execute(sql`analyze audit_events`);
  await database.db.execute(sql`analyze organizations`);
  console.log(`analyze: ${((performance.now() - ta) / 1000).toFixed(1)} s`);
}

function percentile(sorted: number[], p: number): number {
  if (sorted.length === 0) return Number.NaN;
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))] ?? Number.NaN;
}

interface Result {
  name: string;
  rows: number;
  p50: number;
  p95: number;
  max: number;
}

async function timeQuery(name: string, url: string, key: string): Promise<Result> {
  const headers = { authorization: `Bearer ${key}` };
  let rows = 0;
  const times: number[] = [];
  for (let i = 0; i < warmup + runs; i++) {
    const t = performance.now();
    const res = await fetch(url, { headers });
    const body = (await res.json()) as AuditPage;
    const ms = performance.now() - t;
    if (res.status !== 200) throw new Error(`${name}: HTTP ${res.status} ${JSON.stringify(body)}`);
    rows = body.data.length;
    if (i >= warmup) times.push(ms);
  }
  times.sort((a, b) => a - b);
  return { name, rows, p50: percentile(times, 50), p95: percentile(times, 95), max: times.at(-1) ?? Number.NaN };
}

async function main() {
  const database = await openDatabase({ databaseUrl, dataDir: "memory://", poolMax: 10 });
  try {
    await migrate(database);
    console.log(`database: ${database.kind}; events: ${events.toLocaleString("en")} over ${ORGS} organisations; ${runs} timed runs (+${warmup} warm-up) each`);
    await seed(database);

    const orgs = await database.rows<{ id: string; n: number }>(sql`
      select o.id::text as id, (select count(*)::int from audit_events a where a.org_id = o.id) as n
      from organizations o where o.name in ('bench-org-000', 'bench-org-101') order by o.name`);
    const base = await loadConfig({ env: {}, overrides: { host: "127.0.0.1", port: 0 } });
    const config: Config = {
      ...base,
      logLevel: "error",
      accessLog: false,
      drainMs: 1_000,
      plans: { Standard: { requestsPerMinute: 1_000_000 }, Ultra: { requestsPerMinute: 1_000_000 } },
    };
    const gw = await startGateway({ config, database, log: createLogger("error") });
    try {
      const results: Result[] = [];
      for (const [label, org] of [["big org", orgs[0]], ["typical org", orgs[1]]] as const) {
        if (!org) throw new Error("bench organisations missing");
        const { key } = await createKey(database, { orgId: org.id, kind: "service", scopes: ["audit:read"], knownModels: [], tag: config.keyTag });
        const [actor] = await database.rows<{ id: string; name: string }>(
          sql`select actor_id::text as id, actor_name as name from audit_events where org_id = ${org.id} and actor_type = 'user' order by created_at desc limit 1`,
        );
        const u = (params: Record<string, string>) => `${gw.url}/v1/audit-events?${new URLSearchParams(params)}`;
        const surname = (actor?.name ?? "x y").split(" ")[1]?.toLowerCase() ?? "martin";
        const orgIdx = label === "big org" ? 0 : 101;
        const queries: [string, Record<string, string>][] = [
          ["first page, no filter", {}],
          ["from/to (one month)", { from: "2025-06-01T00:00:00Z", to: "2025-06-30T23:59:59.999Z" }],
          ["from/to (one hour, sparse)", { from: "2025-06-01T00:00:00Z", to: "2025-06-01T01:00:00+00:00" }],
          ["actor_id", { actor_id: actor?.id ?? "" }],
          ["category", { category: "scim" }],
          ["action", { action: "scim.updated" }],
          [`q common ("${surname}")`, { q: surname }],
          ["q rare (one target e-mail, ~1% of rows)", { q: `member7@org${orgIdx}.example` }],
          ["q absent (rare trigrams)", { q: "zqxjw" }],
          ["q absent (common trigrams)", { q: `@org${orgIdx + 7}.example` }],
        ];
        for (const [name, params] of queries) results.push(await timeQuery(`${label}: ${name}`, u(params), key));

        // Page 1,000 via cursors: walk there once, then time that page alone.
        const limit = Math.min(50, Math.floor(org.n / 1_000));
        if (limit >= 1) {
          let cursor = "";
          for (let p = 1; p < 1_000; p++) {
            const res = await fetch(u({ limit: String(limit), ...(cursor ? { cursor } : {}) }), { headers: { authorization: `Bearer ${key}` } });
            cursor = ((await res.json()) as AuditPage).next_cursor;
            if (!cursor) throw new Error(`ran out of pages at page ${p}`);
          }
          results.push(await timeQuery(`${label}: page 1,000 (limit ${limit}) via cursor`, u({ limit: String(limit), cursor }), key));
        }
        console.log(`${label}: ${org.n.toLocaleString("en")} events`);
      }
      const w = Math.max(...results.map((r) => r.name.length));
      console.log(`\n${"query".padEnd(w)}  rows   p50 ms   p95 ms   max ms`);
      for (const r of results) {
        console.log(`${r.name.padEnd(w)}  ${String(r.rows).padStart(4)}  ${r.p50.toFixed(2).padStart(7)}  ${r.p95.toFixed(2).padStart(7)}  ${r.max.toFixed(2).padStart(7)}`);
      }
    } finally {
      await gw.stop();
    }
  } finally {
    await database.close();
  }
}

await main();
