// The process engine's limits on a cgroup v2 host. Not a KVM test: it lives
// here because the lab runs this directory, and the lab's Linux mounts cgroup
// v2 only (test/lab/init.sh), as most hosts now do, while this machine and CI
// mount v1 (which test/unit/process-engine.test.ts covers). Where /dev/kvm
// works the directory also runs on the host itself; there these checks run
// only if the host's cgroups are v2 too, and the lab runs them as well.
//
// Checked: each sandbox's own cgroup and its memory.max, pids.max, cpu.max; a
// memory hog killed inside its own cgroup while a sibling answers; pause
// through cgroup.freeze; cgroups removed at kill. Then, as under
// `systemd-run --scope -p Delegate=yes`: in a cgroup that holds only this
// process the engine moves into a leaf of its own and its sandboxes get their
// limits there; with another process in it, one warning says why there are no
// limits and what to do.
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, mkdirSync, readFileSync, rmdirSync, rmSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import type { Sandbox } from '../../host/engine/engine.ts';
import { type Cgroup, CgroupTree } from '../../host/engine/process/cgroups.ts';
import { ProcessEngine } from '../../host/engine/process/engine.ts';
import { storePath } from '../../host/store.ts';
import { labProgress } from './lab-flake.ts';

const progress = labProgress('process-cgroup-v2.test');
const CG = '/sys/fs/cgroup';
const v2Host = existsSync(join(CG, 'cgroup.controllers'));
const inLab = !!process.env.FORKLING_IN_LAB;
const TEMPLATE = `cg2-${randomBytes(3).toString('hex')}`;
const MEMORY_MIB = 128;
const PIDS = 48;
const made: string[] = []; // cgroups this file made for itself (removed at the end)

const cgroupOf = (s: Sandbox): string => {
  const dirs = (s as unknown as { cgroup: { dirs: string[] } | null }).cgroup?.dirs ?? [];
  assert.is(dirs.length, 1, `one v2 cgroup per sandbox: ${JSON.stringify(dirs)}`);
  return dirs[0]!;
};
const hostPid = (s: Sandbox) => (s as unknown as { hostPid: number }).hostPid;
const read = (dir: string, file: string) => readFileSync(join(dir, file), 'utf8').trim();
const ownCgroup = () => /^0::(.*)$/m.exec(readFileSync('/proc/self/cgroup', 'utf8'))?.[1] ?? '';

async function val(s: Sandbox, code: string): Promise<unknown> {
  const r = await s.agent.eval(code);
  if (r.exception) throw new Error(`eval failed: ${r.exception.traceback || r.exception.message}`);
  return r.value;
}

/** A new cgroup below the hierarchy's root, with this process moved into it. */
function moveIntoNewCgroup(name: string): string {
  const dir = join(CG, `${name}-${randomBytes(3).toString('hex')}`);
  mkdirSync(dir);
  made.push(dir);
  writeFileSync(join(dir, 'cgroup.procs'), String(process.pid));
  return dir;
}

const engines: ProcessEngine[] = [];
function newEngine(): { engine: ProcessEngine; warnings: string[] } {
  const warnings: string[] = [];
  const engine = new ProcessEngine({ warn: (l) => warnings.push(l), pidsPerSandbox: PIDS });
  engines.push(engine);
  return { engine, warnings };
}

if (!v2Host && inLab) throw new Error(`the lab has no cgroup v2 hierarchy at ${CG} (test/lab/init.sh mounts one)`);
const v2Test = v2Host ? test : test.skip;

if (!v2Host) {
  test("this host's cgroups are not v2 at /sys/fs/cgroup: the engine does not take them for v2 (the lab checks v2)", async () => {
    const { engine, warnings } = newEngine();
    assert.is.not(engine.cgroups.mode, 'v2', warnings.join('; '));
  });
}

v2Test('each sandbox in a cgroup v2 of its own: its limits, a memory hog killed inside it, pause, removal at kill', async () => {
  const { engine, warnings } = newEngine();
  assert.is(engine.cgroups.mode, 'v2', `the engine uses cgroup v2 (warnings: ${warnings.join('; ')})`);
  progress('creating the template');
  await engine.createTemplate({ name: TEMPLATE, image: 'default', memoryMiB: MEMORY_MIB, warmup: 'WARM = 42' });
  progress('forking 2');
  const [hog, calm] = (await engine.fork(TEMPLATE, 2)) as [Sandbox, Sandbox];
  try {
    const dirs = [hog, calm].map(cgroupOf);
    assert.is.not(dirs[0], dirs[1]);
    for (const [i, s] of [hog, calm].entries()) {
      const d = dirs[i]!;
      assert.ok(d.startsWith(`${CG}/`), d);
      assert.ok(read(d, 'cgroup.procs').split('\n').map(Number).includes(hostPid(s)), `the sandbox's PID 1 is in ${d}`);
      assert.is(read(d, 'memory.max'), String(MEMORY_MIB * 2 ** 20));
      assert.is(read(d, 'pids.max'), String(PIDS));
      assert.match(read(d, 'cpu.max'), /^100000 100000$/, 'one vCPU: one period of CPU time per period');
      assert.is(await val(s, 'WARM'), 42);
    }
    // A CPU limit set again (as the engine raises a zygote's while its forks are set up there), and the
    // zygote's back to the template's once its forks are in their own cgroups.
    const calmCg = (calm as unknown as { cgroup: Cgroup }).cgroup;
    engine.cgroups.setCpuLimit(calmCg, 2.5);
    assert.is(read(dirs[1]!, 'cpu.max'), '250000 100000');
    engine.cgroups.setCpuLimit(calmCg, 1);
    assert.is(read(dirs[1]!, 'cpu.max'), '100000 100000');
    const zygoteCg = readFileSync(`/proc/${engine.zygotePid(TEMPLATE)}/cgroup`, 'utf8').match(/^0::(.*)$/m)![1]!;
    assert.is(read(join(CG, zygoteCg), 'cpu.max'), '100000 100000', "the zygote's own limit again");
    progress('memory hog');
    const hogRun = val(hog, 'x = []\nwhile True: x.append(b"y" * (8 << 20))').catch((e: Error) => e);
    assert.is(await val(calm, 'WARM + 1'), 43, 'a sibling answers while the hog grows');
    assert.instance(await hogRun, Error, 'the hog does not finish normally');
    // (the hog's own cgroup may be gone already, with its sandbox: the engine's directory counts
    // the events of the cgroups below it)
    const ooms = (d: string) => Number(/^oom_kill (\d+)$/m.exec(read(d, 'memory.events'))?.[1]);
    assert.ok(ooms(dirname(dirs[0]!)) >= 1, "the OOM killer acted below the engine's cgroup");
    assert.is(ooms(dirs[1]!), 0, "and not in the sibling's");
    assert.is(await val(calm, 'WARM + 2'), 44, 'the sibling lives on');
    progress('pause');
    await calm.pause();
    assert.is(read(dirs[1]!, 'cgroup.freeze'), '1');
    assert.match(read(dirs[1]!, 'cgroup.events'), /^frozen 1$/m);
    await calm.resume();
    assert.is(await val(calm, 'WARM'), 42);
    await Promise.all([hog.kill(), calm.kill()]);
    for (const d of dirs) assert.not.ok(existsSync(d), `${d} removed at kill`);
  } finally {
    await Promise.all([hog.kill(), calm.kill()]);
  }
});

v2Test('in a cgroup that holds only this process (a delegated scope), the engine moves into a leaf; its sandboxes get their limits', async () => {
  if (process.getuid?.() !== 0 && !inLab) return; // (making cgroups at the hierarchy's root needs root)
  const scope = moveIntoNewCgroup('scope');
  const { engine, warnings } = newEngine();
  assert.is(engine.cgroups.mode, 'v2', `the engine uses cgroup v2 (warnings: ${warnings.join('; ')})`);
  assert.equal(warnings, []);
  assert.ok(ownCgroup().endsWith(`/forkling-host-p${process.pid}`), `this process moved into its leaf: ${ownCgroup()}`);
  assert.match(read(scope, 'cgroup.subtree_control'), /memory/);
  // A second engine of the same process finds the scope above its leaf.
  const second = newEngine();
  assert.is(second.engine.cgroups.mode, 'v2', second.warnings.join('; '));
  await second.engine.close();
  progress('forking 1 in the scope');
  const [s] = (await engine.fork(TEMPLATE, 1)) as [Sandbox];
  const d = cgroupOf(s);
  assert.ok(d.startsWith(`${scope}/forkling-p${process.pid}-`), `the sandbox's cgroup is below the scope: ${d}`);
  assert.is(read(d, 'memory.max'), String(MEMORY_MIB * 2 ** 20));
  assert.is(await val(s, 'WARM'), 42);
  await s.kill();
  assert.not.ok(existsSync(d));
});

v2Test('in a cgroup shared with another process: no limits, and one warning that says why and what to do', async () => {
  if (process.getuid?.() !== 0 && !inLab) return;
  const scope = moveIntoNewCgroup('shared');
  const other = spawn('sleep', ['60'], { stdio: 'ignore' });
  try {
    writeFileSync(join(scope, 'cgroup.procs'), String(other.pid));
    const tree = new CgroupTree(`forkling-p${process.pid}-${randomBytes(4).toString('hex')}`);
    tree.close();
    assert.is(tree.mode, 'none');
    assert.match(tree.warning ?? '', new RegExp(`other processes are in it \\(${other.pid}\\)`));
    assert.match(tree.warning ?? '', /systemd-run --scope -p Delegate=yes/);
    assert.match(tree.warning ?? '', /sandboxes run without memory, pids and cpu limits/);
  } finally {
    other.kill('SIGKILL');
  }
});

test.after(async () => {
  for (const e of engines) await e.close().catch(() => {});
  rmSync(storePath('process-templates', `${TEMPLATE}.json`), { force: true });
  // Back to the hierarchy's root, then the cgroups this file made (leaves first).
  if (made.length) writeFileSync(join(CG, 'cgroup.procs'), String(process.pid));
  for (const d of made.reverse()) {
    for (const leaf of [join(d, `forkling-host-p${process.pid}`), d]) {
      try {
        rmdirSync(leaf);
      } catch {}
    }
  }
});

test.run();
