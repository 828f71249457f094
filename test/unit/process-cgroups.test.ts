// The process engine's cgroups: what a forkling process that is gone left
// behind (a sandbox that outlived it: its agent is Python its own code can
// patch, lifeline included) is killed and removed when the next engine starts.
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { CgroupTree } from '../../host/engine/process/cgroups.ts';
import { pollUntil } from '../../host/util/poll.ts';

test("a gone engine's cgroups are emptied (their processes killed) and removed by the next one", async () => {
  const gonePid = spawnSync('true').pid!; // a pid whose process has exited
  const stale = new CgroupTree(`forkling-p${gonePid}-abcdef`);
  if (stale.mode === 'none') {
    console.log(`  (no cgroups here: ${stale.warning}; skipped)`);
    return;
  }
  const cg = stale.create('left-behind', { memoryBytes: 64 << 20, pids: 16, cpus: 1 })!;
  // Not our child (as a left-behind sandbox is not): the init that reaps it is not blocked meanwhile.
  const sh = spawnSync('sh', ['-c', 'sleep 1000 >/dev/null 2>&1 & echo $!'], { encoding: 'utf8' });
  const pid = Number(sh.stdout.trim());
  assert.ok(pid > 0 && existsSync(`/proc/${pid}`), 'the left-behind process runs');
  stale.enter(cg, pid);
  stale.freeze(cg, true); // frozen where there is a freezer: it must go all the same
  const next = new CgroupTree(`forkling-p${process.pid}-123456`);
  try {
    assert.ok(await pollUntil(() => !existsSync(`/proc/${pid}`) || /^State:\s+Z/m.test(readFileSync(`/proc/${pid}/status`, 'utf8')), 5000), 'killed');
    for (const d of cg.dirs) assert.not.ok(existsSync(d), `${d} removed`);
  } finally {
    next.close();
  }
});

test('a sandbox cgroup with cgroups made below it (as its root can without root on the host) is removed, its processes there killed', async () => {
  const tree = new CgroupTree(`forkling-p${process.pid}-777777`);
  if (tree.mode === 'none') {
    console.log(`  (no cgroups here: ${tree.warning}; skipped)`);
    return;
  }
  const cg = tree.create('nested', { memoryBytes: 64 << 20, pids: 16, cpus: 1 })!;
  const sh = spawnSync('sh', ['-c', 'sleep 1000 >/dev/null 2>&1 & echo $!'], { encoding: 'utf8' });
  const pid = Number(sh.stdout.trim());
  try {
    for (const d of cg.dirs) mkdirSync(join(d, 'a', 'b'), { recursive: true });
    for (const d of cg.dirs) writeFileSync(join(d, 'a', 'b', 'cgroup.procs'), String(pid));
    tree.freeze(cg, true);
    await tree.remove(cg);
    for (const d of cg.dirs) assert.not.ok(existsSync(d), `${d} removed`);
    assert.ok(await pollUntil(() => !existsSync(`/proc/${pid}`) || /^State:\s+Z/m.test(readFileSync(`/proc/${pid}/status`, 'utf8')), 5000), 'killed');
  } finally {
    try {
      process.kill(pid, 'SIGKILL');
    } catch {}
    tree.close();
  }
});

test('a sandbox cgroup limits memory, memory + swap where the kernel accounts swap, pids and cpu (set again later)', () => {
  const tree = new CgroupTree(`forkling-p${process.pid}-654321`);
  if (tree.mode === 'none') {
    console.log(`  (no cgroups here: ${tree.warning}; skipped)`);
    return;
  }
  const cg = tree.create('limits', { memoryBytes: 96 << 20, pids: 33, cpus: 0.5 })!;
  try {
    const read = (name: string) => {
      for (const d of cg.dirs) if (existsSync(join(d, name))) return readFileSync(join(d, name), 'utf8').trim();
      return null;
    };
    if (tree.mode === 'v1') {
      assert.is(read('memory.limit_in_bytes'), String(96 << 20));
      const memsw = read('memory.memsw.limit_in_bytes');
      if (memsw !== null) assert.is(memsw, String(96 << 20), 'no swapping past the limit');
      assert.is(read('cpu.cfs_quota_us'), '50000');
    } else {
      assert.is(read('memory.max'), String(96 << 20));
      assert.is(read('memory.swap.max'), '0');
      assert.is(read('cpu.max'), '50000 100000');
    }
    assert.is(read('pids.max'), '33');
    // (as the engine raises a zygote's while its forks are set up there)
    tree.setCpuLimit(cg, 3);
    assert.is(read(tree.mode === 'v1' ? 'cpu.cfs_quota_us' : 'cpu.max'), tree.mode === 'v1' ? '300000' : '300000 100000');
  } finally {
    void tree.remove(cg).finally(() => tree.close());
  }
});

test("prearm (a move into the cgroup a process is in, taken early) leaves the process where it is; a gone process is no error", async () => {
  const tree = new CgroupTree(`forkling-p${process.pid}-424242`);
  if (tree.mode === 'none') {
    console.log(`  (no cgroups here: ${tree.warning}; skipped)`);
    return;
  }
  const cg = tree.create('prearmed', { memoryBytes: 64 << 20, pids: 16, cpus: 1 })!;
  const sh = spawnSync('sh', ['-c', 'sleep 1000 >/dev/null 2>&1 & echo $!'], { encoding: 'utf8' });
  const pid = Number(sh.stdout.trim());
  try {
    tree.enter(cg, pid);
    const before = readFileSync(`/proc/${pid}/cgroup`, 'utf8');
    await tree.prearm(cg, pid);
    assert.is(readFileSync(`/proc/${pid}/cgroup`, 'utf8'), before, 'in the same cgroups');
    assert.equal(tree.pids(cg), [pid]);
    process.kill(pid, 'SIGKILL');
    await pollUntil(() => !tree.pids(cg).includes(pid), 5000);
    await tree.prearm(cg, pid); // (resolves: an optimisation never fails its caller)
  } finally {
    try {
      process.kill(pid, 'SIGKILL');
    } catch {}
    await tree.remove(cg);
    tree.close();
  }
});

test.run();
