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
// --no-doze (an idle child with nothing to run does not doze: its vCPUs go
// on running, and its timer ticks write pages again between passes),
// --no-pack (a dozing child's private pages are not packed: vm.ts idlePass;
// with packing, the analyses below write them back first, and --trace-idle
// sees the pages written back, not the ones the guest wrote),
// --kernel-args '<extra guest kernel arguments for the template>',
// --trace-idle (which kernel variables an idle child writes: the bytes of the
// guest kernel's data and bss are copied after the passes and compared 8 s
// later, and each changed byte named by the symbol at or below it, so a
// variable /proc/kallsyms does not list takes the name of the one before it;
// a third child, forked with the others, tells where the kernel and its
// symbols are; and what the pages made private again in those 8 s hold),
// --why-private (each page private after the passes: how many of its bytes
// differ from a sibling's with the same history, by what the page is, and for
// process memory which process and mapping holds it).
import { createHash } from 'node:crypto';
import { closeSync, openSync, readFileSync, rmSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { KvmEngine } from '../host/engine/kvm/engine.ts';
import { snapshotNative } from '../host/engine/kvm/snapshot-native.ts';
import { templateDir } from '../host/engine/kvm/template.ts';
import type { KvmSandbox } from '../host/engine/kvm/vm.ts';
import { labRetry } from '../test/kvm/lab-flake.ts';
import { until } from './until.ts';

const { values } = parseArgs({
  options: {
    image: { type: 'string', default: 'default' },
    warmup: { type: 'string', default: 'import json, random, uuid' },
    'no-init-on-free': { type: 'boolean', default: false },
    'no-reclaim': { type: 'boolean', default: false },
    'no-pattern': { type: 'boolean', default: false },
    'no-doze': { type: 'boolean', default: false },
    'no-pack': { type: 'boolean', default: false },
    'kernel-args': { type: 'string', default: '' },
    'trace-idle': { type: 'boolean', default: false },
    'why-private': { type: 'boolean', default: false },
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
owner = {}
if len(sys.argv) > 1:
    # process memory: which process and mapping maps each frame now (pagemap as root)
    want = set(frames)
    import os
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            comm = open(f'/proc/{pid}/comm').read().strip()
            maps = open(f'/proc/{pid}/maps').read().splitlines()
            pm = open(f'/proc/{pid}/pagemap', 'rb')
        except OSError:
            continue
        with pm:
            for m in maps:
                parts = m.split(None, 5)
                a, b = (int(x, 16) for x in parts[0].split('-'))
                name = parts[5] if len(parts) > 5 else '[anon]'
                pm.seek((a >> 12) * 8)
                data = pm.read(((b - a) >> 12) * 8)
                for i in range(len(data) // 8):
                    e = struct.unpack_from('<Q', data, i * 8)[0]
                    if e >> 63 & 1:
                        pfn = e & ((1 << 55) - 1)
                        if pfn in want:
                            owner.setdefault(pfn, (f'{comm}: {name.split("/")[-1]}', a + i * 4096))
per = []
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
        va = None
        if pfn in owner:
            kind += ' / ' + owner[pfn][0]
            va = owner[pfn][1]
        out[kind] = out.get(kind, 0) + 1
        per.append([kind, va])
print(json.dumps(per if len(sys.argv) > 1 else out))
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

interface WhyPrivate {
  /** Each page private after the passes, and how many of its bytes differ from the sibling's. */
  pages: { page: number; differ: number }[];
  /** Of those, pages that are all zero (the guest zeroes what it frees: init_on_free). */
  zero: number;
  /** Of those alike with the sibling's: the pages the pattern holds, and those with its bytes. */
  inPattern: number;
  withPatternBytes: number;
  /** Differing 8-byte words of some pages, against the pattern or the sibling. */
  looks: { page: number; vs: string; words: { off: number; mine: bigint; theirs: bigint }[] }[];
}

function bytesDiffer(a: Buffer, b: Buffer): number {
  let n = 0;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) n++;
  return n;
}

/** Why the child's `pages` are private after the passes: compared with a sibling's with the same history and with the pattern. */
function whyPrivate(sb: KvmSandbox, sibling: KvmSandbox, pages: number[], template: string): WhyPrivate {
  const vm = sb.nativeVm();
  const page = (v: { guestBytes(gpa: number, n: number): Buffer }, p: number) => v.guestBytes(p * 4096, 4096);
  const out: WhyPrivate = {
    pages: pages.map((p) => ({ page: p, differ: bytesDiffer(page(vm, p), page(sibling.nativeVm(), p)) })),
    zero: pages.filter((p) => page(vm, p).every((b) => b === 0)).length,
    inPattern: 0,
    withPatternBytes: 0,
    looks: [],
  };
  const words = (p: number, other: Buffer) => {
    const mine = page(vm, p);
    const w: WhyPrivate['looks'][number]['words'] = [];
    for (let i = 0; i < 4096 && w.length < 6; i += 8) if (mine.readBigUInt64LE(i) !== other.readBigUInt64LE(i)) w.push({ off: i, mine: mine.readBigUInt64LE(i), theirs: other.readBigUInt64LE(i) });
    return w;
  };
  const layer = engine.patternOf(template)?.layer;
  if (layer) {
    // The pattern's bytes: the template's memory file under the pattern layer.
    const has = new Set(snapshotNative().diffPages(layer));
    const fd = openSync(`${templateDir(template)}/memory.bin`, 'r');
    const pat = Buffer.from(snapshotNative().mapLayered(fd, layer.ramSize, [layer]));
    closeSync(fd);
    for (const w of out.pages.filter((x) => x.differ === 0 && has.has(x.page))) {
      out.inPattern++;
      const theirs = pat.subarray(w.page * 4096, w.page * 4096 + 4096);
      if (theirs.equals(page(vm, w.page))) out.withPatternBytes++;
      else out.looks.push({ page: w.page, vs: 'pattern', words: words(w.page, theirs) });
    }
  }
  for (const w of out.pages.filter((x) => x.differ > 0 && x.differ <= 8)) out.looks.push({ page: w.page, vs: 'sibling', words: words(w.page, page(sibling.nativeVm(), w.page)) });
  return out;
}

/** Prints `why` with what each page is now (`kinds`: CLASSIFY per frame) and, given the kernel's layout, its variables' names. */
function printWhy(why: WhyPrivate, kinds: [string, number | null][], layout: KernelLayout | null): void {
  const cols = ['alike', '1-8 B', '9-64 B', '65-512 B', '>512 B'];
  const bucket = (n: number) => (n === 0 ? 0 : n <= 8 ? 1 : n <= 64 ? 2 : n <= 512 ? 3 : 4);
  const table = new Map<string, number[]>();
  why.pages.forEach((w, i) => {
    const k = kinds[i]?.[0] ?? '?';
    const row = table.get(k) ?? cols.map(() => 0);
    row[bucket(w.differ)]! += 4;
    table.set(k, row);
  });
  const alike = why.pages.filter((w) => w.differ === 0).length;
  console.log(`  pages private after the passes (${why.pages.length * 4} KiB; what they hold classified later), KiB by bytes that differ from the sibling's page:`);
  console.log(`    ${'what'.padEnd(56)}${cols.map((c) => c.padStart(9)).join('')}`);
  const sum = (r: number[]) => r.reduce((x, y) => x + y, 0);
  for (const [k, row] of [...table].sort((a, b) => sum(b[1]) - sum(a[1]))) console.log(`    ${k.slice(0, 56).padEnd(56)}${row.map((n) => String(n).padStart(9)).join('')}`);
  console.log(`  all zero (freed by the guest, which zeroes what it frees): ${why.zero * 4} KiB`);
  console.log(`  of the ${alike * 4} KiB alike with the sibling's: ${why.inPattern * 4} KiB are pages the pattern holds, ${why.withPatternBytes * 4} KiB with its bytes`);
  const kindOf = new Map(why.pages.map((w, i) => [w.page, kinds[i]?.[0] ?? '?']));
  const sym = (gpa: number) => {
    if (!layout) return '';
    const va = gpa + layout.text - layout.spans['Kernel code']![0];
    let best = '';
    for (const [a, n] of layout.syms) if (a <= va) best = n;
    return best;
  };
  console.log('  words that differ (guest page vs the pattern or the sibling: offset, mine / theirs, the kernel variable with --trace-idle):');
  for (const l of why.looks.slice(0, 60)) {
    const kind = kindOf.get(l.page) ?? '?';
    console.log(`    ${l.page.toString(16)} vs the ${l.vs}: ${kind}`);
    for (const w of l.words)
      console.log(`      +${w.off.toString(16).padStart(3, '0')} ${w.mine.toString(16).padStart(16)} / ${w.theirs.toString(16).padStart(16)} ${kind.startsWith('Kernel') ? sym(l.page * 4096 + w.off) : ''}`);
  }
}

const reclaimOn = !values['no-reclaim'];
const patternOn = reclaimOn && !values['no-pattern'];
const IDLE_MS = 1000;
const dozeOn = reclaimOn && !values['no-doze'];
const packOn = dozeOn && !values['no-pack'];
const engine = new KvmEngine({ reclaimIdleMs: reclaimOn ? IDLE_MS : 0, pattern: patternOn, doze: dozeOn, pack: packOn });
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
  const rows: { what: string; priv: number; packed: number; all: number; zero: number | null; pattern: number; passes: number; dozing: boolean }[] = [];
  let hostAtIdle = '';
  const row = async (what: string) => {
    const st = await sb.stats();
    const all = st.privateKiB;
    const h = st.counters;
    if (what === 'idle 8 s later')
      hostAtIdle = `host page tables for its RAM ${h.hostPageTableKiB} KiB, KVM's nested page tables ${h.hostNptKiB} KiB, vCPU stacks ${(h.host_vcpu_stack_bytes ?? 0) / 1024} KiB, kvm_run ${(h.host_kvm_run_bytes ?? 0) / 1024} KiB`;
    // (all-zero private pages: what the guest freed since the fork, zeroed as it frees; not read
    // while packed: a read writes the packed pages back)
    const zero = h.packed_bytes ? null : frames(sb).filter((f) => vm.guestBytes(f * 4096, 4096).every((b) => b === 0)).length * 4;
    rows.push({ what, priv: h.guestPrivateKiB ?? 0, packed: (h.packed_bytes ?? 0) / 1024, all, zero, pattern: h.patternKiB ?? 0, passes: sb.reclaimed.passes, dozing: h.dozing === 1 });
  };
  await row('restore answered (ready)');
  for (const k of [sb, sibling!]) if ((await k.agent.eval('1 + 1')).value !== 2) throw new Error('first eval: wrong answer');
  await row('first eval answered');
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
  await row('after the idle passes');
  const passed = new Set(frames(sb));
  const why = values['why-private'] ? whyPrivate(sb, sibling!, [...passed], name) : null;
  const dataBase = layout?.spans['Kernel data']?.[0] ?? 0;
  const dataEnd = layout?.spans['Kernel bss']?.[1] ?? 0;
  const dataBefore = layout ? vm.guestBytes(dataBase, dataEnd - dataBase) : null;
  await new Promise((r) => setTimeout(r, 8000));
  await row('idle 8 s later');
  if (packOn) vm.guestBytes(0, 1); // (written back, still dozing: the pages it holds, compared and classified below)
  const idle = frames(sb);
  const changed = layout && dataBefore ? changedSymbols(vm, layout, dataBase, dataBefore) : null;
  const other = sibling!.nativeVm();
  const alike = idle.filter((f) => vm.guestBytes(f * 4096, 4096).equals(other.guestBytes(f * 4096, 4096))).length;
  if (reclaimOn) {
    await sb.reclaim();
    await row('after one more pass');
  }
  // The child still works after its pages were given back or mapped from the pattern.
  const check = await sb.agent.eval('import hashlib; hashlib.sha256(bytes(range(256)) * 4096).hexdigest()');
  const want = createHash('sha256').update(Buffer.concat(Array.from({ length: 4096 }, () => Buffer.from(Array.from({ length: 256 }, (_, i) => i))))).digest('hex');
  if (check.value !== want) throw new Error(`eval after reclaim: wrong answer ${String(check.value)}`);
  await row('another eval answered');
  const unpackUs = vm.stats().counters.last_unpack_us;
  if (packOn) {
    // Idle again: the engine's pass, the doze and the pack, as after the first eval.
    const packs = vm.stats().counters.packs ?? 0;
    await until('a pack after the eval', () => (vm.stats().counters.packs ?? 0) > packs || !!sb.reclaimed.failed, 120_000);
    await row('idle again');
  }
  const layer = engine.patternOf(name)?.layer;
  console.log(
    `\nprivate guest memory of one forked child (image ${values.image}, warm-up ${JSON.stringify(values.warmup)}, init_on_free=${values['no-init-on-free'] ? 0 : 1}, kernel args ${JSON.stringify(values['kernel-args'])}, idle passes ${reclaimOn ? `after ${IDLE_MS} ms` : 'off'}, pattern ${patternOn ? 'on' : 'off'}, doze ${dozeOn ? 'on' : 'off'}, pack ${packOn ? 'on' : 'off'})`,
  );
  console.log(
    `  ${'step'.padEnd(28)} ${'private'.padStart(10)} ${'packed'.padStart(10)} ${'both'.padStart(10)} ${'the child'.padStart(10)} ${'of it all zero'.padStart(15)} ${'from the pattern'.padStart(17)} ${'passes'.padStart(7)} ${'dozing'.padStart(7)}`,
  );
  for (const r of rows)
    console.log(
      `  ${r.what.padEnd(28)} ${`${r.priv} KiB`.padStart(10)} ${`${r.packed} KiB`.padStart(10)} ${`${r.priv + r.packed} KiB`.padStart(10)} ${`${r.all} KiB`.padStart(10)} ${(r.zero === null ? '-' : `${r.zero} KiB`).padStart(15)} ${`${r.pattern} KiB`.padStart(17)} ${String(r.passes).padStart(7)} ${(r.dozing ? 'yes' : 'no').padStart(7)}`,
    );
  console.log(`  the child: its figure in the engine's stats() (private and packed guest memory, and its host-side structures: vCPU stacks, kvm_run, the host's and KVM's page tables for its RAM)`);
  console.log(`  the host-side structures, idle 8 s later: ${hostAtIdle}`);
  if (packOn) console.log(`  packed: the store of a dozing child's pages, each kept as the bytes in which it differs from what backs it; the eval after the passes wrote them back in ${unpackUs} µs (lab: emulated)`);
  if (dozeOn && !rows.some((r) => r.dozing)) console.log(`  the child did not doze: ${sb.notQuiet ?? 'no idle pass asked'}`);
  if (layer) console.log(`  the pattern file: ${layer.pageCount * 4} KiB in ${layer.runCount} runs, one copy for every child of the template`);
  // Each run mapped from the pattern splits the RAM mapping: what that costs the host (VMAs).
  const pc = (await sb.stats()).counters;
  console.log(`  mappings of this process (2 children): ${readFileSync('/proc/self/maps', 'utf8').trim().split('\n').length}; runs the child mapped from the pattern: ${pc.pattern_maps ?? 0} (${pc.pattern_maps_left ?? 0} more allowed)`);
  // What an idle child holds: classified now.
  const r = await sb.agent.exec(['python3', '-c', CLASSIFY], { stdin: new TextEncoder().encode(JSON.stringify(idle)) });
  if (r.exitCode !== 0) throw new Error(`classifying inside the guest failed: ${new TextDecoder().decode(r.stderr)}`);
  const kinds = JSON.parse(new TextDecoder().decode(r.stdout)) as Record<string, number>;
  console.log(`  of the pages private at "idle 8 s later", ${alike * 4} KiB hold what a sibling with the same history holds at the same address, ${(idle.length - alike) * 4} KiB differ`);
  console.log('  what the pages private at "idle 8 s later" hold (guest /proc/kpageflags, /proc/iomem):');
  for (const [k, n] of Object.entries(kinds).sort((a, b) => b[1] - a[1])) console.log(`    ${k.padEnd(46)} ${String(n * 4).padStart(6)} KiB`);
  if (why) {
    const r3 = await sb.agent.exec(['python3', '-c', CLASSIFY, 'per-frame'], { stdin: new TextEncoder().encode(JSON.stringify(why.pages.map((w) => w.page))) });
    if (r3.exitCode !== 0) throw new Error(`classifying inside the guest failed: ${new TextDecoder().decode(r3.stderr)}`);
    printWhy(why, JSON.parse(new TextDecoder().decode(r3.stdout)) as [string, number | null][], layout);
  }
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
