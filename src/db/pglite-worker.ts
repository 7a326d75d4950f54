/**
 * The embedded database's own thread. PGlite executes Postgres in WebAssembly,
 * synchronously: on the main thread every statement (an insert of usage rows,
 * a commit, a checkpoint) would pause the event loop that serves requests.
 * Here it pauses only this worker. The main thread talks to it through
 * `pglite-remote.ts`; the protocol is small and private to the two files.
 *
 * A second entry point of `bun build --compile` (see package.json), so the
 * compiled executable carries it.
 */
import { readlinkSync } from "node:fs";
import { setPriority } from "node:os";
import { PGlite, type Transaction } from "@electric-sql/pglite";
import type { WorkerInit, WorkerReply, WorkerRequest } from "./pglite-remote.ts";

declare const self: Worker;

let pg: PGlite | undefined;
/** Open transactions: PGlite's handle, the promise of its end, and how to end it. */
interface OpenTx {
  t: Transaction;
  done: Promise<void>;
  commit: () => void;
  rollback: (e: Error) => void;
}
const open = new Map<number, OpenTx>();
let nextTx = 1;

const reply = (m: WorkerReply) => self.postMessage(m);

/** Every own property of a database error (code, detail, constraint, …), so the main thread sees what PGlite threw. */
function errorFields(e: unknown): Record<string, unknown> {
  if (!(e instanceof Error)) return { message: String(e) };
  const out: Record<string, unknown> = { message: e.message, name: e.name };
  for (const k of Object.keys(e)) {
    const v = (e as unknown as Record<string, unknown>)[k];
    if (v === null || ["string", "number", "boolean"].includes(typeof v)) out[k] = v;
  }
  return out;
}

/** drizzle's parsers keep timestamps, dates and intervals as the text Postgres sent; the main thread names those types. */
function queryOptions(raw: number[] | undefined, rowMode: "array" | "object" | undefined) {
  const parsers: Record<number, (v: string) => string> = {};
  for (const oid of raw ?? []) parsers[oid] = (v) => v;
  return { rowMode, parsers };
}

/**
 * Requests come first: on Linux this thread runs at a lower priority (nice
 * 10) than the one serving requests, so when both want the same core the
 * request thread wins, while the database still gets its share (about a
 * tenth of a busy core, all of an idle one). Elsewhere this is a no-op.
 */
function lowerPriority(): void {
  try {
    const tid = Number(readlinkSync("/proc/thread-self").split("/").pop());
    if (Number.isInteger(tid) && tid > 0) setPriority(tid, 10);
  } catch {
    // not Linux, or not permitted: run at the process's priority
  }
}

async function init(m: WorkerInit): Promise<void> {
  lowerPriority();
  pg = new PGlite({
    dataDir: m.dataDir,
    pgliteWasmModule: m.pgliteWasmModule,
    initdbWasmModule: m.initdbWasmModule,
    fsBundle: m.fsBundle,
    // Postgres's default 128 MB of shared buffers is most of the embedded
    // database's memory; its tables are small and its files sit in the
    // operating system's page cache anyway. 16 MB saves ~125 MB of RSS.
    postgresqlconf: ["shared_buffers = 16MB"],
    extensions: Object.fromEntries(
      Object.entries(m.extensions).map(([name, href]) => [name, { name, setup: async () => ({ bundlePath: new URL(href) }) }]),
    ),
  });
  await pg.waitReady;
}

/** Where a statement runs: inside the named open transaction, or on the database. */
function target(tx: number | undefined): PGlite | Transaction {
  const db = tx ? open.get(tx)?.t : pg;
  if (!db) throw new Error(tx ? "Transaction is closed" : "database is not open");
  return db;
}

async function handle(m: WorkerRequest): Promise<void> {
  try {
    switch (m.op) {
      case "init":
        await init(m);
        reply({ id: m.id, value: null });
        return;
      case "query": {
        const r = await target(m.tx).query(m.sql, m.params, queryOptions(m.rawTypes, m.rowMode));
        reply({ id: m.id, value: { rows: r.rows, fields: r.fields, affectedRows: r.affectedRows } });
        return;
      }
      case "exec": {
        const rs = await target(m.tx).exec(m.sql);
        reply({ id: m.id, value: rs.map((r) => ({ rows: r.rows, fields: r.fields, affectedRows: r.affectedRows })) });
        return;
      }
      case "begin": {
        if (!pg) throw new Error("database is not open");
        const tx = nextTx++;
        // The transaction stays open until the main thread ends it; PGlite
        // queues every other statement behind it, as it does in-process.
        const done: Promise<void> = pg.transaction(
          (t) =>
            new Promise<void>((commit, rollback) => {
              open.set(tx, { t, done, commit, rollback });
              reply({ id: m.id, value: tx });
            }),
        );
        // A failed BEGIN (never opened) answers the begin request; a failed COMMIT answers the end request.
        done.catch((e: unknown) => {
          if (!open.has(tx)) reply({ id: m.id, error: errorFields(e) });
        });
        return;
      }
      case "end": {
        const o = open.get(m.tx);
        if (!o) throw new Error("Transaction is closed");
        if (m.commit) o.commit();
        else o.rollback(new Error("rolled back"));
        try {
          await o.done;
        } catch (e) {
          // A rollback that was asked for is its own success.
          if (m.commit) throw e;
        } finally {
          open.delete(m.tx);
        }
        reply({ id: m.id, value: null });
        return;
      }
      case "listen": {
        if (!pg) throw new Error("database is not open");
        await pg.listen(m.channel, (payload) => reply({ id: 0, notify: { channel: m.channel, payload } }));
        reply({ id: m.id, value: null });
        return;
      }
      case "close":
        await pg?.close();
        pg = undefined;
        reply({ id: m.id, value: null });
        return;
    }
  } catch (e) {
    reply({ id: m.id, error: errorFields(e) });
  }
}

self.onmessage = (event: MessageEvent<WorkerRequest>) => {
  void handle(event.data);
};
