// Image builder parts without network or packages: the deterministic cpio
// writer (checked against GNU cpio), compression, kernel file recognition.
import { execFileSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { chmodSync, chownSync, linkSync, lstatSync, lutimesSync, mkdirSync, mkdtempSync, readFileSync, readlinkSync, rmSync, symlinkSync, utimesSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { gunzipSync } from 'node:zlib';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { UserError } from '../../host/errors.ts';
import { agentDiffers, pack, readAgent } from '../../images/build.ts';
import { cpioArchive, listCpio, writeCpio } from '../../images/cpio.ts';
import { inspectKernelFile } from '../../images/kernelfile.ts';
import type { ImageManifest } from '../../images/manifest.ts';

const dir = mkdtempSync(join(tmpdir(), 'forkling-image-parts-'));
const isRoot = process.getuid?.() === 0;

function makeTree(root: string): void {
  mkdirSync(join(root, 'usr/bin'), { recursive: true });
  mkdirSync(join(root, 'etc'), { recursive: true });
  mkdirSync(join(root, 'dev'), { recursive: true });
  writeFileSync(join(root, 'init'), '#!/usr/bin/python3\nprint("hi")\n');
  chmodSync(join(root, 'init'), 0o755);
  writeFileSync(join(root, 'usr/bin/gzip'), Buffer.alloc(5000, 7));
  linkSync(join(root, 'usr/bin/gzip'), join(root, 'usr/bin/gunzip'));
  linkSync(join(root, 'usr/bin/gzip'), join(root, 'usr/bin/a-link'));
  symlinkSync('usr/bin', join(root, 'bin'));
  writeFileSync(join(root, 'etc/empty'), '');
  writeFileSync(join(root, 'etc/odd name-é'), 'x'.repeat(3));
  execFileSync('mkfifo', [join(root, 'dev/fifo')]);
  if (isRoot) {
    execFileSync('mknod', [join(root, 'dev/null'), 'c', '1', '3']);
    execFileSync('mknod', [join(root, 'dev/big'), 'c', '300', '70000']);
    chownSync(join(root, 'etc/empty'), 1000, 8);
  }
  // Fixed times: the writer takes them from the tree.
  const t = 1700000000;
  for (const p of ['init', 'usr/bin/gzip', 'etc/empty', 'etc/odd name-é', 'dev/fifo', 'usr/bin', 'usr', 'etc', 'dev']) utimesSync(join(root, p), t, t);
  lutimesSync(join(root, 'bin'), t, t);
}

async function archive(root: string): Promise<Buffer> {
  const chunks: Buffer[] = [];
  await writeCpio(root, (c) => {
    chunks.push(c);
  });
  return Buffer.concat(chunks);
}

test('cpio: sorted entries, same bytes twice, GNU cpio extracts the same tree', async () => {
  const src = join(dir, 'src');
  makeTree(src);
  const a = await archive(src);
  const b = await archive(src);
  assert.ok(a.equals(b), 'two archives of one tree differ');
  assert.is(a.length % 4, 0);
  const list = listCpio(a);
  const paths = list.map((e) => e.path);
  assert.equal(paths, [...paths].sort((x, y) => Buffer.compare(Buffer.from(x), Buffer.from(y))));
  assert.ok(paths.includes('init') && paths.includes('bin') && paths.includes('etc/odd name-é'));
  // Hard links: one group of three, data only on the last member.
  const links = list.filter((e) => e.nlink === 3);
  assert.is(links.length, 3);
  assert.equal(links.map((e) => e.size), [0, 0, 5000]);

  const out = join(dir, 'out');
  mkdirSync(out);
  execFileSync('cpio', ['-idm', '--quiet'], { cwd: out, input: a });
  assert.is(readFileSync(join(out, 'init'), 'utf8'), readFileSync(join(src, 'init'), 'utf8'));
  assert.is(lstatSync(join(out, 'init')).mode, lstatSync(join(src, 'init')).mode);
  assert.is(readlinkSync(join(out, 'bin')), 'usr/bin');
  assert.is(lstatSync(join(out, 'usr/bin/gunzip')).ino, lstatSync(join(out, 'usr/bin/gzip')).ino);
  assert.ok(readFileSync(join(out, 'usr/bin/a-link')).equals(Buffer.alloc(5000, 7)));
  assert.is(lstatSync(join(out, 'init')).mtimeMs, 1700000000 * 1000);
  assert.ok(lstatSync(join(out, 'dev/fifo')).isFIFO());
  if (isRoot) {
    const st = lstatSync(join(out, 'dev/big'));
    assert.ok(st.isCharacterDevice());
    assert.is(st.rdev, lstatSync(join(src, 'dev/big')).rdev, 'device numbers beyond 8 bits survive');
    assert.is(lstatSync(join(out, 'etc/empty')).uid, 1000);
    assert.is(lstatSync(join(out, 'etc/empty')).gid, 8);
  }
});

test('cpio: a socket is refused', async () => {
  const src = join(dir, 'sock');
  mkdirSync(src);
  const { createServer } = await import('node:net');
  const srv = createServer();
  await new Promise<void>((r) => srv.listen(join(src, 's'), r));
  try {
    await archive(src);
    assert.unreachable('archived a socket');
  } catch (e) {
    assert.match((e as Error).message, /unsupported file type/);
  } finally {
    srv.close();
  }
});

test('cpio: members from memory: newc records, 4-byte alignment and trailer', () => {
  const a = cpioArchive([
    { kind: 'dir', path: 'bin' },
    { kind: 'file', path: '/bin/x', data: Buffer.from('hello'), mode: 0o755 },
    { kind: 'chardev', path: 'dev/console', major: 5, minor: 1 },
  ]);
  assert.is(a.length % 4, 0);
  const names: string[] = [];
  let off = 0;
  for (;;) {
    assert.is(a.subarray(off, off + 6).toString('ascii'), '070701', `magic at ${off}`);
    const field = (i: number) => Number.parseInt(a.subarray(off + 6 + i * 8, off + 14 + i * 8).toString('ascii'), 16);
    const mode = field(1);
    const size = field(6);
    const nameSize = field(11);
    const rdev = [field(9), field(10)];
    const name = a.subarray(off + 110, off + 110 + nameSize - 1).toString();
    names.push(name);
    off += 110 + nameSize;
    off += (4 - (off % 4)) % 4;
    if (name === 'bin/x') {
      assert.is(mode, 0o100755);
      assert.is(a.subarray(off, off + size).toString(), 'hello');
    }
    if (name === 'dev/console') assert.equal(rdev, [5, 1]);
    off += size;
    off += (4 - (off % 4)) % 4;
    if (name === 'TRAILER!!!') break;
  }
  assert.equal(names, ['bin', 'bin/x', 'dev/console', 'TRAILER!!!']);
  assert.is(off, a.length);
  assert.throws(() => cpioArchive([{ kind: 'dir', path: '../etc' }]), /bad cpio path/);
});

test('pack: zstd and gzip are deterministic and hold the archive', async () => {
  const src = join(dir, 'src');
  const raw = await archive(src);
  for (const c of ['zstd', 'gzip'] as const) {
    const f1 = join(dir, `p1.${c}`);
    const f2 = join(dir, `p2.${c}`);
    const r1 = await pack(src, f1, c);
    const r2 = await pack(src, f2, c);
    assert.ok(readFileSync(f1).equals(readFileSync(f2)), `${c}: two packs differ`);
    assert.is(r1.cpioSha256, r2.cpioSha256);
    const back = c === 'gzip' ? gunzipSync(readFileSync(f1)) : execFileSync('zstd', ['-dc', f1], { maxBuffer: 1 << 26 });
    assert.ok(back.equals(raw), `${c}: decompressed archive differs from the cpio`);
    assert.is(r1.cpioBytes, raw.length);
  }
});

function fakeBzImage(version: string | null): Buffer {
  const b = Buffer.alloc(0x1000);
  b.write('HdrS', 0x202, 'latin1');
  if (version !== null) {
    b.writeUInt16LE(0x600 - 0x200, 0x20e);
    b.write(`${version}\0`, 0x600, 'latin1');
  }
  return b;
}

function fakeElf(machine: number, banner: string): Buffer {
  const b = Buffer.alloc(0x2000);
  b.writeUInt32BE(0x7f454c46, 0);
  b[4] = 2;
  b[5] = 1;
  b.writeUInt16LE(machine, 0x12);
  b.write('Linux version %s (%s)\0', 0x400, 'latin1');
  b.write(`${banner}\0`, 0x800, 'latin1');
  return b;
}

test('agentDiffers: an image built with another agent or other helper modules is told apart', () => {
  const a = join(dir, 'agent-a');
  mkdirSync(a);
  writeFileSync(join(a, 'forkling_agent.py'), 'AGENT_VERSION = "1"\n');
  writeFileSync(join(a, 'forkling_zygote.py'), 'Z = 1\n');
  const agent = readAgent(join(a, 'forkling_agent.py'));
  const sha = (t: string) => createHash('sha256').update(t).digest('hex');
  const helperPath = '/usr/lib/python3/dist-packages/forkling_zygote.py';
  const built = (sha256: string, helpers: Record<string, string>) => ({ agent: { path: '/init', version: '1', sha256, helpers } }) as unknown as ImageManifest;
  assert.is(agentDiffers(built(agent.sha256, { [helperPath]: sha('Z = 1\n') }), agent), false, 'same files');
  assert.is(agentDiffers(built(sha('old agent'), { [helperPath]: sha('Z = 1\n') }), agent), true, 'agent changed');
  assert.is(agentDiffers(built(agent.sha256, { [helperPath]: sha('Z = 0\n') }), agent), true, 'helper changed');
  assert.is(agentDiffers(built(agent.sha256, {}), agent), true, 'helper added since');
  assert.is(agentDiffers(built(agent.sha256, { [helperPath]: sha('Z = 1\n'), '/usr/lib/python3/dist-packages/gone.py': sha('') }), agent), true, 'helper removed since');
});

test('kernel files: bzImage and x86-64 vmlinux accepted, anything else refused', () => {
  const p = (n: string, data: Buffer | string): string => {
    const f = join(dir, n);
    writeFileSync(f, data);
    return f;
  };
  const bz = inspectKernelFile(p('bz', fakeBzImage('6.1.0-99-test (someone@host) #1 SMP')));
  assert.equal(bz, { format: 'bzImage', release: '6.1.0-99-test', version: '6.1.0-99-test (someone@host) #1 SMP' });
  assert.is(inspectKernelFile(p('bz0', fakeBzImage(null))).release, null);
  const elf = inspectKernelFile(p('vmlinux', fakeElf(0x3e, 'Linux version 6.6.1-custom (me@box) #3 SMP')));
  assert.is(elf.format, 'vmlinux');
  assert.is(elf.release, '6.6.1-custom');
  const refuse = (f: string, re: RegExp): void => {
    try {
      inspectKernelFile(f);
      assert.unreachable(`accepted ${f}`);
    } catch (e) {
      assert.instance(e, UserError);
      assert.match((e as Error).message, re);
    }
  };
  refuse(p('arm', fakeElf(0xb7, 'Linux version 6.1.0-arm64 (x) #1')), /not x86-64/);
  refuse(p('text', 'this is not a kernel\n'), /neither a bzImage nor an ELF vmlinux/);
  refuse(p('empty', ''), /neither a bzImage nor an ELF vmlinux/);
  refuse(dir, /not a regular file/);
  refuse(join(dir, 'missing'), /cannot read kernel .*ENOENT/);
});

test.after(() => rmSync(dir, { recursive: true, force: true }));
test.run();
