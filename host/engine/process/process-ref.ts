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
  private watched: Promise<void> | null = null;

  /** Throws (code ESRCH) if there is no process `pid`. `reap`: it is our child, reaped once it exits (a launched root). */
  constructor(
    readonly pid: number,
    private readonly opts: { reap?: boolean } = {},
  ) {
    this.fd = sandboxAddon().sandboxPidfd(pid);
  }

  /**
   * Resolves once the process has exited (a zombie, or reaped). The watch (a
   * copy of the pidfd on the event loop, until the exit) starts at the first
   * use: a process only looked at, then released, is not watched.
   */
  get exited(): Promise<void> {
    if (!this.watched) {
      this.watched = new Promise<void>((resolve) => {
        try {
          if (this.fd < 0) throw new Error('released');
          sandboxAddon().sandboxWatchPidfd(this.fd, () => resolve(), this.opts.reap === true);
        } catch {
          resolve(); // (no watch: treated as gone rather than waited for forever)
        }
      }).then(() => {
        this.gone = true;
      });
    }
    return this.watched;
  }

  /**
   * Resolves true once the process has exited, false after `ms`. Holds the
   * event loop meanwhile (the exit watch does not): a script that awaits a
   * kill is not ended by Node with its work half done.
   */
  async exitedWithin(ms: number): Promise<boolean> {
    let timer: ReturnType<typeof setTimeout> | undefined;
    try {
      return await Promise.race([this.exited.then(() => true), new Promise<boolean>((r) => (timer = setTimeout(() => r(false), ms)))]);
    } finally {
      clearTimeout(timer);
    }
  }

  /** Has not exited (as far as the event loop has seen). */
  get alive(): boolean {
    return !this.gone && this.fd >= 0;
  }

  /** Sends `signal` (a name, or a number such as a real-time signal's) to this process only: false if it has exited (or was released). */
  signal(signal: NodeJS.Signals | number): boolean {
    if (this.fd < 0) return false;
    return sandboxAddon().sandboxSignal(this.fd, typeof signal === 'number' ? signal : constants.signals[signal]);
  }

  /** Closes the pidfd (an exit watch started goes on with its own copy); signal() is a no-op after. */
  release(): void {
    if (this.fd >= 0) closeSync(this.fd);
    this.fd = -1;
  }
}
