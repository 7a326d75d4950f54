/**
 * The per-request usage records waiting for the next batched write, kept in
 * columns: a ring of typed arrays for the numbers and plain arrays of
 * references for the strings (organisation, key, alias and target strings
 * already exist in the principal and the config, so nothing is copied).
 *
 * Why not an array of objects: every record lives about one flush interval
 * (1 s), long enough to survive a young-generation collection and be promoted,
 * so an object and a Date per request grew the old generation at thousands of
 * requests a second. Recording a request here allocates nothing; the arrays
 * grow by doubling up to the bound. (Measured with BUN_JSC_logGC=1: fewer
 * allocations and less memory per waiting record, but no measurable change in
 * the request thread's collection pauses.)
 *
 * Bounded: when `max` records are waiting (the database is unreachable for a
 * long time), the oldest record gives way to the newest and is counted as
 * dropped. Token counters live elsewhere and are never dropped.
 */

/**
 * A batch of records in column form, oldest first; `createdAt` in epoch
 * milliseconds. `requests` is how many requests a record sums (1 as recorded;
 * more once aggregated), and `latencyMs` their total latency.
 */
export interface UsageColumns {
  length: number;
  requests: Int32Array;
  orgId: string[];
  keyId: string[];
  alias: string[];
  target: string[];
  promptTokens: Int32Array;
  completionTokens: Int32Array;
  status: Int16Array;
  latencyMs: Int32Array;
  streamed: Uint8Array;
  createdAt: Float64Array;
}

const INITIAL_CAPACITY = 1024;
const INT32_MAX = 2_147_483_647;

const clampInt = (n: number): number => (n > INT32_MAX ? INT32_MAX : n < 0 ? 0 : Math.round(n));

export class UsageLog {
  private cap: number;
  private head = 0;
  private size = 0;
  private orgId: string[];
  private keyId: string[];
  private alias: string[];
  private target: string[];
  private prompt: Int32Array;
  private completion: Int32Array;
  private status: Int16Array;
  private latency: Int32Array;
  private streamed: Uint8Array;
  private createdAt: Float64Array;
  /** Records that gave way to newer ones because the log was full. */
  dropped = 0;

  constructor(private readonly max: number) {
    if (!Number.isInteger(max) || max < 1) throw new RangeError("UsageLog: max must be a positive integer");
    this.cap = Math.min(INITIAL_CAPACITY, max);
    this.orgId = new Array<string>(this.cap);
    this.keyId = new Array<string>(this.cap);
    this.alias = new Array<string>(this.cap);
    this.target = new Array<string>(this.cap);
    this.prompt = new Int32Array(this.cap);
    this.completion = new Int32Array(this.cap);
    this.status = new Int16Array(this.cap);
    this.latency = new Int32Array(this.cap);
    this.streamed = new Uint8Array(this.cap);
    this.createdAt = new Float64Array(this.cap);
  }

  get length(): number {
    return this.size;
  }

  /** Appends one record (positional, so the hot path builds no object). */
  push(
    orgId: string,
    keyId: string,
    alias: string,
    target: string,
    promptTokens: number,
    completionTokens: number,
    status: number,
    latencyMs: number,
    streamed: boolean,
    createdAt: number,
  ): void {
    if (this.size === this.cap) {
      if (this.cap < this.max) this.grow();
      else {
        // Full at the bound: the oldest record gives way.
        this.head = (this.head + 1) % this.cap;
        this.size--;
        this.dropped++;
      }
    }
    const i = (this.head + this.size) % this.cap;
    this.orgId[i] = orgId;
    this.keyId[i] = keyId;
    this.alias[i] = alias;
    this.target[i] = target;
    this.prompt[i] = clampInt(promptTokens);
    this.completion[i] = clampInt(completionTokens);
    this.status[i] = status;
    this.latency[i] = clampInt(latencyMs);
    this.streamed[i] = streamed ? 1 : 0;
    this.createdAt[i] = createdAt;
    this.size++;
  }

  /** Removes the oldest `n` records (at most all) and returns them as columns, oldest first. */
  take(n: number): UsageColumns {
    const count = Math.max(0, Math.min(n, this.size));
    const out: UsageColumns = {
      length: count,
      requests: new Int32Array(count).fill(1),
      orgId: new Array<string>(count),
      keyId: new Array<string>(count),
      alias: new Array<string>(count),
      target: new Array<string>(count),
      promptTokens: new Int32Array(count),
      completionTokens: new Int32Array(count),
      status: new Int16Array(count),
      latencyMs: new Int32Array(count),
      streamed: new Uint8Array(count),
      createdAt: new Float64Array(count),
    };
    for (let k = 0; k < count; k++) {
      const i = (this.head + k) % this.cap;
      out.orgId[k] = this.orgId[i] as string;
      out.keyId[k] = this.keyId[i] as string;
      out.alias[k] = this.alias[i] as string;
      out.target[k] = this.target[i] as string;
      out.promptTokens[k] = this.prompt[i] as number;
      out.completionTokens[k] = this.completion[i] as number;
      out.status[k] = this.status[i] as number;
      out.latencyMs[k] = this.latency[i] as number;
      out.streamed[k] = this.streamed[i] as number;
      out.createdAt[k] = this.createdAt[i] as number;
      // Let the strings go with the record, not with the next overwrite.
      this.orgId[i] = this.keyId[i] = this.alias[i] = this.target[i] = "";
    }
    this.head = count === this.size ? 0 : (this.head + count) % this.cap;
    this.size -= count;
    return out;
  }

  /** Doubles the capacity (up to max), unrolling the ring so the oldest record is at 0. */
  private grow(): void {
    const cap = Math.min(this.cap * 2, this.max);
    const order = (k: number) => (this.head + k) % this.cap;
    const strings = (a: string[]) => {
      const b = new Array<string>(cap);
      for (let k = 0; k < this.size; k++) b[k] = a[order(k)] as string;
      return b;
    };
    const typed = <T extends Int32Array | Int16Array | Uint8Array | Float64Array>(a: T, make: (n: number) => T): T => {
      const b = make(cap);
      for (let k = 0; k < this.size; k++) b[k] = a[order(k)] as number;
      return b;
    };
    this.orgId = strings(this.orgId);
    this.keyId = strings(this.keyId);
    this.alias = strings(this.alias);
    this.target = strings(this.target);
    this.prompt = typed(this.prompt, (n) => new Int32Array(n));
    this.completion = typed(this.completion, (n) => new Int32Array(n));
    this.status = typed(this.status, (n) => new Int16Array(n));
    this.latency = typed(this.latency, (n) => new Int32Array(n));
    this.streamed = typed(this.streamed, (n) => new Uint8Array(n));
    this.createdAt = typed(this.createdAt, (n) => new Float64Array(n));
    this.head = 0;
    this.cap = cap;
  }
}

/**
 * One record per organisation, key, alias, target, status and streamed-or-not:
 * requests counted, tokens and latencies summed, the newest time kept, in the
 * order each group first appears. What a usage write stores (one row where
 * there were thousands a second: the embedded database spent ~20 µs of CPU
 * per inserted row). A sum that would pass the int32 range starts a new record.
 */
export function aggregate(c: UsageColumns): UsageColumns {
  const index = new Map<string, number>();
  const at: number[] = [];
  const n = c.length;
  const out: UsageColumns = {
    length: 0,
    requests: new Int32Array(n),
    orgId: [],
    keyId: [],
    alias: [],
    target: [],
    promptTokens: new Int32Array(n),
    completionTokens: new Int32Array(n),
    status: new Int16Array(n),
    latencyMs: new Int32Array(n),
    streamed: new Uint8Array(n),
    createdAt: new Float64Array(n),
  };
  for (let i = 0; i < n; i++) {
    const key = `${c.orgId[i]}\u0000${c.keyId[i]}\u0000${c.alias[i]}\u0000${c.target[i]}\u0000${c.status[i]}\u0000${c.streamed[i]}`;
    let j = index.get(key);
    const p = c.promptTokens[i] as number;
    const q = c.completionTokens[i] as number;
    const l = c.latencyMs[i] as number;
    const r = c.requests[i] as number;
    if (
      j !== undefined &&
      (out.promptTokens[j] as number) + p <= INT32_MAX &&
      (out.completionTokens[j] as number) + q <= INT32_MAX &&
      (out.latencyMs[j] as number) + l <= INT32_MAX &&
      (out.requests[j] as number) + r <= INT32_MAX
    ) {
      out.requests[j] = (out.requests[j] as number) + r;
      out.promptTokens[j] = (out.promptTokens[j] as number) + p;
      out.completionTokens[j] = (out.completionTokens[j] as number) + q;
      out.latencyMs[j] = (out.latencyMs[j] as number) + l;
      out.createdAt[j] = Math.max(out.createdAt[j] as number, c.createdAt[i] as number);
      continue;
    }
    j = out.length++;
    index.set(key, j);
    at.push(i);
    out.orgId.push(c.orgId[i] as string);
    out.keyId.push(c.keyId[i] as string);
    out.alias.push(c.alias[i] as string);
    out.target.push(c.target[i] as string);
    out.requests[j] = r;
    out.promptTokens[j] = p;
    out.completionTokens[j] = q;
    out.status[j] = c.status[i] as number;
    out.latencyMs[j] = l;
    out.streamed[j] = c.streamed[i] as number;
    out.createdAt[j] = c.createdAt[i] as number;
  }
  const m = out.length;
  return {
    ...out,
    requests: out.requests.slice(0, m),
    promptTokens: out.promptTokens.slice(0, m),
    completionTokens: out.completionTokens.slice(0, m),
    status: out.status.slice(0, m),
    latencyMs: out.latencyMs.slice(0, m),
    streamed: out.streamed.slice(0, m),
    createdAt: out.createdAt.slice(0, m),
  };
}

/** Record `i` of a batch as a batch of one (for writing records one by one). */
export function columnsAt(c: UsageColumns, i: number): UsageColumns {
  return {
    length: 1,
    requests: c.requests.slice(i, i + 1),
    orgId: [c.orgId[i] as string],
    keyId: [c.keyId[i] as string],
    alias: [c.alias[i] as string],
    target: [c.target[i] as string],
    promptTokens: c.promptTokens.slice(i, i + 1),
    completionTokens: c.completionTokens.slice(i, i + 1),
    status: c.status.slice(i, i + 1),
    latencyMs: c.latencyMs.slice(i, i + 1),
    streamed: c.streamed.slice(i, i + 1),
    createdAt: c.createdAt.slice(i, i + 1),
  };
}

/** Record `i` of a batch as a plain object, every field, for a dead letter or a log line. */
export function eventRecord(c: UsageColumns, i: number): Record<string, unknown> {
  return {
    kind: "event",
    requests: c.requests[i],
    org_id: c.orgId[i],
    key_id: c.keyId[i],
    alias: c.alias[i],
    target: c.target[i],
    prompt_tokens: c.promptTokens[i],
    completion_tokens: c.completionTokens[i],
    status: c.status[i],
    latency_ms: c.latencyMs[i],
    streamed: c.streamed[i] === 1,
    created_at: new Date(c.createdAt[i] ?? 0).toISOString(),
  };
}
