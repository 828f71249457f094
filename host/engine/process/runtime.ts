// Host-side runtime directories of the process engine: one per engine
// instance, holding the zygotes' stage mount points and the host ends of the
// sandboxes' /run/forkling (their agent sockets). Nothing here is mounted on
// the host: every mount lives in a sandbox's private mount namespace.
import { randomBytes } from 'node:crypto';
import { mkdirSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

/** $FORKLING_RUNTIME_DIR, else /run/forkling for root, else $XDG_RUNTIME_DIR/forkling or /tmp/forkling-<uid>. */
export function runtimeRoot(): string {
  const env = process.env.FORKLING_RUNTIME_DIR;
  if (env) return env;
  const uid = process.getuid?.() ?? 0;
  if (uid === 0) return '/run/forkling';
  if (process.env.XDG_RUNTIME_DIR) return join(process.env.XDG_RUNTIME_DIR, 'forkling');
  return join(tmpdir(), `forkling-${uid}`);
}

/** Whether a process runs (a zombie, dead but not yet reaped, does not). */
export function processRunning(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat[stat.lastIndexOf(')') + 2] !== 'Z';
  } catch {
    return false;
  }
}

/**
 * A fresh directory for one engine instance (p<pid>-<random>); directories
 * of engines whose process is gone are removed on the way.
 */
export function makeEngineDir(): string {
  const root = runtimeRoot();
  mkdirSync(root, { recursive: true, mode: 0o700 });
  for (const name of readdirSync(root)) {
    const m = /^p(\d+)-[0-9a-f]+$/.exec(name);
    if (m && !processRunning(Number(m[1]))) rmSync(join(root, name), { recursive: true, force: true });
  }
  const dir = join(root, `p${process.pid}-${randomBytes(3).toString('hex')}`);
  mkdirSync(dir, { mode: 0o700 });
  return dir;
}

/** A sandbox id: 12 lowercase hex characters (also a valid host name and path component). */
export function newId(): string {
  return randomBytes(6).toString('hex');
}
