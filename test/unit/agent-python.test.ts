// The agent's own Python tests (guest-agent/tests: golden vectors, the
// embedded schema, the validator, PID-1 helpers, a raw-frame smoke test) run
// with Debian's interpreter, counted as one uvu test.
import { spawnSync } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { AGENT_PYTHON } from '../../host/agent/spawn.ts';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');

test('python: unittest discover guest-agent/tests', () => {
  const r = spawnSync(AGENT_PYTHON, ['-m', 'unittest', 'discover', '-v', 'guest-agent/tests'], {
    cwd: root,
    encoding: 'utf8',
    timeout: 60_000,
  });
  const out = `${r.stdout}${r.stderr}`;
  if (r.status !== 0) console.log(out);
  assert.is(r.status, 0, 'python tests failed (output above)');
  const ran = Number(/Ran (\d+) tests?/.exec(out)?.[1] ?? 0);
  assert.ok(ran >= 20, `only ${ran} python tests ran`);
});

test.run();
