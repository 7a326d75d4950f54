/**
 * Prometheus text exposition, format 0.0.4
 * (https://prometheus.io/docs/instrumenting/exposition_formats/): counters,
 * gauges and histograms with labels, nothing else. It replaces prom-client,
 * whose code (it loads Node's `cluster`, `v8` and `perf_hooks` modules and
 * OpenTelemetry's API) every young collection of the request thread walked:
 * about 1,000 of the serving process's 4,500 function executables for a
 * scrape every few seconds (docs/decisions.md, "Our own metrics exposition").
 *
 * Updates are one Map walk keyed by the label values themselves (no key
 * string, no allocation for a label set seen before); the text is built only
 * when scraped. The output is what prom-client wrote for the same metrics:
 * HELP then TYPE then the samples, label pairs in the order of `labelNames`,
 * histogram buckets with `le` first, metrics in registration order separated
 * by a blank line.
 */

export const CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8";

/** A label value: strings, or numbers written as JavaScript writes them (a status code). */
export type LabelValue = string | number;
export type Labels<T extends string> = Partial<Record<T, LabelValue>>;

const METRIC_NAME = /^[a-zA-Z_:][a-zA-Z0-9_:]*$/;
const LABEL_NAME = /^[a-zA-Z_][a-zA-Z0-9_]*$/;

/** HELP text: backslash and newline escaped. */
export function escapeHelp(s: string): string {
  return s.replace(/\\/g, "\\\\").replace(/\n/g, "\\n");
}

/** A label value: backslash, newline and double quote escaped. */
export function escapeLabelValue(s: string): string {
  return s.replace(/\\/g, "\\\\").replace(/\n/g, "\\n").replace(/"/g, '\\"');
}

/** A sample value as Prometheus reads it (Go's ParseFloat): NaN, +Inf, -Inf, or the number. */
export function formatValue(v: number): string {
  if (Number.isNaN(v)) return "NaN";
  if (v === Number.POSITIVE_INFINITY) return "+Inf";
  if (v === Number.NEGATIVE_INFINITY) return "-Inf";
  return `${v}`;
}

/** `name="value"` pairs for these label values, in the order of `names`. */
function labelPairs(names: readonly string[], values: readonly LabelValue[]): string[] {
  return names.map((n, i) => `${n}="${escapeLabelValue(String(values[i] ?? ""))}"`);
}

export interface Metric {
  readonly name: string;
  /** Called at each scrape before any metric is written: sets values read from elsewhere. */
  collect?(): void;
  /** Appends the HELP and TYPE lines and the samples. */
  write(lines: string[]): void;
  /** Forgets every value (tests). */
  reset(): void;
}

export class Registry {
  readonly contentType = CONTENT_TYPE;
  private readonly list: Metric[] = [];
  private readonly names = new Set<string>();

  register(m: Metric): void {
    if (this.names.has(m.name)) throw new Error(`A metric with the name ${m.name} has already been registered.`);
    this.names.add(m.name);
    this.list.push(m);
  }

  /**
   * The exposition. Every collect hook runs first, in registration order, so
   * a hook may set any metric (earlier or later ones) and a scrape shows the
   * values of one moment.
   */
  metrics(): string {
    for (const m of this.list) m.collect?.();
    const blocks: string[] = [];
    for (const m of this.list) {
      const lines: string[] = [];
      m.write(lines);
      blocks.push(lines.join("\n"));
    }
    return `${blocks.join("\n\n")}\n`;
  }

  resetMetrics(): void {
    for (const m of this.list) m.reset();
  }
}

export interface MetricConfig<T extends string> {
  name: string;
  help: string;
  labelNames?: readonly T[];
  registers?: Registry[];
  /** Called at each scrape before anything is written. */
  collect?: () => void;
}

interface Leaf {
  /** `{a="x",b="y"}`, or "" without labels; escaped once, when the label set is first seen. */
  labels: string;
  value: number;
}

/**
 * Values per label set, in a tree of Maps, one level per label, keyed by the
 * label values themselves: an update builds no key string (the values are
 * mostly the same string instances every time, whose hashes JSC keeps), and
 * allocates only for a label set never seen before. A number and its string
 * ("200" and 200) are two keys: give each label one type.
 */
abstract class Scalar<T extends string> implements Metric {
  readonly name: string;
  readonly collect?: () => void;
  private readonly help: string;
  private readonly names: readonly T[];
  private root = new Map<LabelValue, unknown>();
  private leaves: Leaf[] = [];
  /** The one value of a metric without labels (written even when never set, as 0). */
  private single: Leaf | undefined;
  protected abstract readonly type: "counter" | "gauge";

  constructor(cfg: MetricConfig<T>) {
    if (!METRIC_NAME.test(cfg.name)) throw new Error(`invalid metric name ${JSON.stringify(cfg.name)}`);
    const names = cfg.labelNames ?? [];
    for (const n of names) {
      if (!LABEL_NAME.test(n) || n.startsWith("__")) throw new Error(`invalid label name ${JSON.stringify(n)}`);
    }
    this.name = cfg.name;
    this.help = cfg.help;
    this.names = names;
    if (cfg.collect) this.collect = cfg.collect;
    if (names.length === 0) this.single = this.newLeaf([]);
    for (const r of cfg.registers ?? []) r.register(this);
  }

  private newLeaf(values: LabelValue[]): Leaf {
    const leaf = { labels: values.length === 0 ? "" : `{${labelPairs(this.names, values).join(",")}}`, value: 0 };
    this.leaves.push(leaf);
    return leaf;
  }

  protected leaf(labels: Labels<T> | undefined): Leaf {
    if (this.single) return this.single;
    const names = this.names;
    const last = names.length - 1;
    let node = this.root;
    for (let i = 0; i < last; i++) {
      const v = labels?.[names[i] as T] ?? "";
      let next = node.get(v) as Map<LabelValue, unknown> | undefined;
      if (!next) {
        next = new Map();
        node.set(v, next);
      }
      node = next;
    }
    const v = labels?.[names[last] as T] ?? "";
    let leaf = node.get(v) as Leaf | undefined;
    if (!leaf) {
      leaf = this.newLeaf(names.map((n) => labels?.[n] ?? ""));
      node.set(v, leaf);
    }
    return leaf;
  }

  write(lines: string[]): void {
    lines.push(`# HELP ${this.name} ${escapeHelp(this.help)}`, `# TYPE ${this.name} ${this.type}`);
    for (const l of this.leaves) lines.push(`${this.name}${l.labels} ${formatValue(l.value)}`);
  }

  reset(): void {
    this.root = new Map();
    this.leaves = [];
    if (this.single) this.single = this.newLeaf([]);
  }
}

export class Counter<T extends string = never> extends Scalar<T> {
  protected readonly type = "counter";

  /** Adds `n` (default 1); a counter never goes down, so a negative or NaN `n` throws. */
  inc(n?: number): void;
  inc(labels: Labels<T>, n?: number): void;
  inc(a?: Labels<T> | number, b?: number): void {
    const labels = typeof a === "object" ? a : undefined;
    const n = (typeof a === "number" ? a : b) ?? 1;
    if (!(n >= 0)) throw new Error(`${this.name}: a counter cannot be increased by ${n}`);
    this.leaf(labels).value += n;
  }
}

export class Gauge<T extends string = never> extends Scalar<T> {
  protected readonly type = "gauge";

  set(value: number): void;
  set(labels: Labels<T>, value: number): void;
  set(a: Labels<T> | number, b?: number): void {
    if (typeof a === "number") this.leaf(undefined).value = a;
    else this.leaf(a).value = b ?? 0;
  }

  inc(n = 1): void {
    this.leaf(undefined).value += n;
  }

  dec(n = 1): void {
    this.leaf(undefined).value -= n;
  }
}

interface Series {
  /** `route="/v1/x"` (escaped), written after `le` in the buckets and alone in _sum and _count. */
  label: string;
  /** Observations per bucket (not cumulative); the last slot is above every bound. */
  counts: Float64Array;
  sum: number;
  count: number;
}

/**
 * A histogram with one label, kept as plain arrays per label value. Buckets
 * are written cumulative, with `le` first, ending in `+Inf` (= the count).
 */
export class Histogram implements Metric {
  readonly name: string;
  private readonly help: string;
  private readonly bounds: number[];
  private readonly les: string[];
  private readonly label: string;
  private series = new Map<string, Series>();

  constructor(cfg: { name: string; help: string; labelNames: readonly [string]; buckets: number[]; registers?: Registry[] }) {
    if (!METRIC_NAME.test(cfg.name)) throw new Error(`invalid metric name ${JSON.stringify(cfg.name)}`);
    const label = cfg.labelNames[0];
    if (!LABEL_NAME.test(label) || label.startsWith("__") || label === "le") throw new Error(`invalid label name ${JSON.stringify(label)}`);
    this.name = cfg.name;
    this.help = cfg.help;
    this.label = label;
    this.bounds = [...new Set(cfg.buckets)].filter((b) => Number.isFinite(b)).sort((a, b) => a - b);
    this.les = [...this.bounds.map(formatValue), "+Inf"];
    for (const r of cfg.registers ?? []) r.register(this);
  }

  /** One observation of `value` for this label value. */
  record(labelValue: string, value: number): void {
    let s = this.series.get(labelValue);
    if (!s) {
      s = { label: `${this.label}="${escapeLabelValue(labelValue)}"`, counts: new Float64Array(this.bounds.length + 1), sum: 0, count: 0 };
      this.series.set(labelValue, s);
    }
    const b = this.bounds;
    let i = 0;
    while (i < b.length && value > (b[i] as number)) i++;
    s.counts[i] = (s.counts[i] ?? 0) + 1;
    s.sum += value;
    s.count++;
  }

  write(lines: string[]): void {
    const name = this.name;
    lines.push(`# HELP ${name} ${escapeHelp(this.help)}`, `# TYPE ${name} histogram`);
    for (const s of this.series.values()) {
      let acc = 0;
      for (let i = 0; i < this.les.length; i++) {
        acc += s.counts[i] ?? 0;
        lines.push(`${name}_bucket{le="${this.les[i]}",${s.label}} ${formatValue(acc)}`);
      }
      lines.push(`${name}_sum{${s.label}} ${formatValue(s.sum)}`, `${name}_count{${s.label}} ${formatValue(s.count)}`);
    }
  }

  reset(): void {
    this.series = new Map();
  }
}
