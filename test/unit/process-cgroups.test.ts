// The process engine's cgroups: what a forkling process that is gone left
// behind (a sandbox that outlived it: its agent is Python its own code can
// patch, lifeline included) is killed and removed when the next engine starts.
import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
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

test.run();
