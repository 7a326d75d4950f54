/**
 * What a statement costs the embedded database (PGlite in its worker thread,
 * src/db/pglite-remote.ts), and what sharing one among rows saves:
 * `taskset -c 0 bun run bench/embedded-statements.ts [DATA_DIR]` (default
 * in memory). Process CPU (both threads) per statement, and per stored
 * response when the response store writes them one by one or in shared
 * INSERTs (src/responses/store-queue.ts, writeSpacingFor).
 */
import { sql } from "drizzle-orm";
import { migrate, openDatabase } from "../src/db/client.ts";
import type { Principal } from "../src/auth/types.ts";
import { createLogger } from "../src/lib/log.ts";
import { createResponseStore } from "../src/responses/store.ts";

const N = 400;
const cpuUs = () => {
  const u = process.cpuUsage();
  return u.user + u.system;
};

const database = await openDatabase({ dataDir: Bun.argv[2] ?? "memory://statements" });
await migrate(database);
const orgId = crypto.randomUUID();
await database.rows(sql`insert into organizations (id, name, plan) values (${orgId}, 'bench', 'Standard')`);

async function perCall(name: string, f: (i: number) => Promise<unknown>): Promise<void> {
  for (let i = 0; i < 50; i++) await f(-1 - i);
  const c0 = cpuUs();
  for (let i = 0; i < N; i++) await f(i);
  console.log(`${name.padEnd(52)} ${((cpuUs() - c0) / N).toFixed(0).padStart(5)} µs CPU a statement`);
}

await perCall("select 1", () => database.rows(sql`select 1`));
await perCall("update one row", () => database.rows(sql`update organizations set name = name where id = ${orgId}`));

// A stored response as the Responses API writes one: a 40-token answer and its input.
const response = {
  object: "response",
  status: "completed",
  output: [{ type: "message", role: "assistant", content: [{ type: "output_text", text: "one two three ".repeat(40), annotations: [] }] }],
  usage: { input_tokens: 12, output_tokens: 40, total_tokens: 52 },
};
const principal = { kind: "service", orgId, keyId: orgId, keyRoot: orgId, userId: null } as unknown as Principal;
const store = createResponseStore(database, { retentionDays: 30, log: createLogger("error"), maxReplayBytes: 1 << 24 });
const save = () =>
  store.save({ id: `resp_${crypto.randomUUID().replaceAll("-", "")}`, principal, previousResponseId: null, inputItems: [], response });
for (let i = 0; i < 50; i++) await save();
for (const rows of [1, 4, 16, 64]) {
  const c0 = cpuUs();
  for (let i = 0; i < N; i += rows) await Promise.all(Array.from({ length: rows }, save));
  console.log(`${`stored responses, ${rows} to a statement`.padEnd(52)} ${((cpuUs() - c0) / N).toFixed(0).padStart(5)} µs CPU a response`);
}
await database.close();
