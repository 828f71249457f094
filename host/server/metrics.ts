// Prometheus text exposition (format 0.0.4) for the server: counters, gauges
// read at scrape time, and histograms with fixed buckets. Small on purpose: a
// scrape is rare, an observation is on the hot path (one array walk).

type Labels = Record<string, string>;

function labelKey(labels: Labels): string {
  const keys = Object.keys(labels).sort();
  if (keys.length === 0) return '';
  return `{${keys.map((k) => `${k}="${escapeLabel(labels[k] ?? '')}"`).join(',')}}`;
}

function escapeLabel(v: string): string {
  return v.replace(/\\/g, '\\\\').replace(/\n/g, '\\n').replace(/"/g, '\\"');
}

function fmt(n: number): string {
  if (Number.isNaN(n)) return 'NaN';
  if (n === Number.POSITIVE_INFINITY) return '+Inf';
  if (n === Number.NEGATIVE_INFINITY) return '-Inf';
  return String(n);
}

interface Metric {
  render(out: string[]): void;
}

export class Counter implements Metric {
  private values = new Map<string, number>();
  constructor(
    readonly name: string,
    readonly help: string,
  ) {}
  inc(labels: Labels = {}, by = 1): void {
    const k = labelKey(labels);
    this.values.set(k, (this.values.get(k) ?? 0) + by);
  }
  get(labels: Labels = {}): number {
    return this.values.get(labelKey(labels)) ?? 0;
  }
  render(out: string[]): void {
    out.push(`# HELP ${this.name} ${this.help}`, `# TYPE ${this.name} counter`);
    if (this.values.size === 0) out.push(`${this.name} 0`);
    for (const [k, v] of this.values) out.push(`${this.name}${k} ${fmt(v)}`);
  }
}

/** A gauge whose samples are read when scraped. */
export class Gauge implements Metric {
  constructor(
    readonly name: string,
    readonly help: string,
    private readonly read: () => Array<[Labels, number]>,
  ) {}
  render(out: string[]): void {
    out.push(`# HELP ${this.name} ${this.help}`, `# TYPE ${this.name} gauge`);
    for (const [labels, v] of this.read()) out.push(`${this.name}${labelKey(labels)} ${fmt(v)}`);
  }
}

/** Latency buckets in seconds: 50 µs .. 30 s. */
export const LATENCY_BUCKETS = [
  0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
];

interface HistogramSeries {
  counts: number[];
  sum: number;
  count: number;
}

export class Histogram implements Metric {
  private series = new Map<string, HistogramSeries>();
  constructor(
    readonly name: string,
    readonly help: string,
    readonly buckets: number[] = LATENCY_BUCKETS,
  ) {}
  observe(labels: Labels, value: number): void {
    const k = labelKey(labels);
    let s = this.series.get(k);
    if (!s) {
      s = { counts: new Array(this.buckets.length).fill(0), sum: 0, count: 0 };
      this.series.set(k, s);
    }
    // Counts are stored per bucket (not cumulative) and summed at scrape time.
    let i = 0;
    while (i < this.buckets.length && value > (this.buckets[i] as number)) i++;
    if (i < this.buckets.length) s.counts[i] = (s.counts[i] ?? 0) + 1;
    s.sum += value;
    s.count++;
  }
  count(labels: Labels = {}): number {
    return this.series.get(labelKey(labels))?.count ?? 0;
  }
  render(out: string[]): void {
    out.push(`# HELP ${this.name} ${this.help}`, `# TYPE ${this.name} histogram`);
    for (const [k, s] of this.series) {
      const inner = k ? `${k.slice(1, -1)},` : '';
      let cum = 0;
      for (let i = 0; i < this.buckets.length; i++) {
        cum += s.counts[i] ?? 0;
        out.push(`${this.name}_bucket{${inner}le="${fmt(this.buckets[i] as number)}"} ${cum}`);
      }
      out.push(`${this.name}_bucket{${inner}le="+Inf"} ${s.count}`);
      out.push(`${this.name}_sum${k} ${fmt(s.sum)}`, `${this.name}_count${k} ${s.count}`);
    }
  }
}

export class Registry {
  private metrics: Metric[] = [];
  add<M extends Metric>(m: M): M {
    this.metrics.push(m);
    return m;
  }
  render(): string {
    const out: string[] = [];
    for (const m of this.metrics) m.render(out);
    return `${out.join('\n')}\n`;
  }
}
