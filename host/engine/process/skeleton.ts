// A sandbox's user namespace maps its root onto us only (or, as root, onto an
// unprivileged host uid: engine.ts DEFAULT_ID_BASE): the
// image's files, which belong to the host's root, show as owned by nobody, and
// overlayfs cannot copy up (chown) what it cannot map, so writing anywhere in
// the image failed with EOVERFLOW (a file in /tmp, in /root). The skeleton is
// a tree of the image's directories (modes kept, owned by us: root inside),
// the overlay's top lower layer: every directory is then one the sandbox owns,
// new files can be made anywhere, and the image's own files stay read-only.
// Made once per image, atomically, in the store's cache.
import { createHash } from 'node:crypto';
import { type Dirent, chmodSync, chownSync, existsSync, mkdirSync, readdirSync, renameSync, rmSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { storePath } from '../../store.ts';
import { sandboxAddon } from './native.ts';

/** Changes when what a skeleton holds changes (a new cache entry). */
const SKELETON_FORMAT = 2;

/**
 * The skeleton of `rootfs` (made now if missing), its directories owned by
 * `owner` (as root: the host uid of the sandboxes' root) or by us. A directory we cannot read
 * (root's 0700 /root) is made empty and opaque: an overlay would refuse to
 * look into the image's copy (with our credentials), and its contents are not
 * ours to see anyway.
 */
export function skeletonFor(rootfs: string, owner: number | null = null): string {
  const st = statSync(rootfs);
  // A rebuilt image is a new directory (the store replaces it by rename): a new inode, a new skeleton.
  const key = createHash('sha256').update(`${SKELETON_FORMAT}\0${rootfs}\0${st.ino}\0${st.mtimeMs}\0${owner ?? ''}`).digest('hex').slice(0, 16);
  const dir = storePath('cache', 'skeletons', key);
  if (existsSync(dir)) return dir;
  const tmp = `${dir}.tmp-${process.pid}`;
  rmSync(tmp, { recursive: true, force: true });
  mkdirSync(tmp, { recursive: true });
  const walk = (src: string, dst: string) => {
    let entries: Dirent[];
    try {
      // (as root we can read everything, but the sandboxes' root, an unprivileged uid, is
      // "other" to the image's files: a directory others cannot search is out of its reach)
      if (owner !== null && src !== rootfs && !(statSync(src).mode & 0o001)) throw new Error('not searchable by others');
      entries = readdirSync(src, { withFileTypes: true });
    } catch {
      try {
        sandboxAddon().sandboxOpaque(dst); // not ours to read: made, empty, opaque
      } catch {} // (a store without user xattrs: that directory stays out of reach, as without a skeleton)
      return;
    }
    for (const e of entries) {
      if (!e.isDirectory()) continue;
      const s = join(src, e.name);
      const d = join(dst, e.name);
      mkdirSync(d);
      walk(s, d);
      if (owner !== null) chownSync(d, owner, owner);
      chmodSync(d, statSync(s).mode & 0o7777); // after its children: a read-only directory can still be filled
    }
  };
  walk(rootfs, tmp);
  if (owner !== null) chownSync(tmp, owner, owner);
  chmodSync(tmp, st.mode & 0o7777);
  try {
    renameSync(tmp, dir);
  } catch (e) {
    rmSync(tmp, { recursive: true, force: true });
    if (!existsSync(dir)) throw e; // (another process made it meanwhile: fine)
  }
  return dir;
}
