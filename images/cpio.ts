// Deterministic newc ("070701") cpio of a directory tree, as the kernel's
// initramfs unpacker reads it. Entries are sorted bytewise by path (a parent
// always precedes its children), inode numbers are assigned in that order,
// device numbers of the source filesystem are dropped, and hard links keep
// their link (data on the last member of a group, as GNU cpio writes it; the
// kernel links later members to the first and appends). mtimes, modes and
// owners are taken from the tree as it is: the builder normalizes mtimes
// beforehand, so the same tree gives the same bytes. cpioArchive writes the
// same format from members listed in memory (no tree, no privileges needed
// for a device node).
import { closeSync, lstatSync, openSync, readdirSync, readlinkSync, readSync, type Stats } from 'node:fs';
import { join } from 'node:path';

export interface CpioEntry {
  /** path relative to the root, without leading '/' or './' */
  path: string;
  stat: Stats;
}

export interface CpioStats {
  entries: number;
  /** bytes of regular file data and symlink targets (what the tree occupies, roughly) */
  dataBytes: number;
  /** bytes of the uncompressed archive */
  archiveBytes: number;
}

/** Every entry under `root` (not the root itself), sorted bytewise by path. */
export function walkTree(root: string): CpioEntry[] {
  const out: CpioEntry[] = [];
  const visit = (rel: string): void => {
    const names = readdirSync(rel ? join(root, rel) : root);
    for (const n of names) {
      const p = rel ? `${rel}/${n}` : n;
      const st = lstatSync(join(root, p));
      out.push({ path: p, stat: st });
      if (st.isDirectory()) visit(p);
    }
  };
  visit('');
  // Bytewise order, not locale order: independent of the environment.
  out.sort((a, b) => Buffer.compare(Buffer.from(a.path), Buffer.from(b.path)));
  return out;
}

const hex8 = (n: number): string => {
  if (!Number.isInteger(n) || n < 0 || n > 0xffffffff) throw new RangeError(`cpio field out of range: ${n}`);
  return n.toString(16).padStart(8, '0');
};

function header(f: {
  ino: number;
  mode: number;
  uid: number;
  gid: number;
  nlink: number;
  mtime: number;
  size: number;
  rdevMajor: number;
  rdevMinor: number;
  name: string;
}): Buffer {
  const name = Buffer.from(`${f.name}\0`);
  const fields = [f.ino, f.mode, f.uid, f.gid, f.nlink, f.mtime, f.size, 0, 0, f.rdevMajor, f.rdevMinor, name.length, 0];
  const head = Buffer.from(`070701${fields.map(hex8).join('')}`, 'latin1');
  return Buffer.concat([head, name, pad(head.length + name.length)]);
}

const pad = (n: number): Buffer => Buffer.alloc((4 - (n % 4)) % 4);

const TRAILER = { ino: 0, mode: 0, uid: 0, gid: 0, nlink: 1, mtime: 0, size: 0, rdevMajor: 0, rdevMinor: 0, name: 'TRAILER!!!' };

// Linux dev_t encoding (glibc's gnu_dev_major/minor) for device nodes.
const devMajor = (d: number): number => Number(((BigInt(d) >> 8n) & 0xfffn) | ((BigInt(d) >> 32n) & ~0xfffn));
const devMinor = (d: number): number => Number((BigInt(d) & 0xffn) | ((BigInt(d) >> 12n) & ~0xffn));

/**
 * Writes the archive of `root` through `sink` (called with chunks in order;
 * awaited, so a slow consumer applies back-pressure). Returns counts.
 */
export async function writeCpio(root: string, sink: (chunk: Buffer) => Promise<void> | void): Promise<CpioStats> {
  const entries = walkTree(root);
  // Hard-link groups: source (dev, ino) -> paths in archive order.
  const groups = new Map<string, string[]>();
  for (const e of entries) {
    if (e.stat.isFile() && e.stat.nlink > 1) {
      const k = `${e.stat.dev}:${e.stat.ino}`;
      const g = groups.get(k);
      if (g) g.push(e.path);
      else groups.set(k, [e.path]);
    }
  }
  const inoOf = new Map<string, number>();
  let nextIno = 1;
  let archiveBytes = 0;
  let dataBytes = 0;
  const emit = async (b: Buffer): Promise<void> => {
    archiveBytes += b.length;
    await sink(b);
  };
  const buf = Buffer.alloc(1 << 20);
  for (const e of entries) {
    const st = e.stat;
    const mtime = Math.floor(st.mtimeMs / 1000);
    let ino: number;
    let nlink = 1;
    let carriesData = true;
    if (st.isFile() && st.nlink > 1) {
      const k = `${st.dev}:${st.ino}`;
      const g = groups.get(k)!;
      nlink = g.length;
      ino = inoOf.get(k) ?? nextIno++;
      inoOf.set(k, ino);
      carriesData = g.at(-1) === e.path;
    } else {
      ino = nextIno++;
    }
    const base = { ino, mode: st.mode, uid: st.uid, gid: st.gid, nlink, mtime, rdevMajor: 0, rdevMinor: 0, name: e.path };
    if (st.isSymbolicLink()) {
      const target = Buffer.from(readlinkSync(join(root, e.path)));
      await emit(header({ ...base, size: target.length }));
      await emit(Buffer.concat([target, pad(target.length)]));
      dataBytes += target.length;
    } else if (st.isFile()) {
      const size = carriesData ? st.size : 0;
      await emit(header({ ...base, size }));
      if (size > 0) {
        const fd = openSync(join(root, e.path), 'r');
        try {
          let left = size;
          while (left > 0) {
            const n = readSync(fd, buf, 0, Math.min(buf.length, left), null);
            if (n === 0) throw new Error(`${e.path} shrank while it was archived`);
            await emit(Buffer.from(buf.subarray(0, n)));
            left -= n;
          }
        } finally {
          closeSync(fd);
        }
        await emit(pad(size));
        dataBytes += size;
      }
    } else if (st.isCharacterDevice() || st.isBlockDevice()) {
      await emit(header({ ...base, size: 0, rdevMajor: devMajor(st.rdev), rdevMinor: devMinor(st.rdev) }));
    } else if (st.isDirectory() || st.isFIFO()) {
      await emit(header({ ...base, size: 0 }));
    } else {
      // Sockets have no business in an image.
      throw new Error(`cannot archive ${e.path}: unsupported file type`);
    }
  }
  await emit(header(TRAILER));
  return { entries: entries.length, dataBytes, archiveBytes };
}

/** A member given in memory rather than read from a tree (paths relative to the root). */
export type CpioMember =
  | { kind: 'dir'; path: string; mode?: number }
  | { kind: 'file'; path: string; data: Uint8Array; mode?: number }
  | { kind: 'symlink'; path: string; target: string }
  | { kind: 'chardev'; path: string; major: number; minor: number; mode?: number };

/**
 * The archive of `members` in the order given (a parent before its children),
 * each owned by root with mtime 0 and one link: for small archives put
 * together in memory, such as the KVM lab's initramfs.
 */
export function cpioArchive(members: CpioMember[]): Buffer {
  const parts: Buffer[] = [];
  let ino = 1;
  const record = (name: string, mode: number, data: Uint8Array, rdevMajor = 0, rdevMinor = 0): void => {
    parts.push(header({ ino: ino++, mode, uid: 0, gid: 0, nlink: 1, mtime: 0, size: data.length, rdevMajor, rdevMinor, name }));
    parts.push(Buffer.from(data.buffer, data.byteOffset, data.byteLength), pad(data.length));
  };
  for (const m of members) {
    const path = m.path.replace(/^\/+/, '');
    if (path === '' || path.split('/').includes('..')) throw new Error(`bad cpio path: ${m.path}`);
    if (m.kind === 'dir') record(path, 0o040000 | (m.mode ?? 0o755), new Uint8Array());
    else if (m.kind === 'file') record(path, 0o100000 | (m.mode ?? 0o644), m.data);
    else if (m.kind === 'symlink') record(path, 0o120777, Buffer.from(m.target));
    else record(path, 0o020000 | (m.mode ?? 0o600), new Uint8Array(), m.major, m.minor);
  }
  parts.push(header(TRAILER));
  return Buffer.concat(parts);
}

/** Names in a newc archive (uncompressed), for checks and tests. */
export function listCpio(archive: Buffer): { path: string; mode: number; size: number; nlink: number }[] {
  const out: { path: string; mode: number; size: number; nlink: number }[] = [];
  let off = 0;
  const align = (n: number): number => (n + 3) & ~3;
  for (;;) {
    if (off + 110 > archive.length) throw new Error('truncated cpio header');
    const magic = archive.toString('latin1', off, off + 6);
    if (magic !== '070701') throw new Error(`bad cpio magic at ${off}`);
    const field = (i: number): number => Number.parseInt(archive.toString('latin1', off + 6 + i * 8, off + 14 + i * 8), 16);
    const mode = field(1);
    const nlink = field(4);
    const size = field(6);
    const nameSize = field(11);
    const name = archive.toString('utf8', off + 110, off + 110 + nameSize - 1);
    off = align(off + 110 + nameSize);
    if (name === 'TRAILER!!!') return out;
    out.push({ path: name, mode, size, nlink });
    off = align(off + size);
  }
}
