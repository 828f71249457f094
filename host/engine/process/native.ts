// The process engine's part of the native addon (native/src/sandbox/launch.cc), typed.
import { createRequire } from 'node:module';
import { ADDON_PATH } from '../../native.ts';

export interface LaunchOptions {
  /** The image's unpacked root filesystem (host path): the read-only lower layer. */
  rootfs: string;
  /** An empty host directory; only the sandbox's mount namespace mounts over it. */
  stage: string;
  /** Host directory bind-mounted at /run/forkling inside (the agent's socket lives there). */
  runDir: string;
  hostname: string;
  /** argv[0] is an absolute path inside the new root. */
  argv: string[];
  env: string[];
  userns: boolean;
  /** Lines for /proc/PID/uid_map and gid_map, written by this process. */
  uidMap?: string;
  gidMap?: string;
  setgroupsDeny?: boolean;
  /** cgroup.procs files the child is moved into before it runs anything. */
  cgroupProcs: string[];
  layerSizeMiB?: number;
  /** fd that becomes the child's stdout and stderr (else /dev/null). */
  stdoutFd?: number;
  seccomp: boolean;
}

export interface ExitStatus {
  code: number | null;
  signal: number | null;
}

interface SandboxAddon {
  sandboxLaunch(opts: LaunchOptions): number;
  sandboxReap(pid: number): ExitStatus | null;
  sandboxWait(pid: number): Promise<ExitStatus>;
  sandboxPipe(): [number, number];
}

let addon: SandboxAddon | null = null;

/** The addon's sandbox functions (loaded on first use; the build must have run). */
export function sandboxAddon(): SandboxAddon {
  if (!addon) {
    const req = createRequire(import.meta.url);
    const mod = req(ADDON_PATH) as Partial<SandboxAddon>;
    if (typeof mod.sandboxLaunch !== 'function') {
      throw new Error(`the native addon at ${ADDON_PATH} has no sandboxLaunch: rebuild it with npm run build:native`);
    }
    addon = mod as SandboxAddon;
  }
  return addon;
}
