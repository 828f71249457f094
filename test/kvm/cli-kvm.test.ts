// The CLI's templates and forks with the KVM engine, as a user runs them:
// `forkling template create` (a warm-up, memory and vCPUs of its own),
// `template ls`, `fork --json` and `fork --exec` of it, and `template rm`,
// after which a fork of it is refused. Needs /dev/kvm and the default image.
import { spawnSync } from 'node:child_process';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { labProgress } from './lab-flake.ts';

const NAME = `cli-kvm-${process.pid}`;
const env = { ...process.env, FORKLING_ENGINE: 'kvm' };
const progress = labProgress('cli-kvm.test');
const FLAKE = /triple-fault|did not answer within|vsock port \d+: no answer within/;
const LAB_DEATHS = new Set<NodeJS.Signals>(['SIGKILL', 'SIGSEGV', 'SIGILL', 'SIGBUS']);

/**
 * `forkling <args>`; a run ended by a signal says which in its stderr. In the lab a run that hit
 * the lab's early triple fault or stall, or was killed (SIGKILL: the lab's OOM killer, say; one
 * CI run saw `template create` end with no status and no output), or crashed (one CI run, 2026-12-04,
 * saw `template ls`, which makes no VM, end by SIGSEGV: node under the lab's TCG, as LAB SIGILL in
 * test/run.mjs), is run once more, loudly. A run that timed out (SIGTERM) is not.
 */
function cli(...args: string[]) {
  for (let attempt = 1; ; attempt++) {
    progress(`forkling ${args.join(' ')}`);
    const r = spawnSync(process.execPath, ['bin/forkling.mjs', ...args], { encoding: 'utf8', env, timeout: 400_000 });
    if (r.signal) r.stderr += `(forkling was ended by ${r.signal})\n`;
    const flake = FLAKE.test(r.stderr) || (r.signal !== null && LAB_DEATHS.has(r.signal));
    if (r.status === 0 || attempt === 2 || !process.env.FORKLING_IN_LAB || !flake) return r;
    console.log(`LAB FLAKE (forkling ${args[0]} ${args[1]}): ${r.stderr.trim().split('\n').pop()}; tried again`);
  }
}

test('template create, ls, fork (--json, --exec) and rm with the KVM engine', () => {
  const made = cli('template', 'create', NAME, '--image', 'default', '--warmup', 'import json\nanswer = 6 * 7', '--memory', '384', '--json');
  assert.is(made.status, 0, made.stderr);
  const info = JSON.parse(made.stdout);
  assert.equal([info.name, info.engine, info.image, info.memoryMiB, info.vcpus], [NAME, 'kvm', 'default', 384, 1]);

  const ls = cli('template', 'ls', '--json');
  assert.is(ls.status, 0, ls.stderr);
  const listed = (JSON.parse(ls.stdout) as { name: string; engine: string; warmup?: string }[]).find((t) => t.name === NAME);
  assert.equal([listed?.engine, listed?.warmup], ['kvm', 'import json\nanswer = 6 * 7']);

  const fork = cli('fork', NAME, '-n', '3', '--eval', 'import os\nprint("in", os.uname().nodename)\n(answer, json.dumps([1]))', '--json');
  assert.is(fork.status, 0, fork.stderr);
  const rep = JSON.parse(fork.stdout);
  assert.equal([rep.engine, rep.template, rep.n, rep.children.length], ['kvm', NAME, 3, 3]);
  assert.ok(rep.timings.ready_ms > 0 && rep.timings.ready_ms <= rep.timings.total_ms, JSON.stringify(rep.timings));
  assert.ok(rep.memory.per_child_kib > 0, 'memory per child is measured while the children are alive');
  for (const c of rep.children) {
    assert.equal([c.ok, c.value, c.error], [true, [42, '[1]'], null], JSON.stringify(c));
    assert.is(c.stdout, `in ${c.id}\n`, 'each child has its own hostname: its sandbox id');
  }
  assert.is(new Set(rep.children.map((c: { id: string }) => c.id)).size, 3);

  const exec = cli('fork', NAME, '-n', '2', '--exec', 'cat /proc/sys/kernel/hostname; echo oops >&2; exit 3', '--json');
  assert.is.not(exec.status, 0, 'a failing command fails the fork command');
  assert.ok(exec.stdout.trim(), `fork --exec printed its report: ${exec.stderr}`);
  const ex = JSON.parse(exec.stdout);
  for (const c of ex.children) {
    assert.is(c.stdout, `${c.id}\n`);
    assert.is(c.stderr, 'oops\n');
  }

  const rm = cli('template', 'rm', NAME);
  assert.is(rm.status, 0, rm.stderr);
  assert.match(rm.stdout, `removed template ${NAME} (kvm)`);
  const gone = cli('fork', NAME, '-n', '1', '--eval', '1');
  assert.is.not(gone.status, 0);
  assert.match(gone.stderr, 'does not exist');
});

test.run();
