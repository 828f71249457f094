// A minimal writer of "newc" cpio archives, the format Linux unpacks as an
// initramfs. Enough for directories, files, symlinks and device nodes.

export type CpioEntry =
  | { kind: 'dir'; path: string; mode?: number }
  | { kind: 'file'; path: string; data: Uint8Array; mode?: number }
  | { kind: 'symlink'; path: string; target: string }
  | { kind: 'chardev'; path: string; major: number; minor: number; mode?: number };

const S_IFDIR = 0o040000;
const S_IFREG = 0o100000;
const S_IFLNK = 0o120000;
const S_IFCHR = 0o020000;

function hex8(n: number): string {
  if (!Number.isInteger(n) || n < 0 || n > 0xffffffff) throw new RangeError(`cpio field out of range: ${n}`);
  return n.toString(16).padStart(8, '0');
}

function pad4(n: number): number {
  return (4 - (n % 4)) % 4;
}

/** Serialises entries (paths relative to the archive root, no leading '/') plus the trailer. */
export function cpioArchive(entries: CpioEntry[]): Buffer {
  const parts: Buffer[] = [];
  let ino = 1;
  let offset = 0;
  const push = (b: Buffer) => {
    parts.push(b);
    offset += b.length;
  };
  const record = (name: string, mode: number, data: Uint8Array, rdev: [number, number] = [0, 0]) => {
    const nameBytes = Buffer.from(`${name}\0`, 'utf8');
    const header =
      '070701' +
      [ino++, mode, 0, 0, 1, 0, data.length, 0, 0, rdev[0], rdev[1], nameBytes.length, 0].map(hex8).join('');
    push(Buffer.from(header, 'ascii'));
    push(nameBytes);
    push(Buffer.alloc(pad4(offset)));
    push(Buffer.from(data.buffer, data.byteOffset, data.byteLength));
    push(Buffer.alloc(pad4(offset)));
  };
  for (const e of entries) {
    const path = e.path.replace(/^\/+/, '');
    if (path === '' || path.split('/').includes('..')) throw new Error(`bad cpio path: ${e.path}`);
    switch (e.kind) {
      case 'dir':
        record(path, S_IFDIR | (e.mode ?? 0o755), new Uint8Array());
        break;
      case 'file':
        record(path, S_IFREG | (e.mode ?? 0o644), e.data);
        break;
      case 'symlink':
        record(path, S_IFLNK | 0o777, Buffer.from(e.target, 'utf8'));
        break;
      case 'chardev':
        record(path, S_IFCHR | (e.mode ?? 0o600), new Uint8Array(), [e.major, e.minor]);
        break;
    }
  }
  record('TRAILER!!!', 0, new Uint8Array());
  return Buffer.concat(parts);
}
