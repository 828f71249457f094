// `forkling fork` with the process engine: the report's fields (--json) and
// its table, and a bad option's one clear error.
import { spawnSync } from 'node:child_process';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { ensureImage } from '../../host/images.ts';
import { loud } from '../loud-hook.ts';

const env = { ...process.env, FORKLING_ENGINE: 'process' };
const cli = (...args: string[]) => spawnSync(process.execPath, ['bin/forkling.mjs', 'fork', ...args], { encoding: 'utf8', env, timeout: 120_000 });

// The image first, without the CLI's time limit (a fresh store builds it: a minute or more).
test.before(loud("the suite's set-up (test.before)", () => ensureImage('default')));

test('fork --json: the template is loaded apart from the fork; every child answers; memory while alive', () => {
  const r = cli('default', '-n', '2', '--eval', 'print("hi")\n6 * 7', '--json');
  assert.is(r.status, 0, r.stderr);
  const rep = JSON.parse(r.stdout);
  assert.is(rep.engine, 'process');
  assert.is(rep.template, 'default');
  assert.is(rep.n, 2);
  for (const k of ['template_load_ms', 'total_ms', 'ready_ms', 'child_p50_ms', 'child_p99_ms']) {
    assert.ok(typeof rep.timings[k] === 'number' && rep.timings[k] > 0, `${k}: ${rep.timings[k]}`);
  }
  assert.ok(rep.timings.ready_ms <= rep.timings.total_ms);
  assert.ok(rep.memory.per_child_kib > 0);
  assert.is(rep.children.length, 2);
  for (const c of rep.children) assert.equal([c.ok, c.value, c.stdout, c.error], [true, 42, 'hi\n', null]);
  assert.is(new Set(rep.children.map((c: { id: string }) => c.id)).size, 2);
});

test('fork (table): says what loading the template did; a failing eval fails the command', () => {
  const r = cli('default', '-n', '1', '--eval', '1 / 0');
  assert.is(r.status, 1);
  assert.match(r.stdout, /template loaded in [\d.]+ ms \(once per process, before the fork: its zygote started, warm-up run\)/);
  assert.match(r.stdout, /ZeroDivisionError/);
});

test('fork: -n out of range is one clear error', () => {
  const r = cli('default', '-n', '0');
  assert.is(r.status, 2);
  assert.match(r.stderr, /-n|n must/);
});

test.run();
