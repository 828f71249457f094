// `forkling serve --engine kvm` end to end: a microVM cold-booted through the
// server (Sandbox.boot), used through the SDK (eval, commands, a file round
// trip), killed, and the server drains and exits cleanly. Needs /dev/kvm and
// the default image.
import { createHash, randomBytes } from 'node:crypto';
import { suite } from 'uvu';
import * as assert from 'uvu/assert';
import { Sandbox } from '../../host/index.ts';
import { serve } from '../unit/server-harness.ts';
import { labRetry } from './lab-flake.ts';

const test = suite('server-kvm');

test('boot a microVM through forkling serve and use it through the SDK', async () => {
  const srv = await serve({ engine: 'kvm' });
  try {
    const t0 = performance.now();
    const sb = await labRetry('server boot', () => Sandbox.boot({ url: srv.url, image: 'default', timeoutMs: 600_000 }));
    const bootMs = performance.now() - t0;
    const info = await sb.getInfo();
    assert.is(info.engine, 'kvm');
    const r = await sb.eval('import platform\nprint("in the vm")\n(2 + 3, platform.release())');
    assert.is(r.error, undefined, r.error?.traceback);
    assert.is((r.value as unknown[])[0], 5);
    assert.is(r.stdout, 'in the vm\n');
    const c = await sb.commands.run('cat /proc/cmdline; id -u');
    assert.is(c.exitCode, 0, c.stderr);
    assert.match(c.stdout, 'acpi=off');
    const data = randomBytes(3 * 1024 * 1024 + 7);
    await sb.files.write('/tmp/round.bin', data);
    const back = await sb.files.read('/tmp/round.bin', { format: 'bytes' });
    assert.is(createHash('sha256').update(back).digest('hex'), createHash('sha256').update(data).digest('hex'));
    const rtt: number[] = [];
    for (let i = 0; i < 200; i++) {
      const s = performance.now();
      await sb.eval('1+1');
      rtt.push(performance.now() - s);
    }
    rtt.sort((a, b) => a - b);
    console.log(`  kvm through forkling serve: boot ${bootMs.toFixed(0)} ms; eval round trip median ${rtt[100]?.toFixed(3)} ms`);
    assert.is(await sb.kill(), true);
    assert.is(await sb.isRunning(), false);
  } finally {
    Sandbox.disconnectAll();
    assert.is(await srv.stop(), 0, srv.log.join(''));
  }
});

test.run();
