// Where a forked Linux child's private memory goes: the guest pages it owns
// (pagemap of its RAM mapping) at each step after the fork, then what the
// guest kernel says those pages are now (/proc/kpageflags and /proc/iomem,
// read inside the child as root). Needs KVM that boots a stock kernel: run
// it in the lab,
//
//   FORKLING_LAB_COMMAND='node --import tsx bench/kvm-child-memory.ts' npx tsx test/lab/run.ts
//
// Options: --image (default), --warmup (Python run in the template),
// --no-init-on-free (the template's kernel without init_on_free=1: freed
// pages are then not zeroed, so a child does not copy pages just to free them),
// --no-reclaim (do not give back, after each step, the pages that hold the
// template's bytes again: vm.reclaim()), --kernel-args '<extra guest kernel
// arguments for the template>'.
import { createHash } from 'node:crypto';
import { rmSync } from 'node:fs';
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
    'kernel-args': { type: 'string', default: '' },
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

function frames(sb: KvmSandbox): number[] {
  return [...(sb.nativeVm().memoryUsage({ frames: true }).privateFrames ?? [])];
}

// Reclaim only where this script says so (the engine's idle passes are off).
const engine = new KvmEngine({ reclaimIdleMs: 0 });
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
  // private pages every child writes alike (what one shared copy could serve).
  const [child, sibling] = await labRetry('fork', () => engine.fork(name, 2));
  const sb = child!;
  const vm = sb.nativeVm();
  let alike = 0;
  // Each step: the private pages, then reclaim (pages equal to the template's
  // again are given back) unless --no-reclaim, and the pages left.
  const steps: { what: string; pages: number; left: number; us: number; held: number }[] = [];
  let idle: number[] = [];
  const step = (what: string) => {
    const before = frames(sb);
    const pages = before.length;
    if (what.startsWith('idle 10 s')) {
      idle = before;
      const other = sibling!.nativeVm();
      alike = before.filter((f) => vm.guestBytes(f * 4096, 4096).equals(other.guestBytes(f * 4096, 4096))).length;
    }
    let left = pages;
    let us = 0;
    let held = 0;
    if (!values['no-reclaim']) {
      const r = vm.reclaim();
      left = r.privatePages - r.droppedPages;
      us = r.totalUs;
      held = r.longestPauseUs;
    }
    steps.push({ what, pages, left, us, held });
  };
  step('restore answered (ready)');
  for (const k of [sb, sibling!]) if ((await k.agent.eval('1 + 1')).value !== 2) throw new Error('first eval: wrong answer');
  step('first eval answered');
  await new Promise((r) => setTimeout(r, 2000));
  step('idle 2 s later');
  await new Promise((r) => setTimeout(r, 8000));
  step('idle 10 s later');
  // The child still works after its pages were given back.
  const check = await sb.agent.eval('import hashlib; hashlib.sha256(bytes(range(256)) * 4096).hexdigest()');
  const want = createHash('sha256').update(Buffer.concat(Array.from({ length: 4096 }, () => Buffer.from(Array.from({ length: 256 }, (_, i) => i))))).digest('hex');
  if (check.value !== want) throw new Error(`eval after reclaim: wrong answer ${String(check.value)}`);
  step('another eval answered');
  console.log(
    `\nprivate guest memory of one forked child (image ${values.image}, warm-up ${JSON.stringify(values.warmup)}, init_on_free=${values['no-init-on-free'] ? 0 : 1}, kernel args ${JSON.stringify(values['kernel-args'])}, reclaim ${values['no-reclaim'] ? 'off' : 'on'})`,
  );
  console.log(`  ${'step'.padEnd(28)} ${'private'.padStart(10)} ${'after reclaim'.padStart(14)} ${'reclaim took'.padStart(13)} ${'vCPUs held'.padStart(11)}`);
  for (const s of steps)
    console.log(
      `  ${s.what.padEnd(28)} ${`${s.pages * 4} KiB`.padStart(10)} ${`${s.left * 4} KiB`.padStart(14)} ${`${(s.us / 1000).toFixed(2)} ms`.padStart(13)} ${`${(s.held / 1000).toFixed(2)} ms`.padStart(11)}`,
    );
  // What an idle child holds (before that step's reclaim): classified now.
  const r = await sb.agent.exec(['python3', '-c', CLASSIFY], { stdin: new TextEncoder().encode(JSON.stringify(idle)) });
  if (r.exitCode !== 0) throw new Error(`classifying inside the guest failed: ${new TextDecoder().decode(r.stderr)}`);
  const kinds = JSON.parse(new TextDecoder().decode(r.stdout)) as Record<string, number>;
  console.log(`  of the pages private at "idle 10 s later", ${alike * 4} KiB hold what a sibling with the same history holds at the same address, ${(idle.length - alike) * 4} KiB differ`);
  console.log('  what the pages private at "idle 10 s later" hold (guest /proc/kpageflags, /proc/iomem):');
  for (const [k, n] of Object.entries(kinds).sort((a, b) => b[1] - a[1])) console.log(`    ${k.padEnd(46)} ${String(n * 4).padStart(6)} KiB`);
  await Promise.all([sb.kill(), sibling!.kill()]);
} finally {
  await engine.close();
  rmSync(templateDir(name), { recursive: true, force: true });
}
process.exit(0);
