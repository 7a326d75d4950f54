import { PGlite } from "@electric-sql/pglite";
import { pgArray } from "./src/db/arrays.ts";
import { MIGRATIONS } from "./src/db/migrations.ts";
const pg = new PGlite({ dataDir: process.argv[2], postgresqlconf: ["shared_buffers = 16MB", ...process.argv.slice(3)] } as any);
await pg.waitReady;
for (const m of MIGRATIONS) for (const s of m.statements) { try { await pg.exec(s); } catch (e) { } }
const org = crypto.randomUUID();
await pg.query("insert into organizations (id, name, plan) values ($1, 'b', 'Standard')", [org]);
const response = JSON.stringify({ id: "resp_x", object: "response", created_at: 1, status: "completed", model: "svc-fast", output: [{ id: "msg_" + "a".repeat(40), type: "message", role: "assistant", status: "completed", content: [{ type: "output_text", text: "one two three ".repeat(40), annotations: [] }] }], usage: { input_tokens: 12, output_tokens: 40, total_tokens: 52 }, temperature: 1, top_p: 1, tools: [], tool_choice: "auto", text: { format: { type: "text" } }, metadata: {} });
const input = JSON.stringify([{ type: "message", role: "user", content: "Summarise the plot of Hamlet in two sentences." }]);
const cpu = () => { const u = process.cpuUsage(); return u.user + u.system; };
let n = 0;
const SQL = `insert into responses (id, org_id, owner_user_id, owner_key_id, previous_response_id, input_items, response, output_item_ids, expires_at)
      select i, o, u, k, p, ii, r, string_to_array(oi, ','), timestamptz 'epoch' + e * interval '1 millisecond' from unnest($1::text[], $2::uuid[], $3::uuid[], $4::uuid[], $5::text[], $6::text[], $7::text[], $8::text[], $9::float8[]) as t(i, o, u, k, p, ii, r, oi, e)`;
async function batch(rows: number) {
  const ids = Array.from({ length: rows }, () => `resp_${n++}_${crypto.randomUUID()}`);
  await pg.query(SQL, [pgArray(ids), pgArray(ids.map(() => org)), pgArray(ids.map(() => null)), pgArray(ids.map(() => org)), pgArray(ids.map(() => null)), pgArray(ids.map(() => input)), pgArray(ids.map(() => response)), pgArray(ids.map((i) => "msg_" + i)), pgArray(ids.map(() => Date.now() + 86400e3))]);
}
const rows = Number(process.env.ROWS ?? 8);
for (let i = 0; i < 30; i++) await batch(rows);
const c0 = cpu(); const B = Number(process.env.B ?? 150);
for (let i = 0; i < B; i++) await batch(rows);
console.log(`${rows} rows/stmt: ${((cpu() - c0) / B / rows).toFixed(0)} µs per row, response ${response.length} B`);
