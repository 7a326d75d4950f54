import {
  Counter,
  type CounterConfiguration,
  Histogram,
  type HistogramConfiguration,
  type LabelValues,
  type MetricObjectWithValues,
  type MetricType,
  type MetricValueWithName,
} from "prom-client";

/**
 * Metrics updated on every request. prom-client hashes the label object on
 * each inc/observe (sorting and joining the values), several times a request:
 * a measurable share of the request thread (docs/benchmarks.md). Here the hot
 * path is one Map update keyed by the label values; prom-client sees the sums
 * when it is scraped. The exposition (names, labels, buckets) is unchanged.
 */

interface Pending<T extends string> {
  labels: LabelValues<T>;
  n: number;
}

/**
 * A counter whose increments are summed per label set and handed to
 * prom-client when scraped. The sums sit in a tree of Maps, one level per
 * label, keyed by the label values themselves: an increment builds no key
 * string (the values are mostly the same string instances every time, whose
 * hashes JSC keeps), and allocates only for a label set never seen before.
 */
export class HotCounter<T extends string> {
  readonly counter: Counter<T>;
  private readonly root = new Map<unknown, unknown>();
  private readonly leaves: Pending<T>[] = [];
  private readonly names: readonly T[];

  constructor(cfg: CounterConfiguration<T> & { labelNames: readonly T[] }) {
    this.names = cfg.labelNames;
    const leaves = this.leaves;
    this.counter = new Counter<T>({
      ...cfg,
      collect() {
        for (const p of leaves) {
          if (p.n === 0) continue;
          this.inc(p.labels, p.n);
          p.n = 0;
        }
      },
    });
  }

  /** Adds `n` (default 1) for these labels; the label sets are small closed sets, so the tree stays small. */
  inc(labels: LabelValues<T>, n = 1): void {
    const names = this.names;
    let node = this.root;
    const last = names.length - 1;
    for (let i = 0; i < last; i++) {
      const v = labels[names[i] as T] ?? "";
      let next = node.get(v) as Map<unknown, unknown> | undefined;
      if (!next) {
        next = new Map();
        node.set(v, next);
      }
      node = next;
    }
    const v = last >= 0 ? (labels[names[last] as T] ?? "") : "";
    const p = node.get(v) as Pending<T> | undefined;
    if (p) p.n += n;
    else {
      const leaf = { labels: { ...labels }, n };
      node.set(v, leaf);
      this.leaves.push(leaf);
    }
  }
}

interface Series {
  /** Observations per bucket (not cumulative); the last slot is above every bound. */
  counts: Float64Array;
  sum: number;
  count: number;
}

/**
 * A histogram with one label, kept as plain arrays per label value and
 * exposed in prom-client's own format (it stays a prom-client Histogram, so
 * the registry formats it like any other).
 */
export class HotHistogram extends Histogram<string> {
  private readonly bounds: number[];
  private readonly label: string;
  private readonly series = new Map<string, Series>();
  private readonly metricName: string;
  private readonly helpText: string;
  private readonly promType: MetricType;

  constructor(cfg: HistogramConfiguration<string> & { labelNames: readonly [string]; buckets: number[] }) {
    super(cfg);
    this.metricName = cfg.name;
    this.helpText = cfg.help;
    // prom-client's typings declare a numeric enum here; at run time it is the
    // string the registry prints ("histogram"), set by the base class.
    this.promType = Reflect.get(this, "type") as MetricType;
    this.bounds = [...cfg.buckets].sort((a, b) => a - b);
    this.label = cfg.labelNames[0];
  }

  /** One observation of `value` for this label value. */
  record(labelValue: string, value: number): void {
    let s = this.series.get(labelValue);
    if (!s) {
      s = { counts: new Float64Array(this.bounds.length + 1), sum: 0, count: 0 };
      this.series.set(labelValue, s);
    }
    const b = this.bounds;
    let i = 0;
    while (i < b.length && value > (b[i] as number)) i++;
    s.counts[i] = (s.counts[i] ?? 0) + 1;
    s.sum += value;
    s.count++;
  }

  override reset(): void {
    // The base constructor calls reset() before this class's fields exist.
    this.series?.clear();
  }

  override async get(): Promise<MetricObjectWithValues<MetricValueWithName<string>>> {
    const values: MetricValueWithName<string>[] = [];
    const name = this.metricName;
    const bucket = `${name}_bucket`;
    for (const [v, s] of this.series) {
      let acc = 0;
      for (let i = 0; i < this.bounds.length; i++) {
        acc += s.counts[i] ?? 0;
        values.push({ metricName: bucket, labels: this.labelsOf(v, this.bounds[i]), value: acc });
      }
      values.push({ metricName: bucket, labels: this.labelsOf(v, "+Inf"), value: s.count });
      values.push({ metricName: `${name}_sum`, labels: this.labelsOf(v), value: s.sum });
      values.push({ metricName: `${name}_count`, labels: this.labelsOf(v), value: s.count });
    }
    return { name, help: this.helpText, type: this.promType, values, aggregator: "sum", collect: () => {} };
  }

  /** The registry formats from this when it exists (prom-client's Histogram has one); the same values. */
  getForPromString(): Promise<MetricObjectWithValues<MetricValueWithName<string>>> {
    return this.get();
  }

  private labelsOf(v: string, le?: number | string): LabelValues<string> {
    const out: LabelValues<string> = {};
    if (le !== undefined) out.le = le;
    out[this.label] = v;
    return out;
  }
}
