// The addon's in-process VMM (native/src/vmm_binding.cc), typed.
import { native } from '../../native.ts';

export interface NativeVmOptions {
  /** bzImage or vmlinux ELF */
  kernel: string;
  initrd?: string;
  cmdline: string;
  memoryMiB: number;
  vcpus: number;
  /** Unix socket of the VM's virtio-vsock device (`CONNECT <port>\n` protocol). */
  vsockPath?: string;
  vsockCid?: number;
  /** virtio-rng (default true) */
  rng?: boolean;
}

export type NativeVmEvent =
  | { type: 'console'; lines: string[] }
  | { type: 'console-dropped'; count: number }
  | {
      type: 'stopped';
      /** reset | panic | triple-fault | internal-error | fail-entry | system-event | halt | error */
      reason: string;
      message: string;
    }
  | { type: 'device-error'; device: string; message: string };

export interface NativeVmStats {
  memoryBytes: number;
  /** guest RAM pages backed by host memory now */
  residentBytes: number;
  counters: Record<string, number>;
}

export interface NativeVm {
  start(): void;
  /** Returns once every vCPU is out of KVM_RUN. */
  pause(): void;
  resume(): void;
  /** Joins the vCPU and device threads and frees guest RAM; idempotent. */
  kill(): void;
  stats(): NativeVmStats;
  /** Registers of every vCPU, one line each (pauses them for a moment). */
  debugState(): string;
}

export interface NativeVmClass {
  new (opts: NativeVmOptions, onEvents: (events: NativeVmEvent[]) => void): NativeVm;
}

export function nativeVmClass(): NativeVmClass {
  return (native() as unknown as { Vm: NativeVmClass }).Vm;
}
