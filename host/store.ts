// The on-disk store: images, templates, caches. One root, atomic writes.
import { randomBytes } from 'node:crypto';
import { mkdirSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { homedir } from 'node:os';
import { dirname, join } from 'node:path';

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

/**
 * Builds a directory atomically: `fill` writes into a staging directory next to
 * `dest`; only when it succeeds does the staging directory replace `dest`.
 * A failure or crash leaves `dest` as it was (stale staging dirs start with '.staging-').
 */
export async function buildDirAtomic(dest: string, fill: (staging: string) => Promise<void>): Promise<void> {
  const parent = dirname(dest);
  mkdirSync(parent, { recursive: true });
  const staging = join(parent, `.staging-${randomBytes(6).toString('hex')}`);
  mkdirSync(staging);
  try {
    await fill(staging);
    const old = join(parent, `.old-${randomBytes(6).toString('hex')}`);
    let hadOld = false;
    try {
      renameSync(dest, old);
      hadOld = true;
    } catch (e) {
      // No old directory is fine; anything else (EXDEV on an overlay without
      // redirect_dir, EACCES) would only surface as a puzzling ENOTEMPTY below.
      if ((e as NodeJS.ErrnoException).code !== 'ENOENT') throw e;
    }
    renameSync(staging, dest);
    if (hadOld) rmSync(old, { recursive: true, force: true });
  } catch (e) {
    rmSync(staging, { recursive: true, force: true });
    throw e;
  }
}
