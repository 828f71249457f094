// `forkling template create|ls|rm`: warm templates. Generic over the Engine
// interface: `create` asks the selected engine to boot, warm up and freeze
// one; `ls` and `rm` read the store, where each engine keeps its templates
// (kvm: templates/<name>/template.json next to its state and memory files;
// process: process-templates/<name>.json).
import { existsSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import type { TemplateInfo } from '../engine/engine.ts';
import { openEngine } from '../engine/select.ts';
import { MAX_WARMUP_TIMEOUT_MS } from '../engine/warmup.ts';
import { checkName, UserError } from '../errors.ts';
import { removeDirAtomic, storePath } from '../store.ts';
import { parseSubcommand } from './args.ts';

const USAGE = `usage:
  forkling template create <name> [--image <image>] [--warmup <python code>] [--warmup-timeout <seconds>] [--memory <MiB>] [--vcpus <n>] [--engine kvm|process|auto] [--json]
  forkling template ls [--json]
  forkling template rm <name>`;

const HELP = `${USAGE}

create  boots the image (default: default), waits for the agent, runs the warm-up code in its
        default context and freezes the result as a template that fork starts children from;
        a warm-up still running after --warmup-timeout seconds (default 600) is interrupted
        and nothing is saved (a process template runs it again, with that limit, at each start)
ls      lists the templates of every engine in the store
rm      removes a template (of every engine that has one of that name)
The template "default" (image default, no warm-up) is created on first use by fork.`;

const OPTIONS = {
  image: { type: 'string' },
  warmup: { type: 'string' },
  'warmup-timeout': { type: 'string' },
  memory: { type: 'string' },
  vcpus: { type: 'string' },
  engine: { type: 'string' },
  json: { type: 'boolean' },
  help: { type: 'boolean', short: 'h' },
} as const;

/** Parses the options, refusing those `sub` does not take. */
const parse = (sub: string, argv: string[], allowed: (keyof typeof OPTIONS)[]) => parseSubcommand(`template ${sub}`, argv, OPTIONS, allowed, USAGE);

/** A positive integer option within [min, max], or undefined when absent. */
export function intOption(name: string, v: string | undefined, min: number, max: number): number | undefined {
  if (v === undefined) return undefined;
  const n = Number(v);
  if (!/^\d+$/.test(v.trim()) || !Number.isSafeInteger(n) || n < min || n > max) {
    throw new UserError(`--${name} must be an integer from ${min} to ${max} (got ${JSON.stringify(v)})`);
  }
  return n;
}

export interface StoredTemplate extends TemplateInfo {
  /** Where its definition lives. */
  path: string;
}

/** Every template in the store, both engines, sorted by engine then name. Unreadable entries are skipped. */
export function listStoredTemplates(): StoredTemplate[] {
  const out: StoredTemplate[] = [];
  const read = (path: string) => {
    try {
      const t = JSON.parse(readFileSync(path, 'utf8')) as TemplateInfo;
      if (typeof t.name === 'string' && (t.engine === 'kvm' || t.engine === 'process')) out.push({ ...t, path });
    } catch {}
  };
  const kvmDir = storePath('templates');
  if (existsSync(kvmDir)) {
    for (const name of readdirSync(kvmDir)) if (!name.startsWith('.')) read(storePath('templates', name, 'template.json'));
  }
  const procDir = storePath('process-templates');
  if (existsSync(procDir)) {
    for (const f of readdirSync(procDir)) if (f.endsWith('.json') && !f.startsWith('.')) read(storePath('process-templates', f));
  }
  return out.sort((a, b) => a.engine.localeCompare(b.engine) || a.name.localeCompare(b.name));
}

export async function templateCommand(argv: string[]): Promise<number> {
  const [sub, ...rest] = argv;
  if (!sub || sub === '--help' || sub === '-h' || sub === 'help') {
    console.log(HELP);
    return sub ? 0 : 2;
  }
  switch (sub) {
    case 'create': {
      const { values, positionals } = parse(sub, rest, ['image', 'warmup', 'warmup-timeout', 'memory', 'vcpus', 'engine', 'json']);
      if (values.help) {
        console.log(HELP);
        return 0;
      }
      if (positionals.length !== 1) throw new UserError('template create takes exactly one template name', USAGE);
      const name = checkName('template', positionals[0]!);
      const image = checkName('image', values.image ?? 'default');
      const memoryMiB = intOption('memory', values.memory, 64, 65536);
      const vcpus = intOption('vcpus', values.vcpus, 1, 64);
      const warmupTimeoutS = intOption('warmup-timeout', values['warmup-timeout'], 1, MAX_WARMUP_TIMEOUT_MS / 1000);
      if (warmupTimeoutS !== undefined && !values.warmup) throw new UserError('--warmup-timeout limits a warm-up: give one with --warmup', USAGE);
      const engine = await openEngine(values.engine);
      try {
        const t0 = performance.now();
        const info = await engine.createTemplate({
          name,
          image,
          ...(values.warmup !== undefined ? { warmup: values.warmup } : {}),
          ...(warmupTimeoutS !== undefined ? { warmupTimeoutMs: warmupTimeoutS * 1000 } : {}),
          ...(memoryMiB !== undefined ? { memoryMiB } : {}),
          ...(vcpus !== undefined ? { vcpus } : {}),
        });
        const ms = performance.now() - t0;
        if (values.json) console.log(JSON.stringify({ ...info, createMs: Math.round(ms) }, null, 2));
        else console.log(`template ${info.name} (${info.engine}, image ${info.image}, ${info.memoryMiB} MiB, ${info.vcpus} vCPU) created in ${(ms / 1000).toFixed(1)} s`);
      } finally {
        await engine.close();
      }
      return 0;
    }
    case 'ls': {
      const { values, positionals } = parse(sub, rest, ['json']);
      if (values.help) {
        console.log(HELP);
        return 0;
      }
      if (positionals.length) throw new UserError('template ls takes no names', USAGE);
      const list = listStoredTemplates();
      if (values.json) {
        console.log(JSON.stringify(list.map(({ path: _p, ...t }) => t), null, 2));
        return 0;
      }
      if (!list.length) {
        console.log('no templates (forkling template create <name> --image <image>)');
        return 0;
      }
      const rows = [['NAME', 'ENGINE', 'IMAGE', 'MEMORY', 'VCPUS', 'CREATED', 'WARM-UP']];
      for (const t of list) {
        const w = t.warmup ? t.warmup.replace(/\s+/g, ' ') : '';
        rows.push([t.name, t.engine, t.image, `${t.memoryMiB} MiB`, String(t.vcpus), t.createdAt, w.length > 40 ? `${w.slice(0, 37)}...` : w]);
      }
      const widths = rows[0]!.map((_, i) => Math.max(...rows.map((r) => r[i]!.length)));
      for (const r of rows) console.log(r.map((c, i) => c.padEnd(widths[i]!)).join('  ').trimEnd());
      return 0;
    }
    case 'rm': {
      const { values, positionals } = parse(sub, rest, []);
      if (values.help) {
        console.log(HELP);
        return 0;
      }
      if (positionals.length !== 1) throw new UserError('template rm takes exactly one template name', USAGE);
      const name = checkName('template', positionals[0]!);
      const found = listStoredTemplates().filter((t) => t.name === name);
      // A KVM template whose template.json cannot be read (damaged) is not listed, but goes too.
      const kvmDir = storePath('templates', name);
      if (!found.some((t) => t.engine === 'kvm') && existsSync(kvmDir)) found.push({ name, engine: 'kvm', path: kvmDir } as StoredTemplate);
      if (!found.length) throw new UserError(`template ${JSON.stringify(name)} does not exist`, 'see forkling template ls');
      for (const t of found) {
        // (moved aside in one step: a process loading it meanwhile sees it whole or not at all)
        if (t.engine === 'kvm') removeDirAtomic(kvmDir);
        else rmSync(t.path, { force: true });
        console.log(`removed template ${name} (${t.engine})`);
      }
      return 0;
    }
    default:
      throw new UserError(`unknown template command ${JSON.stringify(sub)}`, USAGE);
  }
}
