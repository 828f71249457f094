// `forkling fork <template> -n N [--eval code | --exec cmd]`: N children of a
// template, each running the code or command; prints timings, memory per
// child (measured while the children are alive) and every child's result.
// Generic over the Engine interface (kvm or process, chosen by --engine).
import type { Sandbox } from '../engine/engine.ts';
import { openEngine } from '../engine/select.ts';
import { checkName, UserError } from '../errors.ts';
import { parseCommandLine } from './args.ts';
import { intOption, listStoredTemplates } from './template.ts';

const USAGE = 'usage: forkling fork [<template>] [-n <N>] [--eval <python code> | --exec <command>] [--json] [--keep] [--engine kvm|process|auto]';

const HELP = `${USAGE}

Creates N children (default 1, at most 1024) of the template (default: default, created on first use), in parallel,
each ready once its agent has been restored (fresh entropy, clock, hostname, id). With
--eval every child runs the Python code in its default context; with --exec the shell
command. --keep leaves the children running until Ctrl-C.

Timings: the template is loaded first (template_load_ms: the process engine starts its
zygote, the KVM engine checks the template's files; a server does this once; on first
use of default it also includes building the image and creating the template:
template_created says so), then ready_ms is from the fork call until every child is
ready, and total_ms until every child has also answered its --eval or --exec.`;

const OPTIONS = {
  n: { type: 'string', short: 'n' },
  eval: { type: 'string' },
  exec: { type: 'string' },
  json: { type: 'boolean' },
  keep: { type: 'boolean' },
  engine: { type: 'string' },
  help: { type: 'boolean', short: 'h' },
} as const;

export interface ForkChildResult {
  id: string;
  ok: boolean;
  value: unknown;
  stdout: string;
  stderr: string;
  error: string | null;
}

export interface ForkReport {
  engine: string;
  template: string;
  n: number;
  /** Whether this run created the template first (default, on first use): then template_load_ms includes that. */
  template_created: boolean;
  /** template_load_ms: making the template ready to fork in this process (once; not part of the others) */
  timings: { template_load_ms: number; total_ms: number; ready_ms: number; child_p50_ms: number; child_p99_ms: number };
  memory: { per_child_kib: number };
  children: ForkChildResult[];
}

/** The q-quantile (0..1) of values, nearest-rank. */
export function quantile(values: number[], q: number): number {
  if (!values.length) return 0;
  const s = [...values].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil(q * s.length) - 1))]!;
}

const round = (x: number): number => Math.round(x * 100) / 100;
const td = new TextDecoder();

async function runIn(sb: Sandbox, what: { eval?: string; exec?: string }): Promise<ForkChildResult> {
  const base = { id: sb.id, value: null as unknown, stdout: '', stderr: '', error: null as string | null };
  try {
    if (what.eval !== undefined) {
      const r = await sb.agent.eval(what.eval);
      if (r.exception) return { ...base, ok: false, stdout: r.stdout, stderr: r.stderr, error: `${r.exception.type}: ${r.exception.message}` };
      return { ...base, ok: true, value: r.value !== undefined ? r.value : r.repr, stdout: r.stdout, stderr: r.stderr };
    }
    if (what.exec !== undefined) {
      const r = await sb.agent.exec(what.exec);
      const code = r.exitCode ?? null;
      return {
        ...base,
        ok: code === 0,
        value: code,
        stdout: td.decode(r.stdout),
        stderr: td.decode(r.stderr),
        error: code === 0 ? null : r.signal ? `killed by ${r.signal}` : `exit status ${code}`,
      };
    }
    return { ...base, ok: true };
  } catch (e) {
    return { ...base, ok: false, error: (e as Error).message };
  }
}

const LOAD_WHAT: Record<string, string> = {
  process: 'its zygote started, warm-up run',
  kvm: 'its files checked',
};

function printTable(rep: ForkReport): void {
  const t = rep.timings;
  console.log(`${rep.n} children of template ${rep.template} (${rep.engine})`);
  const what = rep.template_created ? 'created first (its image built if need be), then loaded' : (LOAD_WHAT[rep.engine] ?? 'made ready');
  console.log(`  template ${rep.template_created ? 'created and loaded' : 'loaded'} in ${t.template_load_ms} ms (once per process, before the fork: ${what})`);
  console.log(`  ready: ${t.ready_ms} ms for all; per child p50 ${t.child_p50_ms} ms, p99 ${t.child_p99_ms} ms; total ${t.total_ms} ms`);
  console.log(`  private memory per child (while alive): ${rep.memory.per_child_kib} KiB`);
  const rows = [['CHILD', 'OK', 'VALUE', 'STDOUT', 'ERROR']];
  const cut = (s: string) => {
    const one = s.replace(/\s+/g, ' ').trim();
    return one.length > 40 ? `${one.slice(0, 37)}...` : one;
  };
  for (const c of rep.children) rows.push([c.id, c.ok ? 'yes' : 'no', cut(c.value === null ? '' : typeof c.value === 'string' ? c.value : JSON.stringify(c.value) ?? ''), cut(c.stdout), cut(c.error ?? '')]);
  const widths = rows[0]!.map((_, i) => Math.max(...rows.map((r) => r[i]!.length)));
  for (const r of rows) console.log(`  ${r.map((c, i) => c.padEnd(widths[i]!)).join('  ').trimEnd()}`);
}

export async function forkCommand(argv: string[]): Promise<number> {
  const { values, positionals } = parseCommandLine({ args: argv, options: OPTIONS, allowPositionals: true }, USAGE);
  if (values.help) {
    console.log(HELP);
    return 0;
  }
  if (positionals.length > 1) throw new UserError('fork takes one template name', USAGE);
  const template = checkName('template', positionals[0] ?? 'default');
  const n = intOption('n', values.n ?? '1', 1, 1024)!;
  if (values.eval !== undefined && values.exec !== undefined) throw new UserError('give --eval or --exec, not both', USAGE);

  const engine = await openEngine(values.engine);
  let children: Sandbox[] = [];
  try {
    // A one-shot process loads the template first (a server does once): timed apart from the fork.
    const existed = listStoredTemplates().some((t) => t.engine === engine.name && t.name === template);
    const tl = performance.now();
    await engine.prepare(template);
    const t0 = performance.now();
    children = await engine.fork(template, n);
    const results = await Promise.all(children.map((c) => runIn(c, { ...(values.eval !== undefined ? { eval: values.eval } : {}), ...(values.exec !== undefined ? { exec: values.exec } : {}) })));
    const total = performance.now() - t0;
    // Memory while every child is alive (after it ran its code).
    const stats = await Promise.all(children.map((c) => c.stats().catch(() => null)));
    const priv = stats.filter((s) => s !== null).map((s) => s.privateKiB);
    const perChild = priv.length ? priv.reduce((a, b) => a + b, 0) / priv.length : 0;
    const ready = children.map((c) => c.timings.readyAt - c.timings.startedAt);
    const rep: ForkReport = {
      engine: engine.name,
      template,
      n,
      template_created: !existed,
      timings: {
        template_load_ms: round(t0 - tl),
        total_ms: round(total),
        ready_ms: round(Math.max(...children.map((c) => c.timings.readyAt)) - t0),
        child_p50_ms: round(quantile(ready, 0.5)),
        child_p99_ms: round(quantile(ready, 0.99)),
      },
      memory: { per_child_kib: Math.round(perChild) },
      children: results,
    };
    if (values.json) console.log(JSON.stringify(rep, null, 2));
    else printTable(rep);
    if (values.keep) {
      // (handlers before the line: a signal sent as soon as it is read ends them, not the process)
      const ended = new Promise<void>((resolve) => {
        process.once('SIGINT', resolve);
        process.once('SIGTERM', resolve);
      });
      console.error(`forkling: ${n} children running; Ctrl-C ends them`);
      await ended;
    }
    return results.every((r) => r.ok) ? 0 : 1;
  } finally {
    await Promise.all(children.map((c) => c.kill().catch(() => {})));
    await engine.close();
  }
}
