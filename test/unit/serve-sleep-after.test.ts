// How long an idle KVM sandbox stays awake before it sleeps (packed, its KVM
// VM closed): `forkling serve --sleep-after-ms` and $FORKLING_KVM_SLEEP_AFTER_MS
// (host/engine/kvm/sleep-after.ts). Bad values are one clear error before
// anything starts; the process engine says it ignores the flag. (That a KVM
// child sleeps and wakes is tested in the lab: test/kvm/fork.test.ts.)
import { spawnSync } from 'node:child_process';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { KvmEngine } from '../../host/engine/kvm/engine.ts';
import { defaultReclaimIdleMs, RECLAIM_IDLE_MS } from '../../host/engine/kvm/sleep-after.ts';
import { UserError } from '../../host/errors.ts';
import { pollUntil } from '../../host/util/poll.ts';
import { serve, serverMode } from './server-harness.ts';

const VAR = 'FORKLING_KVM_SLEEP_AFTER_MS';
const cli = (...args: string[]) =>
  spawnSync(process.execPath, ['bin/forkling.mjs', ...args], { encoding: 'utf8', env: { ...process.env, FORKLING_ENGINE: 'process' }, timeout: 60_000 });

function withEnv<T>(value: string | undefined, f: () => T): T {
  const saved = { v: process.env[VAR], lab: process.env.FORKLING_IN_LAB };
  if (value === undefined) delete process.env[VAR];
  else process.env[VAR] = value;
  delete process.env.FORKLING_IN_LAB;
  try {
    return f();
  } finally {
    if (saved.v === undefined) delete process.env[VAR];
    else process.env[VAR] = saved.v;
    if (saved.lab !== undefined) process.env.FORKLING_IN_LAB = saved.lab;
  }
}

test('$FORKLING_KVM_SLEEP_AFTER_MS: the default when unset, a whole number of ms when set, else one clear error', () => {
  assert.is(withEnv(undefined, defaultReclaimIdleMs), RECLAIM_IDLE_MS);
  assert.is(withEnv('', defaultReclaimIdleMs), RECLAIM_IDLE_MS);
  assert.is(withEnv('2500', defaultReclaimIdleMs), 2500);
  assert.is(withEnv('0', defaultReclaimIdleMs), 0);
  for (const bad of ['soon', '-1', '1.5', '86400001']) {
    try {
      withEnv(bad, defaultReclaimIdleMs);
      assert.unreachable(`${VAR}=${bad} was taken`);
    } catch (e) {
      assert.instance(e, UserError);
      assert.match((e as Error).message, `${VAR}=${bad} is not a whole number from 0 to 86400000`);
    }
  }
  // The engine checks it as it is made, not at its first fork.
  assert.throws(() => withEnv('soon', () => new KvmEngine()), /FORKLING_KVM_SLEEP_AFTER_MS=soon/);
  assert.throws(() => new KvmEngine({ reclaimIdleMs: -1 }), /reclaimIdleMs -1 is not a whole number of ms/);
});

test('serve --sleep-after-ms: a bad value is one clear error before anything starts', () => {
  const word = cli('serve', '--sleep-after-ms', 'soon', '--listen', '127.0.0.1:0');
  assert.is(word.status, 2, word.stderr);
  assert.match(word.stderr, /--sleep-after-ms must be an integer ≥ 0, got "soon"/);
  assert.is(word.stdout, '', 'nothing listened');
  const long = cli('serve', '--sleep-after-ms', '86400001', '--listen', '127.0.0.1:0');
  assert.is(long.status, 2, long.stderr);
  assert.match(long.stderr, /--sleep-after-ms 86400001 is more than a day/);
  assert.match(cli('serve', '--help').stdout, /--sleep-after-ms <n>/);
});

test('serve --sleep-after-ms with the process engine: said to be ignored', async () => {
  if (serverMode() !== 'cli') return;
  const srv = await serve({ engine: 'process', extraArgs: ['--sleep-after-ms', '5000', '--spares', '0'] });
  try {
    // (the line comes after `listening`)
    assert.ok(await pollUntil(() => /--sleep-after-ms is for the kvm engine: ignored/.test(srv.log.join('')), 10_000), srv.log.join(''));
  } finally {
    assert.is(await srv.stop(), 0, srv.log.join(''));
  }
});

test.run();
