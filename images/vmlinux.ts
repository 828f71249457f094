// The plain vmlinux ELF inside a bzImage, for booting the ELF path of the
// KVM loader with the same kernel as an image's bzImage (Debian ships no
// vmlinux). The x86 boot protocol (2.08+) says where the compressed kernel
// lies: payload_offset (from the start of the protected-mode code) and
// payload_length in the setup header. The compression is told by its magic;
// gzip is inflated by node's zlib, xz and zstd by the system's tools. The ELF
// is checked (x86-64, the bzImage's release) and cached under the store's
// cache, keyed by the bzImage's sha256, so later boots just read it.
import { spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import { closeSync, existsSync, fstatSync, openSync, readFileSync, readSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { promisify } from 'node:util';
import { gunzip } from 'node:zlib';
import { UserError } from '../host/errors.ts';
import { writeFileAtomic } from '../host/store.ts';
import { cacheRoot } from './cache.ts';

export type PayloadCompression = 'gzip' | 'xz' | 'zstd';

export interface BzImagePayload {
  /** file offset of the compressed kernel */
  offset: number;
  /** its length, the kernel's 4-byte size trailer included */
  length: number;
  compression: PayloadCompression;
  /** the vmlinux's size as the build recorded it (the payload's last 4 bytes) */
  uncompressedSize: number;
  /** e.g. 6.1.0-57-amd64, from the header's kernel_version string */
  release: string | null;
}

export interface ExtractedVmlinux {
  path: string;
  compression: PayloadCompression;
  release: string | null;
  /** size of the ELF file */
  bytes: number;
  /** true when it came from the cache (no decompression) */
  cached: boolean;
}

/** The largest vmlinux accepted (Debian's is 63 MiB); anything bigger is a damaged or hostile header. */
export const MAX_VMLINUX_BYTES = 1 << 30;

const FIX = 'pass the bzImage (vmlinuz) unchanged, or an uncompressed vmlinux (the kernel tree has scripts/extract-vmlinux)';

// Magics at the start of the payload. The kernel build can use any of these;
// forkling extracts the first three (Debian uses xz).
const MAGICS: { name: string; magic: number[] }[] = [
  { name: 'gzip', magic: [0x1f, 0x8b, 0x08] },
  { name: 'xz', magic: [0xfd, 0x37, 0x7a, 0x58, 0x5a, 0x00] },
  { name: 'zstd', magic: [0x28, 0xb5, 0x2f, 0xfd] },
  { name: 'bzip2', magic: [0x42, 0x5a, 0x68] },
  { name: 'lzma', magic: [0x5d, 0x00, 0x00] },
  { name: 'lzo', magic: [0x89, 0x4c, 0x5a, 0x4f] },
  { name: 'lz4', magic: [0x02, 0x21, 0x4c, 0x18] },
];
const EXTRACTED: readonly string[] = ['gzip', 'xz', 'zstd'];

/** Reads and checks the setup header of a bzImage held in `bz`; `name` is for messages. */
export function readBzImagePayload(bz: Uint8Array, name: string): BzImagePayload {
  const b = Buffer.from(bz.buffer, bz.byteOffset, bz.byteLength);
  if (b.length < 0x268 || b.readUInt16LE(0x1fe) !== 0xaa55 || b.toString('latin1', 0x202, 0x206) !== 'HdrS') {
    throw new UserError(`${name} is not a bzImage (no boot sector signature or "HdrS" setup header)`, FIX);
  }
  const protocol = b.readUInt16LE(0x206);
  if (protocol < 0x208) {
    const v = `${protocol >> 8}.${(protocol & 0xff).toString().padStart(2, '0')}`;
    throw new UserError(`${name} uses boot protocol ${v}; its header says where the compressed kernel is only from 2.08 (Linux 2.6.26)`, FIX);
  }
  const setupSects = b[0x1f1] || 4;
  const pmStart = (setupSects + 1) * 512;
  const payloadOffset = b.readUInt32LE(0x248);
  const length = b.readUInt32LE(0x24c);
  const offset = pmStart + payloadOffset;
  if (payloadOffset === 0 || length < 16 || offset + length > b.length) {
    throw new UserError(
      `${name}: the setup header puts the compressed kernel at ${offset}+${length}, outside the file's ${b.length} bytes (truncated or damaged)`,
      FIX,
    );
  }
  const head = b.subarray(offset, offset + 8);
  const kind = MAGICS.find((m) => m.magic.every((x, i) => head[i] === x))?.name;
  if (!kind) throw new UserError(`${name}: the compressed kernel starts with bytes ${head.toString('hex')}, which no kernel compression uses (damaged file?)`, FIX);
  if (!EXTRACTED.includes(kind)) {
    throw new UserError(`${name}: the kernel inside is ${kind}-compressed; forkling extracts only gzip, xz and zstd`, FIX);
  }
  // The build appends the vmlinux size (little endian) to every payload; for
  // gzip it is the member's own ISIZE field.
  const uncompressedSize = b.readUInt32LE(offset + length - 4);
  if (uncompressedSize < 64 || uncompressedSize > MAX_VMLINUX_BYTES) {
    throw new UserError(`${name}: the kernel inside claims to be ${uncompressedSize} bytes uncompressed (damaged file?)`, FIX);
  }
  return { offset, length, compression: kind as PayloadCompression, uncompressedSize, release: releaseOf(b) };
}

/** The release (first word of the kernel_version string) when the header has one. */
function releaseOf(b: Buffer): string | null {
  const ptr = b.readUInt16LE(0x20e);
  if (ptr === 0 || ptr + 0x200 >= b.length) return null;
  const s = b.subarray(ptr + 0x200, Math.min(b.length, ptr + 0x200 + 256));
  const end = s.indexOf(0);
  const release = s.toString('latin1', 0, end < 0 ? s.length : end).split(' ')[0] ?? '';
  return /^[0-9A-Za-z._+~-]{1,64}$/.test(release) ? release : null;
}

const gunzipAsync = promisify(gunzip);
const tooBigError = (name: string, limit: number) =>
  new UserError(`${name}: the kernel inside decompresses to more than the ${limit} bytes its header records (damaged file?)`, FIX);

/** Decompresses `data` with a limit on the output (a lying header cannot fill memory). */
async function inflate(compression: PayloadCompression, data: Buffer, limit: number, name: string): Promise<Buffer> {
  if (compression === 'gzip') {
    try {
      return await gunzipAsync(data, { maxOutputLength: limit + 1 });
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === 'ERR_BUFFER_TOO_LARGE') throw tooBigError(name, limit);
      throw new UserError(`${name}: the gzip-compressed kernel inside does not inflate: ${(e as Error).message}`, FIX);
    }
  }
  const [cmd, pkg] = compression === 'xz' ? ['xz', 'xz-utils'] : ['zstd', 'zstd'];
  return new Promise((res, rej) => {
    const p = spawn(cmd, ['--decompress', '--stdout', '--quiet'], { stdio: ['pipe', 'pipe', 'pipe'] });
    const chunks: Buffer[] = [];
    let got = 0;
    let stderr = '';
    let tooBig = false;
    p.stdout.on('data', (c: Buffer) => {
      got += c.length;
      if (got > limit) {
        tooBig = true;
        p.kill('SIGKILL');
      } else chunks.push(c);
    });
    p.stderr.on('data', (d) => {
      if (stderr.length < 4096) stderr += d;
    });
    // The tool may stop reading early (corrupt input); its exit status says why.
    p.stdin.on('error', () => {});
    p.stdin.end(data);
    p.on('error', (e: NodeJS.ErrnoException) =>
      rej(new UserError(`cannot run ${cmd} to extract the kernel from ${name}: ${e.code ?? e.message}`, `install it: apt-get install ${pkg}`)),
    );
    p.on('close', (status, signal) => {
      if (tooBig) return rej(tooBigError(name, limit));
      if (status !== 0) {
        const why = stderr.trim().split('\n').slice(-3).join('; ') || `exit ${status ?? signal}`;
        return rej(new UserError(`${name}: ${cmd} could not decompress the kernel inside: ${why}`, FIX));
      }
      res(Buffer.concat(chunks, got));
    });
  });
}

/**
 * Checks that `elf` is an x86-64 executable ELF whose headers and sections lie
 * inside it; returns where it ends (the build appends relocation data for
 * KASLR after the ELF, which a plain vmlinux does not have).
 */
export function elfExtent(elf: Buffer, name: string): number {
  const bad = (why: string) => new UserError(`${name}: the extracted kernel ${why}`, FIX);
  if (elf.length < 64 || elf.readUInt32BE(0) !== 0x7f454c46) throw bad('is not an ELF file');
  if (elf[4] !== 2 || elf[5] !== 1 || elf.readUInt16LE(0x12) !== 0x3e) throw bad(`is not a 64-bit little-endian x86-64 ELF (class ${elf[4]}, machine ${elf.readUInt16LE(0x12)})`);
  if (elf.readUInt16LE(0x10) !== 2) throw bad(`is not an executable ELF (e_type ${elf.readUInt16LE(0x10)})`);
  const num = (off: number) => {
    const v = elf.readBigUInt64LE(off);
    if (v > BigInt(elf.length)) throw bad(`has an offset or size past its end (${v} at header byte ${off})`);
    return Number(v);
  };
  const within = (start: number, size: number, what: string) => {
    if (start + size > elf.length) throw bad(`has ${what} outside the file (${start}+${size} of ${elf.length} bytes)`);
    return start + size;
  };
  const phoff = num(0x20);
  const shoff = num(0x28);
  const phentsize = elf.readUInt16LE(0x36);
  const phnum = elf.readUInt16LE(0x38);
  const shentsize = elf.readUInt16LE(0x3a);
  const shnum = elf.readUInt16LE(0x3c);
  if (phnum === 0 || phentsize !== 56) throw bad('has no program headers');
  let end = within(phoff, phnum * phentsize, 'program headers');
  let loads = 0;
  for (let i = 0; i < phnum; i++) {
    const ph = phoff + i * phentsize;
    if (elf.readUInt32LE(ph) === 1) loads++;
    end = Math.max(end, within(num(ph + 8), num(ph + 32), `segment ${i}`));
  }
  if (loads === 0) throw bad('has no loadable segment');
  if (shnum > 0) {
    if (shentsize !== 64) throw bad(`has section headers of ${shentsize} bytes`);
    end = Math.max(end, within(shoff, shnum * shentsize, 'section headers'));
    for (let i = 0; i < shnum; i++) {
      const sh = shoff + i * shentsize;
      if (elf.readUInt32LE(sh + 4) === 8) continue; // SHT_NOBITS (.bss) takes no file space
      end = Math.max(end, within(num(sh + 0x18), num(sh + 0x20), `section ${i}`));
    }
  }
  return end;
}

/**
 * The vmlinux ELF inside `bzImage`, extracted once into `cacheDir` (default
 * <cache>/kernel) and reused after. Throws a UserError for anything that is not
 * a well-formed bzImage with an x86-64 vmlinux of its own release inside.
 */
export async function vmlinuxFromBzImage(bzImage: string, opts: { cacheDir?: string } = {}): Promise<ExtractedVmlinux> {
  const abs = resolve(bzImage);
  let bz: Buffer;
  try {
    bz = readFileSync(abs);
  } catch (e) {
    throw new UserError(`cannot read the kernel ${abs}: ${(e as NodeJS.ErrnoException).code ?? (e as Error).message}`, FIX);
  }
  const p = readBzImagePayload(bz, abs);
  const sha = createHash('sha256').update(bz).digest('hex');
  const path = join(opts.cacheDir ?? join(cacheRoot(), 'kernel'), `vmlinux-${p.release ?? 'unknown'}-${sha.slice(0, 16)}`);
  // Written atomically, so an existing file is complete; still refuse a non-ELF there.
  if (existsSync(path)) {
    const head = Buffer.alloc(64);
    const fd = openSync(path, 'r');
    let n: number;
    let size: number;
    try {
      n = readSync(fd, head, 0, 64, 0);
      size = fstatSync(fd).size;
    } finally {
      closeSync(fd);
    }
    if (n === 64 && head.readUInt32BE(0) === 0x7f454c46) return { path, compression: p.compression, release: p.release, bytes: size, cached: true };
  }
  let compressed = bz.subarray(p.offset, p.offset + p.length);
  // The size trailer is not part of an xz or zstd stream (the tools would call it garbage).
  if (p.compression !== 'gzip') compressed = compressed.subarray(0, compressed.length - 4);
  const out = await inflate(p.compression, compressed, p.uncompressedSize, abs);
  if (out.length !== p.uncompressedSize) {
    throw new UserError(`${abs}: the kernel inside decompresses to ${out.length} bytes, but the file records ${p.uncompressedSize} (damaged file?)`, FIX);
  }
  const elf = out.subarray(0, elfExtent(out, abs));
  if (p.release && elf.indexOf(`Linux version ${p.release} `) < 0) {
    throw new UserError(`${abs}: the kernel inside is not release ${p.release}, which its header names (no "Linux version ${p.release}" banner)`, FIX);
  }
  writeFileAtomic(path, elf);
  return { path, compression: p.compression, release: p.release, bytes: elf.length, cached: false };
}
