// `forkling doctor` tells the truth about this host: one line per check, the
// engine `auto` would pick and why, and an exit code that says whether the
// chosen engine can run. Commands that need KVM where it is unusable name it.
import { spawnSync } from 'node:child_process';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { cgroupMoveCheck, kernelCheck, kvmDebugfsCheck } from '../../host/doctor/checks.ts';
import { probeKvm } from '../../host/doctor/kvm-probe.ts';

const env = { ...process.env };
delete env.FORKLING_ENGINE;
const cli = (...args: string[]) => spawnSync(process.execPath, ['bin/forkling.mjs', ...args], { encoding: 'utf8', env });

interface Report {
  ok: boolean;
  engine: string;
  engineReason: string;
  checks: { name: string; status: string; detail: string; fix?: string }[];
}

test('doctor --json: every check, and the engine auto picks matches the KVM probe', () => {
  const r = cli('doctor', '--json');
  const rep = JSON.parse(r.stdout) as Report;
  const names = rep.checks.map((c) => c.name);
  for (const n of ['node', '/dev/kvm', 'host kernel', 'cgroups', 'cgroup moves', 'user namespaces', 'userfaultfd', 'store space', 'image tools', 'lab tools']) {
    assert.ok(names.includes(n), `missing check ${n}: ${names.join(', ')}`);
  }
  for (const c of rep.checks) {
    assert.ok(['pass', 'warn', 'fail'].includes(c.status), c.name);
    if (c.status === 'fail') assert.ok(c.fix, `a failing check says how to fix it: ${c.name}`);
  }
  const kvm = probeKvm();
  assert.is(rep.engine, kvm.usable ? 'kvm' : 'process');
  if (!kvm.usable) assert.match(rep.engineReason, kvm.reason);
  assert.is(r.status, rep.ok ? 0 : 1);
});

test('doctor (text): one line per check, then the engine line', () => {
  const r = cli('doctor');
  const lines = r.stdout.split('\n').filter((l) => /^(pass|warn|FAIL)\s/.test(l));
  assert.ok(lines.length >= 9, r.stdout);
  assert.match(r.stdout, /\nengine/);
});

test('doctor --engine kvm fails where KVM cannot run; a bad engine is a clear error', () => {
  if (!probeKvm().usable) {
    const r = cli('doctor', '--engine', 'kvm');
    assert.is(r.status, 1, r.stdout);
    assert.match(r.stdout, 'engine kvm cannot run here');
    const run = cli('run', 'default', '--engine', 'kvm', '--eval', '1');
    assert.is.not(run.status, 0);
    assert.match(run.stderr, 'forkling doctor');
  }
  const bad = cli('doctor', '--engine', 'qemu');
  assert.is(bad.status, 2);
  assert.match(bad.stderr, 'unknown engine');
  assert.match(bad.stderr, 'fix:');
});

test("cgroup moves: favordynmods on any cgroup mount passes; off, a warning names the mount to remount", () => {
  const hybrid = [
    '25 24 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755',
    '26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw',
    '28 25 0:25 / /sys/fs/cgroup/pids rw,nosuid,nodev,noexec,relatime shared:14 - cgroup cgroup rw,pids',
  ];
  const off = cgroupMoveCheck(hybrid.join('\n'));
  assert.is(off.status, 'warn');
  assert.match(off.fix ?? '', 'mount -o remount,favordynmods "/sys/fs/cgroup/unified"');
  const on = cgroupMoveCheck(hybrid.map((l) => l.replace(/cgroup2 rw$/, 'cgroup2 rw,favordynmods')).join('\n'));
  assert.is(on.status, 'pass');
  assert.match(on.detail, '/sys/fs/cgroup/unified');
  const v2 = cgroupMoveCheck('30 1 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot');
  assert.match(v2.fix ?? '', 'remount,favordynmods "/sys/fs/cgroup" ');
  const spaced = cgroupMoveCheck('31 1 0:27 / /mnt/my\\040cg rw - cgroup2 cgroup2 rw,favordynmods');
  assert.match(spaced.detail, '/mnt/my cg');
  assert.is(cgroupMoveCheck('22 1 0:5 / /proc rw - proc proc rw').status, 'pass');
});

test('host kernel: 5.14 or newer passes; 5.10-5.13 warns that forks copy nothing ahead; older warns untested', () => {
  assert.is(kernelCheck('6.18.44-fc-v1252').status, 'pass');
  assert.is(kernelCheck('5.14.0-1-amd64').status, 'pass');
  const noPopulate = kernelCheck('5.10.0-30-amd64');
  assert.is(noPopulate.status, 'warn');
  assert.match(noPopulate.detail, 'MADV_POPULATE_WRITE');
  assert.match(noPopulate.fix ?? '', '5.14');
  const old = kernelCheck('4.19.0');
  assert.is(old.status, 'warn');
  assert.match(old.detail, 'older than 5.10');
});

test('KVM debugfs: on, a warning says what it costs per sandbox and how to turn it off; off passes', () => {
  const on = kvmDebugfsCheck('nodev\tsysfs\nnodev\tdebugfs\nnodev\ttracefs\n\text4\n');
  assert.is(on.status, 'warn');
  assert.match(on.detail, 'per sandbox');
  assert.match(on.fix ?? '', 'debugfs=off');
  assert.is(kvmDebugfsCheck('nodev\tsysfs\nnodev\ttracefs\n\text4\n').status, 'pass');
  // (a name that only contains it is not it)
  assert.is(kvmDebugfsCheck('nodev\tmydebugfs2\n').status, 'pass');
});

test.run();
