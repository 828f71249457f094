// The vmlinux ELF out of a bzImage (images/vmlinux.ts): the real Debian kernel
// when the store's cache has it (extracted, checked, loaded by the VMM's ELF
// loader into a buffer, cached), small made-up bzImages for gzip, xz and zstd,
// and broken or hostile ones (truncated, bad magic, payload out of range,
// lying size, corrupt stream, wrong ELF, wrong release, missing tool). Also the
// KVM engine's check of a kernel given instead of an image's own.
import { execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { gzipSync } from 'node:zlib';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { kernelForImage } from '../../host/engine/kvm/engine.ts';
import { UserError } from '../../host/errors.ts';
import { distroKernel } from '../../images/kernel.ts';
import { inspectKernelFile } from '../../images/kernelfile.ts';
import { elfExtent, readBzImagePayload, vmlinuxFromBzImage } from '../../images/vmlinux.ts';
import { vmm } from '../native/vmm-internals.ts';

const dir = mkdtempSync(join(tmpdir(), 'forkling-vmlinux-'));
const MiB = 2 ** 20;
let n = 0;
const fresh = () => join(dir, `cache-${n++}`);

async function rejects(fn: () => Promise<unknown>, re: RegExp): Promise<UserError> {
  try {
    await fn();
  } catch (e) {
    assert.instance(e, UserError, String(e));
    assert.match((e as Error).message, re, (e as Error).message);
    return e as UserError;
  }
  assert.unreachable(`expected a UserError matching ${re}`);
  throw new Error('unreachable');
}

const RELEASE = '9.9.9-test';

/**
 * A small x86-64 vmlinux: one PT_LOAD of `code` at 16 MiB holding a Linux
 * banner, a .text and a .bss section, section headers at the end.
 */
function fakeElf(opts: { release?: string; klass?: number; machine?: number; segmentPastEnd?: boolean } = {}): Buffer {
  const code = Buffer.alloc(0x2000, 0x90);
  code.write(`Linux version ${opts.release ?? RELEASE} (builder@host) #1 SMP\n\0`, 0x100, 'latin1');
  const shoff = 0x1000 + code.length;
  const b = Buffer.alloc(shoff + 3 * 64);
  b.write('\x7fELF', 0, 'latin1');
  b[4] = opts.klass ?? 2;
  b[5] = 1;
  b[6] = 1;
  b.writeUInt16LE(2, 0x10); // ET_EXEC
  b.writeUInt16LE(opts.machine ?? 0x3e, 0x12);
  b.writeUInt32LE(1, 0x14);
  b.writeBigUInt64LE(0x1000000n, 0x18); // e_entry: physical, as vmlinux's
  b.writeBigUInt64LE(64n, 0x20); // e_phoff
  b.writeBigUInt64LE(BigInt(shoff), 0x28); // e_shoff
  b.writeUInt16LE(64, 0x34);
  b.writeUInt16LE(56, 0x36);
  b.writeUInt16LE(1, 0x38);
  b.writeUInt16LE(64, 0x3a);
  b.writeUInt16LE(3, 0x3c);
  const ph = 64;
  b.writeUInt32LE(1, ph); // PT_LOAD
  b.writeUInt32LE(5, ph + 4);
  b.writeBigUInt64LE(opts.segmentPastEnd ? BigInt(b.length - 0x100) : 0x1000n, ph + 8); // past the end: starts in, ends out
  b.writeBigUInt64LE(0xffffffff81000000n, ph + 16);
  b.writeBigUInt64LE(0x1000000n, ph + 24);
  b.writeBigUInt64LE(BigInt(code.length), ph + 32);
  b.writeBigUInt64LE(BigInt(code.length + 0x1000), ph + 40);
  code.copy(b, 0x1000);
  // Section 0 is null; 1: .text (PROGBITS) over the segment; 2: .bss (NOBITS) past the file's end.
  const sh = (i: number, type: number, off: number, size: number) => {
    b.writeUInt32LE(type, shoff + i * 64 + 4);
    b.writeBigUInt64LE(BigInt(off), shoff + i * 64 + 0x18);
    b.writeBigUInt64LE(BigInt(size), shoff + i * 64 + 0x20);
  };
  sh(1, 1, 0x1000, code.length);
  sh(2, 8, 0x7fff0000, 0x1000);
  return b;
}

// What the build compresses: the ELF plus KASLR relocation data after it.
const ELF = fakeElf();
const RELOCS = Buffer.alloc(3000, 0xab);
const size32 = (n: number) => {
  const b = Buffer.alloc(4);
  b.writeUInt32LE(n);
  return b;
};

function compress(kind: 'gzip' | 'xz' | 'zstd' | 'raw-lz4', data: Buffer, recordedSize = data.length): Buffer {
  if (kind === 'gzip') return gzipSync(data);
  if (kind === 'raw-lz4') return Buffer.concat([Buffer.from([0x02, 0x21, 0x4c, 0x18]), data, size32(recordedSize)]);
  const out = execFileSync(kind, kind === 'xz' ? ['-c', '--check=crc32'] : ['-c', '-q', '-19'], { input: data, maxBuffer: 64 * MiB });
  return Buffer.concat([out, size32(recordedSize)]);
}

/** A bzImage around `payload`: setup header (protocol 2.15), 3 setup sectors, a kernel_version string. */
function fakeBz(payload: Buffer, opts: { protocol?: number; payloadOffset?: number; length?: number; release?: string; cut?: number } = {}): Buffer {
  const pmStart = 4 * 512;
  const payloadOffset = opts.payloadOffset ?? 0x100; // the decompressor's code comes first
  const b = Buffer.alloc(pmStart + 0x100 + payload.length + 16);
  b[0x1f1] = 3;
  b.writeUInt16LE(0xaa55, 0x1fe);
  b[0x201] = 0x66;
  b.write('HdrS', 0x202, 'latin1');
  b.writeUInt16LE(opts.protocol ?? 0x020f, 0x206);
  b.writeUInt16LE(0x300 - 0x200, 0x20e);
  b.write(`${opts.release ?? RELEASE} (builder@host) #1 SMP`, 0x300, 'latin1');
  b.writeUInt32LE(payloadOffset, 0x248);
  b.writeUInt32LE(opts.length ?? payload.length, 0x24c);
  payload.copy(b, pmStart + 0x100);
  return opts.cut ? b.subarray(0, b.length - opts.cut) : b;
}

function write(name: string, data: Buffer): string {
  const p = join(dir, name);
  writeFileSync(p, data);
  return p;
}

test('extracts gzip, xz and zstd payloads: the ELF alone (relocation data cut off), byte for byte, cached', async () => {
  for (const kind of ['gzip', 'xz', 'zstd'] as const) {
    const bz = write(`bz-${kind}`, fakeBz(compress(kind, Buffer.concat([ELF, RELOCS]))));
    const p = readBzImagePayload(readFileSync(bz), bz);
    assert.is(p.compression, kind);
    assert.is(p.uncompressedSize, ELF.length + RELOCS.length);
    assert.is(p.release, RELEASE);
    const cache = fresh();
    const r = await vmlinuxFromBzImage(bz, { cacheDir: cache });
    assert.is(r.cached, false);
    assert.is(r.compression, kind);
    assert.ok(r.path.startsWith(cache) && r.path.includes(RELEASE), r.path);
    assert.ok(readFileSync(r.path).equals(ELF), `${kind}: the file is the ELF exactly`);
    assert.is(r.bytes, ELF.length);
    const info = inspectKernelFile(r.path);
    assert.is(info.format, 'vmlinux');
    assert.is(info.release, RELEASE);
    const again = await vmlinuxFromBzImage(bz, { cacheDir: cache });
    assert.equal(again, { ...r, cached: true });
  }
});

test('refuses what is not a bzImage, an old protocol, a truncated file, a payload out of range or of unknown magic', async () => {
  const good = fakeBz(compress('xz', ELF));
  const cases: [string, Buffer, RegExp][] = [
    ['empty', Buffer.alloc(0), /is not a bzImage/],
    ['an ELF', ELF, /is not a bzImage/],
    ['no HdrS', Buffer.concat([good.subarray(0, 0x202), Buffer.from('XXXX'), good.subarray(0x206)]), /is not a bzImage/],
    ['protocol 2.06', fakeBz(compress('xz', ELF), { protocol: 0x0206 }), /boot protocol 2\.06.*only from 2\.08/],
    ['truncated', fakeBz(compress('xz', ELF), { cut: 200 }), /outside the file's \d+ bytes \(truncated or damaged\)/],
    ['offset past the end', fakeBz(compress('xz', ELF), { payloadOffset: 0x7fffffff }), /outside the file/],
    ['length past the end', fakeBz(compress('xz', ELF), { length: 0xffffffff }), /outside the file/],
    ['zero length', fakeBz(compress('xz', ELF), { length: 0 }), /outside the file/],
    ['zero offset', fakeBz(compress('xz', ELF), { payloadOffset: 0 }), /outside the file/],
    ['bad magic', fakeBz(Buffer.concat([Buffer.from('not compressed at all'), size32(100)])), /starts with bytes 6e6f7420636f6d70, which no kernel compression uses/],
    ['lz4', fakeBz(compress('raw-lz4', ELF)), /lz4-compressed; forkling extracts only gzip, xz and zstd/],
    ['huge size', fakeBz(compress('xz', ELF, 0xfffffff0)), /claims to be 4294967280 bytes uncompressed/],
  ];
  for (const [what, data, re] of cases) {
    const path = write(`bad-${what.replace(/\W/g, '-')}`, data);
    const e = await rejects(() => vmlinuxFromBzImage(path, { cacheDir: fresh() }), re);
    assert.ok(e.hint, `${what}: the error says how to fix it`);
  }
  await rejects(() => vmlinuxFromBzImage(join(dir, 'missing'), { cacheDir: fresh() }), /cannot read the kernel .*ENOENT/);
});

test('refuses a payload that lies about its size, is corrupt, or holds no x86-64 vmlinux of its release', async () => {
  const xzOf = (data: Buffer, size?: number) => compress('xz', data, size);
  const corrupt = xzOf(ELF);
  corrupt.fill(0x55, 40, 80);
  const cases: [string, Buffer, RegExp][] = [
    ['size too big', fakeBz(xzOf(ELF, ELF.length + 10)), /decompresses to \d+ bytes, but the file records \d+/],
    ['size too small', fakeBz(xzOf(ELF, ELF.length - 100)), /decompresses to more than the \d+ bytes its header records/],
    // zlib checks the limit between its 16 KiB output chunks: a larger ELF.
    ['gzip size too small', fakeBz(Buffer.concat([gzipSync(Buffer.concat([ELF, Buffer.alloc(200_000)])).subarray(0, -4), size32(100)])), /decompresses to more than the 100 bytes/],
    ['corrupt gzip', fakeBz(Buffer.concat([gzipSync(ELF).subarray(0, 30), size32(ELF.length)])), /gzip-compressed kernel inside does not inflate: unexpected end/],
    ['corrupt xz', fakeBz(corrupt), /xz could not decompress the kernel inside: .*(corrupt|format|Unexpected)/i],
    ['not an ELF', fakeBz(xzOf(Buffer.alloc(5000, 1))), /the extracted kernel is not an ELF file/],
    ['32-bit ELF', fakeBz(xzOf(fakeElf({ klass: 1 }))), /not a 64-bit little-endian x86-64 ELF \(class 1/],
    ['arm64 ELF', fakeBz(xzOf(fakeElf({ machine: 183 }))), /machine 183/],
    ['segment past the end', fakeBz(xzOf(fakeElf({ segmentPastEnd: true }))), /segment 0 outside the file/],
    ['other release', fakeBz(xzOf(fakeElf({ release: '5.10.0-1-amd64' }))), /not release 9\.9\.9-test, which its header names/],
  ];
  for (const [what, data, re] of cases) {
    const cache = fresh();
    await rejects(() => vmlinuxFromBzImage(write(`lie-${what.replace(/\W/g, '-')}`, data), { cacheDir: cache }), re);
    assert.not.ok(existsSync(cache), `${what}: nothing cached`);
  }
  // The header check alone, on a buffer: out of range after the header.
  assert.throws(() => elfExtent(ELF.subarray(0, ELF.length - 1), 'x'), /section headers outside the file/);
  assert.is(elfExtent(Buffer.concat([ELF, RELOCS]), 'x'), ELF.length);
});

test('a missing xz or zstd says which package to install; a damaged cache entry is replaced', async () => {
  const bz = write('bz-tool', fakeBz(compress('zstd', ELF)));
  const path = process.env.PATH;
  process.env.PATH = join(dir, 'no-such-dir');
  try {
    const e = await rejects(() => vmlinuxFromBzImage(bz, { cacheDir: fresh() }), /cannot run zstd to extract the kernel .*ENOENT/);
    assert.match(e.hint ?? '', /apt-get install zstd/);
  } finally {
    process.env.PATH = path;
  }
  const cache = fresh();
  const first = await vmlinuxFromBzImage(bz, { cacheDir: cache });
  writeFileSync(first.path, 'garbage');
  const second = await vmlinuxFromBzImage(bz, { cacheDir: cache });
  assert.is(second.cached, false);
  assert.ok(readFileSync(second.path).equals(ELF));
});

test('the KVM engine takes another kernel only when it is of the release the image has modules for', () => {
  const bz = write('bz-engine', fakeBz(compress('xz', ELF)));
  const image = (release: string | null, modules: unknown[] = [{ name: 'vsock' }]) => ({ name: 'img', kernel: '/images/img/vmlinuz', manifest: { kernel: { release }, modules } });
  assert.is(kernelForImage(image(RELEASE)), '/images/img/vmlinuz', 'no override: the image kernel');
  assert.is(kernelForImage(image(RELEASE), bz), bz);
  const vm = write('vmlinux-other', fakeElf({ release: '5.10.0-1-amd64' }));
  let msg = '';
  try {
    kernelForImage(image(RELEASE), vm);
  } catch (e) {
    assert.instance(e, UserError);
    msg = (e as Error).message;
  }
  assert.match(msg, /is release 5\.10\.0-1-amd64, but image img's modules are for 9\.9\.9-test/);
  assert.is(kernelForImage(image(RELEASE, []), vm), vm, 'an image without modules takes any kernel');
  assert.throws(() => kernelForImage(image(RELEASE), write('not-a-kernel', Buffer.alloc(4096, 1))), /neither a bzImage nor an ELF vmlinux/);
});

const realKernel = (() => {
  try {
    const k = distroKernel();
    return existsSync(k.vmlinuz) ? k : null;
  } catch {
    return null;
  }
})();

test("the distribution kernel: its vmlinux is x86-64, of the bzImage's release, and the VMM's ELF loader takes it", async () => {
  if (!realKernel) {
    console.log('  (no distribution kernel in the store cache: skipped this check)');
    return;
  }
  const cache = fresh();
  const t0 = performance.now();
  const c0 = process.cpuUsage();
  const r = await vmlinuxFromBzImage(realKernel.vmlinuz, { cacheDir: cache });
  const cpu = process.cpuUsage(c0);
  const ms = performance.now() - t0;
  assert.is(r.release, realKernel.release);
  const p = readBzImagePayload(readFileSync(realKernel.vmlinuz), realKernel.vmlinuz);
  assert.ok(r.bytes <= p.uncompressedSize && r.bytes > 16 * MiB, `${r.bytes} bytes`);
  const info = inspectKernelFile(r.path);
  assert.is(info.format, 'vmlinux');
  assert.is(info.release, realKernel.release, 'the banner inside names the same release');
  const elf = readFileSync(r.path);
  const k = vmm.parseKernel(elf);
  assert.is(k.kind, 'elf');
  const segs = k.segments ?? [];
  assert.ok(segs.length > 0);
  // ENTRY(phys_startup_64): the physical start of the first segment, at or above 1 MiB.
  assert.is(k.entry, segs[0]?.paddr);
  assert.ok((k.entry ?? 0) >= MiB);
  const mem = Buffer.alloc(256 * MiB);
  const initrd = 30 * MiB;
  const l = vmm.loadLinux(mem, elf, 'console=ttyS0 rdinit=/init', initrd, 1);
  assert.is(l.entry, k.entry);
  assert.is(l.kernelEnd, Math.max(...segs.map((s) => s.paddr + s.memsz)));
  assert.ok(l.initrdAddr >= l.kernelEnd && l.initrdAddr + initrd <= 256 * MiB, 'initrd above the kernel');
  const off0 = Number(elf.readBigUInt64LE(64 + 8)); // first program header's p_offset
  assert.ok(mem.subarray(l.entry, l.entry + 4096).equals(elf.subarray(off0, off0 + 4096)), 'startup_64 is where the entry points');
  const zp = mem.subarray(0x7000, 0x8000);
  assert.is(zp.readUInt16LE(0x1fe), 0xaa55);
  assert.is(zp.toString('latin1', 0x202, 0x206), 'HdrS');
  assert.is(zp[0x210], 0xff, 'type_of_loader');
  assert.is(zp.readUInt32LE(0x218), l.initrdAddr);
  assert.is(zp.readUInt32LE(0x21c), initrd);
  const t1 = performance.now();
  const again = await vmlinuxFromBzImage(realKernel.vmlinuz, { cacheDir: cache });
  assert.is(again.cached, true);
  console.log(
    `  ${realKernel.release}: ${r.compression} payload ${(p.length / MiB).toFixed(1)} MiB -> vmlinux ${(r.bytes / MiB).toFixed(1)} MiB ` +
      `(${((p.uncompressedSize - r.bytes) / 1024).toFixed(0)} KiB of relocation data cut); extraction ${ms.toFixed(0)} ms wall, ` +
      `${((cpu.user + cpu.system) / 1000).toFixed(0)} ms CPU in node (plus the ${r.compression} process); cached ${(performance.now() - t1).toFixed(0)} ms`,
  );
});

test.after(() => rmSync(dir, { recursive: true, force: true }));

test.run();
