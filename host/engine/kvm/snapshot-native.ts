// The addon's `snapshot` part (native/src/snapshot_binding.cc), typed: the
// state-file container, the sparse memory file, pagemap accounting and diff
// layers. Errors for a bad file carry code 'ECORRUPT' and a message that
// names what was loaded ("template X is corrupt: ...").
import { type Mapping, native } from '../../native.ts';
import type { NativePreparedVm, NativeSnapshot } from './native-vm.ts';

export interface StateSection {
  tag: number;
  index: number;
  data: Uint8Array;
}

export interface MemoryFileInfo {
  size: number;
  dataPages: number;
  checksum: number;
}

export interface DiffLayerHandle {
  readonly handle: unknown;
  readonly pageCount: number;
  readonly runCount: number;
  readonly ramSize: number;
}

type Bytes = Uint8Array | ArrayBuffer | Mapping;

export interface SnapshotNative {
  crc32c(data: Bytes, seed?: number): number;
  encodeStateFile(sections: StateSection[]): Uint8Array;
  decodeStateFile(data: Bytes, what: string): StateSection[];
  writeMemoryFile(memory: Bytes, path: string, srcFd?: number): MemoryFileInfo;
  scanMemoryFile(path: string, what: string): MemoryFileInfo;
  verifyMemoryFile(path: string, expected: MemoryFileInfo, what: string): void;
  clearVerifyCache(): void;
  /** Pages of a mapping owned privately, shared with the page cache, and the 2 MiB spans with any page present (a page-table page each). */
  pageCounts(memory: Bytes): { private: number; shared: number; tableSpans: number };
  privatePages(memory: Bytes): number[];
  fillGaps(pages: number[], budget: number): number[];
  writeDiff(fd: number, memory: Bytes, pages: number[], dataChecksum?: boolean): void;
  openDiff(fd: number, what: string): DiffLayerHandle;
  diffPages(layer: DiffLayerHandle): number[];
  collapseDiffs(chain: DiffLayerHandle[], fd: number): void;
  mapLayered(baseFd: number, size: number, chain: DiffLayerHandle[]): ArrayBuffer;
  createTempDiffFile(dir: string): number;
  /** Reads and checks dir/state.bin and dir/memory.bin; the result restores VMs (NativeVmOptions.restore). */
  loadTemplate(dir: string, what: string): NativeSnapshot;
  /**
   * Creates and restores VMs from `snapshot` on worker threads (creation
   * mostly waits on the kernel, so several at once overlap); not started.
   * Each result is passed to `new Vm({ prepared })`.
   */
  prepareVms(snapshot: NativeSnapshot, configs: { vsockPath: string; vsockCid?: number; rng?: boolean }[]): Promise<NativePreparedVm[]>;
  /** Frees a prepared VM that will not be started (a no-op for one already taken). */
  releasePrepared(prepared: NativePreparedVm): void;
}

/** Section tags as the C++ side spells them (four ASCII characters, little-endian). */
export function sectionTag(s: string): number {
  if (s.length !== 4) throw new Error('a section tag has four characters');
  return (s.charCodeAt(0) | (s.charCodeAt(1) << 8) | (s.charCodeAt(2) << 16) | (s.charCodeAt(3) << 24)) >>> 0;
}

export function snapshotNative(): SnapshotNative {
  return (native() as unknown as { snapshot: SnapshotNative }).snapshot;
}
