// `forkling serve --engine kvm` end to end: a microVM cold-booted through the
// server (Sandbox.boot), used through the SDK (eval, commands, a file round
// trip), killed, and the server drains and exits cleanly; and children of
// the `default` template (made on first use) created, forked and branched
// through the server. Needs /dev/kvm and the default image.
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
    // (in the lab the whole use is retried: the VM's guest may panic in exception entry while in use)
    await labRetry('server boot and use', () => bootAndUse(srv.url));
  } finally {
    Sandbox.disconnectAll();
    assert.is(await srv.stop(), 0, srv.log.join(''));
  }
});

async function bootAndUse(url: string): Promise<void> {
  const t0 = performance.now();
  const sb = await Sandbox.boot({ url, image: 'default', timeoutMs: 600_000 });
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
}

test('create, fork and branch children of a template through forkling serve and the SDK', async () => {
  const srv = await serve({ engine: 'kvm' });
  const opts = { url: srv.url, timeoutMs: 600_000 };
  try {
    // (the template `default` is made on first use: a boot and a freeze, minutes in the lab)
    const a = await labRetry('server create', () => Sandbox.create({ ...opts, template: 'default' }), console.error, 2, ['early', 'silent', 'stall']);
    const info = await a.getInfo();
    assert.is(info.engine, 'kvm');
    assert.is(info.template, 'default');
    const set = await a.eval('import random\nlevel = "a"\nopen("/tmp/mine", "w").write("a")\nrandom.random()');
    assert.is(set.error, undefined, set.error?.traceback);

    const kids = await labRetry('server fork', () => Sandbox.fork('default', 3, opts), console.error, 2, ['early', 'stall']);
    assert.is(kids.length, 3);
    const seen = new Set<unknown>([set.value]);
    for (const k of kids) {
      const r = await k.eval('import random, os\n("level" in globals(), os.path.exists("/tmp/mine"), random.random())');
      assert.is(r.error, undefined, r.error?.traceback);
      const [hasLevel, hasFile, x] = r.value as [boolean, boolean, number];
      assert.is(hasLevel, false, 'a fork of the template sees no state of another child');
      assert.is(hasFile, false, "a fork of the template sees no other child's file");
      assert.not.ok(seen.has(x), 'random.random() differs in every child');
      seen.add(x);
      assert.is((await k.getInfo()).template, 'default');
    }

    const branches = await labRetry('server branch', () => a.branch(2, { timeoutMs: 600_000 }), console.error, 2, ['early', 'stall']);
    assert.is(branches.length, 2);
    for (const [i, b] of branches.entries()) {
      assert.is((await b.getInfo()).parent, a.id);
      const r = await b.eval(`(level, open("/tmp/mine").read())`);
      assert.is(r.error, undefined, r.error?.traceback);
      assert.equal(r.value, ['a', 'a'], 'a branch continues from its source: its variables and RAM files');
      const w = await b.eval(`level = "b${i}"\nopen("/tmp/mine", "w").write("b${i}")`);
      assert.is(w.error, undefined, w.error?.traceback);
    }
    for (const [i, b] of branches.entries()) assert.equal((await b.eval('(level, open("/tmp/mine").read())')).value, [`b${i}`, `b${i}`]);
    const src = await a.eval('(level, open("/tmp/mine").read())');
    assert.equal(src.value, ['a', 'a'], 'the source goes on, unchanged by its branches');

    for (const s of [a, ...kids, ...branches]) assert.is(await s.kill(), true);
    assert.equal(await Sandbox.list({ url: srv.url }), []);
  } finally {
    Sandbox.disconnectAll();
    assert.is(await srv.stop(), 0, srv.log.join(''));
  }
});

test.run();
