// Where a forked Linux child's private memory goes: the guest pages it owns
// (pagemap of its RAM mapping) at each step after the fork, with the engine's
// idle reclaim passes and the template's pattern as a server runs them, then what the
// guest kernel says those pages are now (/proc/kpageflags and /proc/iomem,
// read inside the child as root). Needs KVM that boots a stock kernel: run
// it in the lab,
//
//   FORKLING_LAB_COMMAND='node --import tsx bench/kvm-child-memory.ts' npx tsx test/lab/run.ts
//
// Options: --image (default), --warmup (Python run in the template),
// --no-init-on-free (the template's kernel without init_on_free=1: freed
// pages are then not zeroed, so a child does not copy pages just to free them),
// --no-reclaim (the engine's idle passes off: no page that holds the
// template's bytes again is given back), --no-pattern (the passes do not map
// what children hold alike from the template's pattern: pattern.ts),
// --kernel-args '<extra guest kernel arguments for the template>',
// --trace-idle (which kernel variables an idle child writes: the bytes of the
// guest kernel's data and bss are copied after the passes and compared 8 s
// later, and each changed byte named by the symbol at or below it, so a
// variable /proc/kallsyms does not list takes the name of the one before it;
// a third child, forked with the others, tells where the kernel and its
// symbols are; and what the pages made private again in those 8 s hold).
import { createHash } from 'node:crypto';
import { readFileSync, rmSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { KvmEngine } from '../host/engine/kvm/engine.ts';
import { templateDir } from '../host/engine/kvm/template.ts';
import type { KvmSandbox } from '../host/engine/kvm/vm.ts';
import { labRetry } from '../test/kvm/lab-flake.ts';

const { values } = parseArgs({
  options: {
    image: { type: 'string', default: 'default' },
    warmup: { type: 'string', default: 'import json, random, uuid' },
    'no-init-on-free': { type: 'boolean', default: false },
    'no-reclaim': { type: 'boolean', default: false },
    'no-pattern': { type: 'boolean', default: false },
    'kernel-args': { type: 'string', default: '' },
    'trace-idle': { type: 'boolean', default: false },
  },
});

/** Runs inside the child: sorts the given frames by what the kernel uses them for now. */
const CLASSIFY = `
import json, struct, sys
frames = json.loads(sys.stdin.read())
spans = []
for line in open('/proc/iomem'):
    rng, _, name = line.strip().partition(' : ')
    if name in ('Kernel code', 'Kernel rodata', 'Kernel data', 'Kernel bss'):
        a, b = (int(x, 16) for x in rng.split('-'))
        spans.append((a >> 12, b >> 12, name))
BITS = {7: 'slab', 10: 'free (buddy)', 26: 'page table'}
out = {}
with open('/proc/kpageflags', 'rb') as f:
    for pfn in frames:
        kind = next((n for a, b, n in spans if a <= pfn <= b), None)
        if kind is None:
            f.seek(pfn * 8)
            flags = struct.unpack('<Q', f.read(8))[0]
            kind = next((n for bit, n in BITS.items() if flags >> bit & 1), None)
            if kind is None:
                if flags >> 12 & 1:
                    kind = 'anonymous (process memory)'
                elif flags >> 5 & 1:
                    kind = 'page cache / tmpfs'
                elif flags >> 15 & 1 or flags >> 16 & 1:
                    kind = 'compound (other kernel)'
                else:
                    kind = 'other kernel (stacks, per-cpu, vmalloc, ...)'
        out[kind] = out.get(kind, 0) + 1
print(json.dumps(out))
`;

/** Runs inside a child: the guest kernel's data and bss (physical) and its symbols' addresses in them. */
const KERNEL_LAYOUT = `
import json
spans = {}
for line in open('/proc/iomem'):
    rng, _, name = line.strip().partition(' : ')
    if name in ('Kernel code', 'Kernel data', 'Kernel bss'):
        a, b = (int(x, 16) for x in rng.split('-'))
        spans[name] = [a, b + 1]
syms = []
text = None
for line in open('/proc/kallsyms'):
    addr, kind, name = line.split()[:3]
    if name == '_text':
        text = int(addr, 16)
    if kind in 'dDbB':
        syms.append([int(addr, 16), name])
print(json.dumps({'spans': spans, 'text': text, 'syms': sorted(syms)}))
`;
interface KernelLayout {
  spans: Record<string, [number, number]>;
  text: number;
  syms: [number, string][];
}

/** The kernel variables (data and bss) whose bytes differ between `before` (copied at gpa `base`) and now. */
function changedSymbols(vm: ReturnType<KvmSandbox['nativeVm']>, layout: KernelLayout, base: number, before: Buffer): Map<string, number> {
  const now = vm.guestBytes(base, before.length);
  // Physical to virtual: the kernel image is mapped as one block from _text ("Kernel code" starts there).
  const delta = layout.text - layout.spans['Kernel code']![0];
  const out = new Map<string, number>();
  let j = 0;
  const [d0, d1] = layout.spans['Kernel data']!;
  const [b0, b1] = layout.spans['Kernel bss']!;
  for (let i = 0; i < before.length; i++) {
    if (before[i] === now[i]) continue;
    // (between data and bss lie the init sections the kernel freed: pages it reuses for anything)
    const pa = base + i;
    if (!((pa >= d0 && pa < d1) || (pa >= b0 && pa < b1))) continue;
    const va = pa + delta;
    while (j + 1 < layout.syms.length && layout.syms[j + 1]![0] <= va) j++;
    const name = layout.syms[j] && layout.syms[j]![0] <= va ? layout.syms[j]![1] : '?';
    out.set(name, (out.get(name) ?? 0) + 1);
  }
  return out;
}

function frames(sb: KvmSandbox): number[] {
  return [...(sb.nativeVm().memoryUsage({ frames: true }).privateFrames ?? [])];
}

/** Polls `ok` (the engine's own state) every 100 ms, up to `ms`. */
async function until(what: string, ok: () => boolean, ms: number): Promise<void> {
  const deadline = Date.now() + ms;
  while (!ok()) {
    if (Date.now() > deadline) throw new Error(`${what}: not within ${ms / 1000} s`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

const reclaimOn = !values['no-reclaim'];
const patternOn = reclaimOn && !values['no-pattern'];
const IDLE_MS = 1000;
const engine = new KvmEngine({ reclaimIdleMs: reclaimOn ? IDLE_MS : 0, pattern: patternOn });
const name = `child-memory-${process.pid}`;
try {
  await labRetry('template boot', () =>
    engine.createTemplate({
      name,
      image: values.image!,
      warmup: values.warmup!,
      boot: { initOnFree: !values['no-init-on-free'], kernelArgs: values['kernel-args']!.split(' ').filter(Boolean) },
    }),
  );
  // Two siblings with the same history: the second is only read, to see which of the first's
  // private pages every child writes alike.
  const [child, sibling, scout] = await labRetry('fork', () => engine.fork(name, values['trace-idle'] ? 3 : 2));
  let layout: KernelLayout | null = null;
  if (scout) {
    const r = await scout.agent.exec(['python3', '-c', KERNEL_LAYOUT]);
    if (r.exitCode !== 0) throw new Error(`reading the kernel's layout failed: ${new TextDecoder().decode(r.stderr)}`);
    layout = JSON.parse(new TextDecoder().decode(r.stdout)) as KernelLayout;
    await scout.kill();
  }
  const sb = child!;
  const vm = sb.nativeVm();
  const rows: { what: string; priv: number; pattern: number; passes: number }[] = [];
  const row = (what: string) => {
    const m = vm.memoryUsage();
    rows.push({ what, priv: m.guestPrivateBytes / 1024, pattern: m.guestPatternBytes / 1024, passes: sb.reclaimed.passes });
  };
  row('restore answered (ready)');
  for (const k of [sb, sibling!]) if ((await k.agent.eval('1 + 1')).value !== 2) throw new Error('first eval: wrong answer');
  row('first eval answered');
  // (passes after the eval: with --trace-idle the scout's request may let some run before it)
  const passesBefore = sb.reclaimed.passes;
  // The engine's passes: the first after 1 s idle; the pattern is built meanwhile by a hidden
  // child (pattern.ts), and an idle child runs one more pass once it is there.
  if (patternOn) {
    await until('the pattern', () => !!engine.patternOf(name)?.layer || !!engine.patternOf(name)?.failed, 300_000);
    const failed = engine.patternOf(name)?.failed;
    if (failed) throw new Error(`building the pattern failed: ${failed}`);
    await until('a pass with the pattern', () => (sb.reclaimed.patternPages > 0 && sb.reclaimed.passes > passesBefore) || !!sb.reclaimed.failed, 120_000);
  } else if (reclaimOn) {
    await until('the first idle pass', () => sb.reclaimed.passes > passesBefore || !!sb.reclaimed.failed, 120_000);
  }
  if (sb.reclaimed.failed) throw new Error(`a reclaim pass failed: ${sb.reclaimed.failed}`);
  row('after the idle passes');
  const passed = new Set(frames(sb));
  const dataBase = layout?.spans['Kernel data']?.[0] ?? 0;
  const dataEnd = layout?.spans['Kernel bss']?.[1] ?? 0;
  const dataBefore = layout ? vm.guestBytes(dataBase, dataEnd - dataBase) : null;
  await new Promise((r) => setTimeout(r, 8000));
  const idle = frames(sb);
  const changed = layout && dataBefore ? changedSymbols(vm, layout, dataBase, dataBefore) : null;
  const other = sibling!.nativeVm();
  const alike = idle.filter((f) => vm.guestBytes(f * 4096, 4096).equals(other.guestBytes(f * 4096, 4096))).length;
  row('idle 8 s later');
  if (reclaimOn) {
    await sb.reclaim();
    row('after one more pass');
  }
  // The child still works after its pages were given back or mapped from the pattern.
  const check = await sb.agent.eval('import hashlib; hashlib.sha256(bytes(range(256)) * 4096).hexdigest()');
  const want = createHash('sha256').update(Buffer.concat(Array.from({ length: 4096 }, () => Buffer.from(Array.from({ length: 256 }, (_, i) => i))))).digest('hex');
  if (check.value !== want) throw new Error(`eval after reclaim: wrong answer ${String(check.value)}`);
  row('another eval answered');
  const layer = engine.patternOf(name)?.layer;
  console.log(
    `\nprivate guest memory of one forked child (image ${values.image}, warm-up ${JSON.stringify(values.warmup)}, init_on_free=${values['no-init-on-free'] ? 0 : 1}, kernel args ${JSON.stringify(values['kernel-args'])}, idle passes ${reclaimOn ? `after ${IDLE_MS} ms` : 'off'}, pattern ${patternOn ? 'on' : 'off'})`,
  );
  console.log(`  ${'step'.padEnd(28)} ${'private'.padStart(10)} ${'from the pattern'.padStart(17)} ${'passes'.padStart(7)}`);
  for (const r of rows) console.log(`  ${r.what.padEnd(28)} ${`${r.priv} KiB`.padStart(10)} ${`${r.pattern} KiB`.padStart(17)} ${String(r.passes).padStart(7)}`);
  if (layer) console.log(`  the pattern file: ${layer.pageCount * 4} KiB in ${layer.runCount} runs, one copy for every child of the template`);
  // Each run mapped from the pattern splits the RAM mapping: what that costs the host (VMAs).
  console.log(`  mappings of this process (2 children): ${readFileSync('/proc/self/maps', 'utf8').trim().split('\n').length}`);
  // What an idle child holds: classified now.
  const r = await sb.agent.exec(['python3', '-c', CLASSIFY], { stdin: new TextEncoder().encode(JSON.stringify(idle)) });
  if (r.exitCode !== 0) throw new Error(`classifying inside the guest failed: ${new TextDecoder().decode(r.stderr)}`);
  const kinds = JSON.parse(new TextDecoder().decode(r.stdout)) as Record<string, number>;
  console.log(`  of the pages private at "idle 8 s later", ${alike * 4} KiB hold what a sibling with the same history holds at the same address, ${(idle.length - alike) * 4} KiB differ`);
  console.log('  what the pages private at "idle 8 s later" hold (guest /proc/kpageflags, /proc/iomem):');
  for (const [k, n] of Object.entries(kinds).sort((a, b) => b[1] - a[1])) console.log(`    ${k.padEnd(46)} ${String(n * 4).padStart(6)} KiB`);
  if (changed) {
    // The pages an idle child made private again within 8 s of its passes, and the kernel variables it wrote.
    const fresh = idle.filter((f) => !passed.has(f));
    const r2 = await sb.agent.exec(['python3', '-c', CLASSIFY], { stdin: new TextEncoder().encode(JSON.stringify(fresh)) });
    const freshKinds = r2.exitCode === 0 ? (JSON.parse(new TextDecoder().decode(r2.stdout)) as Record<string, number>) : {};
    console.log(`  private again within 8 s of the passes: ${fresh.length * 4} KiB (${idle.length * 4} KiB private then, ${passed.size * 4} KiB after the passes)`);
    for (const [k, n] of Object.entries(freshKinds).sort((a, b) => b[1] - a[1])) console.log(`    ${k.padEnd(46)} ${String(n * 4).padStart(6)} KiB`);
    console.log(`  kernel variables (data, bss) whose bytes changed in those 8 s, bytes changed:`);
    for (const [k, n] of [...changed].sort((a, b) => b[1] - a[1]).slice(0, 40)) console.log(`    ${k.padEnd(46)} ${String(n).padStart(6)}`);
  }
  await Promise.all([sb.kill(), sibling!.kill()]);
} finally {
  await engine.close();
  rmSync(templateDir(name), { recursive: true, force: true });
}
process.exit(0);
