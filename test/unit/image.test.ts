// Guest images built for real from the host's apt sources: `default` and one
// with python3-numpy, checked file by file against their manifests, run in a
// chroot, rebuilt for the same sha256, and bad input refused with the store
// unchanged. Needs root, mmdebstrap, zstd, cpio and the apt sources (the
// first run downloads the packages and the kernel into the cache; later runs
// reuse it: FORKLING_CACHE, default /var/tmp/forkling-test-cache).
import { execFileSync, spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { copyFileSync, existsSync, lstatSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { basename, dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { imageCommand } from '../../host/cli/image.ts';
import { UserError } from '../../host/errors.ts';
import { buildImage, ensureImage, type ImageManifest, listImages, loadImage, verifyImage } from '../../host/images.ts';
import { DEFAULT_AGENT, readAgent } from '../../images/build.ts';
import { listCpio, walkTree } from '../../images/cpio.ts';
import { GUEST_MODULES } from '../../images/modules.ts';

process.env.FORKLING_CACHE ||= '/var/tmp/forkling-test-cache';
const root = fileURLToPath(new URL('../..', import.meta.url));
const home = mkdtempSync('/var/tmp/forkling-image-test-');
process.env.FORKLING_HOME = home;
const times: Record<string, number> = {};
// The agent as it is now: the builds compared for equal bytes must see the same agent files.
const agentDir = join(home, 'agent');
mkdirSync(agentDir);
for (const f of readdirSync(dirname(DEFAULT_AGENT))) if (f.endsWith('.py')) copyFileSync(join(dirname(DEFAULT_AGENT), f), join(agentDir, f));
const agentPath = join(agentDir, basename(DEFAULT_AGENT));
let first: ImageManifest;

async function timedBuild(label: string, name: string, extras: string[] = []): Promise<ImageManifest> {
  const t = Date.now();
  const m = await buildImage({ name, extras, agentPath });
  times[label] = (Date.now() - t) / 1000;
  return m;
}

/** Every path under dir with type, size and mtime: equal snapshots mean nothing changed. */
function snapshot(dir: string): string[] {
  if (!existsSync(dir)) return [];
  return walkTree(dir).map((e) => `${e.path} ${e.stat.mode} ${e.stat.size} ${e.stat.mtimeMs} ${e.stat.ino}`);
}

function chrootPython(root: string, code: string): string {
  // env -i: nothing of the host's Python setup (PYTHONPATH, pyenv) leaks in.
  const r = spawnSync('chroot', [root, '/usr/bin/env', '-i', 'PATH=/usr/bin:/bin', '/usr/bin/python3', '-c', code], { encoding: 'utf8' });
  assert.is(r.status, 0, `python in the chroot failed: ${r.stderr}`);
  return r.stdout.trim();
}

function expectUserError(e: unknown, re: RegExp): void {
  assert.instance(e, UserError, `not a UserError: ${String(e)}`);
  assert.match((e as Error).message, re);
}

async function refused(opts: Parameters<typeof buildImage>[0], re: RegExp): Promise<void> {
  try {
    await buildImage(opts);
  } catch (e) {
    expectUserError(e, re);
    return;
  }
  assert.unreachable(`build ${JSON.stringify(opts)} succeeded`);
}

test('default: builds, and every file matches the sha256 in its manifest', async () => {
  first = await timedBuild('default (first)', 'default');
  const img = loadImage('default');
  assert.equal(await verifyImage('default'), []);
  const m = img.manifest;
  assert.is(m.name, 'default');
  for (const p of ['python3', 'python3-msgpack', 'usr-is-merged']) assert.ok(m.packages.installed.some((x) => x.name === p), `${p} not installed`);
  assert.not.ok(m.packages.installed.some((x) => x.name === 'perl' || x.name === 'usrmerge'), 'perl or usrmerge pulled in');
  assert.ok(m.cmdline.includes('rdinit=/init'));
  assert.ok(m.cmdline.some((a) => /^forkling\.port=\d+$/.test(a)));
  assert.is(m.agent.version, readAgent(agentPath).version);
  assert.is(m.agent.sha256, createHash('sha256').update(readFileSync(agentPath)).digest('hex'));
  assert.ok(m.agent.helpers['/usr/lib/python3/dist-packages/forkling_zygote.py'], 'zygote helper not installed');
  assert.is(m.kernel.format, 'bzImage');
  assert.match(m.kernel.source, /^distro:linux-image-/);
  assert.is(m.initramfs.compression, 'zstd');
  assert.is(m.sizes.compressed, lstatSync(img.initramfs).size);
  assert.ok(m.sizes.unpacked > 30e6 && m.sizes.unpacked < 200e6, `unpacked size ${m.sizes.unpacked}`);
});

test('default: the initramfs is the rootfs and holds /init, python3, the agent modules and the guest kernel modules', () => {
  const img = loadImage('default');
  const m = img.manifest;
  const raw = execFileSync('zstd', ['-dc', img.initramfs], { maxBuffer: 1 << 30 });
  assert.is(createHash('sha256').update(raw).digest('hex'), m.initramfs.cpioSha256);
  const entries = listCpio(raw);
  const byPath = new Map(entries.map((e) => [e.path, e]));
  assert.equal(
    entries.map((e) => e.path),
    walkTree(img.rootfs).map((e) => e.path),
    'cpio entries differ from the rootfs',
  );
  const init = byPath.get('init');
  assert.ok(init && (init.mode & 0o170000) === 0o100000 && (init.mode & 0o777) === 0o755, '/init is not a 0755 file');
  assert.ok(byPath.has('usr/bin/python3'), 'no python3');
  for (const h of Object.keys(m.agent.helpers)) assert.ok(byPath.has(h.slice(1)), `no ${h}`);
  for (const gone of ['etc/resolv.conf', 'usr/share/doc/python3', 'usr/share/man/man1']) assert.not.ok(byPath.has(gone), `${gone} not pruned`);

  // Modules: every wanted one present or built in, dependencies first, list file = manifest.
  const names = m.modules.map((x) => x.name);
  for (const want of GUEST_MODULES) {
    assert.ok(names.includes(want) || m.builtinModules.includes(want) || (want === 'rng_core' && !names.includes(want)), `module ${want} missing`);
  }
  assert.ok(names.includes('vmw_vsock_virtio_transport') && names.includes('virtio_pci'));
  m.modules.forEach((mod, i) => {
    assert.ok(byPath.get(mod.path)?.size === mod.size, `${mod.path} missing or of another size`);
    assert.ok(mod.path.endsWith('.ko'), `${mod.path} is compressed`);
    for (const d of mod.depends) assert.ok(names.indexOf(d) > -1 ? names.indexOf(d) < i : m.builtinModules.includes(d), `${mod.name} before its dependency ${d}`);
  });
  assert.is(readFileSync(join(img.rootfs, 'etc/forkling/modules'), 'utf8'), m.modules.map((x) => `${x.path}\n`).join(''));
});

test('default: its python imports the agent, msgpack and the zygote helper in a chroot', () => {
  const img = loadImage('default');
  const out = chrootPython(
    img.rootfs,
    [
      'import importlib.machinery, importlib.util, sys',
      "loader = importlib.machinery.SourceFileLoader('forkling_agent', '/init')",
      "mod = importlib.util.module_from_spec(importlib.util.spec_from_loader('forkling_agent', loader))",
      "sys.modules['forkling_agent'] = mod",
      'loader.exec_module(mod)',
      'import msgpack, forkling_zygote',
      "print(mod.AGENT_VERSION, msgpack.unpackb(msgpack.packb({'a': 1})), sys.version_info[0])",
    ].join('\n'),
  );
  assert.is(out, `${img.manifest.agent.version} {'a': 1} 3`);
});

test('same inputs, same bytes: a rebuild offline, from the cache, gives the same sha256', async () => {
  // Leftovers of an interrupted build are cleaned by the next one.
  mkdirSync(join(home, 'images', '.staging-leftover', 'rootfs'), { recursive: true });
  // No network at all: a new network namespace has only a down loopback.
  const t = Date.now();
  const r = spawnSync('unshare', ['-n', join(root, 'node_modules/.bin/tsx'), join(root, 'test/unit/image-build-child.ts'), agentPath, 'default'], {
    encoding: 'utf8',
    env: process.env,
    maxBuffer: 1 << 26,
  });
  times['default (offline rebuild from cache)'] = (Date.now() - t) / 1000;
  assert.is(r.status, 0, `offline rebuild failed: ${r.stderr}`);
  assert.match(r.stderr, /package sources unreachable, using the cached package lists/);
  const again = JSON.parse(r.stdout) as ImageManifest;
  assert.equal(again.files, first.files);
  assert.is(again.initramfs.cpioSha256, first.initramfs.cpioSha256);
  assert.not.ok(existsSync(join(home, 'images', '.staging-leftover')), 'stale staging dir left');
  assert.equal(readdirSync(join(home, 'images')).sort(), ['default']);
  assert.equal(await verifyImage('default'), []);
});

test('numpy: --extra python3-numpy imports and computes in a chroot', async () => {
  const m = await timedBuild('numpy', 'numpy', ['python3-numpy']);
  assert.equal(m.packages.extras, ['python3-numpy']);
  assert.ok(m.packages.installed.some((x) => x.name === 'python3-numpy'));
  assert.equal(await verifyImage('numpy'), []);
  const out = chrootPython(loadImage('numpy').rootfs, 'import numpy; a = numpy.arange(9.0).reshape(3, 3) + numpy.eye(3); print(round(float(numpy.linalg.det(a)), 6))');
  // [[1,1,2],[3,5,5],[6,7,9]]: det = -5, through LAPACK (found via update-alternatives' libblas.so.3/liblapack.so.3).
  assert.is(out, '-5.0');
  console.log(
    `  sizes: default ${(first.sizes.compressed / 1e6).toFixed(1)} MB compressed / ${(first.sizes.unpacked / 1e6).toFixed(1)} MB unpacked; ` +
      `numpy ${(m.sizes.compressed / 1e6).toFixed(1)} MB / ${(m.sizes.unpacked / 1e6).toFixed(1)} MB; build times ${JSON.stringify(times)}`,
  );
});

test('bad input is refused with one clear error and the store unchanged', async () => {
  const before = snapshot(join(home, 'images'));
  await refused({ name: 'bad/name' }, /invalid image name/);
  await refused({ name: '..' }, /invalid image name/);
  await refused({ name: 'x', extras: ['--no-such-option'] }, /invalid package name/);
  await refused({ name: 'x', extras: ['forkling-no-such-package'] }, /Unable to locate package forkling-no-such-package/);
  await refused({ name: 'default', extras: ['python3-numpy=0.0.0-nope'] }, /version 0\.0\.0-nope not found/);
  const notKernel = join(home, 'not-a-kernel');
  writeFileSync(notKernel, 'hello\n');
  await refused({ name: 'x', kernel: notKernel }, /neither a bzImage nor an ELF vmlinux/);
  await refused({ name: 'x', kernel: join(home, 'missing-kernel') }, /cannot read kernel/);
  // A source nobody answers (a fresh key in the cache: no lists to fall back on).
  const sources = join(home, 'unreachable.sources');
  writeFileSync(sources, `Types: deb\nURIs: http://127.0.0.1:9/debian-${Date.now()}\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n`);
  process.env.FORKLING_APT_SOURCES = sources;
  try {
    await refused({ name: 'default' }, /cannot read the package sources/);
  } finally {
    delete process.env.FORKLING_APT_SOURCES;
  }
  assert.equal(snapshot(join(home, 'images')), before, 'the store changed');
});

test('full disk: one clear error, old image intact, no half image', async () => {
  if (process.getuid?.() !== 0) assert.unreachable('this test needs root (tmpfs mount)');
  const small = mkdtempSync('/var/tmp/forkling-image-full-');
  execFileSync('mount', ['-t', 'tmpfs', '-o', 'size=24m', 'tmpfs', small]);
  const saved = process.env.FORKLING_HOME;
  try {
    process.env.FORKLING_HOME = small;
    // An old image (only its manifest and files matter here) that must survive.
    const old = join(small, 'images', 'default');
    mkdirSync(join(old, 'rootfs'), { recursive: true });
    writeFileSync(join(old, 'manifest.json'), readFileSync(join(home, 'images', 'default', 'manifest.json')));
    const before = snapshot(join(small, 'images'));
    await refused({ name: 'default' }, /disk is full/);
    assert.equal(snapshot(join(small, 'images')), before);
  } finally {
    process.env.FORKLING_HOME = saved;
    execFileSync('umount', [small]);
    rmSync(small, { recursive: true, force: true });
  }
});

async function cli(argv: string[]): Promise<{ code: number; out: string }> {
  const lines: string[] = [];
  const log = console.log;
  console.log = (...a: unknown[]) => lines.push(a.join(' '));
  try {
    return { code: await imageCommand(argv), out: lines.join('\n') };
  } finally {
    console.log = log;
  }
}

test('CLI: ls, inspect --verify, rm; misuse refused', async () => {
  const ls = await cli(['ls']);
  assert.is(ls.code, 0);
  assert.match(ls.out, /^default\s/m);
  assert.match(ls.out, /^numpy\s.*python3-numpy/m);
  const js = JSON.parse((await cli(['ls', '--json'])).out) as { name: string }[];
  assert.equal(js.map((e) => e.name), ['default', 'numpy']);
  const insp = await cli(['inspect', 'default', '--verify']);
  assert.is(insp.code, 0);
  assert.match(insp.out, /verify\s+ok/);
  const injs = JSON.parse((await cli(['inspect', 'numpy', '--json'])).out) as ImageManifest;
  assert.equal(injs.packages.extras, ['python3-numpy']);
  for (const bad of [['ls', '--kernel', 'x'], ['inspect'], ['build'], ['frobnicate'], ['build', 'x', '--nope']]) {
    try {
      await imageCommand(bad);
      assert.unreachable(`accepted ${bad.join(' ')}`);
    } catch (e) {
      expectUserError(e, /./);
    }
  }
  assert.is((await cli(['rm', 'numpy'])).code, 0);
  assert.equal(listImages().map((e) => e.name), ['default']);
  try {
    loadImage('numpy');
    assert.unreachable('numpy still loads');
  } catch (e) {
    expectUserError(e, /does not exist/);
  }
});

test('ensureImage: returns the built default without rebuilding (and says nothing); other names must exist', async () => {
  const t = Date.now();
  const said: string[] = [];
  const img = await ensureImage('default', { progress: (l) => said.push(l) });
  assert.ok(Date.now() - t < 2000, 'ensureImage rebuilt an existing image');
  assert.equal(said, []);
  assert.is(img.manifest.initramfs.cpioSha256, first.initramfs.cpioSha256);
  try {
    await ensureImage('never-built');
    assert.unreachable('ensureImage built a non-default image');
  } catch (e) {
    expectUserError(e, /does not exist/);
  }
});

test.after(() => {
  rmSync(home, { recursive: true, force: true });
});
test.run();
