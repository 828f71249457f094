// A process the engine signals and waits for by a pidfd, never by its number:
// the PID 1s of sandboxes and zygotes are not our children (their parents or
// the host's init reap them), so once one has exited its number may be a
// later process's, anywhere on the host, and a kill by number would reach it.
import { closeSync } from 'node:fs';
import { constants } from 'node:os';
import { sandboxAddon } from './native.ts';

export class ProcessRef {
  private fd: number;
  private gone = false;
  /** Resolves once the process has exited (a zombie, or reaped). */
  readonly exited: Promise<void>;

  /** Throws (code ESRCH) if there is no process `pid`. `reap`: it is our child, reaped once it exits (a launched root). */
  constructor(
    readonly pid: number,
    opts: { reap?: boolean } = {},
  ) {
    const addon = sandboxAddon();
    this.fd = addon.sandboxPidfd(pid);
    this.exited = new Promise<void>((resolve) => {
      try {
        addon.sandboxWatchPidfd(this.fd, () => resolve(), opts.reap === true);
      } catch {
        resolve(); // (no watch: treated as gone rather than waited for forever)
      }
    }).then(() => {
      this.gone = true;
    });
  }

  /** Has not exited (as far as the event loop has seen). */
  get alive(): boolean {
    return !this.gone && this.fd >= 0;
  }

  /** Sends `signal` to this process only: false if it has exited (or was released). */
  signal(signal: NodeJS.Signals): boolean {
    if (this.fd < 0) return false;
    return sandboxAddon().sandboxSignal(this.fd, constants.signals[signal]);
  }

  /** Closes the pidfd (the exit watch goes on with its own copy); signal() is a no-op after. */
  release(): void {
    if (this.fd >= 0) closeSync(this.fd);
    this.fd = -1;
  }
}
