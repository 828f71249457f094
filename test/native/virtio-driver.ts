// A fake virtio driver for the device-model tests: it lays out split rings in
// the test device's guest RAM (an ArrayBuffer), posts buffers, kicks, and
// reads the used rings back, the way a guest kernel would. It can also write
// any raw descriptor or ring value, so tests can play a hostile guest.
import { native } from '../../host/native.ts';

export type DeviceEventKind = 'interrupt' | 'failure';

export interface TestDeviceOptions {
  memorySize: number;
  /** RAM regions as [gpa, size] (default: all of memorySize at gpa 0) */
  regions?: [number, number][];
  guestCid?: number | bigint;
  socketPath?: string;
  onEvent?: (kind: DeviceEventKind, value: number | string) => void;
}

export interface QueueConfig {
  size: number;
  ready: boolean;
  desc: number | bigint;
  driver: number | bigint;
  device: number | bigint;
}

export interface VsockStats {
  txPackets: number;
  rxPackets: number;
  badPackets: number;
  resetsSent: number;
  droppedControl: number;
  connections: number;
  /** the event loop's thread has ended until something happens (requestPark) */
  parked: boolean;
  parks: number;
  /** parks asked for and refused (work waiting), with no pass made for them */
  parkRefusals: number;
  /** epoll fds the process's park watch holds now, every device's */
  parkWatched: number;
}

export interface VsockState {
  guestCid: bigint;
  active: boolean;
  driverFeatures: bigint;
  nextHostPort: number;
  queues: {
    size: number;
    ready: boolean;
    desc: bigint;
    driver: bigint;
    device: bigint;
    lastAvail: number;
    nextUsed: number;
  }[];
}

/** native/src/vmm_testing.cc */
export interface VirtioTestDevice {
  readonly memory: ArrayBuffer;
  deviceId(): number;
  deviceFeatures(): bigint;
  numQueues(): number;
  maxQueueSize(queue: number): number;
  readConfig(offset: number, length: number): Uint8Array;
  writeConfig(offset: number, data: Uint8Array): void;
  activate(queues: QueueConfig[], driverFeatures: bigint | number): void;
  notify(queue: number): void;
  reset(): void;
  transportReset(): void;
  /** waits until the device handled everything before the call; false on timeout */
  sync(timeoutMs?: number): boolean;
  failure(): string | null;
  stats(): VsockStats;
  /** vsock snapshot support */
  pause(): void;
  resume(): void;
  /** vsock: the loop parks at its next wake if it has nothing to do (virtio_vsock.h RequestPark) */
  requestPark(): void;
  /** VsockState for vsock; for rng only active, driverFeatures and queues */
  saveState(): VsockState;
  restoreState(state: VsockState | Pick<VsockState, 'active' | 'driverFeatures' | 'queues'>): void;
  close(): void;
}

/** Guest RAM mapped from a file as a restored VM's is, read as device models read it (native/src/vmm/ram_guard.h). */
export interface GuestRamProbe {
  read(gpa: number, len: number): Uint8Array | null;
  lost(): boolean;
  close(): void;
}

/** The bookkeeping of a VM's pattern runs (native/src/vmm/snapshot/pattern.h), without a pattern file. */
export interface PatternBackingProbe {
  add(first: number, count: number): void;
  remove(first: number, count: number): void;
  has(page: number): boolean;
  pages(): number[];
  maps(): number;
  mapsLeft(): number;
  exhaust(): void;
  close(): void;
}

/** Packing without a VM (native/src/vmm/snapshot/packed_pages.h): pages packed against their bases, then written back over the bases. */
export interface PackRoundTrip {
  added: boolean[];
  packedPages: number;
  encodedBytes: number;
  hostBytes: number;
  applied: boolean;
  restored: Uint8Array;
}

interface VmmTesting {
  VirtioTestDevice: new (kind: 'rng' | 'vsock', options: TestDeviceOptions) => VirtioTestDevice;
  GuestRamProbe: new (path: string, size: number) => GuestRamProbe;
  PatternBackingProbe: new () => PatternBackingProbe;
  patternMapsInProcess(): number;
  packRoundTrip(pages: Uint8Array, bases: Uint8Array, ramPages?: number): PackRoundTrip;
  squeezeZeros(bytes: Uint8Array): globalThis.Buffer;
  expandZeros(bytes: Uint8Array, maxBytes: number): globalThis.Buffer;
}

export function vmmTesting(): VmmTesting {
  return (native() as unknown as { vmmTesting: VmmTesting }).vmmTesting;
}

export const VIRTIO_F_INDIRECT_DESC = 1n << 28n;
export const VIRTIO_F_VERSION_1 = 1n << 32n;
export const DESC_F_NEXT = 1;
export const DESC_F_WRITE = 2;
export const DESC_F_INDIRECT = 4;
export const AVAIL_F_NO_INTERRUPT = 1;

export interface Buffer {
  addr: number;
  len: number;
  write: boolean;
}

export interface UsedElem {
  id: number;
  len: number;
}

/** One split virtqueue as the driver sees it. */
export class FakeQueue {
  readonly config: QueueConfig;
  private readonly view: DataView;
  private availIdx = 0;
  private lastUsed = 0;
  private readonly free: number[] = [];
  /** head -> descriptor indices of its chain (to recycle them) */
  private readonly chains = new Map<number, number[]>();

  constructor(
    private readonly driver: FakeDriver,
    readonly index: number,
    readonly size: number,
    desc: number,
    avail: number,
    used: number,
  ) {
    this.view = new DataView(driver.memory);
    this.config = { size, ready: true, desc, driver: avail, device: used };
    for (let i = 0; i < size; i++) this.free.push(i);
  }

  get descAddr(): number {
    return Number(this.config.desc);
  }
  get availAddr(): number {
    return Number(this.config.driver);
  }
  get usedAddr(): number {
    return Number(this.config.device);
  }

  /** Raw descriptor write (addr as bigint to reach any 64-bit value). */
  writeDesc(i: number, addr: number | bigint, len: number, flags: number, next: number): void {
    writeDescAt(this.view, this.descAddr + 16 * i, addr, len, flags, next);
  }

  /** Puts `head` in the next avail slot and bumps avail.idx (no kick). */
  publish(head: number): void {
    this.view.setUint16(this.availAddr + 4 + 2 * (this.availIdx % this.size), head, true);
    this.availIdx = (this.availIdx + 1) & 0xffff;
    this.view.setUint16(this.availAddr + 2, this.availIdx, true);
  }

  /** Raw avail.idx write. */
  setAvailIdx(v: number): void {
    this.availIdx = v & 0xffff;
    this.view.setUint16(this.availAddr + 2, this.availIdx, true);
  }

  setAvailFlags(flags: number): void {
    this.view.setUint16(this.availAddr, flags, true);
  }

  get freeCount(): number {
    return this.free.length;
  }

  /** Posts a chain of buffers (readable ones first); returns the head. */
  addChain(bufs: Buffer[], opts: { indirect?: boolean } = {}): number {
    if (opts.indirect) {
      const table = this.driver.alloc(16 * bufs.length, 16);
      bufs.forEach((b, i) => {
        const last = i === bufs.length - 1;
        writeDescAt(this.view, table + 16 * i, b.addr, b.len, (b.write ? DESC_F_WRITE : 0) | (last ? 0 : DESC_F_NEXT), last ? 0 : i + 1);
      });
      const head = this.take(1)[0]!;
      this.writeDesc(head, table, 16 * bufs.length, DESC_F_INDIRECT, 0);
      this.chains.set(head, [head]);
      this.publish(head);
      return head;
    }
    const ids = this.take(bufs.length);
    bufs.forEach((b, i) => {
      const last = i === bufs.length - 1;
      this.writeDesc(ids[i]!, b.addr, b.len, (b.write ? DESC_F_WRITE : 0) | (last ? 0 : DESC_F_NEXT), last ? 0 : ids[i + 1]!);
    });
    this.chains.set(ids[0]!, ids);
    this.publish(ids[0]!);
    return ids[0]!;
  }

  private take(n: number): number[] {
    if (this.free.length < n) throw new Error(`queue ${this.index}: ${n} descriptors wanted, ${this.free.length} free`);
    return this.free.splice(0, n);
  }

  usedIdx(): number {
    return this.view.getUint16(this.usedAddr + 2, true);
  }

  /** New used elements since the last call; their descriptors become free again. */
  takeUsed(): UsedElem[] {
    const out: UsedElem[] = [];
    const idx = this.usedIdx();
    while (this.lastUsed !== idx) {
      const at = this.usedAddr + 4 + 8 * (this.lastUsed % this.size);
      const e = { id: this.view.getUint32(at, true), len: this.view.getUint32(at + 4, true) };
      out.push(e);
      const ids = this.chains.get(e.id);
      if (ids) {
        this.chains.delete(e.id);
        this.free.push(...ids);
      }
      this.lastUsed = (this.lastUsed + 1) & 0xffff;
    }
    return out;
  }

  kick(): void {
    this.driver.device.notify(this.index);
  }
}

function writeDescAt(view: DataView, at: number, addr: number | bigint, len: number, flags: number, next: number): void {
  view.setBigUint64(at, BigInt.asUintN(64, BigInt(addr)), true);
  view.setUint32(at + 8, len >>> 0, true);
  view.setUint16(at + 12, flags & 0xffff, true);
  view.setUint16(at + 14, next & 0xffff, true);
}

/**
 * A device plus the driver's view of its RAM: a bump allocator (from 4 KiB up;
 * `reset()` starts it over), its queues, and the device's interrupts and
 * failures as awaitable events (the device calls back, nobody polls).
 */
export class FakeDriver {
  readonly device: VirtioTestDevice;
  readonly memory: ArrayBuffer;
  readonly bytes: Uint8Array;
  readonly view: DataView;
  queues: FakeQueue[] = [];
  interrupts: number[] = [];
  failures: string[] = [];
  private next = 0x1000;
  private waiters: (() => void)[] = [];

  constructor(kind: 'rng' | 'vsock', options: Omit<TestDeviceOptions, 'onEvent'>) {
    this.device = new (vmmTesting().VirtioTestDevice)(kind, {
      ...options,
      onEvent: (k, v) => {
        if (k === 'interrupt') this.interrupts[v as number] = (this.interrupts[v as number] ?? 0) + 1;
        else this.failures.push(v as string);
        this.poke();
      },
    });
    this.memory = this.device.memory;
    this.bytes = new Uint8Array(this.memory);
    this.view = new DataView(this.memory);
  }

  /** The allocator position, to `rewind` to later (reusing that memory). */
  get mark(): number {
    return this.next;
  }
  rewind(mark: number): void {
    this.next = mark;
  }

  alloc(len: number, align = 16): number {
    const at = Math.ceil(this.next / align) * align;
    if (at + len > this.memory.byteLength) throw new Error(`fake driver: out of guest memory (${len} bytes wanted)`);
    this.next = at + len;
    // Zeroed, as a driver clears its rings (memory may be reused after rewind).
    this.bytes.fill(0, at, at + len);
    return at;
  }

  /** Lays out queues (sizes given) and activates the device. */
  setup(sizes: number[], features: bigint = VIRTIO_F_VERSION_1 | VIRTIO_F_INDIRECT_DESC): FakeQueue[] {
    this.queues = sizes.map((size, i) => {
      const desc = this.alloc(16 * size, 16);
      const avail = this.alloc(6 + 2 * size, 2);
      const used = this.alloc(6 + 8 * size, 4);
      return new FakeQueue(this, i, size, desc, avail, used);
    });
    this.device.activate(
      this.queues.map((q) => q.config),
      features,
    );
    return this.queues;
  }

  q(i: number): FakeQueue {
    const q = this.queues[i];
    if (!q) throw new Error(`no queue ${i}`);
    return q;
  }

  /** A buffer in guest RAM, optionally filled. */
  buffer(len: number, data?: Uint8Array): number {
    const at = this.alloc(len, 16);
    if (data) this.bytes.set(data, at);
    return at;
  }

  /** Wakes `until`/`nextEvent` waiters as a device event would (for conditions that also depend on host sockets). */
  poke(): void {
    const w = this.waiters;
    this.waiters = [];
    for (const f of w) f();
  }

  /** Resolves at the next device event (interrupt or failure); rejects after timeoutMs. */
  nextEvent(timeoutMs = 5000): Promise<void> {
    return new Promise((resolve, reject) => {
      const t = setTimeout(() => reject(new Error(`no device event within ${timeoutMs} ms`)), timeoutMs);
      this.waiters.push(() => {
        clearTimeout(t);
        resolve();
      });
    });
  }

  /** Waits until `cond()` holds, re-checking at each device event. */
  async until(cond: () => boolean, what: string, timeoutMs = 5000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    while (!cond()) {
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`timed out waiting for ${what}`);
      try {
        await this.nextEvent(left);
      } catch {
        if (!cond()) throw new Error(`timed out waiting for ${what}`);
      }
    }
  }

  close(): void {
    this.device.close();
  }
}
