// Fork and BRANCH figures of the KVM engine, side by side with a cold boot of
// the same guest, in one run on one template.
//
//   npx tsx bench/kvm-fork.ts [--guest tiny|linux] [--image default] [--print-shift 10] [--sizes 1,10,100] [--no-pattern] [--cgroup]
//
// In the lab a Linux fork of 100 rarely survives the lab's early triple fault
// (it strikes a few percent of the children there; see test/kvm/lab-flake.ts):
// use --sizes 1,10,30, or a lab without nested paging
// (FORKLING_LAB_CPU=EPYC,+svm,-npt: bench/README.md).
//
// --guest tiny (default): the VMM alone, with test/kvm/tiny-guest.ts (an ELF
//   that counts in guest memory and prints the count): "ready" is the first
//   counter line after the restore, so it includes up to one print period of
//   guest time (2^print-shift increments). Runs wherever /dev/kvm works.
// --guest linux: the whole engine with a Linux image and its agent: ready is
//   the agent's `restore` answer, plus the first eval answer.
//
// Memory per child is measured while the children are alive: the guest pages
// each owns alone (pagemap of its RAM mapping), and what the host holds per
// child beyond them (hostPerChild: this process's other anonymous memory,
// page tables, KVM's nested page tables, slab and vmalloc; system-wide, so
// other activity adds noise), next to the engine's own per-VM host figure.
// --cgroup (as root, cgroup v2; mounted if it is not, as in the lab): this
// process first moves into a memory cgroup of its own, and each fork adds
// that cgroup's growth per child (memory.current: all the kernel charges to
// it, guest pages and KVM's structures alike, without other processes' noise).
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { quantile } from '../host/cli/fork.ts';
import type { NativePreparedVm, NativeSnapshot, NativeVm } from '../host/engine/kvm/native-vm.ts';
import { nativeVmClass } from '../host/engine/kvm/native-vm.ts';
import { snapshotNative } from '../host/engine/kvm/snapshot-native.ts';
import { labRetry } from '../test/kvm/lab-flake.ts';
import { enterMemoryCgroup, type MemoryCgroup } from './memory-cgroup.ts';
import { counterOf, DIRTY_MEMORY_MIB, writeTinyGuest } from '../test/kvm/tiny-guest.ts';

const { values } = parseArgs({
  options: {
    guest: { type: 'string', default: 'tiny' },
    image: { type: 'string', default: 'default' },
    'print-shift': { type: 'string', default: '10' },
    sizes: { type: 'string', default: '1,10,100' },
    'no-pattern': { type: 'boolean', default: false },
    cgroup: { type: 'boolean', default: false },
  },
});
const SIZES = values.sizes!.split(',').map(Number);
if (SIZES.some((n) => !Number.isInteger(n) || n < 1 || n > 1024)) throw new Error(`--sizes ${values.sizes}: whole numbers from 1 to 1024, comma-separated`);
const f = (x: number, d = 1) => x.toFixed(d);

function kib(field: string, text: string): number {
  const m = new RegExp(`^${field}:\\s+(\\d+) kB`, 'm').exec(text);
  return m ? Number(m[1]) : 0;
}
/** --cgroup: the memory cgroup this process moved into (left at exit). */
let cgroup: MemoryCgroup | null = null;

/** This process's anonymous memory, and the kernel's page tables, guest page tables, slab and vmalloc (system-wide); its cgroup's memory with --cgroup. */
function hostMemory(): Record<'anon' | 'pageTables' | 'secPageTables' | 'slab' | 'vmalloc' | 'cgroup', number> {
  const r = readFileSync('/proc/self/smaps_rollup', 'utf8');
  const m = readFileSync('/proc/meminfo', 'utf8');
  return { anon: kib('Anonymous', r), pageTables: kib('PageTables', m), secPageTables: kib('SecPageTables', m), slab: kib('Slab', m), vmalloc: kib('VmallocUsed', m), cgroup: cgroup?.currentKiB() ?? Number.NaN };
}
/**
 * What the host holds per child beyond the child's own guest pages (`guestKiB`
 * in all): this process's other anonymous memory (device buffers, thread
 * stacks, heap), its page tables for guest RAM, KVM's nested page tables
 * (SecPageTables), slab and vmalloc (KVM's VM and vCPU structures, kernel
 * stacks). System-wide figures: other activity adds noise.
 */
function hostPerChild(before: ReturnType<typeof hostMemory>, after: ReturnType<typeof hostMemory>, n: number, guestKiB: number): { kib: number; note: string } {
  const d = (k: keyof typeof before) => (after[k] - before[k]) / n;
  const parts = { anon: d('anon') - guestKiB / n, pageTables: d('pageTables'), secPageTables: d('secPageTables'), slab: d('slab'), vmalloc: d('vmalloc') };
  const grew = cgroup ? `; the memory cgroup grew ${f(d('cgroup'))} KiB per child (guest pages included)` : '';
  return {
    kib: Object.values(parts).reduce((a, b) => a + b, 0),
    note: `host per child: other anon ${f(parts.anon)}, page tables ${f(parts.pageTables)}, SecPageTables ${f(parts.secPageTables)}, slab ${f(parts.slab)}, vmalloc ${f(parts.vmalloc)} KiB${grew}`,
  };
}

interface Row {
  what: string;
  readyMs: number;
  p50: number;
  p99: number;
  createMs: number;
  privKiB: number;
  hostKiB: number;
  note: string;
}
const rows: Row[] = [];
/** What kind of KVM the figures come from: they mean very different things. */
function whereMeasured(): string {
  if (process.env.FORKLING_IN_LAB) return 'inside the QEMU lab (TCG with emulated SVM): times are meaningless, page counts hold';
  if (existsSync('/sys/module/kvm_pvm')) return "this host's /dev/kvm is kvm_pvm (software nested virtualisation): times are not those of hardware KVM";
  return 'hardware KVM (kvm_intel / kvm_amd)';
}

function print(header: string): void {
  console.log(`\n${header}`);
  console.log(`  (${whereMeasured()})`);
  const head = ['case', 'all ready ms', 'child p50 ms', 'child p99 ms', 'create+restore ms/child (wall/N)', 'guest private KiB/child', 'host KiB/child', 'note'];
  const table = [head, ...rows.map((r) => [r.what, f(r.readyMs), f(r.p50, 2), f(r.p99, 2), f(r.createMs, 2), f(r.privKiB), f(r.hostKiB), r.note])];
  const w = head.map((_, i) => Math.max(...table.map((t) => t[i]!.length)));
  for (const t of table) console.log(`  ${t.map((c, i) => c.padEnd(w[i]!)).join('  ')}`);
}

// ---------------------------------------------------------------- tiny guest

const Vm = nativeVmClass();
let sockN = 0;

class TinyVm {
  readonly vm: NativeVm;
  readonly t0: number;
  createMs: number;
  readyAt = -1;
  lines: string[] = [];
  private waiters: (() => void)[] = [];
  constructor(
    readonly dir: string,
    opts: { kernel?: string; memoryMiB?: number; restore?: NativeSnapshot; pauseOnReady?: boolean; prepared?: NativePreparedVm; vsockPath?: string; t0?: number },
  ) {
    this.t0 = opts.t0 ?? performance.now();
    this.vm = new Vm(
      {
        kernel: opts.kernel ?? '',
        cmdline: '',
        memoryMiB: opts.memoryMiB ?? 64,
        vcpus: 1,
        vsockPath: opts.vsockPath ?? join(dir, `b${sockN++}.sock`),
        ...(opts.restore ? { restore: opts.restore } : {}),
        ...(opts.prepared ? { prepared: opts.prepared } : {}),
      },
      (evs) => {
        for (const e of evs) {
          if (e.type === 'console') {
            for (const l of e.lines) {
              if (this.readyAt < 0 && counterOf(l) !== null) {
                this.readyAt = performance.now();
                // An idle sandbox does not spin: stop this one (the tiny guest never
                // halts) so it does not take the CPU from the children still starting.
                if (opts.pauseOnReady) this.vm.pause();
              }
              if (this.lines.length < 64) this.lines.push(l);
            }
          } else if (e.type === 'stopped') throw new Error(`a VM stopped: ${e.reason}: ${e.message}`);
        }
        for (const w of this.waiters.splice(0)) w();
      },
    );
    this.createMs = performance.now() - this.t0;
    this.vm.start();
  }
  async until(pred: () => boolean): Promise<void> {
    const deadline = performance.now() + 600_000;
    while (!pred()) {
      if (performance.now() > deadline) throw new Error('the guest did not get there in time');
      await new Promise<void>((r) => {
        this.waiters.push(r);
        setTimeout(r, 200).unref();
      });
    }
  }
  ready(): Promise<void> {
    return this.until(() => this.readyAt >= 0);
  }
}

/** n children as the engine makes them: created and restored on C++ worker threads, then wrapped and started. */
async function startTiny(dir: string, snap: NativeSnapshot, n: number, memoryMiB: number): Promise<TinyVm[]> {
  const t0 = performance.now();
  const paths = Array.from({ length: n }, () => join(dir, `b${sockN++}.sock`));
  const prepared = await snapshotNative().prepareVms(snap, paths.map((vsockPath) => ({ vsockPath })));
  const made = performance.now() - t0;
  const kids = prepared.map((p, i) => new TinyVm(dir, { prepared: p, vsockPath: paths[i]!, memoryMiB, pauseOnReady: true, t0 }));
  for (const k of kids) k.createMs = made / n; // wall time of the parallel creation, per child
  return kids;
}

async function tiny(): Promise<void> {
  const shift = Number(values['print-shift']);
  const dir = mkdtempSync(join(tmpdir(), 'forkling-bench-'));
  const s = snapshotNative();
  try {
    const counter = writeTinyGuest(join(dir, 'counter.elf'), { printShift: shift });
    // Cold boot of the same guest: new VM, kernel loaded, first counter line.
    const cold = new TinyVm(dir, { kernel: counter });
    await cold.ready();
    const coldMs = cold.readyAt - cold.t0;
    rows.push({ what: 'cold boot', readyMs: coldMs, p50: coldMs, p99: coldMs, createMs: cold.createMs, privKiB: cold.vm.memoryUsage().guestMemfdBytes / 1024, hostKiB: NaN, note: 'memfd pages' });
    cold.vm.pause();
    const tpl = join(dir, 'tpl');
    mkdirSync(tpl);
    cold.vm.saveTemplate(tpl);
    cold.vm.kill();
    const spec = s.loadTemplate(tpl, 'template bench');

    for (const n of SIZES) {
      const before = hostMemory();
      const t0 = performance.now();
      const kids = await startTiny(dir, spec, n, 64);
      await Promise.all(kids.map((k) => k.ready()));
      const all = Math.max(...kids.map((k) => k.readyAt)) - t0;
      const after = hostMemory();
      const priv = kids.map((k) => k.vm.memoryUsage().guestPrivateBytes / 1024);
      const ready = kids.map((k) => k.readyAt - k.t0);
      const host = hostPerChild(before, after, n, priv.reduce((a, b) => a + b, 0));
      rows.push({
        what: `fork N=${n}`,
        readyMs: all,
        p50: quantile(ready, 0.5),
        p99: quantile(ready, 0.99),
        createMs: kids.reduce((a, k) => a + k.createMs, 0) / n,
        privKiB: priv.reduce((a, b) => a + b, 0) / n,
        hostKiB: host.kib,
        note: host.note,
      });
      for (const k of kids) k.vm.kill();
    }

    // BRANCH of a sandbox that dirtied 50 MiB after its restore.
    const dirtyAt = 4 << shift; // after 4 counter lines
    const dirty = writeTinyGuest(join(dir, 'dirty.elf'), { printShift: shift, dirtyAt });
    const boot = new TinyVm(dir, { kernel: dirty, memoryMiB: DIRTY_MEMORY_MIB });
    await boot.ready();
    boot.vm.pause();
    const dtpl = join(dir, 'dtpl');
    mkdirSync(dtpl);
    boot.vm.saveTemplate(dtpl);
    boot.vm.kill();
    const dspec = s.loadTemplate(dtpl, 'template bench-dirty');
    for (const n of [1, 10]) {
      const src = new TinyVm(dir, { restore: dspec, memoryMiB: DIRTY_MEMORY_MIB });
      await src.until(() => src.lines.includes('F'));
      const t0 = performance.now();
      const b = src.vm.branch('/dev/shm');
      const kids = await startTiny(dir, b.snapshot, n, DIRTY_MEMORY_MIB);
      await Promise.all(kids.map((k) => k.ready()));
      const all = Math.max(...kids.map((k) => k.readyAt)) - t0;
      const ready = kids.map((k) => k.readyAt - k.t0);
      const priv = kids.map((k) => k.vm.memoryUsage().guestPrivateBytes / 1024);
      const p = b.pauseParts;
      rows.push({
        what: `branch N=${n}`,
        readyMs: all,
        p50: quantile(ready, 0.5),
        p99: quantile(ready, 0.99),
        createMs: kids.reduce((a, k) => a + k.createMs, 0) / n,
        privKiB: priv.reduce((a, x) => a + x, 0) / n,
        hostKiB: NaN,
        note: `pre-copy ${f(b.precopyUs / 1000, 2)} ms (${b.precopyPages} pages) while running, then source paused ${f(b.pauseUs / 1000, 2)} ms (${b.recopiedPages} pages again; stop ${f(p.stopUs / 1000, 2)}, save ${f(p.saveUs / 1000, 2)}, scan ${f(p.scanUs / 1000, 2)}, copy ${f(p.copyUs / 1000, 2)}) for ${b.privatePages} written pages (${f((b.privatePages * 4) / 1024)} MiB) in ${b.runs} runs`,
      });
      for (const k of kids) k.vm.kill();
      src.vm.kill();
    }
    print(`forkling KVM fork/branch, tiny guest (ready = first counter line, printed every 2^${shift} increments)`);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

// ---------------------------------------------------------------- linux guest

async function linux(): Promise<void> {
  const { KvmEngine } = await import('../host/engine/kvm/engine.ts');
  // In the emulated lab 100 children take minutes to answer, not milliseconds.
  // Idle reclaim passes as outside the lab (the lab's default is off).
  const { RECLAIM_IDLE_MS } = await import('../host/engine/kvm/sleep-after.ts');
  const engine = new KvmEngine({
    reclaimIdleMs: RECLAIM_IDLE_MS,
    pattern: !values['no-pattern'],
    ...(process.env.FORKLING_IN_LAB ? { childReadyTimeoutMs: 900_000 } : {}),
  });
  const name = `bench-${process.pid}`;
  try {
    const t0 = performance.now();
    const cold = await labRetry('cold boot', () => engine.boot({ image: values.image! }));
    await cold.agent.eval('1');
    const coldMs = performance.now() - t0;
    rows.push({ what: 'cold boot', readyMs: coldMs, p50: coldMs, p99: coldMs, createMs: NaN, privKiB: (await cold.stats()).counters.guestPrivateKiB!, hostKiB: NaN, note: 'boot to first eval answer' });
    await cold.kill();
    await labRetry('template boot', () => engine.createTemplate({ name, image: values.image!, warmup: 'import json, random, uuid' }));
    for (const n of SIZES) {
      const before = hostMemory();
      const t = performance.now();
      // In the lab one early triple fault among n children fails the fork: more tries for large n.
      const kids = await labRetry(`fork of ${n}`, () => engine.fork(name, n), console.error, n >= 50 ? 4 : 2);
      await Promise.all(kids.map((k) => k.agent.eval('1')));
      const all = performance.now() - t;
      const after = hostMemory();
      const ready = kids.map((k) => k.timings.readyAt - k.timings.startedAt);
      const atEval = await Promise.all(kids.map((k) => k.stats()));
      const priv = atEval.map((s) => s.counters.guestPrivateKiB!);
      const engineHost = atEval.map((s) => s.counters.hostKiB!);
      const host = hostPerChild(before, after, n, priv.reduce((a, b) => a + b, 0));
      // The same children idle a while later (the guest kernel's timers, the
      // agent's threads), after the engine's own reclaim passes (at
      // RECLAIM_IDLE_MS), the last with the template's pattern (built once,
      // after the first fork, by a hidden child: host/engine/kvm/pattern.ts).
      const idleDeadline = performance.now() + 600_000;
      const settled = (k: (typeof kids)[number]) =>
        !!k.reclaimed.failed || (k.reclaimed.passes > 0 && (values['no-pattern'] || k.reclaimed.patternPasses > 0 || !!engine.patternOf(name)?.failed));
      while (!kids.every(settled) && performance.now() < idleDeadline) await new Promise((r) => setTimeout(r, 200));
      await new Promise((r) => setTimeout(r, 1000));
      const atIdle = await Promise.all(kids.map((k) => k.stats()));
      const idle = atIdle.map((s) => s.counters.guestPrivateKiB!);
      const fromPattern = atIdle.map((s) => s.counters.patternKiB!);
      const patternNote = engine.patternOf(name)?.layer
        ? `, ${f(fromPattern.reduce((a, b) => a + b, 0) / n)} KiB mapped from the pattern (one ${f(engine.patternOf(name)!.layer!.pageCount * 4)} KiB file)`
        : `, no pattern (${values['no-pattern'] ? '--no-pattern' : (engine.patternOf(name)?.failed ?? 'not built')})`;
      rows.push({
        what: `fork N=${n}`,
        readyMs: all,
        p50: quantile(ready, 0.5),
        p99: quantile(ready, 0.99),
        createMs: NaN,
        privKiB: priv.reduce((a, b) => a + b, 0) / n,
        hostKiB: host.kib,
        note: `ready = agent restore answered; all = first eval answered; private when idle, 1 s after the engine's reclaim passes: ${f(idle.reduce((a, b) => a + b, 0) / n)} KiB${patternNote}; ${host.note}; the engine's own per-VM host figure ${f(engineHost.reduce((a, b) => a + b, 0) / n)} KiB`,
      });
      await Promise.all(kids.map((k) => k.kill()));
    }
    const [src] = await labRetry('fork', () => engine.fork(name, 1));
    await src!.agent.eval('b = bytearray(50 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1');
    for (const n of [1, 10]) {
      const t = performance.now();
      const kids = await labRetry(`branch of ${n}`, () => engine.branch(src!, n));
      await Promise.all(kids.map((k) => k.agent.eval('len(b)')));
      const all = performance.now() - t;
      const b = engine.lastBranch!;
      const ready = kids.map((k) => k.timings.readyAt - k.timings.startedAt);
      rows.push({
        what: `branch N=${n}`,
        readyMs: all,
        p50: quantile(ready, 0.5),
        p99: quantile(ready, 0.99),
        createMs: NaN,
        privKiB: NaN,
        hostKiB: NaN,
        note: `source paused ${f(b.pauseUs / 1000, 2)} ms for ${b.privatePages} written pages in ${b.runs} runs`,
      });
      await Promise.all(kids.map((k) => k.kill()));
    }
    print(`forkling KVM fork/branch, Linux image ${values.image}`);
  } finally {
    await engine.close();
    const { templateDir } = await import('../host/engine/kvm/template.ts');
    rmSync(templateDir(name), { recursive: true, force: true });
  }
}

if (values.guest !== 'linux' && values.guest !== 'tiny') throw new Error('--guest tiny|linux');
if (values.cgroup) cgroup = enterMemoryCgroup('forkling-bench');
try {
  if (values.guest === 'linux') await linux();
  else await tiny();
} finally {
  cgroup?.leave();
}
process.exit(0);
