// One image build at a time per store: builds share the package lists (apt
// locks them) and the image directories. The lock is a file created with
// O_EXCL holding the owner's pid; a lock whose owner died is taken over.
import { closeSync, mkdirSync, openSync, readFileSync, rmSync, watch, writeSync } from 'node:fs';
import { dirname } from 'node:path';

function ownerAlive(lockFile: string): boolean {
  let pid: number;
  try {
    pid = Number.parseInt(readFileSync(lockFile, 'utf8'), 10);
  } catch {
    return false;
  }
  if (!Number.isInteger(pid) || pid <= 0) return false;
  if (pid === process.pid) return true;
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'EPERM';
  }
}

function tryTake(lockFile: string): boolean {
  try {
    const fd = openSync(lockFile, 'wx');
    writeSync(fd, String(process.pid));
    closeSync(fd);
    return true;
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== 'EEXIST') throw e;
    return false;
  }
}

/** Waits until the lock file is gone (or its owner died), watching its directory. */
function waitForRelease(lockFile: string): Promise<void> {
  return new Promise((resolve) => {
    const w = watch(dirname(lockFile), () => check());
    // The owner can die without removing the file: its liveness is checked now and then too.
    const timer = setInterval(() => check(), 1000);
    const check = (): void => {
      let gone = false;
      try {
        readFileSync(lockFile);
        gone = !ownerAlive(lockFile);
        if (gone) rmSync(lockFile, { force: true });
      } catch {
        gone = true;
      }
      if (gone) {
        w.close();
        clearInterval(timer);
        resolve();
      }
    };
    check();
  });
}

/** Runs fn holding the lock; `onWait` is called once if another process holds it. */
export async function withLock<T>(lockFile: string, fn: () => Promise<T>, onWait?: () => void): Promise<T> {
  mkdirSync(dirname(lockFile), { recursive: true });
  let told = false;
  while (!tryTake(lockFile)) {
    if (!told) {
      onWait?.();
      told = true;
    }
    await waitForRelease(lockFile);
  }
  try {
    return await fn();
  } finally {
    rmSync(lockFile, { force: true });
  }
}
