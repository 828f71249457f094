// The process engine's part of the native addon (native/src/sandbox/launch.cc), typed.
import { createRequire } from 'node:module';
import { UserError } from '../../errors.ts';
import { ADDON_PATH } from '../../native.ts';

export interface LaunchOptions {
  /** The image's unpacked root filesystem (host path): the read-only lower layer. */
  rootfs: string;
  /** Without root: the rootfs's directories, owned by us (skeleton.ts), as the top lower layer. */
  skeleton?: string;
  /** An empty host directory; only the sandbox's mount namespace mounts over it. */
  stage: string;
  /** Host directory bound read-only at /run/forkling-agent inside (the agent's code). */
  agentDir?: string;
  hostname: string;
  /** argv[0] is an absolute path inside the new root. */
  argv: string[];
  env: string[];
  /** cgroup.procs files the sandbox is moved into before it runs anything. */
  cgroupProcs: string[];
  layerSizeMiB?: number;
  /** fd that becomes the child's stdout and stderr (else /dev/null). */
  stdoutFd?: number;
  /** Read end of a pipe whose write end only this process keeps: the sandbox gets it as fd 5 and ends at EOF. */
  lifelineFd?: number;
  seccomp: boolean;
}

export interface ExitStatus {
  code: number | null;
  signal: number | null;
}

export interface Launched {
  /** The sandbox's PID 1, as seen from here: our child (reap it once it exits). */
  pid: number;
  /** Our child that set it up; it exits once the sandbox runs: reap it with sandboxWait(). */
  keeperPid: number;
}

interface RawAddon {
  sandboxLaunch(opts: LaunchOptions): Launched;
  sandboxReap(pid: number): ExitStatus | null;
  sandboxWatch(pid: number, cb: (s: ExitStatus) => void): void;
  /** As sandboxWatch, for the process of a pidfd (the addon watches a copy of it); reaps it only if `reap` (our child, and ours to reap). */
  sandboxWatchPidfd(pidfd: number, cb: (s: ExitStatus) => void, reap?: boolean): void;
  /** A pidfd (close-on-exec) of process `pid`; throws ESRCH if there is none. */
  sandboxPidfd(pid: number): number;
  /** Sends a signal through a pidfd: true if sent, false if that process has exited. */
  sandboxSignal(pidfd: number, signal: number): boolean;
  sandboxPipe(): [number, number];
  /** Marks a directory opaque to the overlay layers below it (user.overlay.opaque; skeleton.ts). */
  sandboxOpaque(dir: string): void;
  /**
   * Removes base/rel and all below it without following a symbolic link in
   * rel or below (what a sandbox can write); null, or what failed. Never throws
   * for the file system.
   */
  sandboxRemoveTree(base: string, rel: string): string | null;
  /**
   * An O_PATH fd of the Unix socket at `rel` below process `pid`'s root
   * directory, resolved without following any link and without leaving that
   * root; throws (code ENOTSOCK, ELOOP, ESRCH, ...) otherwise. Connect to
   * /proc/self/fd/<fd>, then close it.
   */
  sandboxAgentSocket(pid: number, rel: string): number;
  /** The pid (in our pid namespace) of the process that listened on the other end of a connected Unix socket; -1 once it has exited (where the kernel has SO_PEERPIDFD). */
  sandboxPeerPid(fd: number): number;
}

export interface SandboxAddon extends RawAddon {
  /**
   * Resolves when process `pid` has exited (reaping it when it is our child; the
   * status is null for others). A pidfd on the event loop; does not keep Node alive.
   */
  sandboxWait(pid: number): Promise<ExitStatus>;
}

let addon: SandboxAddon | null = null;

/** The addon's sandbox functions (loaded on first use; the build must have run). */
export function sandboxAddon(): SandboxAddon {
  if (!addon) {
    const req = createRequire(import.meta.url);
    // FORKLING_ADDON: a private copy of the addon (a shared build directory is rebuilt from scratch by node-gyp).
    const path = process.env.FORKLING_ADDON || ADDON_PATH;
    let mod: Partial<RawAddon>;
    try {
      mod = req(path) as Partial<RawAddon>;
    } catch (e) {
      throw new UserError(`cannot load the native addon ${path}: ${(e as Error).message.split('\n')[0]}`, 'build it: npm run build:native');
    }
    if (typeof mod.sandboxLaunch !== 'function' || typeof mod.sandboxWatch !== 'function' || typeof mod.sandboxRemoveTree !== 'function' || typeof mod.sandboxAgentSocket !== 'function' || typeof mod.sandboxSignal !== 'function') {
      throw new Error(`the native addon at ${ADDON_PATH} has no sandboxLaunch/sandboxWatch/sandboxRemoveTree/sandboxAgentSocket/sandboxSignal: rebuild it with npm run build:native`);
    }
    const raw = mod as RawAddon;
    addon = {
      ...raw,
      sandboxWait: (pid) =>
        new Promise((resolve, reject) => {
          try {
            raw.sandboxWatch(pid, resolve);
          } catch (e) {
            if ((e as NodeJS.ErrnoException).code === 'ESRCH') resolve({ code: null, signal: null }); // already gone
            else reject(e);
          }
        }),
    };
  }
  return addon;
}
