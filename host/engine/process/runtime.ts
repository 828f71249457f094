// Host-side runtime directories of the process engine: one per engine
// instance, holding the stage mount points of its zygotes and cold-booted
// sandboxes. Nothing here is mounted on the host (every mount lives in a
// sandbox's private mount namespace) and no sandbox writes here: agent
// sockets live in each sandbox's own /run (agent-socket.ts).
import { randomBytes } from 'node:crypto';
import { lstatSync, mkdirSync, readdirSync, statfsSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { isAbsolute, join, relative } from 'node:path';
import { UserError } from '../../errors.ts';
import { processRunning } from '../../util/process.ts';
import { sandboxAddon } from './native.ts';

const TMPFS_MAGIC = 0x01021994;
const RAMFS_MAGIC = 0x858458f6;

/** Whether `path` is on a memory file system (tmpfs, ramfs). */
export function inMemory(path: string): boolean {
  try {
    const { type } = statfsSync(path);
    return type === TMPFS_MAGIC || type === RAMFS_MAGIC;
  } catch {
    return false;
  }
}

/**
 * $FORKLING_RUNTIME_DIR, else /run/forkling for root, else
 * $XDG_RUNTIME_DIR/forkling or /tmp/forkling-<uid>; /dev/shm/forkling[-<uid>]
 * instead of /run or /tmp where those are not in memory and /dev/shm is
 * (nothing here need outlive a reboot; when forks still made their socket
 * directories here, a disk file system cost ~3 ms of CPU per fork).
 */
export function runtimeRoot(env: NodeJS.ProcessEnv = process.env, uid = process.getuid?.() ?? 0, memory = inMemory): string {
  if (env.FORKLING_RUNTIME_DIR) return env.FORKLING_RUNTIME_DIR;
  if (uid === 0) return memory('/run') || !memory('/dev/shm') ? '/run/forkling' : '/dev/shm/forkling';
  if (env.XDG_RUNTIME_DIR) return join(env.XDG_RUNTIME_DIR, 'forkling');
  return memory(tmpdir()) || !memory('/dev/shm') ? join(tmpdir(), `forkling-${uid}`) : `/dev/shm/forkling-${uid}`;
}

/**
 * Makes `dir` (mode 0700) unless it exists, and checks that it is ours alone:
 * a directory, not a link, owned by us, writable by no one else. /tmp and
 * /dev/shm are writable by every user, who could have made it first.
 */
export function ownPrivateDir(dir: string, uid = process.getuid?.() ?? 0): void {
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  const st = lstatSync(dir);
  const why = !st.isDirectory()
    ? 'is not a directory (a link?)'
    : st.uid !== uid
      ? `belongs to uid ${st.uid}, not to us (uid ${uid})`
      : st.mode & 0o022
        ? `is writable by others (mode ${(st.mode & 0o777).toString(8)})`
        : null;
  if (why) throw new UserError(`the runtime directory ${dir} ${why}`, 'remove it, or set FORKLING_RUNTIME_DIR to a directory of your own');
}

/**
 * A fresh directory for one engine instance (p<pid>-<random>); directories
 * of engines whose process is gone are removed on the way.
 */
export function makeEngineDir(): string {
  const root = runtimeRoot();
  ownPrivateDir(root);
  for (const name of readdirSync(root)) {
    const m = /^p(\d+)-[0-9a-f]+$/.exec(name);
    // (what cannot go now, say while a sandbox that outlived its engine still writes there, is tried again next time)
    if (m && !processRunning(Number(m[1]))) removeTree(root, join(root, name));
  }
  const dir = join(root, `p${process.pid}-${randomBytes(3).toString('hex')}`);
  mkdirSync(dir, { mode: 0o700 });
  return dir;
}

/** A sandbox id: 12 lowercase hex characters (also a valid host name and path component). */
export function newId(): string {
  return randomBytes(6).toString('hex');
}

/**
 * Removes `dir`, below `base` (a directory of ours), and everything in it
 * without following a symbolic link below `base` (Node's rmSync follows a
 * directory swapped for a link meanwhile: when sandboxes could write here,
 * one could make us empty any host directory; the directory of an engine
 * of an older version may still hold what its sandboxes wrote). Returns what
 * failed, or null; never throws.
 */
export function removeTree(base: string, dir: string): string | null {
  const rel = relative(base, dir);
  if (!rel || rel.startsWith('..') || isAbsolute(rel)) return `${dir} is not below ${base}`;
  try {
    return sandboxAddon().sandboxRemoveTree(base, rel);
  } catch (e) {
    return (e as Error).message;
  }
}
