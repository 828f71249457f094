// Settings from the environment: malformed values are one clear error, never silently the default.
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { UserError } from '../../host/errors.ts';
import { envFlag, envWhole } from '../../host/util/env.ts';

function withEnv<T>(name: string, value: string | undefined, fn: () => T): T {
  const old = process.env[name];
  if (value === undefined) delete process.env[name];
  else process.env[name] = value;
  try {
    return fn();
  } finally {
    if (old === undefined) delete process.env[name];
    else process.env[name] = old;
  }
}

function refused(fn: () => unknown, match: RegExp): void {
  try {
    fn();
  } catch (e) {
    assert.instance(e, UserError);
    assert.match((e as Error).message, match);
    assert.ok((e as UserError).hint, 'says how to fix it');
    return;
  }
  assert.unreachable('expected a UserError');
}

test('envWhole: unset or empty is the default; whole numbers in range are taken; anything else is refused', () => {
  const N = 'FORKLING_TEST_WHOLE';
  assert.is(withEnv(N, undefined, () => envWhole(N, 3, 0, 10)), 3);
  assert.is(withEnv(N, ' ', () => envWhole(N, 3, 0, 10)), 3);
  assert.is(withEnv(N, '0', () => envWhole(N, 3, 0, 10)), 0);
  assert.is(withEnv(N, '10', () => envWhole(N, 3, 0, 10)), 10);
  for (const bad of ['11', '-1', '2.5', 'abc', '1e2', '0x4', '8 spares']) {
    refused(() => withEnv(N, bad, () => envWhole(N, 3, 0, 10)), new RegExp(`^${N}=.* is not a whole number from 0 to 10$`));
  }
});

test('envFlag: 1 and 0; unset is the default; anything else is refused', () => {
  const N = 'FORKLING_TEST_FLAG';
  assert.is(withEnv(N, undefined, () => envFlag(N)), false);
  assert.is(withEnv(N, undefined, () => envFlag(N, true)), true);
  assert.is(withEnv(N, '1', () => envFlag(N)), true);
  assert.is(withEnv(N, '0', () => envFlag(N, true)), false);
  for (const bad of ['true', 'yes', 'on', '2']) refused(() => withEnv(N, bad, () => envFlag(N)), /is neither 1 \(on\) nor 0 \(off\)/);
});

test.run();
