// The on-disk store: images, templates, caches. One root, atomic writes.
import { randomBytes } from 'node:crypto';
import { closeSync, existsSync, fsyncSync, mkdirSync, openSync, readdirSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { homedir } from 'node:os';
import { basename, dirname, join } from 'node:path';
import { processRunning } from './util/process.ts';

/** $FORKLING_HOME, else /var/lib/forkling for root, else $XDG_DATA_HOME/forkling. */
export function storeRoot(): string {
  const env = process.env.FORKLING_HOME;
  if (env) return env;
  if (process.getuid?.() === 0) return '/var/lib/forkling';
  const data = process.env.XDG_DATA_HOME || join(homedir(), '.local', 'share');
  return join(data, 'forkling');
}

export const storePath = (...parts: string[]): string => join(storeRoot(), ...parts);

/** Writes a file atomically: temp file in the same directory, fsync'd by rename semantics. */
export function writeFileAtomic(path: string, data: string | Uint8Array): void {
  mkdirSync(dirname(path), { recursive: true });
  const tmp = `${path}.tmp-${randomBytes(6).toString('hex')}`;
  try {
    writeFileSync(tmp, data, { flush: true });
    renameSync(tmp, path);
  } catch (e) {
    rmSync(tmp, { force: true });
    throw e;
  }
}

/** fsync of a file or directory by path (a directory: its entries, after renames in it). */
function syncPath(path: string): void {
  const fd = openSync(path, 'r');
  try {
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}

/** A directory next to `dest` for a build's `staging` or a replaced `old` one: the names recoverBuilds knows. */
function besideName(dest: string, kind: 'staging' | 'old'): string {
  return join(dirname(dest), `.${kind}-${basename(dest)}-${process.pid}-${randomBytes(6).toString('hex')}`);
}

/**
 * What a build of `dest` by a process that died left next to it: its staging
 * directory goes; its `.old-` (the previous `dest`, moved aside just before
 * the new one moved in) is put back if `dest` is missing, else goes.
 */
function recoverBuilds(parent: string, name: string): void {
  let entries: string[] = [];
  try {
    entries = readdirSync(parent);
  } catch {
    return;
  }
  for (const e of entries) {
    const m = /^\.(staging|old)-(.+)-(\d+)-[0-9a-f]{12}$/.exec(e);
    if (!m || m[2] !== name || processRunning(Number(m[3]))) continue;
    const path = join(parent, e);
    try {
      if (m[1] === 'old' && !existsSync(join(parent, name))) renameSync(path, join(parent, name));
      else rmSync(path, { recursive: true, force: true });
    } catch {}
  }
}

/**
 * Builds a directory atomically: `fill` writes into a staging directory next to
 * `dest`; only when it succeeds does the staging directory replace `dest`, its
 * files and itself synced first (a power loss right after never shows a
 * complete-looking `dest` with empty files). A failure leaves `dest` as it
 * was; what a crash left is put right by the next build of `dest`.
 */
export async function buildDirAtomic(dest: string, fill: (staging: string) => Promise<void>): Promise<void> {
  const parent = dirname(dest);
  mkdirSync(parent, { recursive: true });
  recoverBuilds(parent, basename(dest));
  const staging = besideName(dest, 'staging');
  mkdirSync(staging);
  try {
    await fill(staging);
    for (const e of readdirSync(staging, { withFileTypes: true })) if (e.isFile()) syncPath(join(staging, e.name));
    syncPath(staging);
    const old = besideName(dest, 'old');
    let hadOld = false;
    try {
      renameSync(dest, old);
      hadOld = true;
    } catch (e) {
      // No old directory is fine; anything else (EXDEV on an overlay without
      // redirect_dir, EACCES) would only surface as a puzzling ENOTEMPTY below.
      if ((e as NodeJS.ErrnoException).code !== 'ENOENT') throw e;
    }
    try {
      renameSync(staging, dest);
    } catch (e) {
      if (hadOld) renameSync(old, dest); // (the previous one back in place)
      throw e;
    }
    syncPath(parent);
    if (hadOld) rmSync(old, { recursive: true, force: true });
  } catch (e) {
    rmSync(staging, { recursive: true, force: true });
    throw e;
  }
}

/** Removes a directory of the store as one step for its readers: moved aside first, then deleted. */
export function removeDirAtomic(dir: string): void {
  const aside = besideName(dir, 'old');
  renameSync(dir, aside);
  rmSync(aside, { recursive: true, force: true });
}
