/**
 * The main thread's handle on the embedded database, which runs in its own
 * worker (`pglite-worker.ts`). It offers the part of PGlite's interface that
 * drizzle's pglite driver and `client.ts` use — query, exec, transaction,
 * listen, close — so drizzle works on it unchanged, and the wasm Postgres
 * never runs on the thread that serves requests.
 */

export interface WorkerInit {
  id: number;
  op: "init";
  dataDir: string;
  pgliteWasmModule: WebAssembly.Module;
  initdbWasmModule: WebAssembly.Module;
  fsBundle: Blob;
  /** Extension name → file URL of its bundle. */
  extensions: Record<string, string>;
}

export type WorkerRequest =
  | WorkerInit
  | { id: number; op: "query"; sql: string; params: unknown[]; rowMode?: "array" | "object"; rawTypes?: number[]; tx?: number }
  | { id: number; op: "exec"; sql: string; tx?: number }
  | { id: number; op: "begin" }
  | { id: number; op: "end"; tx: number; commit: boolean }
  | { id: number; op: "listen"; channel: string }
  | { id: number; op: "close" };

export type WorkerReply =
  | { id: number; value: unknown }
  | { id: number; error: Record<string, unknown> }
  | { id: 0; notify: { channel: string; payload: string } };

export interface Results<T = Record<string, unknown>> {
  rows: T[];
  fields: { name: string; dataTypeID: number }[];
  affectedRows?: number;
}

interface QueryOptions {
  rowMode?: "array" | "object";
  /** drizzle passes parsers that keep some types as text; only such identity parsers are supported. */
  parsers?: Record<number, (value: string, typeId: number) => unknown>;
}

export interface RemoteTransaction {
  query<T>(sql: string, params?: unknown[], options?: QueryOptions): Promise<Results<T>>;
  exec(sql: string): Promise<Results[]>;
}

/** Turn the worker's plain error back into an Error carrying the same fields (code, detail, …). */
function toError(fields: Record<string, unknown>): Error {
  const e = new Error(String(fields.message ?? "database error"));
  Object.assign(e, fields);
  return e;
}

function rawTypes(options: QueryOptions | undefined): number[] | undefined {
  if (!options?.parsers) return undefined;
  const out: number[] = [];
  for (const [oid, parse] of Object.entries(options.parsers)) {
    const probe = "1999-01-08 04:05:06";
    if (parse(probe, Number(oid)) !== probe) throw new Error(`unsupported parser for type ${oid}: only text-preserving parsers cross to the database worker`);
    out.push(Number(oid));
  }
  return out;
}

/**
 * The worker's module. In development it sits next to this file. In the
 * compiled executable it is a second entry point (package.json build:compile),
 * kept at its path under src/, while this code is bundled into the main entry
 * at the root of the embedded file system.
 */
function workerUrl(): string {
  const compiled = import.meta.url.includes("$bunfs");
  return new URL(compiled ? "./db/pglite-worker.ts" : "./pglite-worker.ts", import.meta.url).href;
}

export class PGliteRemote {
  private worker: Worker;
  private nextId = 1;
  private waiting = new Map<number, { resolve: (v: unknown) => void; reject: (e: Error) => void }>();
  private listeners = new Map<string, Set<(payload: string) => void>>();
  private dead: Error | undefined;
  /** Transactions started: statements outside a transaction (each its own) and BEGINs. */
  transactions = 0;

  private constructor(worker: Worker) {
    this.worker = worker;
    // The worker keeps the process alive only while a statement is waiting on it,
    // so a forgotten close() never holds a finished program open.
    worker.unref();
    worker.onmessage = (event: MessageEvent<WorkerReply>) => this.receive(event.data);
    worker.onerror = (event) => this.fail(new Error(`database worker failed: ${event.message}`));
  }

  /** Start the worker and open the database in it. */
  static async open(init: Omit<WorkerInit, "id" | "op">): Promise<PGliteRemote> {
    const worker = new Worker(workerUrl());
    const remote = new PGliteRemote(worker);
    try {
      await remote.call({ op: "init", ...init });
    } catch (e) {
      worker.terminate();
      throw e;
    }
    return remote;
  }

  private receive(m: WorkerReply): void {
    if ("notify" in m) {
      for (const fn of this.listeners.get(m.notify.channel) ?? []) fn(m.notify.payload);
      return;
    }
    const w = this.waiting.get(m.id);
    if (!w) return;
    this.waiting.delete(m.id);
    if (this.waiting.size === 0) this.worker.unref();
    if ("error" in m) w.reject(toError(m.error));
    else w.resolve(m.value);
  }

  private fail(e: Error): void {
    this.dead = e;
    for (const w of this.waiting.values()) w.reject(e);
    this.waiting.clear();
    this.worker.unref();
  }

  private call<T>(req: WorkerRequest extends infer R ? (R extends unknown ? Omit<R, "id"> : never) : never): Promise<T> {
    if (this.dead) return Promise.reject(this.dead);
    const id = this.nextId++;
    return new Promise<T>((resolve, reject) => {
      if (this.waiting.size === 0) this.worker.ref();
      this.waiting.set(id, { resolve: resolve as (v: unknown) => void, reject });
      this.worker.postMessage({ ...req, id });
    });
  }

  query<T = Record<string, unknown>>(sql: string, params: unknown[] = [], options?: QueryOptions, tx?: number): Promise<Results<T>> {
    if (tx === undefined) this.transactions++;
    return this.call<Results<T>>({ op: "query", sql, params, rowMode: options?.rowMode, rawTypes: rawTypes(options), tx });
  }

  exec(sql: string, tx?: number): Promise<Results[]> {
    if (tx === undefined) this.transactions++;
    return this.call<Results[]>({ op: "exec", sql, tx });
  }

  /**
   * BEGIN in the worker, run `fn` here with a handle whose statements go into
   * that transaction, then COMMIT (or ROLLBACK if `fn` throws). The worker
   * holds every other statement back meanwhile, as PGlite does in-process.
   */
  async transaction<T>(fn: (tx: RemoteTransaction) => Promise<T>): Promise<T> {
    this.transactions++;
    const id = await this.call<number>({ op: "begin" });
    let closed = false;
    const check = () => {
      if (closed) throw new Error("Transaction is closed");
    };
    const tx: RemoteTransaction = {
      query: async (sql, params, options) => {
        check();
        return this.query(sql, params, options, id);
      },
      exec: async (sql) => {
        check();
        return this.exec(sql, id);
      },
    };
    let result: T;
    try {
      result = await fn(tx);
    } catch (e) {
      closed = true;
      await this.call({ op: "end", tx: id, commit: false }).catch(() => {});
      throw e;
    }
    closed = true;
    await this.call({ op: "end", tx: id, commit: true });
    return result;
  }

  async listen(channel: string, fn: (payload: string) => void): Promise<() => Promise<void>> {
    let set = this.listeners.get(channel);
    if (!set) {
      set = new Set();
      this.listeners.set(channel, set);
      await this.call({ op: "listen", channel });
    }
    set.add(fn);
    return async () => {
      set.delete(fn);
    };
  }

  async close(): Promise<void> {
    try {
      if (!this.dead) await this.call({ op: "close" });
    } finally {
      this.fail(new Error("database is closed"));
      this.worker.terminate();
    }
  }
}
