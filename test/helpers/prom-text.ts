/**
 * A strict reader of the Prometheus text exposition format 0.0.4
 * (https://prometheus.io/docs/instrumenting/exposition_formats/), stricter
 * than Prometheus itself where the gateway has no reason to use a freedom:
 * every family has exactly one HELP and one TYPE line before its samples, no
 * other comments, no timestamps, a family's samples are contiguous, no series
 * twice, and a histogram's buckets are cumulative, ascending in `le` and end
 * in `+Inf` equal to `_count`, with `_sum` and `_count` for every label set.
 * Throws an Error naming the line on the first violation.
 */

export interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

export interface Family {
  name: string;
  help: string;
  type: "counter" | "gauge" | "histogram" | "summary" | "untyped";
  samples: Sample[];
}

const METRIC_NAME = /^[a-zA-Z_:][a-zA-Z0-9_:]*$/;
const LABEL_NAME = /^[a-zA-Z_][a-zA-Z0-9_]*$/;
const TYPES = new Set(["counter", "gauge", "histogram", "summary", "untyped"]);
// Go's strconv.ParseFloat as Prometheus's parser uses it, minus hex floats and underscores.
const VALUE = /^(?:[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?Inf|NaN)$/;

/** A HELP text or label value with its escapes undone; `allowed` are the characters that may follow a backslash. */
function unescaped(s: string, allowed: string, where: string): string {
  let out = "";
  for (let i = 0; i < s.length; i++) {
    const c = s[i] as string;
    if (c === "\n") throw new Error(`${where}: raw newline`);
    if (c !== "\\") {
      out += c;
      continue;
    }
    const next = s[++i];
    if (next === undefined || !allowed.includes(next)) throw new Error(`${where}: invalid escape \\${next ?? "(end)"}`);
    out += next === "n" ? "\n" : next;
  }
  return out;
}

function parseValue(s: string, where: string): number {
  if (!VALUE.test(s)) throw new Error(`${where}: not a float: ${JSON.stringify(s)}`);
  if (s.endsWith("Inf")) return s.startsWith("-") ? Number.NEGATIVE_INFINITY : Number.POSITIVE_INFINITY;
  return s === "NaN" ? Number.NaN : Number(s);
}

/** `name{labels} value` (labels optional), read character by character. */
function parseSample(line: string, where: string): Sample {
  const nameEnd = line.search(/[{ ]/);
  if (nameEnd <= 0) throw new Error(`${where}: no metric name`);
  const name = line.slice(0, nameEnd);
  if (!METRIC_NAME.test(name)) throw new Error(`${where}: invalid metric name ${JSON.stringify(name)}`);
  const labels: Record<string, string> = {};
  let i = nameEnd;
  if (line[i] === "{") {
    i++;
    while (line[i] !== "}") {
      const eq = line.indexOf("=", i);
      if (eq < 0) throw new Error(`${where}: label without =`);
      const label = line.slice(i, eq);
      if (!LABEL_NAME.test(label) || label.startsWith("__")) throw new Error(`${where}: invalid label name ${JSON.stringify(label)}`);
      if (label in labels) throw new Error(`${where}: label ${label} twice`);
      if (line[eq + 1] !== '"') throw new Error(`${where}: label value not quoted`);
      let j = eq + 2;
      let raw = "";
      for (;;) {
        const c = line[j];
        if (c === undefined) throw new Error(`${where}: unterminated label value`);
        if (c === '"') break;
        if (c === "\\") {
          raw += c + (line[j + 1] ?? "");
          j += 2;
          continue;
        }
        raw += c;
        j++;
      }
      labels[label] = unescaped(raw, '\\"n', `${where}: label ${label}`);
      i = j + 1;
      if (line[i] === ",") i++;
      else if (line[i] !== "}") throw new Error(`${where}: expected , or } after label ${label}`);
    }
    i++;
  }
  if (line[i] !== " ") throw new Error(`${where}: expected one space before the value`);
  const rest = line.slice(i + 1);
  if (rest.includes(" ")) throw new Error(`${where}: a timestamp or trailing text: ${JSON.stringify(rest)}`);
  return { name, labels, value: parseValue(rest, where) };
}

const seriesKey = (s: Sample) =>
  `${s.name}${JSON.stringify(
    Object.entries(s.labels).sort(([a], [b]) => (a < b ? -1 : 1)),
  )}`;

/** The family a sample belongs to: its own name, or for a histogram's `_bucket`, `_sum`, `_count` the base name. */
function familyOf(sample: string, current: Family | undefined): string {
  if (current?.type === "histogram") {
    for (const suffix of ["_bucket", "_sum", "_count"]) {
      if (sample === current.name + suffix) return current.name;
    }
  }
  return sample;
}

function checkHistogram(f: Family): void {
  const byLabels = new Map<string, { buckets: [number, number][]; sum?: number; count?: number }>();
  for (const s of f.samples) {
    const { le, ...rest } = s.labels;
    const key = JSON.stringify(Object.entries(rest).sort(([a], [b]) => (a < b ? -1 : 1)));
    let e = byLabels.get(key);
    if (!e) {
      e = { buckets: [] };
      byLabels.set(key, e);
    }
    if (s.name === `${f.name}_bucket`) {
      if (le === undefined) throw new Error(`${f.name}: a bucket without le`);
      e.buckets.push([parseValue(le, `${f.name} le`), s.value]);
    } else {
      if (le !== undefined) throw new Error(`${s.name}: le outside a bucket`);
      if (s.name === `${f.name}_sum`) e.sum = s.value;
      else e.count = s.value;
    }
  }
  for (const [key, e] of byLabels) {
    const where = `${f.name}${key}`;
    if (e.buckets.length === 0) throw new Error(`${where}: no buckets`);
    for (let i = 1; i < e.buckets.length; i++) {
      const [le0, v0] = e.buckets[i - 1] as [number, number];
      const [le1, v1] = e.buckets[i] as [number, number];
      if (!(le1 > le0)) throw new Error(`${where}: le not ascending (${le0}, ${le1})`);
      if (!(v1 >= v0)) throw new Error(`${where}: buckets not cumulative (${v0}, ${v1})`);
    }
    const [lastLe, lastV] = e.buckets.at(-1) as [number, number];
    if (lastLe !== Number.POSITIVE_INFINITY) throw new Error(`${where}: the last bucket is not +Inf`);
    if (e.count === undefined || e.sum === undefined) throw new Error(`${where}: _sum or _count missing`);
    if (lastV !== e.count) throw new Error(`${where}: +Inf bucket ${lastV} is not _count ${e.count}`);
  }
}

export function parseExposition(text: string): Map<string, Family> {
  if (!text.endsWith("\n")) throw new Error("the exposition does not end with a newline");
  const families = new Map<string, Family>();
  const series = new Set<string>();
  const closed = new Set<string>();
  let current: Family | undefined;
  const lines = text.slice(0, -1).split("\n");
  const open = (name: string, where: string): Family => {
    if (!METRIC_NAME.test(name)) throw new Error(`${where}: invalid metric name ${JSON.stringify(name)}`);
    if (closed.has(name)) throw new Error(`${where}: ${name} resumed after another family`);
    let f = families.get(name);
    if (!f) {
      if (current && current.name !== name) closed.add(current.name);
      f = { name, help: "", type: "untyped", samples: [] };
      families.set(name, f);
      current = f;
    }
    return f;
  };
  const helped = new Set<string>();
  const typed = new Set<string>();
  for (const [n, line] of lines.entries()) {
    const where = `line ${n + 1}`;
    if (line === "") continue;
    if (line.startsWith("#")) {
      const m = /^# (HELP|TYPE) ([^ ]+) (.*)$/.exec(line);
      if (!m) throw new Error(`${where}: a comment other than HELP or TYPE: ${JSON.stringify(line)}`);
      const [, kind, name = "", rest = ""] = m;
      const f = open(name, where);
      if (f.samples.length > 0) throw new Error(`${where}: ${kind} after ${name}'s samples`);
      if (kind === "HELP") {
        if (helped.has(name)) throw new Error(`${where}: a second HELP for ${name}`);
        helped.add(name);
        f.help = unescaped(rest, "\\n", where);
      } else {
        if (typed.has(name)) throw new Error(`${where}: a second TYPE for ${name}`);
        if (!TYPES.has(rest)) throw new Error(`${where}: unknown type ${JSON.stringify(rest)}`);
        typed.add(name);
        f.type = rest as Family["type"];
      }
      continue;
    }
    const s = parseSample(line, where);
    const f = families.get(familyOf(s.name, current)) ?? open(s.name, where);
    if (f !== current) throw new Error(`${where}: ${s.name} outside its family's block`);
    if (!helped.has(f.name) || !typed.has(f.name)) throw new Error(`${where}: ${s.name} before its HELP and TYPE`);
    if (f.type !== "histogram" && s.name !== f.name) throw new Error(`${where}: ${s.name} in family ${f.name}`);
    if (f.type !== "histogram" && "le" in s.labels) throw new Error(`${where}: le on a ${f.type}`);
    if (f.type === "counter" && !(s.value >= 0)) throw new Error(`${where}: counter ${s.name} is ${s.value}`);
    const key = seriesKey(s);
    if (series.has(key)) throw new Error(`${where}: series ${key} twice`);
    series.add(key);
    f.samples.push(s);
  }
  for (const f of families.values()) {
    if (!helped.has(f.name) || !typed.has(f.name)) throw new Error(`${f.name}: no HELP or no TYPE`);
    if (f.type === "histogram") checkHistogram(f);
  }
  return families;
}
