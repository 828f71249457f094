// Fork on the KVM engine with a Linux image and its agent (needs /dev/kvm on
// which the distribution kernel boots, and the default image): warm-up state
// in every child, 10 children in parallel, fresh entropy and clock in each,
// children independent, memory freed on kill, corrupt templates refused, a
// warm-up past its limit refused.
import { execFileSync } from 'node:child_process';
import { copyFileSync, cpSync, existsSync, mkdirSync, readdirSync, readFileSync, readlinkSync, realpathSync, rmSync, truncateSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import type { TemplateInfo } from '../../host/engine/engine.ts';
import { KvmEngine } from '../../host/engine/kvm/engine.ts';
import { RECLAIM_IDLE_MS } from '../../host/engine/kvm/sleep-after.ts';
import { MEMORY_FILE, STATE_FILE, templateDir } from '../../host/engine/kvm/template.ts';
import { labRetry, labTest } from './lab-flake.ts';
import { loud } from '../loud-hook.ts';

const engine = new KvmEngine();
const NAME = `test-fork-${process.pid}`;
const WARMUP = 'import os, random, uuid, time\nWARM = "warm-" + str(6 * 7)\nrandom.seed(1234)\nTEMPLATE_FIRST = random.random()';
let info: TemplateInfo;

/** A fork of the test template (in the lab, a test of children is retried as a whole after a triple fault: labTest). */
const fork = (n: number) => engine.fork(NAME, n);

async function rejects(p: () => Promise<unknown>, match: RegExp): Promise<void> {
  try {
    await p();
  } catch (e) {
    assert.match((e as Error).message, match);
    return;
  }
  assert.unreachable(`expected a rejection matching ${match}`);
}

/** Polls `ok` (the engine's state) every `everyMs` until it holds; fails with `why()` past `deadline` (a Date.now()). */
async function until(ok: () => boolean | Promise<boolean>, deadline: number, why: () => string, everyMs = 100): Promise<void> {
  while (!(await ok())) {
    assert.ok(Date.now() < deadline, why());
    await new Promise((res) => setTimeout(res, everyMs));
  }
}

function fdsOf(path: string): number {
  return readdirSync('/proc/self/fd').filter((fd) => {
    try {
      return readlinkSync(`/proc/self/fd/${fd}`) === path;
    } catch {
      return false; // (closed meanwhile)
    }
  }).length;
}

function mappingsOf(path: string): number {
  return readFileSync('/proc/self/maps', 'utf8').split('\n').filter((l) => l.endsWith(path)).length;
}

test.before(loud("the suite's set-up (test.before)", async () => {
  info = await labRetry('template boot', () => engine.createTemplate({ name: NAME, image: 'default', warmup: WARMUP }));
}));

/** A test that runs on hardware KVM only, not in the lab (see where it is used). */
const notInLab = process.env.FORKLING_IN_LAB ? test.skip : test;

labTest('the warm-up state is in every child; children are ready after restore', async () => {
  await engine.prepare(NAME); // (checks the template's files; the fork then finds them checked)
  await rejects(() => engine.prepare(`${NAME}-missing`), /does not exist/);
  const kids = await fork(3);
  try {
    kids.push(...(await fork(1)));
    for (const k of kids) {
      assert.ok(k.timings.readyAt > k.timings.startedAt);
      const r = await k.agent.eval('WARM');
      assert.is(r.value, 'warm-42');
      const h = await k.agent.request('hello', { versions: [1] });
      assert.is(h.sandboxId, k.id, 'restore set the sandbox id');
    }
    // The template is loaded once: the children of both forks share its state and one descriptor of its memory file.
    assert.is(fdsOf(realpathSync(join(templateDir(NAME), MEMORY_FILE))), 1, 'descriptors of the memory file');
  } finally {
    await Promise.all(kids.map((k) => k.kill()));
  }
});

labTest('10 children in parallel each answer their own eval', async () => {
  const kids = await fork(10);
  try {
    // (each with a subprocess whose output is that child's eval's: the agent's reader thread was restored with it)
    const answers = await Promise.all(kids.map((k, i) => k.agent.eval(`os.system("echo child ${i}")\n${i} * 1000 + 7`)));
    assert.equal(answers.map((a) => a.value), kids.map((_, i) => i * 1000 + 7));
    assert.equal(answers.map((a) => a.stdout), kids.map((_, i) => `child ${i}\n`));
  } finally {
    await Promise.all(kids.map((k) => k.kill()));
  }
});

labTest('os.urandom, uuid4 and random.random differ in every child and from the template', async () => {
  // What the template itself would draw next from its seeded generator.
  const templateNext = Number(execFileSync('/usr/bin/python3', ['-c', 'import random; random.seed(1234); random.random(); print(repr(random.random()))']).toString().trim());
  const kids = await fork(5);
  try {
    const draws = await Promise.all(kids.map((k) => k.agent.eval('(os.urandom(16).hex(), str(uuid.uuid4()), random.random())')));
    const vals = draws.map((d) => d.value as [string, string, number]);
    for (let i = 0; i < 3; i++) assert.is(new Set(vals.map((v) => v[i])).size, kids.length, `draw ${i} differs in every child`);
    for (const v of vals) assert.is.not(v[2], templateNext, 'random was reseeded by restore');
  } finally {
    await Promise.all(kids.map((k) => k.kill()));
  }
});

labTest('time.time() in a child of a template made a while ago is within 1 s of the host', async () => {
  // The template's clock stopped when it was saved; make sure it is old.
  const age = Date.now() - Date.parse(info.createdAt);
  if (age < 3000) await new Promise((r) => setTimeout(r, 3000 - age));
  const [k] = await fork(1);
  try {
    const r = await k!.agent.eval('time.time()');
    const host = Date.now() / 1000;
    assert.ok(Math.abs((r.value as number) - host) < 1, `guest ${r.value} host ${host}`);
  } finally {
    await k!.kill();
  }
});

labTest('a file written in one child is absent in its siblings', async () => {
  const [a, b] = await fork(2);
  try {
    await a!.agent.writeFile('/tmp/only-in-a', 'a');
    assert.is((await a!.agent.request('files.exists', { path: '/tmp/only-in-a' })).exists, true);
    assert.is((await b!.agent.request('files.exists', { path: '/tmp/only-in-a' })).exists, false);
    await a!.agent.eval('WARM = "changed"');
    assert.is((await b!.agent.eval('WARM')).value, 'warm-42');
  } finally {
    await Promise.all([a!.kill(), b!.kill()]);
  }
});

// Not run in the lab (where the tiny guest's test in snapshot-vm.test.ts checks that killed
// children leave no mapping): it froze the lab's kernel in 3 of about 9 runs on 2026-12-01
// (a soft lockup in kvm-pit threads on both CPUs while three Linux VMs went, twice in a row in
// one run): most likely the same lost TLB-flush IPI of QEMU's nested SVM as the reclaim test below.
notInLab('children own few pages while alive; killing them frees their memory', async () => {
  const mem = join(templateDir(NAME), MEMORY_FILE);
  const kids = await fork(3);
  try {
    const stats = await Promise.all(kids.map((k) => k.stats()));
    for (const s of stats) assert.ok(s.privateKiB > 0 && s.privateKiB < 64 * 1024, `${s.privateKiB} KiB private`);
    console.log(`    private memory per idle child: ${stats.map((s) => s.privateKiB).join(', ')} KiB`);
    assert.ok(mappingsOf(mem) >= 3);
  } finally {
    await Promise.all(kids.map((k) => k.kill()));
  }
  assert.is(mappingsOf(mem), 0, 'no child maps the memory file any more');
});

// Not run in the lab: there it froze the lab's kernel in three of four CI
// runs (a soft lockup of this process while pages were given back, with a
// sibling VM running on the other CPU; most likely the TLB-flush IPI of
// MADV_DONTNEED lost by QEMU's emulated nested SVM). Reclaim is tested in
// the lab with the tiny guest (snapshot-vm.test.ts); this runs on hardware KVM.

notInLab('reclaim: a child gives back the pages it wrote back to the template; its data, files and sibling are intact', async () => {
  const [a, b] = await fork(2);
  try {
    // Data of its own (1 MiB that is not the template's), a file in RAM, and
    // a burst of Python work whose pages go back to what they were.
    await a!.agent.eval('import hashlib\nX = bytes(range(256)) * 4096\nsum(len(str(i)) for i in range(200000))');
    await a!.agent.writeFile('/tmp/kept', 'kept after reclaim');
    const before = (await a!.stats()).privateKiB;
    const r = await a!.reclaim();
    const after = (await a!.stats()).privateKiB;
    assert.ok(r.droppedPages > 0, `${r.droppedPages} of ${r.privatePages} pages given back`);
    assert.ok(after < before, `private ${before} -> ${after} KiB`);
    assert.ok(after >= 1024, 'the 1 MiB of its own data stays private');
    const want = execFileSync('/usr/bin/python3', ['-c', 'import hashlib; print(hashlib.sha256(bytes(range(256)) * 4096).hexdigest())']).toString().trim();
    assert.is((await a!.agent.eval('hashlib.sha256(X).hexdigest()')).value, want);
    assert.is(new TextDecoder().decode(await a!.agent.readFile('/tmp/kept')), 'kept after reclaim');
    assert.is((await a!.agent.eval('WARM')).value, 'warm-42');
    // The engine reclaims by itself once the agent is idle (asked for here:
    // the lab's default is off, see defaultReclaimIdleMs, should this run there).
    a!.reclaimWhenIdle(RECLAIM_IDLE_MS);
    const passes = (await a!.stats()).counters.reclaimPasses!;
    const deadline = Date.now() + 60_000;
    await until(async () => (await a!.stats()).counters.reclaimPasses! > passes, deadline, () => 'no reclaim pass while idle', 200);
    assert.is((await a!.agent.eval('hashlib.sha256(X).hexdigest()')).value, want);
    assert.equal((await b!.agent.eval("('X' in globals(), WARM)")).value, [false, 'warm-42']);
    console.log(`    reclaim: private ${before} -> ${after} KiB (${r.droppedPages} of ${r.privatePages} pages given back)`);
  } finally {
    await Promise.all([a!.kill(), b!.kill()]);
  }
});

// In the lab too: the children's passes and the pattern's mappings are asked for here (the
// lab's default has no idle passes: defaultReclaimIdleMs).
labTest("pattern: idle children map what they hold alike from their template's pattern; each keeps its own state, and so does a branch", async () => {
  const e = new KvmEngine({ reclaimIdleMs: 300 });
  try {
    const [a, b] = await e.fork(NAME, 2);
    assert.is((await a!.agent.eval('MINE = "a"; WARM')).value, 'warm-42');
    assert.is((await b!.agent.eval('MINE = "b"; WARM')).value, 'warm-42');
    // The pattern is built after the fork by a hidden child; idle children then run a pass with it.
    const deadline = Date.now() + 300_000;
    const wait = (what: string, ok: () => boolean) => until(ok, deadline, () => `${what}: not in time`);
    await wait('the pattern', () => !!e.patternOf(NAME)?.layer || !!e.patternOf(NAME)?.failed);
    // (thrown as it is: the lab's flakes of a restored child are told by their words, labTest)
    const failed = e.patternOf(NAME)?.failed;
    if (failed) throw new Error(`building the pattern failed: ${failed}`);
    await wait('a pass with the pattern', () => (a!.reclaimed.patternPages > 0 && b!.reclaimed.patternPages > 0) || !!a!.reclaimed.failed || !!b!.reclaimed.failed);
    assert.is(a!.reclaimed.failed, undefined);
    assert.is(b!.reclaimed.failed, undefined);
    const s = await a!.stats();
    assert.ok(s.counters.patternKiB! > 0, `${s.counters.patternKiB} KiB mapped from the pattern`);
    // Each child goes on with its own state, and computes right.
    const want = execFileSync('/usr/bin/python3', ['-c', 'import hashlib; print(hashlib.sha256(bytes(range(256)) * 4096).hexdigest())']).toString().trim();
    for (const [k, mine] of [
      [a!, 'a'],
      [b!, 'b'],
    ] as const) {
      assert.equal((await k.agent.eval('import hashlib; (MINE, WARM, hashlib.sha256(bytes(range(256)) * 4096).hexdigest())')).value, [mine, 'warm-42', want]);
    }
    // A branch of a child that maps the pattern continues from it.
    const [c] = await e.branch(a!, 1);
    assert.equal((await c!.agent.eval('(MINE, WARM)')).value, ['a', 'warm-42']);
    console.log(`    pattern: ${(e.patternOf(NAME)?.layer?.pageCount ?? 0) * 4} KiB; an idle child maps ${s.counters.patternKiB} KiB from it, holds ${s.counters.guestPrivateKiB} KiB of guest memory alone`);
  } finally {
    await e.close();
  }
});

labTest('doze: an idle child with nothing to run waits for input with its vCPUs out of KVM_RUN; input wakes it with the right time; a child with a timed wait does not doze until it ended', async () => {
  const e = new KvmEngine({ reclaimIdleMs: 300, pattern: false });
  try {
    const [a, b] = await e.fork(NAME, 2);
    assert.is((await a!.agent.eval('WARM')).value, 'warm-42');
    // b's thread sleeps 15 s: b is asked again later (less often each time), and dozes once it ended.
    await b!.agent.eval('import threading, time\n_t = threading.Thread(target=time.sleep, args=(15,), daemon=True)\n_t.start()');
    const bAsked = Date.now();
    const deadline = Date.now() + 120_000;
    const counters = async (k: typeof a) => (await k!.stats()).counters;
    await until(async () => (await counters(a)).dozing === 1 && b!.notQuiet !== null, deadline, () => `no doze: a says ${a!.notQuiet}, b ${b!.notQuiet}`);
    assert.match(b!.notQuiet ?? '', /^thread \d+ \(.*\) waits in clock_nanosleep with a timeout$/);
    assert.is((await counters(b)).dozes, 0, 'a child whose thread sleeps with a timeout dozed');
    // While it dozes its vCPUs do not run (no exit of any kind) and it writes no page.
    const exits = (c: Record<string, number>) => Object.entries(c).reduce((n, [k, v]) => (k.startsWith('exits_') ? n + v : n), 0);
    const before = await counters(a);
    await new Promise((res) => setTimeout(res, 3000));
    const still = await counters(a);
    assert.is(still.dozing, 1);
    assert.is(exits(still), exits(before), 'a dozing VM exited to the VMM');
    assert.is(still.guestPrivateKiB, before.guestPrivateKiB, 'a dozing VM wrote pages');
    // Input wakes it; its clock went on (kvm-clock) while it dozed.
    const t = (await a!.agent.eval('import time; time.time()')).value as number;
    assert.ok(Math.abs(t - Date.now() / 1000) < 1, `the woken child's clock is ${t - Date.now() / 1000} s off`);
    const woke = await counters(a);
    assert.ok(woke.dozes! >= 1 && woke.dozed_ms! >= 3000, JSON.stringify(woke));
    // Idle again, it dozes again; the guest told of no stall.
    await until(async () => (await counters(a)).dozes! > woke.dozes!, deadline, () => `no second doze: ${a!.notQuiet}`);
    assert.is((await a!.agent.eval('WARM + "!"')).value, 'warm-42!');
    const stalls = a!.console.filter((l) => /soft lockup|rcu.*stall|hung task/i.test(l));
    assert.equal(stalls, [], 'the guest reported a stall');
    const bBusy = b!.notQuiet;
    await until(async () => (await counters(b)).dozing === 1, bAsked + 120_000, () => `b never dozed after its thread ended: ${b!.notQuiet}`, 200);
    assert.is(b!.notQuiet, null);
    console.log(`    doze: dozed ${woke.dozes} time(s), ${woke.dozed_ms} ms; private ${still.guestPrivateKiB} KiB and packed ${still.packedKiB} KiB while dozing (packs ${still.packs}, unpacks ${still.unpacks}, last pack ${JSON.stringify(a!.lastPack)}); b: ${bBusy}, then dozed ${((Date.now() - bAsked) / 1000).toFixed(1)} s after its thread started, unasked`);
  } finally {
    await e.close();
  }
});

labTest('pack: a dozing child keeps its private pages as the bytes that differ, in less room; reads, input and a branch get every byte back', async () => {
  const e = new KvmEngine({ reclaimIdleMs: 300, pattern: false });
  try {
    const [a] = await e.fork(NAME, 1);
    const k = a!;
    const vm = k.nativeVm();
    await k.agent.eval('import hashlib, os\nBLOB = bytearray(os.urandom(200000))\nDIGEST = hashlib.sha256(BLOB).hexdigest()');
    const counters = async () => (await k.stats()).counters;
    const deadline = Date.now() + 120_000;
    // (read while it is packed: the stop-35 CI once found packs 1 and dozing 1 but packed_pages 0,
    // its pages written back while it dozed; a vsock pass does that (vm.cc: BeforePass) and
    // nothing packs it again: not proven, see the session-36 note)
    let first: Record<string, number> = {};
    const packed = async () => {
      first = await counters();
      return first.packs! >= 1 && first.packed_pages! > 0;
    };
    await until(packed, deadline, () => `no pack: ${k.notQuiet ?? 'quiet'}, ${JSON.stringify(k.lastPack)}`);
    // The engine packed it after its doze: what it gave back is counted as the store's size.
    const p = k.lastPack!;
    assert.ok(p.packed && p.packedPages > 0 && first.dozing === 1, JSON.stringify(p));
    assert.is(first.packed_pages, p.packedPages);
    assert.is(first.guestPrivateKiB, p.keptPages * 4, 'the packed pages were given back');
    assert.ok(first.packed_bytes! > 0 && first.packed_bytes! < p.packedPages * 4096, `${first.packed_bytes} bytes for ${p.packedPages} pages`);
    assert.is(first.packedKiB, first.packed_bytes! / 1024);
    const stats = await k.stats();
    assert.ok(stats.privateKiB >= first.guestPrivateKiB! + first.packedKiB!, 'the store is in the child\'s private memory');
    // Every byte back: a read of guest RAM writes the pages back first (still dozing); those bytes, packed again and read again, are the same.
    vm.guestBytes(0, 1);
    assert.is((await counters()).unpacks, 1);
    const frames = [...(vm.memoryUsage({ frames: true }).privateFrames ?? [])];
    assert.ok(frames.length > p.keptPages, `${frames.length} private pages once written back`);
    const before = frames.map((f) => vm.guestBytes(f * 4096, 4096));
    const again = vm.pack({ shelve: false });
    assert.ok(again.packed && !again.shelved, JSON.stringify(again));
    assert.is(again.privatePages, frames.length);
    assert.ok(vm.memoryUsage().guestPrivateBytes < frames.length * 4096);
    const after = frames.map((f) => vm.guestBytes(f * 4096, 4096));
    const differ = frames.filter((_, i) => !after[i]!.equals(before[i]!));
    assert.equal(differ, [], 'pages unlike what they were before the pack');
    // Shelved too (its KVM VM closed) and made again by a read.
    const shelved = vm.pack();
    assert.ok(shelved.packed && shelved.shelved, JSON.stringify(shelved));
    const back0 = frames.map((f) => vm.guestBytes(f * 4096, 4096));
    const moved = frames.filter((_, i) => !back0[i]!.equals(before[i]!));
    const words = moved.slice(0, 4).map((f) => {
      const i = frames.indexOf(f);
      const w: string[] = [];
      for (let o = 0; o < 4096 && w.length < 4; o += 8)
        if (back0[i]!.readBigUInt64LE(o) !== before[i]!.readBigUInt64LE(o)) w.push(`+${o.toString(16)} ${before[i]!.readBigUInt64LE(o).toString(16)}->${back0[i]!.readBigUInt64LE(o).toString(16)}`);
      return `${f.toString(16)}: ${w.join(' ')}`;
    });
    console.log(`    shelve round trip: ${moved.length} of ${frames.length} pages changed ${words.join('; ')}`);
    // The same bytes but for the guest's kvm-clock area of its vCPU (a pvclock_vcpu_time_info, 32
    // bytes: version and TSC stamp), which KVM itself writes as it takes the vCPU up again.
    const blocks = moved.map((f) => {
      const i = frames.indexOf(f);
      const b = new Set<number>();
      for (let o = 0; o < 4096; o++) if (back0[i]![o] !== before[i]![o]) b.add(o >> 5);
      return b.size;
    });
    assert.ok(moved.length <= 1 && blocks.every((n) => n === 1), `a shelve and unshelve changed more than a vCPU's kvm-clock area: ${words.join('; ')}`);
    // Input writes them back before the guest runs: its state is whole.
    assert.ok(vm.pack().packed, 'packed again (still dozing)');
    assert.is((await k.agent.eval('hashlib.sha256(BLOB).hexdigest() == DIGEST')).value, true);
    const woke = await counters();
    assert.is(woke.packed_pages, 0);
    assert.is(woke.unpacks, 4);
    assert.is(vm.pack().packed, false, 'an awake VM is not packed');
    // Packed with nothing left private, its page tables go too: the host's for its RAM (this
    // process's VmPTE) and KVM's nested ones (the lab's SecPageTables: its only VM now).
    const meminfo = (key: string) => Number(readFileSync('/proc/meminfo', 'utf8').match(new RegExp(`^${key}:\\s+(\\d+) kB`, 'm'))?.[1] ?? Number.NaN);
    const vmPte = () => Number(readFileSync('/proc/self/status', 'utf8').match(/^VmPTE:\s+(\d+) kB/m)?.[1] ?? Number.NaN);
    // And its KVM VM is closed (shelved): this process holds its VM's and vCPU's files no more.
    // ('anon_inode:kvm-vm', 'anon_inode:kvm-vcpu:0': not their stats files, kvm-vm-stats)
    const kvmFiles = (kind: 'vm' | 'vcpu') =>
      readdirSync('/proc/self/fd').filter((f) => {
        try {
          const l = readlinkSync(`/proc/self/fd/${f}`);
          return kind === 'vm' ? l === 'anon_inode:kvm-vm' : l.startsWith('anon_inode:kvm-vcpu:');
        } catch {
          return false; // (closed meanwhile)
        }
      }).length;
    // And no thread of ours runs for it: its vCPU thread ends, and its vsock loop's parks.
    const threads = (name: RegExp) =>
      readdirSync('/proc/self/task').filter((t) => {
        try {
          return name.test(readFileSync(`/proc/self/task/${t}/comm`, 'utf8').trim());
        } catch {
          return false; // (ended meanwhile)
        }
      }).length;
    const awake = await counters();
    const [pte0, sec0, vms0, vcpus0, loops0, vcpuThreads0] = [vmPte(), meminfo('SecPageTables'), kvmFiles('vm'), kvmFiles('vcpu'), threads(/^vsock$/), threads(/^vcpu/)];
    await until(async () => (await counters()).packs! >= 5, deadline, () => `no second pack by the engine: ${k.notQuiet ?? 'quiet'}`);
    await until(async () => (await counters()).vsock_parked === 1, deadline, () => `the shelved child's vsock loop did not park: ${JSON.stringify(k.lastPack)}`);
    const [pte1, sec1, vms1, vcpus1, loops1, vcpuThreads1] = [vmPte(), meminfo('SecPageTables'), kvmFiles('vm'), kvmFiles('vcpu'), threads(/^vsock$/), threads(/^vcpu/)];
    const deep = await counters();
    assert.ok(k.lastPack?.ramTablesDropped && k.lastPack.shelved, JSON.stringify(k.lastPack));
    const said = (c: Record<string, number | undefined>) => JSON.stringify({ packs: c.packs, unpacks: c.unpacks, shelved: c.shelved, shelves: c.shelves, dozing: c.dozing, dozes: c.dozes, vsock_rx: c.vsock_rx_packets, vsock_tx: c.vsock_tx_packets, irqs: c.virtio_interrupts });
    assert.is(deep.shelved, 1, said(deep));
    assert.ok(deep.shelf_bytes! > 0, `a shelved child keeps its KVM state: shelf_bytes ${deep.shelf_bytes}`);
    assert.is(vms0 - vms1, 1, `KVM VM files ${vms0} -> ${vms1}`);
    assert.is(vcpus0 - vcpus1, 1, `KVM vCPU files ${vcpus0} -> ${vcpus1}`);
    assert.is(loops0 - loops1, 1, `vsock loop threads ${loops0} -> ${loops1}`);
    assert.is(vcpuThreads0 - vcpuThreads1, 1, `vCPU threads ${vcpuThreads0} -> ${vcpuThreads1}`);
    assert.is(deep.host_kvm_run_bytes, 0);
    assert.is(deep.host_vcpu_stack_bytes, 0);
    assert.is(deep.hostPageTableKiB, 0);
    assert.is(deep.hostNptKiB, 0);
    assert.ok(pte0 - pte1 >= awake.hostPageTableKiB! * 0.75, `VmPTE ${pte0} -> ${pte1} KiB; the child's tables were ${awake.hostPageTableKiB} KiB`);
    if (Number.isFinite(sec0)) assert.ok(sec0 - sec1 >= awake.hostNptKiB! * 0.5, `SecPageTables ${sec0} -> ${sec1} KiB; the child's nested tables counted ${awake.hostNptKiB} KiB`);
    // Woken, its KVM VM made again with its memory slots, it runs; its clock went on while it was away.
    assert.is((await k.agent.eval('hashlib.sha256(BLOB).hexdigest() == DIGEST')).value, true);
    const t = ((await k.agent.eval('import time; time.time()')).value as number) - Date.now() / 1000;
    assert.ok(Math.abs(t) < 1, `the unshelved child's clock is ${t} s off`);
    const back = await counters();
    assert.is(back.shelved, 0);
    assert.is(back.shelf_bytes, 0, 'its shelf is dropped at the wake');
    assert.is(back.vsock_parked, 0, 'its vsock loop runs again');
    assert.ok(back.vsock_parks! >= 1);
    assert.is(kvmFiles('vm'), vms0, 'KVM VM files after the wake');
    await until(async () => (await counters()).packs! >= 6, deadline, () => `no third pack by the engine: ${k.notQuiet ?? 'quiet'}`);
    // A branch of a packed child (its pause writes them back) continues from its state.
    const [c] = await e.branch(k, 1);
    assert.is((await c!.agent.eval('BLOB[7] = (BLOB[7] + 1) % 256; MINE = hashlib.sha256(BLOB).hexdigest(); MINE == DIGEST')).value, false);
    assert.is((await k.agent.eval('hashlib.sha256(BLOB).hexdigest() == DIGEST')).value, true);
    // The branch child too, its RAM mapped anew over its diff layer: packed, woken, whole.
    await until(async () => ((await c!.stats()).counters.packs ?? 0) >= 1, deadline, () => `the branch child was not packed: ${c!.notQuiet ?? 'quiet'}`);
    assert.ok(c!.lastPack?.ramTablesDropped, JSON.stringify(c!.lastPack));
    assert.is((await c!.agent.eval('hashlib.sha256(BLOB).hexdigest() == MINE')).value, true);
    console.log(`    pack: ${p.privatePages} private pages, ${p.packedPages} packed into ${first.packed_bytes! / 1024} KiB, ${p.keptPages} kept; written back in ${woke.last_unpack_us} µs`);
    console.log(`    shelved: KVM VM files ${vms0} -> ${vms1}, vCPU files ${vcpus0} -> ${vcpus1}, vsock loop threads ${loops0} -> ${loops1}, vCPU threads ${vcpuThreads0} -> ${vcpuThreads1}; its KVM state kept in ${deep.shelf_bytes} bytes; made again in ${back.last_unshelve_us} µs (lab: emulated)`);
    console.log(`    page tables freed with nothing left private: this process's VmPTE ${pte0} -> ${pte1} KiB (the child's counted ${awake.hostPageTableKiB} KiB), SecPageTables ${sec0} -> ${sec1} KiB (its nested tables counted ${awake.hostNptKiB} KiB)`);
  } finally {
    await e.close();
  }
});

labTest('a memory file cut short under a live child stops that child only, with why; the template is refused then', async () => {
  // (the host's own reads of such RAM took SIGBUS and ended the host process: native/src/vmm/ram_guard.h)
  const cut = `${NAME}-cut`;
  const dir = templateDir(cut);
  mkdirSync(dir, { recursive: true });
  for (const f of [STATE_FILE, 'template.json']) copyFileSync(join(templateDir(NAME), f), join(dir, f));
  execFileSync('cp', ['--sparse=always', join(templateDir(NAME), MEMORY_FILE), join(dir, MEMORY_FILE)]);
  const infoPath = join(dir, 'template.json');
  writeFileSync(infoPath, readFileSync(infoPath, 'utf8').replace(`"name": "${NAME}"`, `"name": "${cut}"`));
  const [victim] = await engine.fork(cut, 1);
  const [bystander] = await fork(1);
  try {
    assert.is((await victim!.agent.eval('WARM')).value, 'warm-42');
    truncateSync(join(dir, MEMORY_FILE), 4096);
    // Its next eval (its vsock rings, its kernel's pages) meets the missing pages.
    const answer = victim!.agent.eval('WARM').then(
      (r) => `answered ${JSON.stringify(r.value)}`,
      (e: Error) => e.message,
    );
    const info = await victim!.exited;
    assert.is(info.reason, 'internal-error', JSON.stringify(info));
    assert.match(info.message ?? '', new RegExp(`^error: guest RAM lost: the memory file of template ${cut} \\(.*\\), now shorter than the guest's RAM, .* the VM is stopped`));
    assert.match(await answer, /stopped/);
    console.log(`    the child stopped: ${info.message}`);
    // The host process and the other template's child go on.
    assert.is((await bystander!.agent.eval('WARM + "!"')).value, 'warm-42!');
    await rejects(() => engine.fork(cut, 1), new RegExp(`template ${cut} is (corrupt|refused)`));
  } finally {
    await Promise.all([victim!.kill(), bystander!.kill()]);
    rmSync(dir, { recursive: true, force: true });
  }
});

test('a warm-up past its limit is interrupted and refused with why; no template is saved', async () => {
  const late = `${NAME}-late`;
  let msg = '';
  try {
    // (a boot that flakes in the lab is tried again; the refusal is no flake and ends it)
    await labRetry('late warm-up', () => engine.createTemplate({ name: late, image: 'default', memoryMiB: 384, warmup: 'while True: pass', warmupTimeoutMs: 2000 }));
  } catch (e) {
    msg = (e as Error).message;
  }
  assert.match(msg, new RegExp(`the warm-up of template ${late} did not finish within 2 s`), msg || 'the template was made');
  assert.not.ok(existsSync(templateDir(late)), 'nothing saved');
});

test('a corrupted state file or memory file is refused', async () => {
  const bad = `${NAME}-bad`;
  const dir = templateDir(bad);
  try {
    cpSync(templateDir(NAME), dir, { recursive: true });
    const infoPath = join(dir, 'template.json');
    writeFileSync(infoPath, readFileSync(infoPath, 'utf8').replace(`"name": "${NAME}"`, `"name": "${bad}"`));
    const state = readFileSync(join(dir, STATE_FILE));
    state[state.length >> 1]! ^= 1;
    writeFileSync(join(dir, STATE_FILE), state);
    await rejects(() => engine.fork(bad, 1), /template .* is corrupt: state file/);
    copyFileSync(join(templateDir(NAME), STATE_FILE), join(dir, STATE_FILE));
    const fd = readFileSync(join(dir, MEMORY_FILE));
    // flip a byte in the first non-zero page
    let at = fd.findIndex((b) => b !== 0);
    if (at < 0) at = 0;
    fd[at]! ^= 1;
    writeFileSync(join(dir, MEMORY_FILE), fd);
    await rejects(() => engine.fork(bad, 1), /template .* is corrupt: memory file .* fails its checksum/);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test.after(async () => {
  await engine.close();
  rmSync(templateDir(NAME), { recursive: true, force: true });
});
test.run();
