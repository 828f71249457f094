// Nothing of the process engine outlives its host process: kill -9 the host
// and its zygote, forks, branches and cold-booted sandboxes die with it
// (PR_SET_PDEATHSIG on the keeper and on each launched PID 1, which sandbox
// code cannot undo, then the pid namespace's init rule); the next engine
// removes the stale runtime and cgroup directories.
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, readFileSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { ProcessEngine } from '../../host/engine/process/engine.ts';
import { storePath } from '../../host/store.ts';

const root = dirname(dirname(dirname(fileURLToPath(import.meta.url))));
const TEMPLATE = `test-lifetime-${randomBytes(3).toString('hex')}`;

/** Running (zombies do not count). */
function running(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat[stat.lastIndexOf(')') + 2] !== 'Z';
  } catch {
    return false;
  }
}

test('a script that kills its sandboxes and closes the engine runs to its end, and Node then exits by itself', async () => {
  // (the exit watches do not hold the event loop: a kill awaited with nothing else pending let
  // Node end the script half way, and an exit seen during Node's teardown aborted it)
  const child = spawn(join(root, 'node_modules', '.bin', 'tsx'), [join(root, 'test', 'unit', 'process-lifetime-child.ts')], {
    cwd: root,
    env: { ...process.env, FORKLING_TEST_MODE: 'end' },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let out = '';
  child.stdout.on('data', (d) => (out += d));
  child.stderr.on('data', (d) => (out += d));
  const code = await new Promise((r) => child.once('exit', (c, sig) => r(c ?? sig)));
  assert.is(code, 0, out);
  assert.ok(out.includes('ended'), out);
});

test('kill -9 of the host takes every sandbox with it', async () => {
  const child = spawn(join(root, 'node_modules', '.bin', 'tsx'), [join(root, 'test', 'unit', 'process-lifetime-child.ts')], {
    cwd: root,
    env: { ...process.env, FORKLING_TEST_TEMPLATE: TEMPLATE },
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const line = await new Promise<string>((resolve, reject) => {
    let out = '';
    child.stdout.on('data', (d) => {
      out += d;
      if (out.includes('\n')) resolve(out.split('\n')[0]!);
    });
    child.once('exit', (code) => reject(new Error(`child exited (${code}) before it was ready`)));
  });
  const { pids, cgroups } = JSON.parse(line) as { pids: number[]; cgroups: string[] };
  assert.is(pids.length, 5);
  for (const p of pids) assert.ok(running(p), `pid ${p} runs before the kill`);
  const exited = new Promise((r) => child.once('exit', r));
  // tsx runs the script in a node child of its own: kill that one too (both -9, no cleanup at all)
  const inner = readFileSync(`/proc/${child.pid}/task/${child.pid}/children`, 'utf8').split(' ').filter(Boolean).map(Number);
  for (const p of [...inner, child.pid!]) process.kill(p, 'SIGKILL');
  await exited;
  const deadline = Date.now() + 5000;
  while (pids.some(running) && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
  assert.equal(pids.filter(running), [], 'every zygote and sandbox process is gone');
  // the next engine clears what the dead one could not
  const next = new ProcessEngine({ warn: () => {} });
  await next.close();
  for (const d of cgroups) assert.not.ok(existsSync(d), `stale cgroup ${d} removed`);
  rmSync(storePath('process-templates', `${TEMPLATE}.json`), { force: true });
});

test.run();
