// `forkling template create|ls|rm` with the process engine: a warm-up's time
// limit (--warmup-timeout), its clear errors, and that a refused template
// leaves nothing in the store.
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { readFileSync, writeFileSync } from 'node:fs';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { ensureImage } from '../../host/images.ts';
import { storePath } from '../../host/store.ts';
import { loud } from '../loud-hook.ts';

const env = { ...process.env, FORKLING_ENGINE: 'process' };
const cli = (...args: string[]) => spawnSync(process.execPath, ['bin/forkling.mjs', ...args], { encoding: 'utf8', env, timeout: 120_000 });
const NAME = `test-cli-template-${randomBytes(3).toString('hex')}`;
const listed = () => (JSON.parse(cli('template', 'ls', '--json').stdout) as { name: string }[]).some((t) => t.name === NAME);

test.before(loud("the suite's set-up (test.before)", () => ensureImage('default')));
test.after(() => {
  cli('template', 'rm', NAME);
});

test('template ls --help and template rm --help print the help (not a listing, not an error)', () => {
  for (const sub of ['ls', 'rm']) {
    const r = cli('template', sub, '--help');
    assert.is(r.status, 0, r.stderr);
    assert.match(r.stdout, /forkling template create <name>/);
  }
});

test('template create: a bad --warmup-timeout is one clear error, before anything starts', () => {
  const alone = cli('template', 'create', NAME, '--warmup-timeout', '5');
  assert.is(alone.status, 2, alone.stderr);
  assert.match(alone.stderr, /--warmup-timeout limits a warm-up: give one with --warmup/);
  const zero = cli('template', 'create', NAME, '--warmup', 'W = 1', '--warmup-timeout', '0');
  assert.is(zero.status, 2, zero.stderr);
  assert.match(zero.stderr, /--warmup-timeout must be an integer from 1 to 86400 \(got "0"\)/);
  assert.not.ok(listed());
});

test('template create: a warm-up past its limit is interrupted and refused, saying how to allow more; nothing is saved', () => {
  const t0 = performance.now();
  const r = cli('template', 'create', NAME, '--warmup', 'import time\nwhile True: time.sleep(0.05)', '--warmup-timeout', '1');
  assert.is(r.status, 2, r.stderr);
  assert.match(r.stderr, new RegExp(`the warm-up of template ${NAME} did not finish within 1 s`));
  assert.match(r.stderr, /--warmup-timeout <seconds>/);
  assert.ok(performance.now() - t0 < 60_000);
  assert.not.ok(listed(), 'no template saved');
});

test('template create: a warm-up within its limit; the limit is kept with the template (a zygote runs it again, under it, at each start)', () => {
  const r = cli('template', 'create', NAME, '--warmup', 'import time\ntime.sleep(1.5)\nW = 7', '--warmup-timeout', '30', '--json');
  assert.is(r.status, 0, r.stderr);
  assert.is((JSON.parse(r.stdout) as { warmupTimeoutMs?: number }).warmupTimeoutMs, 30_000);
  assert.ok(listed());
  // another process starts the template's zygote from its saved definition
  const f = cli('fork', NAME, '-n', '1', '--eval', 'W * 6', '--json');
  assert.is(f.status, 0, f.stderr);
  assert.equal((JSON.parse(f.stdout) as { children: { value: unknown }[] }).children.map((c) => c.value), [42]);
  // the saved limit is the one a start runs under: 1 s is too little for that warm-up
  const file = storePath('process-templates', `${NAME}.json`);
  writeFileSync(file, JSON.stringify({ ...JSON.parse(readFileSync(file, 'utf8')), warmupTimeoutMs: 1000 }));
  const late = cli('fork', NAME, '-n', '1', '--eval', 'W');
  assert.is(late.status, 2, late.stderr);
  assert.match(late.stderr, new RegExp(`the warm-up of template ${NAME} did not finish within 1 s \\(interrupted in <cell-\\d+>, line 2: time.sleep\\(1.5\\)\\)`));
});

test.run();
