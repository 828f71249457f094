// The store's atomic directory builds: a build replaces its directory whole
// or not at all, and what a build that crashed left behind is put right by
// the next build of that directory.
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { buildDirAtomic, removeDirAtomic } from '../../host/store.ts';

const fresh = () => mkdtempSync(join(tmpdir(), 'forkling-store-'));

test('a build replaces the directory whole; a failed one leaves it as it was, with nothing beside it', async () => {
  const parent = fresh();
  const dest = join(parent, 'tpl');
  await buildDirAtomic(dest, async (s) => writeFileSync(join(s, 'a'), 'one'));
  await buildDirAtomic(dest, async (s) => writeFileSync(join(s, 'b'), 'two'));
  assert.equal(readdirSync(dest), ['b']);
  await buildDirAtomic(dest, async (s) => {
    writeFileSync(join(s, 'c'), 'half');
    throw new Error('fill failed');
  }).then(
    () => assert.unreachable('the failure was lost'),
    (e: Error) => assert.is(e.message, 'fill failed'),
  );
  assert.equal(readdirSync(dest), ['b']);
  assert.equal(readdirSync(parent), ['tpl'], 'no staging or old directory left');
});

test("what a build that crashed left is put right by the next: its old directory back in place if it was moved aside, its staging removed", async () => {
  const parent = fresh();
  const dead = spawnSync('true').pid!; // (a process that has exited)
  // crashed between moving the old one aside and moving the new one in
  mkdirSync(join(parent, `.old-tpl-${dead}-0123456789ab`));
  writeFileSync(join(parent, `.old-tpl-${dead}-0123456789ab`, 'state'), 'good');
  mkdirSync(join(parent, `.staging-tpl-${dead}-0123456789ab`));
  // a live process's build (ours) and another directory's leftovers are not touched
  mkdirSync(join(parent, `.staging-tpl-${process.pid}-aaaaaaaaaaaa`));
  mkdirSync(join(parent, `.old-other-${dead}-bbbbbbbbbbbb`));
  await buildDirAtomic(join(parent, 'tpl'), async () => {
    throw new Error('this build fails too');
  }).catch(() => {});
  assert.is(readFileSync(join(parent, 'tpl', 'state'), 'utf8'), 'good', 'the previous directory is back');
  assert.equal(readdirSync(parent).sort(), [`.old-other-${dead}-bbbbbbbbbbbb`, `.staging-tpl-${process.pid}-aaaaaaaaaaaa`, 'tpl'].sort());
});

test('removeDirAtomic: gone in one step, nothing left beside it', () => {
  const parent = fresh();
  mkdirSync(join(parent, 'tpl', 'sub'), { recursive: true });
  writeFileSync(join(parent, 'tpl', 'sub', 'f'), 'x');
  removeDirAtomic(join(parent, 'tpl'));
  assert.not.ok(existsSync(join(parent, 'tpl')));
  assert.equal(readdirSync(parent), []);
});

test.run();
