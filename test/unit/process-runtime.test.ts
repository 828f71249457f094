// Where the process engine keeps its runtime directories (the stages of its
// zygotes and cold-booted sandboxes), and that it refuses one it does not own alone.
import { spawnSync } from 'node:child_process';
import { chmodSync, chownSync, existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { inMemory, ownPrivateDir, removeTree, runtimeRoot } from '../../host/engine/process/runtime.ts';

const only = (...paths: string[]) => (p: string) => paths.includes(p);

test('FORKLING_RUNTIME_DIR wins', () => {
  assert.is(runtimeRoot({ FORKLING_RUNTIME_DIR: '/x/y' }, 0, () => false), '/x/y');
  assert.is(runtimeRoot({ FORKLING_RUNTIME_DIR: '/x/y', XDG_RUNTIME_DIR: '/r' }, 1000, () => true), '/x/y');
});

test('root: /run/forkling where /run is in memory (or /dev/shm is not), else /dev/shm/forkling', () => {
  assert.is(runtimeRoot({}, 0, only('/run', '/dev/shm')), '/run/forkling');
  assert.is(runtimeRoot({}, 0, () => false), '/run/forkling');
  assert.is(runtimeRoot({}, 0, only('/dev/shm')), '/dev/shm/forkling');
});

test('a user: $XDG_RUNTIME_DIR/forkling, else the temporary directory or /dev/shm when only that is in memory', () => {
  assert.is(runtimeRoot({ XDG_RUNTIME_DIR: '/run/user/1000' }, 1000, () => false), '/run/user/1000/forkling');
  assert.is(runtimeRoot({}, 1000, () => true), join(tmpdir(), 'forkling-1000'));
  assert.is(runtimeRoot({}, 1000, () => false), join(tmpdir(), 'forkling-1000'));
  assert.is(runtimeRoot({}, 1000, only('/dev/shm')), '/dev/shm/forkling-1000');
});

test('inMemory tells tmpfs from a disk', () => {
  assert.is(inMemory('/proc/self'), false);
  assert.is(inMemory('/no/such/path'), false);
  const shm = inMemory('/dev/shm');
  if (!shm) console.log('  (/dev/shm is not tmpfs here: the positive case is not checked)');
  else assert.ok(shm);
});

test('the runtime directory must be ours alone: made 0700, others refused', () => {
  const base = mkdtempSync(join(tmpdir(), 'forkling-rt-'));
  try {
    const mine = join(base, 'mine');
    ownPrivateDir(mine);
    ownPrivateDir(mine); // again: it exists, still fine
    const open = join(base, 'open');
    mkdirSync(open);
    chmodSync(open, 0o777);
    assert.throws(() => ownPrivateDir(open), /writable by others/);
    const link = join(base, 'link');
    symlinkSync(mine, link);
    assert.throws(() => ownPrivateDir(link), /not a directory/);
    if (process.getuid?.() === 0) {
      const theirs = join(base, 'theirs');
      mkdirSync(theirs, { mode: 0o700 });
      chownSync(theirs, 4321, 4321);
      assert.throws(() => ownPrivateDir(theirs), /belongs to uid 4321/);
    }
  } finally {
    rmSync(base, { recursive: true, force: true });
  }
});

test('removeTree: what a sandbox wrote goes, following no link; deeper than PATH_MAX too; nothing outside', () => {
  const base = mkdtempSync(join(tmpdir(), 'forkling-rmtree-'));
  const outside = mkdtempSync(join(tmpdir(), 'forkling-rmtree-outside-'));
  try {
    writeFileSync(join(outside, 'keep'), 'host file');
    const sb = join(base, 's', 'abc');
    mkdirSync(join(sb, 'd', 'e'), { recursive: true });
    writeFileSync(join(sb, 'd', 'e', 'f'), 'x');
    symlinkSync(outside, join(sb, 'link-to-outside')); // a link to a host directory: removed as a link
    symlinkSync(outside, join(sb, 'd', 'swapped'));
    mkdirSync(join(sb, 'ro'));
    writeFileSync(join(sb, 'ro', 'f'), 'x');
    chmodSync(join(sb, 'ro'), 0o500);
    // deeper than PATH_MAX (Node's rmSync fails there with ENAMETOOLONG)
    const mkDeep = 'import os, sys\nos.chdir(sys.argv[1])\nfor _ in range(500):\n    os.mkdir("aaaaaaaaaaaaaaa")\n    os.chdir("aaaaaaaaaaaaaaa")\nopen("f", "w").close()';
    const deep = spawnSync('python3', ['-c', mkDeep, sb]);
    assert.is(deep.status, 0, String(deep.stderr));
    assert.is(removeTree(base, sb), null);
    assert.not.ok(existsSync(sb));
    assert.equal(readdirSync(outside), ['keep'], 'the linked host directory is untouched');
    // A link among the components below base is not followed either: base/l/x where l -> outside.
    symlinkSync(outside, join(base, 'l'));
    assert.match(String(removeTree(base, join(base, 'l', 'keep'))), /no link followed/);
    assert.ok(existsSync(join(outside, 'keep')));
    assert.match(String(removeTree(base, '/etc')), /is not below/);
    assert.is(removeTree(base, join(base, 'gone')), null, 'what is not there is removed already');
  } finally {
    rmSync(base, { recursive: true, force: true });
    rmSync(outside, { recursive: true, force: true });
  }
});

test.run();
