// The native addon (native/src/*.cc), loaded on first use and typed here.
// Conventions: failures throw an Error with `code` (errno name, e.g. 'EBADF'),
// `errno` and `syscall` (see NativeErrnoError); file descriptors are numbers the
// caller closes; 64-bit register and address quantities are bigint, narrower
// fields are numbers.
import { existsSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { UserError } from './errors.ts';

export const ADDON_PATH = join(dirname(dirname(fileURLToPath(import.meta.url))), 'native', 'build', 'Release', 'forkling.node');

/** What the addon throws for a failed syscall. */
export interface NativeErrnoError extends Error {
  code: string;
  errno: number;
  syscall: string;
}

export function isErrnoError(e: unknown, code?: string): e is NativeErrnoError {
  return e instanceof Error && typeof (e as NativeErrnoError).syscall === 'string' && (code === undefined || (e as NativeErrnoError).code === code);
}

/**
 * A memory mapping. `buffer` views the memory when it was mapped PROT_READ|PROT_WRITE
 * (else null); `unmap()` detaches the buffer before munmap, so no JS view outlives
 * the memory. A Mapping that is garbage-collected (with its buffer) is unmapped.
 * Note: SIGBUS still hits reads past the end of a truncated file mapping (only
 * guest RAM made by the VMM is guarded: native/src/vmm/ram_guard.h).
 */
export interface Mapping {
  readonly buffer: ArrayBuffer | null;
  /** host virtual address (for KVM memory slots); stale once unmapped */
  readonly address: bigint;
  readonly length: number;
  readonly mapped: boolean;
  unmap(): void;
}

export interface KvmRegs {
  rax: bigint;
  rbx: bigint;
  rcx: bigint;
  rdx: bigint;
  rsi: bigint;
  rdi: bigint;
  rsp: bigint;
  rbp: bigint;
  r8: bigint;
  r9: bigint;
  r10: bigint;
  r11: bigint;
  r12: bigint;
  r13: bigint;
  r14: bigint;
  r15: bigint;
  rip: bigint;
  rflags: bigint;
}

export interface KvmSegment {
  base: bigint;
  limit: number;
  selector: number;
  type: number;
  present: number;
  dpl: number;
  db: number;
  s: number;
  l: number;
  g: number;
  avl: number;
  unusable: number;
}

export interface KvmDtable {
  base: bigint;
  limit: number;
}

export interface KvmSregs {
  cs: KvmSegment;
  ds: KvmSegment;
  es: KvmSegment;
  fs: KvmSegment;
  gs: KvmSegment;
  ss: KvmSegment;
  tr: KvmSegment;
  ldt: KvmSegment;
  gdt: KvmDtable;
  idt: KvmDtable;
  cr0: bigint;
  cr2: bigint;
  cr3: bigint;
  cr4: bigint;
  cr8: bigint;
  efer: bigint;
  apicBase: bigint;
  /** 4 x 64 bits */
  interruptBitmap: bigint[];
}

export interface KvmMemoryRegion {
  slot: number;
  /** KVM_MEM_LOG_DIRTY_PAGES | KVM_MEM_READONLY */
  flags: number;
  guestPhysAddr: bigint;
  /** 0n deletes the slot */
  memorySize: bigint;
  /** must lie inside a live Mapping (checked by the addon) */
  userspaceAddr: bigint;
}

/** A KVM_RUN exit, decoded from the vCPU's kvm_run page. */
export interface KvmExit {
  reason: number;
  /** KVM_EXIT_ name without the prefix, e.g. 'IO', 'HLT' */
  reasonName: string;
  io?: {
    /** KVM_EXIT_IO_IN (0) or KVM_EXIT_IO_OUT (1) */
    direction: number;
    size: number;
    port: number;
    count: number;
    /** offset in the run mapping where an IN answer goes */
    dataOffset: number;
    /** copy of size*count bytes (what the guest wrote, for OUT) */
    data: Uint8Array;
  };
  mmio?: { physAddr: bigint; len: number; isWrite: boolean; data: Uint8Array };
  internal?: { suberror: number; ndata: number; data: bigint[] };
  failEntry?: { hardwareEntryFailureReason: bigint; cpu: number };
  hardwareExitReason?: bigint;
  systemEvent?: { type: number; data: bigint[] };
}

export interface NativeConstants {
  readonly [name: string]: number;
  readonly PROT_NONE: number;
  readonly PROT_READ: number;
  readonly PROT_WRITE: number;
  readonly PROT_EXEC: number;
  readonly MAP_SHARED: number;
  readonly MAP_PRIVATE: number;
  readonly MAP_ANONYMOUS: number;
  readonly MAP_NORESERVE: number;
  readonly MAP_POPULATE: number;
  readonly MADV_DONTNEED: number;
  readonly MADV_REMOVE: number;
  readonly MADV_WILLNEED: number;
  readonly MADV_FREE: number;
  readonly MFD_CLOEXEC: number;
  readonly MFD_ALLOW_SEALING: number;
  readonly EFD_CLOEXEC: number;
  readonly EFD_NONBLOCK: number;
  readonly EFD_SEMAPHORE: number;
  readonly KVM_API_VERSION: number;
  readonly KVM_EXIT_IO: number;
  readonly KVM_EXIT_HLT: number;
  readonly KVM_EXIT_MMIO: number;
  readonly KVM_EXIT_SHUTDOWN: number;
  readonly KVM_EXIT_FAIL_ENTRY: number;
  readonly KVM_EXIT_INTERNAL_ERROR: number;
  readonly KVM_EXIT_INTR: number;
  readonly KVM_EXIT_IO_IN: number;
  readonly KVM_EXIT_IO_OUT: number;
  readonly KVM_MEM_LOG_DIRTY_PAGES: number;
  readonly KVM_MEM_READONLY: number;
  readonly KVM_CAP_USER_MEMORY: number;
  readonly KVM_CAP_SET_TSS_ADDR: number;
  readonly KVM_CAP_NR_MEMSLOTS: number;
  readonly KVM_CAP_IRQCHIP: number;
  readonly KVM_CAP_IMMEDIATE_EXIT: number;
  readonly KVM_RUN_MMIO_DATA_OFFSET: number;
  readonly KVM_RUN_SIZE: number;
  readonly PAGE_SIZE: number;
}

/** The addon's exports (the raw syscall layer; later parts add theirs). */
export interface Native {
  constants: NativeConstants;
  openKvm(): number;
  close(fd: number): void;
  /** default flags MFD_CLOEXEC */
  memfdCreate(name: string, flags?: number): number;
  /** default flags EFD_CLOEXEC; read/write it with node:fs as 8-byte little-endian counters */
  eventfd(initval?: number, flags?: number): number;
  ftruncate(fd: number, length: number | bigint): void;
  /** MAP_FIXED is refused: the addon never places memory over existing mappings */
  mmap(length: number | bigint, prot: number, flags: number, fd?: number, offset?: number | bigint): Mapping;
  munmap(mapping: Mapping): void;
  /** range is relative to the mapping and must lie inside it */
  madvise(mapping: Mapping, offset: number | bigint, length: number | bigint, advice: number): void;
  kvmGetApiVersion(kvmFd: number): number;
  /** on the /dev/kvm fd or a VM fd */
  kvmCheckExtension(fd: number, cap: number): number;
  kvmCreateVm(kvmFd: number, type?: number): number;
  kvmGetVcpuMmapSize(kvmFd: number): number;
  kvmCreateVcpu(vmFd: number, id: number): number;
  kvmSetTssAddr(vmFd: number, addr: number | bigint): void;
  kvmSetUserMemoryRegion(vmFd: number, region: KvmMemoryRegion): void;
  kvmGetRegs(vcpuFd: number): KvmRegs;
  kvmSetRegs(vcpuFd: number, regs: KvmRegs): void;
  kvmGetSregs(vcpuFd: number): KvmSregs;
  kvmSetSregs(vcpuFd: number, sregs: KvmSregs): void;
  /** runs the vCPU until its next exit; `runMapping` = the vCPU fd mmapped MAP_SHARED with kvmGetVcpuMmapSize bytes */
  kvmRun(vcpuFd: number, runMapping: Mapping): KvmExit;
}

let loaded: Native | undefined;

/** The addon; throws a UserError saying how to build it when it is missing. */
export function native(): Native {
  if (loaded) return loaded;
  if (!existsSync(ADDON_PATH)) {
    throw new UserError(
      `the native addon is not built (${ADDON_PATH} is missing)`,
      'run npm install in the forkling directory (or npm run build:native to rebuild only the addon)',
    );
  }
  const require = createRequire(import.meta.url);
  try {
    loaded = require(ADDON_PATH) as Native;
  } catch (e) {
    throw new UserError(
      `cannot load the native addon ${ADDON_PATH}: ${(e as Error).message}`,
      'rebuild it for this Node.js with: npm run build:native',
    );
  }
  return loaded;
}
