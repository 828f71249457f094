// BRANCH on the KVM engine with a Linux image and its agent (needs /dev/kvm
// on which the distribution kernel boots, and the default image): children
// continue from the live state of a running sandbox, three levels deep; the
// source goes on; children are independent of the source and each other.
import { rmSync } from 'node:fs';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { KvmEngine } from '../../host/engine/kvm/engine.ts';
import { templateDir } from '../../host/engine/kvm/template.ts';
import type { KvmSandbox } from '../../host/engine/kvm/vm.ts';
import { labRetry, labTest } from './lab-flake.ts';
import { loud } from '../loud-hook.ts';

const engine = new KvmEngine();
const NAME = `test-branch-${process.pid}`;
const alive: KvmSandbox[] = [];

test.before(loud("the suite's set-up (test.before)", async () => {
  await labRetry('template boot', () => engine.createTemplate({ name: NAME, image: 'default', warmup: 'BASE = "template"' }));
}));

labTest('a BRANCH child sees variables and RAM files set after the template; the source goes on', async () => {
  const [src] = await engine.fork(NAME, 1);
  alive.push(src!);
  await src!.agent.eval('L1 = "one"\nbig = bytearray(8 << 20)\nbig[::4096] = b"x" * len(big[::4096])');
  await src!.agent.writeFile('/tmp/from-source', 'source file');
  const kids = await engine.branch(src!, 2);
  alive.push(...kids);
  const b = engine.lastBranch!;
  assert.ok(b.privatePages >= 2048, `the 8 MiB the source wrote is in the diff (${b.privatePages} pages)`);
  console.log(`    branch: pre-copy ${b.precopyUs.toFixed(0)} µs, source paused ${b.pauseUs.toFixed(0)} µs, ${b.privatePages} pages in ${b.runs} runs`);
  for (const k of kids) {
    assert.is((await k.agent.eval('(BASE, L1, big.count(b"x"))')).repr, "('template', 'one', 2048)");
    assert.is(new TextDecoder().decode(await k.agent.readFile('/tmp/from-source')), 'source file');
  }
  // The source goes on, and what it does now no child sees (and the other way round).
  assert.is((await src!.agent.eval('L1 + "-after"')).value, 'one-after');
  await src!.agent.eval('SOURCE_ONLY = 1');
  await kids[0]!.agent.eval('CHILD_ONLY = 1');
  assert.is((await kids[1]!.agent.eval('"SOURCE_ONLY" in dir() or "CHILD_ONLY" in dir()')).value, false);
  assert.is((await src!.agent.eval('"CHILD_ONLY" in dir()')).value, false);
});

labTest('a third-level BRANCH child sees all three levels', async () => {
  const [l0] = await engine.fork(NAME, 1);
  alive.push(l0!);
  await l0!.agent.eval('A = 1');
  const [l1] = await engine.branch(l0!, 1);
  alive.push(l1!);
  await l1!.agent.eval('B = 2');
  const [l2] = await engine.branch(l1!, 1);
  alive.push(l2!);
  await l2!.agent.eval('C = 3');
  const [l3] = await engine.branch(l2!, 1);
  alive.push(l3!);
  assert.is(engine.lastBranch!.depth, 3);
  assert.is((await l3!.agent.eval('(BASE, A, B, C)')).repr, "('template', 1, 2, 3)");
  // Each level's fresh identity came from restore.
  const ids = await Promise.all([l1!, l2!, l3!].map(async (s) => (await s.agent.request('hello', { versions: [1] })).sandboxId));
  assert.equal(ids, [l1!.id, l2!.id, l3!.id]);
});

test.after(async () => {
  await Promise.all(alive.map((s) => s.kill()));
  await engine.close();
  rmSync(templateDir(NAME), { recursive: true, force: true });
});
test.run();
