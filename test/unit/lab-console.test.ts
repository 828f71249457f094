// The KVM lab's pieces that run without qemu: console parsing and the cpio writer.
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { LabConsole } from '../lab/console.ts';
import { cpioArchive } from '../lab/cpio.ts';

function feedAll(lines: string[], chunk = 7): LabConsole {
  let t = 0;
  const con = new LabConsole(undefined, () => ++t);
  const text = lines.map((l) => `${l}\r\n`).join('');
  // Arbitrary chunking: lines arrive split across reads.
  for (let i = 0; i < text.length; i += chunk) con.feed(text.slice(i, i + chunk));
  con.flush();
  return con;
}

test('console: stages, the summary and the failure list of the inner suite', () => {
  const con = feedAll([
    '[    1.2] random kernel line',
    '3 passed, 9 failed',
    'LAB-STAGE kernel-up 1.9',
    'LAB-STAGE kvm-ready 1 2.8',
    'LAB-STAGE mounted 3.0',
    'LAB-NODE-START 3.0',
    '',
    '=== KVM tests',
    'failed: test/kvm/a.test.ts, test/kvm/b.test.ts',
    '',
    '5 passed, 2 failed',
    'LAB-EXIT 1 12.7',
    'kernel: [ 12.7] something',
    '1 passed, 0 failed',
    'LAB-POWEROFF',
  ]);
  assert.equal(con.outcome.summary, { passed: 5, failed: 2, failures: ['test/kvm/a.test.ts', 'test/kvm/b.test.ts'] });
  assert.is(con.outcome.exitCode, 1);
  assert.is(con.outcome.setupFailure, null);
  assert.equal([...con.stages.keys()], ['kernel-up', 'kvm-ready', 'mounted', 'node-start', 'first-output', 'exit', 'poweroff']);
  assert.is(con.lastLines(1)[0], 'LAB-POWEROFF');
});

test('console: set-up failures and a missing summary', () => {
  const con = feedAll(['LAB-STAGE kernel-up 1.0', 'LAB-FAIL insmod kvm_amd', 'LAB-FAIL later']);
  assert.is(con.outcome.setupFailure, 'insmod kvm_amd');
  assert.is(con.outcome.summary, null);
  assert.is(con.outcome.exitCode, null);
  const t = feedAll(['LAB-NODE-START 3', 'LAB-TIMEOUT killed', 'LAB-EXIT 137 40']);
  assert.ok(t.outcome.innerTimeout);
  assert.is(t.outcome.summary, null);
  assert.is(t.outcome.exitCode, 137);
});

test('cpio: newc records, 4-byte alignment and trailer', () => {
  const a = cpioArchive([
    { kind: 'dir', path: 'bin' },
    { kind: 'file', path: '/bin/x', data: Buffer.from('hello'), mode: 0o755 },
    { kind: 'chardev', path: 'dev/console', major: 5, minor: 1 },
  ]);
  assert.is(a.length % 4, 0);
  const names: string[] = [];
  let off = 0;
  for (;;) {
    assert.is(a.subarray(off, off + 6).toString('ascii'), '070701', `magic at ${off}`);
    const field = (i: number) => Number.parseInt(a.subarray(off + 6 + i * 8, off + 14 + i * 8).toString('ascii'), 16);
    const mode = field(1);
    const size = field(6);
    const nameSize = field(11);
    const rdev = [field(9), field(10)];
    const name = a.subarray(off + 110, off + 110 + nameSize - 1).toString();
    names.push(name);
    off += 110 + nameSize;
    off += (4 - (off % 4)) % 4;
    if (name === 'bin/x') {
      assert.is(mode, 0o100755);
      assert.is(a.subarray(off, off + size).toString(), 'hello');
    }
    if (name === 'dev/console') assert.equal(rdev, [5, 1]);
    off += size;
    off += (4 - (off % 4)) % 4;
    if (name === 'TRAILER!!!') break;
  }
  assert.equal(names, ['bin', 'bin/x', 'dev/console', 'TRAILER!!!']);
  assert.is(off, a.length);
  assert.throws(() => cpioArchive([{ kind: 'dir', path: '../etc' }]), /bad cpio path/);
});

test.run();
