// The KVM lab's console parsing, which runs without qemu.
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { LabConsole } from '../lab/console.ts';

function feedAll(lines: string[], chunk = 7): LabConsole {
  let t = 0;
  const con = new LabConsole(undefined, () => ++t);
  const text = lines.map((l) => `${l}\r\n`).join('');
  // Arbitrary chunking: lines arrive split across reads.
  for (let i = 0; i < text.length; i += chunk) con.feed(text.slice(i, i + chunk));
  con.flush();
  return con;
}

test('console: stages, the summary, the failure list and the recap of what failed in the inner suite', () => {
  const con = feedAll([
    '[    1.2] random kernel line',
    '3 passed, 9 failed',
    'LAB-STAGE kernel-up 1.9',
    'LAB-STAGE kvm-ready 1 2.8',
    'LAB-STAGE mounted 3.0',
    'LAB-NODE-START 3.0',
    '',
    '=== KVM tests',
    '=== what failed (the details above, again)',
    '--- test/kvm/a.test.ts',
    '   FAIL  "boots"',
    '[   9.1] a kernel line in between',
    '    the agent answers  (is)',
    '',
    '--- test/kvm/b.test.ts (ran no test, exit 1)',
    'Error: boom',
    'failed: test/kvm/a.test.ts, test/kvm/b.test.ts',
    '',
    '5 passed, 2 failed',
    'LAB-EXIT 1 12.7',
    'kernel: [ 12.7] something',
    '1 passed, 0 failed',
    'LAB-POWEROFF',
  ]);
  assert.equal(con.outcome.summary, {
    passed: 5,
    failed: 2,
    failures: ['test/kvm/a.test.ts', 'test/kvm/b.test.ts'],
    details: ['--- test/kvm/a.test.ts', '   FAIL  "boots"', '    the agent answers  (is)', '--- test/kvm/b.test.ts (ran no test, exit 1)', 'Error: boom'],
  });
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

test('console: the file the inner suite runs, and when the last line came (to tell a frozen lab)', () => {
  let t = 100;
  const con = new LabConsole(undefined, () => t);
  assert.is(con.lastLineAt, 100);
  assert.is(con.runningFile, null);
  t = 250;
  con.feed('LAB-NODE-START 3.0\nLAB-FILE test/kvm/boot.test.ts\n');
  assert.is(con.runningFile, 'test/kvm/boot.test.ts');
  assert.is(con.lastLineAt, 250);
  t = 900;
  con.feed('--- test/kvm/boot.test.ts (9.0s)\nLAB-FILE test/kvm/fork.test.ts\n');
  assert.is(con.runningFile, 'test/kvm/fork.test.ts');
  assert.is(con.lastLineAt, 900);
  t = 2000;
  con.feed('partial line without its end');
  assert.is(con.lastLineAt, 900, 'only complete lines count');
  assert.ok(!con.stages.has('first-output') || con.stages.get('first-output') === 900, 'LAB-FILE lines are not output of the suite');
});

test("console: the lab's heartbeat says when it last ran; it is neither shown, nor output, nor in the tail", () => {
  let t = 100;
  const shown: string[] = [];
  const con = new LabConsole((l) => shown.push(l), () => t);
  con.feed('LAB-NODE-START 3.0\n');
  assert.is(con.lastBeatAt, null, 'none before the first');
  t = 300;
  con.feed('LAB-BEAT 23.1\n');
  assert.is(con.lastBeatAt, 300);
  assert.is(con.lastLineAt, 100, 'a heartbeat is not output of the suite');
  assert.not.ok(con.stages.has('first-output'));
  assert.equal(shown, ['LAB-NODE-START 3.0']);
  assert.equal(con.lastLines(), ['LAB-NODE-START 3.0']);
});

test("console: the lab kernel's soft lockup reports tell a stuck CPU, and its log lines are not the suite's output", () => {
  let t = 100;
  const con = new LabConsole(undefined, () => t);
  con.feed('LAB-NODE-START 3.0\nLAB-FILE test/kvm/fork.test.ts\n');
  t = 500;
  con.feed('[  429.2] watchdog: BUG: soft lockup - CPU#1 stuck for 22s! [node:383]\n[  429.2] Call Trace:\n');
  assert.is(con.stuckS, 22);
  assert.is(con.lastLineAt, 100, 'kernel log lines do not count as output');
  con.feed('kernel: [  429.2] watchdog: BUG: soft lockup - CPU#1 stuck for 22s! [node:383]\nkernel: [  429.2] RIP: 0010:svm_vcpu_run+0x1c\n');
  assert.is(con.lastLineAt, 100, 'nor the full report init.sh shows from dmesg');
  con.feed('[  803.2] watchdog: BUG: soft lockup - CPU#1 stuck for 396s! [node:383]\n');
  con.feed('[  810.0] watchdog: BUG: soft lockup - CPU#0 stuck for 23s! [node:390]\n');
  assert.is(con.stuckS, 396);
  // (each CPU's last report, for the watch that ends a boot where every CPU is stuck at once)
  assert.equal(con.stuckByCpu.get(1), { s: 396, at: 500 });
  assert.equal(con.stuckByCpu.get(0), { s: 23, at: 500 });
  t = 600;
  con.feed('  [+] 3 more\n');
  assert.is(con.lastLineAt, 600);
  t = 700;
  con.feed('[fork.test +12.5s] test: 10 children in parallel\n');
  assert.is(con.lastLineAt, 700, "a test file's progress line (labProgress) counts");
});

test.run();
