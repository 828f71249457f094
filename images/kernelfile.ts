// Recognizes a kernel file given with --kernel: an x86 bzImage (boot protocol
// header "HdrS" at 0x202) or an x86-64 ELF vmlinux. Anything else is refused
// before a build starts.
import { closeSync, openSync, readSync, statSync } from 'node:fs';
import { UserError } from '../host/errors.ts';

export interface KernelFileInfo {
  format: 'bzImage' | 'vmlinux';
  /** e.g. 6.1.0-57-amd64, when the file says */
  release: string | null;
  /** the full "6.1.0-57-amd64 (debian-kernel@...) #1 SMP ..." string, when found */
  version: string | null;
}

const HINT = 'pass a bzImage (arch/x86/boot/bzImage) or an uncompressed x86-64 vmlinux';

function readAt(fd: number, pos: number, len: number): Buffer {
  const b = Buffer.alloc(len);
  const n = readSync(fd, b, 0, len, pos);
  return b.subarray(0, n);
}

/** Reads the format and version of a kernel file; throws a UserError for anything else. */
export function inspectKernelFile(path: string): KernelFileInfo {
  let size: number;
  try {
    const st = statSync(path);
    if (!st.isFile()) throw new UserError(`kernel ${path} is not a regular file`, HINT);
    size = st.size;
  } catch (e) {
    if (e instanceof UserError) throw e;
    throw new UserError(`cannot read kernel ${path}: ${(e as NodeJS.ErrnoException).code ?? (e as Error).message}`, HINT);
  }
  const fd = openSync(path, 'r');
  try {
    const head = readAt(fd, 0, 0x280);
    if (head.length >= 0x210 && head.toString('latin1', 0x202, 0x206) === 'HdrS') {
      // kernel_version: offset (minus 0x200) of a NUL-terminated string, boot protocol >= 2.00.
      const ptr = head.readUInt16LE(0x20e);
      let version: string | null = null;
      if (ptr !== 0 && ptr + 0x200 < size) {
        const s = readAt(fd, ptr + 0x200, 256);
        const end = s.indexOf(0);
        version = s.toString('latin1', 0, end < 0 ? s.length : end).trim() || null;
      }
      return { format: 'bzImage', release: version?.split(' ')[0] ?? null, version };
    }
    if (head.length >= 0x40 && head.readUInt32BE(0) === 0x7f454c46) {
      const cls = head[4];
      const data = head[5];
      const machine = head.readUInt16LE(0x12);
      if (cls !== 2 || data !== 1 || machine !== 0x3e) {
        throw new UserError(`kernel ${path} is an ELF file but not x86-64 (class ${cls}, machine ${machine})`, HINT);
      }
      const version = findLinuxVersion(fd, size);
      return { format: 'vmlinux', release: version?.split(' ')[0] ?? null, version };
    }
    throw new UserError(`kernel ${path} is neither a bzImage nor an ELF vmlinux`, HINT);
  } finally {
    closeSync(fd);
  }
}

/** Finds "Linux version X ..." (the linux_banner) in an uncompressed vmlinux. */
function findLinuxVersion(fd: number, size: number): string | null {
  const needle = Buffer.from('Linux version ');
  const chunk = 4 << 20;
  for (let pos = 0; pos < size; pos += chunk - needle.length) {
    const b = readAt(fd, pos, chunk);
    let i = b.indexOf(needle);
    while (i >= 0) {
      const end = b.indexOf(0, i);
      const s = b.toString('latin1', i + needle.length, end < 0 ? Math.min(b.length, i + 300) : end);
      // The banner is "Linux version <release> (<builder>) ..."; skip format strings like "%s".
      if (/^[0-9]+\.[0-9]+/.test(s)) return s.split('\n')[0]!.trim();
      i = b.indexOf(needle, i + 1);
    }
    if (b.length < chunk) break;
  }
  return null;
}
