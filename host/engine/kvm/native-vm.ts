// The addon's in-process VMM (native/src/vmm_binding.cc), typed.
import { native } from '../../native.ts';
import type { DiffLayerHandle } from './snapshot-native.ts';

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
  /**
   * Restore this snapshot (from snapshot.loadTemplate() or vm.branch())
   * instead of booting: kernel, initrd and cmdline are ignored, memory and
   * vCPUs come from the snapshot.
   */
  restore?: NativeSnapshot;
  /** Adopt a VM made by snapshot.prepareVms() (all other options are then ignored). */
  prepared?: NativePreparedVm;
}

/** A VM created and restored off the JS thread, not started (snapshot.prepareVms). */
export interface NativePreparedVm {
  readonly prepared: unknown;
}

/** A snapshot a VM can be restored from (template or branch), held by the addon. */
export interface NativeSnapshot {
  readonly handle: unknown;
  readonly what: string;
  readonly memoryMiB: number;
  readonly vcpus: number;
  /** Diff layers over the template's memory file (0 for a template). */
  readonly depth: number;
}

export interface NativeBranch {
  snapshot: NativeSnapshot;
  /** How long the source's vCPUs were stopped. */
  pauseUs: number;
  /** Where the pause went: stopping the vCPUs, saving state, finding written pages, copying them. */
  pauseParts: { stopUs: number; saveUs: number; scanUs: number; copyUs: number };
  /** Copy while the source ran (before the pause), and pages copied again in the pause. */
  precopyUs: number;
  precopyPages: number;
  recopiedPages: number;
  /** Pages the source had written since it was restored. */
  privatePages: number;
  /** Pages in the new diff layer (private pages plus filled gaps). */
  diffPages: number;
  runs: number;
  depth: number;
  collapsed: boolean;
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
  /**
   * Exits, device and vsock counters, and the host memory of the VM outside
   * guest RAM that is cheap to read: host_vcpu_stack_bytes and
   * host_kvm_run_bytes (resident), host_npt_min_bytes (the fewest table pages
   * of KVM's nested page table that hold the entries KVM says it maps).
   */
  counters: Record<string, number>;
}

export interface NativePack {
  /** Whether the VM holds packed pages now. */
  packed: boolean;
  privatePages: number;
  /** Given back (their differing bytes kept). */
  packedPages: number;
  /** Left private: too unlike what backs them. */
  keptPages: number;
  /** Host memory the packed bytes take (page-rounded). */
  hostBytes: number;
  /** Nothing was left private: KVM's nested tables and the host's page tables for its RAM were freed too, until it wakes. */
  ramTablesDropped: boolean;
  /** And its KVM VM closed (its state kept in the host) until it wakes: no kernel structures of KVM left for it. */
  shelved: boolean;
  totalUs: number;
}

export interface NativeVm {
  start(): void;
  /** Returns once every vCPU is out of KVM_RUN. */
  pause(): void;
  resume(): void;
  /**
   * Holds every vCPU outside KVM_RUN until input for the guest comes (vsock
   * bytes or a connection from the host, an interrupt): for a guest in which
   * nothing would run without input (the agent's `quiet`), whose timer ticks
   * would otherwise write pages. Returns once they wait; false when the VM
   * does not run. The `dozing`, `dozes` and `dozed_ms` counters say more.
   */
  doze(): boolean;
  /** Dozed and not woken since. */
  dozing(): boolean;
  /** Joins the vCPU and device threads and frees guest RAM; idempotent. */
  kill(): void;
  stats(): NativeVmStats;
  /** Delivers the events posted so far to onEvents now, before it returns (a stop's reason among them). */
  flushEvents(): void;
  /** Registers of every vCPU, one line each (pauses them for a moment). */
  debugState(): string;
  /** Writes dir/state.bin and dir/memory.bin; the VM must be paused. */
  saveTemplate(dir: string): { memory: { size: number; dataPages: number; checksum: number }; stateBytes: number; saveMs: number; memoryMs: number };
  /** Pauses, captures state and written pages into a diff layer (an unlinked file in dir), resumes. */
  branch(dir: string): NativeBranch;
  /** Guest RAM pages this VM owns alone (private) and shares with the page cache. */
  /** With `frames`, also the guest frame numbers (gpa >> 12) of the pages the VM owns privately (a restored VM). */
  memoryUsage(opts?: { frames?: boolean }): {
    guestPrivateBytes: number;
    guestSharedBytes: number;
    guestMemfdBytes: number;
    /** Pages mapped from its pattern (setPattern), written since or not. */
    guestPatternBytes: number;
    /** The host's page-table pages for guest RAM: one per 2 MiB span with a page present. */
    guestTableBytes: number;
    privateFrames?: Float64Array;
  };
  /**
   * A restored VM: drops its private pages that hold the snapshot's bytes
   * again (they fall back to the shared memory file or diff layer; the guest
   * cannot tell). Holds the vCPUs for moments only. Looks at private pages
   * from RAM page `fromPage` on, at most `maxPages` of them (default: all).
   */
  reclaim(opts?: { fromPage?: number; maxPages?: number }): NativeReclaim;
  /**
   * A restored VM that dozes: each private page kept as the bytes in which it
   * differs from what backs it (pattern or snapshot), in one mapping of the
   * host's, and given back; written back before anything reads or runs its
   * RAM again (input wakes it). Nothing when it does not doze or is packed.
   * Counters `packed_pages`, `packed_bytes` (the store), `packs`, `unpacks`,
   * `last_unpack_us` (vmm/snapshot/packed_pages.h).
   */
  pack(opts?: { shelve?: boolean }): NativePack;
  /**
   * A restored VM: its private pages (and small gaps between them) as a
   * pattern, an unlinked diff file in `dir`, for its siblings (vmm/snapshot/pattern.h).
   * `others`: more children of the same snapshot with the same history; their
   * pages too, and with two, a page this one alone holds otherwise takes theirs.
   */
  capturePattern(dir: string, others?: NativeVm[]): DiffLayerHandle;
  /** A restored VM, once: reclaim maps runs that hold this pattern's bytes from it. */
  setPattern(pattern: DiffLayerHandle): void;
  /** Test and diagnostics only: a copy of guest RAM at a guest physical address. */
  guestBytes(gpa: number, length: number): Buffer;
  /** Test and diagnostics only: writes guest RAM from the host side. */
  writeGuestBytes(gpa: number, bytes: Uint8Array): void;
}

export interface NativeReclaim {
  /** Private pages looked at. */
  privatePages: number;
  /** Where to go on (maxPages was reached), or null when done. */
  nextPage: number | null;
  /** Pages given back (shared with the page cache again). */
  droppedPages: number;
  /** Pages that held the pattern's bytes, now mapped from it (shared). */
  patternPages: number;
  /** vCPUs held, in all and at most at once. */
  pauseUs: number;
  longestPauseUs: number;
  totalUs: number;
}

export interface NativeVmClass {
  new (opts: NativeVmOptions, onEvents: (events: NativeVmEvent[]) => void): NativeVm;
}

export function nativeVmClass(): NativeVmClass {
  return (native() as unknown as { Vm: NativeVmClass }).Vm;
}
