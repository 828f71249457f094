// What N idle forked Linux children cost the host in all, kernel included:
// this process moves into a memory cgroup of its own (bench/memory-cgroup.ts),
// forks N children, lets the engine's idle passes run (give back, pattern,
// doze, pack) and reads the cgroup's growth per child while they are alive:
// guest pages, packed pages, host and KVM page tables, KVM's VM and vCPU
// structures, kernel stacks of the vCPU threads, everything the kernel charges
// to us. Side by side with what the engine's stats() counts for the same
// children, so the difference is what the engine does not see. Then again
// after the children are killed (what they gave back). Needs root, cgroup v2
// and KVM that boots a stock kernel: run it in the lab,
//
//   FORKLING_LAB_COMMAND='node --expose-gc --import tsx bench/kvm-idle-memory.ts' npx tsx test/lab/run.ts
//
// The VMM's C++ heap per child is read from malloc's own count (mallinfo2).
// Then the time each idle child takes to answer (its wake) against an awake one.
//
// Options: --n children (default 10), --each (fork them one call each, as
// `Sandbox.create` through the server does, not in one call), --image,
// --warmup, --no-shelve (pack without closing the KVM VM), --no-pack (doze
// without packing), --no-doze (none of them).
import { readdirSync, readFileSync, rmSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { KvmEngine } from '../host/engine/kvm/engine.ts';
import { templateDir } from '../host/engine/kvm/template.ts';
import type { KvmSandbox } from '../host/engine/kvm/vm.ts';
import { labRetry } from '../test/kvm/lab-flake.ts';
import { vmm } from '../test/native/vmm-internals.ts';
import { enterMemoryCgroup } from './memory-cgroup.ts';
import { until } from './until.ts';

const { values } = parseArgs({
  options: {
    n: { type: 'string', default: '10' },
    each: { type: 'boolean', default: false },
    image: { type: 'string', default: 'default' },
    warmup: { type: 'string', default: 'import json, random, uuid' },
    'no-shelve': { type: 'boolean', default: false },
    'no-pack': { type: 'boolean', default: false },
    'no-doze': { type: 'boolean', default: false },
  },
});
const N = Number(values.n);
if (!Number.isInteger(N) || N < 1 || N > 256) throw new Error(`--n ${values.n}: a whole number from 1 to 256`);
const dozeOn = !values['no-doze'];
const packOn = dozeOn && !values['no-pack'];
const shelveOn = packOn && !values['no-shelve'];
const IDLE_MS = 1000;

/** Settled: V8's garbage collected (with --expose-gc) and the kernel's deferred frees run. */
async function settle(): Promise<void> {
  (globalThis as { gc?: () => void }).gc?.();
  await new Promise((r) => setTimeout(r, 2000));
  (globalThis as { gc?: () => void }).gc?.();
}

/** An idle child is done with its passes: dozing (and packed) where asked, else past its first pass. */
function idleDone(sb: KvmSandbox, passesBefore: number): boolean {
  if (sb.reclaimed.failed) throw new Error(`child ${sb.id}: an idle pass failed: ${sb.reclaimed.failed}`);
  if (sb.reclaimed.patternPasses === 0 || sb.reclaimed.passes <= passesBefore) return false;
  const c = sb.nativeVm().stats().counters;
  if (!dozeOn) return true;
  return c.dozing === 1 && (!packOn || (c.packs ?? 0) > 0) && (!shelveOn || c.shelved === 1);
}

/** Kernel allocations by kind, KiB (system-wide, root): slab caches (objects x size) and vmalloc areas by caller. */
function kernelParts(): Map<string, number> {
  const out = new Map<string, number>();
  const add = (k: string, kib: number) => out.set(k, (out.get(k) ?? 0) + kib);
  try {
    for (const line of readFileSync('/proc/slabinfo', 'utf8').split('\n').slice(2)) {
      const f = line.split(/\s+/);
      if (f.length > 3) add(`slab ${f[0]}`, (Number(f[2]) * Number(f[3])) / 1024);
    }
    for (const line of readFileSync('/proc/vmallocinfo', 'utf8').split('\n')) {
      const f = line.split(/\s+/);
      if (f.length > 2) add(`vmalloc ${f[2]!.replace(/\+0x.*/, '')}`, Number(f[1]) / 1024 - 4); // (each area has a guard page)
    }
  } catch {} // (not root: left out)
  return out;
}

const threads = () => readdirSync('/proc/self/task').length;
/** V8's heap in use, KiB (after a collection with --expose-gc: settle()). */
const heapKiB = () => process.memoryUsage().heapUsed / 1024;
/** malloc's bytes in use, KiB: the VMM's C++ objects (a VM, its devices, a shelved VM's KVM state, buffers). */
const mallocKiB = () => vmm.mallocInUse() / 1024;

const cg = enterMemoryCgroup('forkling-idle-memory');
const engine = new KvmEngine({ reclaimIdleMs: IDLE_MS, doze: dozeOn, pack: packOn, shelve: shelveOn });
const name = `idle-memory-${process.pid}`;
try {
  await labRetry('template boot', () => engine.createTemplate({ name, image: values.image!, warmup: values.warmup! }));
  // A first child makes the engine build the template's pattern (a hidden child, once per
  // template) and warms up this process: costs that are not per child, left out of the baseline.
  const [first] = await labRetry('first fork', () => engine.fork(name, 1));
  await first!.agent.eval('1 + 1');
  await until('the pattern', () => !!engine.patternOf(name)?.layer || !!engine.patternOf(name)?.failed, 300_000);
  if (engine.patternOf(name)?.failed) throw new Error(`building the pattern failed: ${engine.patternOf(name)?.failed}`);
  await until('the first child idle', () => idleDone(first!, 0), 300_000);

  await settle();
  const before = { current: cg.currentKiB(), stat: cg.stat(), parts: kernelParts(), threads: threads(), heap: heapKiB(), malloc: mallocKiB() };
  const kids = values.each
    ? (await Promise.all(Array.from({ length: N }, () => labRetry('fork', () => engine.fork(name, 1))))).flat()
    : await labRetry('fork', () => engine.fork(name, N));
  for (const k of kids) if ((await k.agent.eval('1 + 1')).value !== 2) throw new Error(`child ${k.id}: wrong answer`);
  const passes = new Map(kids.map((k) => [k, k.reclaimed.passes]));
  await until(`${N} children idle`, () => kids.every((k) => idleDone(k, passes.get(k)!)), 600_000);
  await settle();
  const idle = { current: cg.currentKiB(), stat: cg.stat(), parts: kernelParts(), threads: threads(), heap: heapKiB(), malloc: mallocKiB() };
  const stats = await Promise.all(kids.map((k) => k.stats()));
  const counted = stats.reduce((a, s) => a + s.privateKiB, 0) / N;
  const dozing = kids.filter((k) => k.nativeVm().stats().counters.dozing === 1).length;
  const shelved = kids.filter((k) => k.nativeVm().stats().counters.shelved === 1).length;
  // What that costs in time: each idle child's first answer (its vsock loop started again, its
  // pages written back, its KVM VM made again, the guest woken), one child at a time; then a
  // second answer from the same child, awake.
  const wakes: { firstMs: number; againMs: number; unpackMs: number; unshelveMs: number }[] = [];
  for (const k of kids) {
    const t0 = performance.now();
    if ((await k.agent.eval('1 + 1')).value !== 2) throw new Error(`child ${k.id}: wrong answer after its wake`);
    const t1 = performance.now();
    await k.agent.eval('1 + 1');
    const t2 = performance.now();
    const c = k.nativeVm().stats().counters;
    wakes.push({ firstMs: t1 - t0, againMs: t2 - t1, unpackMs: (c.last_unpack_us ?? 0) / 1000, unshelveMs: (c.last_unshelve_us ?? 0) / 1000 });
  }
  await Promise.all(kids.map((k) => k.kill()));
  await settle();
  const killed = { current: cg.currentKiB(), stat: cg.stat() };

  const per = (a: number, b: number) => (b - a) / N;
  const fields = Object.keys(idle.stat).filter((k) => Math.abs(per(before.stat[k] ?? 0, idle.stat[k]!)) >= 1 || Math.abs(per(killed.stat[k] ?? 0, idle.stat[k]!)) >= 1);
  const fileIdle = per(before.stat.file ?? 0, idle.stat.file ?? 0);
  const allIdle = per(before.current, idle.current);
  console.log(
    `\nwhat ${N} idle forked children cost the host, per child (${values.each ? 'forked one call each' : 'forked in one call'}, image ${values.image}, warm-up ${JSON.stringify(values.warmup)}, idle passes after ${IDLE_MS} ms, pattern on, doze ${dozeOn ? 'on' : 'off'}, pack ${packOn ? 'on' : 'off'}, shelve ${shelveOn ? 'on' : 'off'}; ${dozing} of ${N} dozing, ${shelved} shelved)`,
  );
  console.log(`  memory cgroup of this process, KiB per child (memory.current is exact; memory.stat's fields, which the kernel sums lazily, only roughly):`);
  console.log(`    ${'field'.padEnd(22)} ${'idle children'.padStart(14)} ${'freed by kill'.padStart(14)}`);
  console.log(`    ${'memory.current'.padEnd(22)} ${allIdle.toFixed(1).padStart(14)} ${per(killed.current, idle.current).toFixed(1).padStart(14)}`);
  for (const k of fields) console.log(`    ${k.padEnd(22)} ${per(before.stat[k] ?? 0, idle.stat[k]!).toFixed(1).padStart(14)} ${per(killed.stat[k] ?? 0, idle.stat[k]!).toFixed(1).padStart(14)}`);
  // memory.current moves with this process's own heap too (V8, malloc, huge pages), as it forks
  // and again as it collects the killed children's objects: only roughly per child. The kernel's
  // part (memory.stat kernel) has no such noise; the engine counts the child's user memory.
  const kernelIdle = per(before.stat.kernel ?? 0, idle.stat.kernel ?? 0);
  const kernelFreed = per(killed.stat.kernel ?? 0, idle.stat.kernel ?? 0);
  const heap = per(before.heap, idle.heap);
  const malloc = per(before.malloc, idle.malloc);
  console.log(`  the engine's figure (stats().privateKiB, mean: guest pages private and packed, vCPU stacks, kvm_run, page tables for its RAM): ${counted.toFixed(1)} KiB`);
  console.log(`  the kernel's memory for it (memory.stat kernel: KVM's VM and vCPU structures, thread stacks and structures, mappings): ${kernelIdle.toFixed(1)} KiB while alive, ${kernelFreed.toFixed(1)} KiB given back when killed`);
  console.log(`  this process's V8 heap per child (its JS objects, after a collection): ${heap.toFixed(1)} KiB`);
  console.log(`  this process's malloc heap per child (the VMM's C++ objects: the VM, its devices and buffers, a shelved VM's KVM state; in use, not what the arenas hold): ${malloc.toFixed(1)} KiB`);
  console.log(`  the child in all: ${(counted + Math.max(kernelIdle, kernelFreed) + Math.max(heap, 0) + Math.max(malloc, 0)).toFixed(1)} KiB (the four above, the kernel's larger figure)`);
  console.log(`  (cross-check, with this process's own heap noise: memory.current grew ${(allIdle - fileIdle).toFixed(1)} KiB per child while forked, file pages left out, and ${per(killed.current, idle.current).toFixed(1)} KiB came back when killed)`);
  console.log(`  (where: ${process.env.FORKLING_IN_LAB ? 'the QEMU lab: page counts hold, times mean nothing' : 'this host'}; this process's heap ${(globalThis as { gc?: unknown }).gc ? 'collected before each read' : 'not collected: run node with --expose-gc'})`);
  const grown = [...idle.parts].map(([k, v]) => [k, per(before.parts.get(k) ?? 0, v)] as const).filter(([, v]) => v >= 2).sort((a, b) => b[1] - a[1]);
  if (grown.length) {
    console.log(`  the kernel's allocations that grew (system-wide /proc/slabinfo and /proc/vmallocinfo), KiB per child:`);
    for (const [k, v] of grown.slice(0, 16)) console.log(`    ${k.padEnd(40)} ${v.toFixed(1).padStart(8)}`);
  }
  console.log(`  threads of this process per child: ${per(before.threads, idle.threads).toFixed(1)}`);
  const med = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
  const ms = (f: (w: (typeof wakes)[number]) => number) => `median ${med(wakes.map(f)).toFixed(1)} ms, max ${Math.max(...wakes.map(f)).toFixed(1)}`;
  console.log(`  an idle child's first answer (eval 1 + 1, one child at a time): ${ms((w) => w.firstMs)}; of it, its pages written back and its KVM VM made again: ${ms((w) => w.unpackMs)} (the KVM VM alone: ${ms((w) => w.unshelveMs)})`);
  console.log(`  the same child's next answer, awake: ${ms((w) => w.againMs)}${process.env.FORKLING_IN_LAB ? ' (lab: emulated, times mean nothing)' : ''}`);
  await first!.kill();
} finally {
  await engine.close();
  rmSync(templateDir(name), { recursive: true, force: true });
  cg.leave();
}
process.exit(0);
