// The split virtqueue (native/src/vmm/virtqueue.cc) driven through virtio-rng
// over a plain ArrayBuffer as guest RAM, no KVM: valid chains (direct,
// multi-buffer, indirect, ring wrap-around), then a hostile driver (buffers
// outside RAM, overflowing addresses, loops, zero and huge lengths, bad
// indirect tables, avail index jumps, bad queue layouts) and a bounded,
// seeded fuzz of descriptor tables. Every hostile case must fail the device
// with a message, leave the used ring untouched and keep the process alive.
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { DESC_F_INDIRECT, DESC_F_NEXT, DESC_F_WRITE, FakeDriver, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_VERSION_1, vmmTesting } from './virtio-driver.ts';

const MEM = 1 << 20;

function rng(memorySize = MEM, regions?: [number, number][]): FakeDriver {
  return new FakeDriver('rng', regions ? { memorySize, regions } : { memorySize });
}

function allZero(b: Uint8Array): boolean {
  return b.every((x) => x === 0);
}

/** Expects the device to have failed with a message matching `re`, and nothing used. */
function expectFailed(d: FakeDriver, re: RegExp, usedBefore = 0): void {
  const f = d.device.failure();
  assert.ok(f !== null, 'device reports a failure');
  assert.match(f!, re);
  assert.is(d.q(0).usedIdx(), usedBefore, 'nothing was returned to the driver');
}

test('rng identifies itself and offers VERSION_1 and INDIRECT_DESC only', () => {
  const d = rng();
  try {
    assert.is(d.device.deviceId(), 4);
    assert.is(d.device.numQueues(), 1);
    assert.is(d.device.maxQueueSize(0), 256);
    assert.is(d.device.maxQueueSize(1), 0);
    assert.is(d.device.deviceFeatures(), VIRTIO_F_VERSION_1 | VIRTIO_F_INDIRECT_DESC);
    assert.ok(allZero(d.device.readConfig(0, 8)), 'no config space');
  } finally {
    d.close();
  }
});

test('rng fills a writable buffer and raises an interrupt', async () => {
  const d = rng();
  try {
    const [q] = d.setup([16]);
    const buf = d.buffer(256);
    const head = q!.addChain([{ addr: buf, len: 256, write: true }]);
    q!.kick();
    assert.equal(q!.takeUsed(), [{ id: head, len: 256 }]);
    assert.not.ok(allZero(d.bytes.subarray(buf, buf + 256)), 'random bytes written');
    await d.until(() => (d.interrupts[0] ?? 0) >= 1, 'the queue interrupt');
    assert.is(d.device.failure(), null);
  } finally {
    d.close();
  }
});

test('multi-buffer and indirect chains, readable parts skipped, ring wraps around', () => {
  const d = rng();
  try {
    const [q] = d.setup([4]);
    // Three writable buffers in one chain.
    const a = d.buffer(16);
    const b = d.buffer(32);
    const c = d.buffer(48);
    let head = q!.addChain([
      { addr: a, len: 16, write: true },
      { addr: b, len: 32, write: true },
      { addr: c, len: 48, write: true },
    ]);
    q!.kick();
    assert.equal(q!.takeUsed(), [{ id: head, len: 96 }]);
    for (const [at, len] of [
      [a, 16],
      [b, 32],
      [c, 48],
    ] as const)
      assert.not.ok(allZero(d.bytes.subarray(at, at + len)), `buffer at ${at} filled`);
    // A readable buffer first: left alone, only the writable part counts.
    const r = d.buffer(64);
    const w = d.buffer(64);
    head = q!.addChain([
      { addr: r, len: 64, write: false },
      { addr: w, len: 64, write: true },
    ]);
    q!.kick();
    assert.equal(q!.takeUsed(), [{ id: head, len: 64 }]);
    assert.ok(allZero(d.bytes.subarray(r, r + 64)), 'readable buffer untouched');
    // Indirect tables.
    const i1 = d.buffer(24);
    const i2 = d.buffer(40);
    head = q!.addChain(
      [
        { addr: i1, len: 24, write: true },
        { addr: i2, len: 40, write: true },
      ],
      { indirect: true },
    );
    q!.kick();
    assert.equal(q!.takeUsed(), [{ id: head, len: 64 }]);
    // Many single-buffer chains: the 4-entry ring and the 16-bit indices wrap.
    for (let round = 0; round < 40; round++) {
      const heads = [0, 1, 2].map(() => q!.addChain([{ addr: d.buffer(8), len: 8, write: true }]));
      q!.kick();
      assert.equal(
        q!.takeUsed(),
        heads.map((id) => ({ id, len: 8 })),
      );
    }
    assert.is(d.device.failure(), null);
  } finally {
    d.close();
  }
});

test('a request is capped at 64 KiB and a chain without writable space gets 0 bytes', () => {
  const d = new FakeDriver('rng', { memorySize: 4 << 20 });
  try {
    const [q] = d.setup([8]);
    const big = d.buffer(1 << 20);
    let head = q!.addChain([{ addr: big, len: 1 << 20, write: true }]);
    q!.kick();
    assert.equal(q!.takeUsed(), [{ id: head, len: 65536 }]);
    assert.ok(allZero(d.bytes.subarray(big + 65536, big + 65536 + 4096)), 'nothing written past the cap');
    head = q!.addChain([{ addr: d.buffer(32), len: 32, write: false }]);
    q!.kick();
    assert.equal(q!.takeUsed(), [{ id: head, len: 0 }]);
  } finally {
    d.close();
  }
});

test('VIRTQ_AVAIL_F_NO_INTERRUPT suppresses the interrupt', async () => {
  const d = rng();
  try {
    const [q] = d.setup([8]);
    q!.setAvailFlags(1);
    q!.addChain([{ addr: d.buffer(8), len: 8, write: true }]);
    q!.kick();
    q!.setAvailFlags(0);
    q!.addChain([{ addr: d.buffer(8), len: 8, write: true }]);
    q!.kick();
    assert.is(q!.takeUsed().length, 2);
    await d.until(() => (d.interrupts[0] ?? 0) >= 1, 'an interrupt');
    // Events arrive in order, so by now the first kick's one would have come too.
    assert.is(d.interrupts[0], 1, 'exactly one interrupt for two batches');
  } finally {
    d.close();
  }
});

test('a queue that is not ready is ignored', () => {
  const d = rng();
  try {
    d.device.activate([{ size: 8, ready: false, desc: 0, driver: 0, device: 0 }], VIRTIO_F_VERSION_1);
    d.device.notify(0);
    d.device.notify(7);
    assert.is(d.device.failure(), null);
  } finally {
    d.close();
  }
});

test('snapshot: a device restored over a copy of guest memory continues the ring (rng)', () => {
  const a = rng();
  const b = rng();
  try {
    const [q] = a.setup([8]);
    for (let i = 0; i < 3; i++) q!.addChain([{ addr: a.buffer(16), len: 16, write: true }]);
    q!.kick();
    assert.is(q!.takeUsed().length, 3);
    const state = a.device.saveState();
    assert.is(state.active, true);
    assert.is(state.queues[0]!.lastAvail, 3);
    assert.is(state.queues[0]!.nextUsed, 3);
    // The "child": its own RAM, a copy of the parent's.
    b.bytes.set(a.bytes);
    b.device.restoreState(state);
    // Post a fourth chain in the child by hand, at ring slot 3.
    const buf = 0x30000;
    const v = b.view;
    v.setBigUint64(q!.descAddr + 16 * 5, BigInt(buf), true);
    v.setUint32(q!.descAddr + 16 * 5 + 8, 32, true);
    v.setUint16(q!.descAddr + 16 * 5 + 12, DESC_F_WRITE, true);
    v.setUint16(q!.availAddr + 4 + 2 * 3, 5, true);
    v.setUint16(q!.availAddr + 2, 4, true);
    b.device.notify(0);
    assert.is(v.getUint16(q!.usedAddr + 2, true), 4, 'child used idx continues from 3');
    assert.is(v.getUint32(q!.usedAddr + 4 + 8 * 3, true), 5);
    assert.is(v.getUint32(q!.usedAddr + 4 + 8 * 3 + 4, true), 32);
    assert.not.ok(allZero(b.bytes.subarray(buf, buf + 32)));
    assert.ok(allZero(a.bytes.subarray(buf, buf + 32)), 'the parent memory is untouched');
    assert.is(a.q(0).usedIdx(), 3);
  } finally {
    a.close();
    b.close();
  }
});

// ---- hostile queue layouts ---------------------------------------------------

const badLayouts: [string, { size: number; desc: number | bigint; driver: number | bigint; device: number | bigint }, RegExp][] = [
  ['size 0', { size: 0, desc: 0x1000, driver: 0x2000, device: 0x3000 }, /not a power of two/],
  ['size 3', { size: 3, desc: 0x1000, driver: 0x2000, device: 0x3000 }, /not a power of two/],
  ['size above max', { size: 512, desc: 0x1000, driver: 0x4000, device: 0x5000 }, /above the maximum 256/],
  ['misaligned descriptor table', { size: 8, desc: 0x1008, driver: 0x2000, device: 0x3000 }, /not 16-byte aligned/],
  ['misaligned avail ring', { size: 8, desc: 0x1000, driver: 0x2001, device: 0x3000 }, /not 2-byte aligned/],
  ['misaligned used ring', { size: 8, desc: 0x1000, driver: 0x2000, device: 0x3002 }, /not 4-byte aligned/],
  ['descriptor table past RAM', { size: 256, desc: MEM - 16 * 128, driver: 0x2000, device: 0x3000 }, /descriptor table .* outside guest RAM/],
  ['avail ring past RAM', { size: 8, desc: 0x1000, driver: MEM - 4, device: 0x3000 }, /available ring .* outside guest RAM/],
  ['used ring at 2^64-8', { size: 8, desc: 0x1000, driver: 0x2000, device: 0xfffffffffffffff8n }, /used ring .* outside guest RAM/],
];

for (const [name, layout, re] of badLayouts) {
  test(`bad queue layout fails the device at activation: ${name}`, () => {
    const d = rng();
    try {
      d.device.activate([{ ready: true, ...layout }], VIRTIO_F_VERSION_1);
      const f = d.device.failure();
      assert.ok(f !== null, 'failed');
      assert.match(f!, re);
      d.device.notify(0); // ignored, no crash
    } finally {
      d.close();
    }
  });
}

// ---- hostile chains ------------------------------------------------------------

interface HostileCase {
  name: string;
  /** writes raw descriptors into queue 0 (size 8) and returns the head to publish */
  build: (d: FakeDriver) => number;
  re: RegExp;
  features?: bigint;
  regions?: [number, number][];
}

const S = 8; // queue size for the hostile cases

/** Writes descriptor i of queue 0 and returns i (the head to publish). */
function desc(d: FakeDriver, i: number, addr: number | bigint, len: number, flags: number, next: number): number {
  d.q(0).writeDesc(i, addr, len, flags, next);
  return i;
}

const hostile: HostileCase[] = [
  { name: 'buffer past the end of RAM', build: (d) => desc(d, 0, MEM - 8, 16, DESC_F_WRITE, 0), re: /outside guest RAM/ },
  { name: 'buffer far outside RAM', build: (d) => desc(d, 0, 1n << 40n, 16, DESC_F_WRITE, 0), re: /outside guest RAM/ },
  { name: 'address + length overflows 64 bits', build: (d) => desc(d, 0, 0xfffffffffffffff0n, 0x20, DESC_F_WRITE, 0), re: /outside guest RAM/ },
  { name: 'huge length', build: (d) => desc(d, 0, 0x8000, 0xffffffff, DESC_F_WRITE, 0), re: /outside guest RAM/ },
  { name: 'zero length', build: (d) => desc(d, 0, 0x8000, 0, DESC_F_WRITE, 0), re: /zero-length/ },
  {
    name: 'buffer spanning a hole between RAM regions',
    regions: [
      [0, 0x40000],
      [0x50000, MEM - 0x50000],
    ],
    build: (d) => desc(d, 0, 0x3fff0, 0x20, DESC_F_WRITE, 0),
    re: /outside guest RAM/,
  },
  {
    name: 'buffer inside a hole',
    regions: [
      [0, 0x40000],
      [0x50000, MEM - 0x50000],
    ],
    build: (d) => desc(d, 0, 0x44000, 0x20, DESC_F_WRITE, 0),
    re: /outside guest RAM/,
  },
  { name: 'head index beyond the queue', build: () => 8, re: /descriptor index 8 is outside the table of 8/ },
  { name: 'head index 0xffff', build: () => 0xffff, re: /descriptor index 65535/ },
  {
    name: 'next index beyond the queue',
    build: (d) => desc(d, 0, 0x8000, 16, DESC_F_WRITE | DESC_F_NEXT, 200),
    re: /descriptor index 200 is outside/,
  },
  { name: 'self loop', build: (d) => desc(d, 3, 0x8000, 16, DESC_F_WRITE | DESC_F_NEXT, 3), re: /longer than its table/ },
  {
    name: 'two-descriptor loop',
    build: (d) => {
      d.q(0).writeDesc(0, 0x8000, 16, DESC_F_WRITE | DESC_F_NEXT, 1);
      d.q(0).writeDesc(1, 0x9000, 16, DESC_F_WRITE | DESC_F_NEXT, 0);
      return 0;
    },
    re: /longer than its table/,
  },
  {
    name: 'readable after writable',
    build: (d) => {
      d.q(0).writeDesc(0, 0x8000, 16, DESC_F_WRITE | DESC_F_NEXT, 1);
      d.q(0).writeDesc(1, 0x9000, 16, 0, 0);
      return 0;
    },
    re: /readable buffer after a device-writable/,
  },
  {
    name: 'indirect without the feature',
    features: VIRTIO_F_VERSION_1,
    build: (d) => desc(d, 0, 0x8000, 32, DESC_F_INDIRECT, 0),
    re: /INDIRECT_DESC was not negotiated/,
  },
  { name: 'indirect table length not a multiple of 16', build: (d) => desc(d, 0, 0x8000, 24, DESC_F_INDIRECT, 0), re: /not a multiple of 16/ },
  { name: 'indirect table of zero length', build: (d) => desc(d, 0, 0x8000, 0, DESC_F_INDIRECT, 0), re: /not a multiple of 16/ },
  { name: 'indirect table too long', build: (d) => desc(d, 0, 0x8000, 16 * 2048, DESC_F_INDIRECT, 0), re: /not a multiple of 16 between/ },
  { name: 'indirect table outside RAM', build: (d) => desc(d, 0, MEM - 16, 32, DESC_F_INDIRECT, 0), re: /indirect table .* outside guest RAM/ },
  { name: 'indirect with NEXT', build: (d) => desc(d, 0, 0x8000, 32, DESC_F_INDIRECT | DESC_F_NEXT, 1), re: /indirect descriptor with VIRTQ_DESC_F_NEXT/ },
  {
    name: 'indirect after a direct descriptor',
    build: (d) => {
      d.q(0).writeDesc(0, 0x9000, 16, DESC_F_NEXT, 1);
      d.q(0).writeDesc(1, 0x8000, 32, DESC_F_INDIRECT, 0);
      return 0;
    },
    re: /indirect descriptor in the middle of a chain/,
  },
  {
    name: 'nested indirect',
    build: (d) => {
      const v = d.view;
      // table at 0x8000: entry 0 is itself indirect
      v.setBigUint64(0x8000, 0x9000n, true);
      v.setUint32(0x8008, 32, true);
      v.setUint16(0x800c, DESC_F_INDIRECT, true);
      d.q(0).writeDesc(0, 0x8000, 16, DESC_F_INDIRECT, 0);
      return 0;
    },
    re: /nested indirect/,
  },
  {
    name: 'loop inside an indirect table',
    build: (d) => {
      const v = d.view;
      for (let i = 0; i < 2; i++) {
        v.setBigUint64(0x8000 + 16 * i, 0xa000n, true);
        v.setUint32(0x8008 + 16 * i, 16, true);
        v.setUint16(0x800c + 16 * i, DESC_F_WRITE | DESC_F_NEXT, true);
        v.setUint16(0x800e + 16 * i, 1 - i, true);
      }
      d.q(0).writeDesc(0, 0x8000, 32, DESC_F_INDIRECT, 0);
      return 0;
    },
    re: /longer than its table/,
  },
  {
    name: 'next index beyond an indirect table',
    build: (d) => {
      const v = d.view;
      v.setBigUint64(0x8000, 0xa000n, true);
      v.setUint32(0x8008, 16, true);
      v.setUint16(0x800c, DESC_F_WRITE | DESC_F_NEXT, true);
      v.setUint16(0x800e, 2, true);
      d.q(0).writeDesc(0, 0x8000, 32, DESC_F_INDIRECT, 0);
      return 0;
    },
    re: /indirect descriptor index 2 is outside the table of 2/,
  },
];

for (const h of hostile) {
  test(`hostile chain fails the device, not the process: ${h.name}`, () => {
    const d = rng(MEM, h.regions);
    try {
      const [q] = d.setup([S], h.features);
      q!.publish(h.build(d));
      q!.kick();
      expectFailed(d, h.re);
      // A failed device stays failed and touches nothing, even for good chains.
      q!.writeDesc(5, 0xb000, 16, DESC_F_WRITE, 0);
      q!.publish(5);
      q!.kick();
      expectFailed(d, h.re);
    } finally {
      d.close();
    }
  });
}

test('an avail index that jumps more than the queue size fails the device', () => {
  const d = rng();
  try {
    const [q] = d.setup([S]);
    q!.writeDesc(0, 0x8000, 16, DESC_F_WRITE, 0);
    q!.setAvailIdx(S + 1);
    q!.kick();
    expectFailed(d, /available index 9 is 9 ahead of the device, more than the queue size 8/);
  } finally {
    d.close();
  }
});

test('an avail index going backwards (a huge jump mod 2^16) fails the device', () => {
  const d = rng();
  try {
    const [q] = d.setup([S]);
    q!.addChain([{ addr: 0x8000, len: 16, write: true }]);
    q!.kick();
    assert.is(q!.takeUsed().length, 1);
    q!.setAvailIdx(0);
    q!.kick();
    expectFailed(d, /ahead of the device/, 1);
  } finally {
    d.close();
  }
});

test('the failure callback fires once and reset brings the device back', async () => {
  const d = rng();
  try {
    let [q] = d.setup([S]);
    q!.writeDesc(0, MEM, 16, DESC_F_WRITE, 0);
    q!.publish(0);
    q!.kick();
    q!.kick();
    await d.until(() => d.failures.length >= 1, 'the failure event');
    assert.is(d.failures.length, 1);
    assert.match(d.failures[0]!, /virtio-rng queue: buffer 0x100000\+16 is outside guest RAM/);
    d.device.reset();
    assert.is(d.device.failure(), null, 'reset clears the failure');
    [q] = d.setup([S]);
    const buf = d.buffer(32);
    const head = q!.addChain([{ addr: buf, len: 32, write: true }]);
    q!.kick();
    assert.equal(q!.takeUsed(), [{ id: head, len: 32 }]);
  } finally {
    d.close();
  }
});

test('the binding refuses bad arguments with errors, and a closed device with an error', () => {
  const T = vmmTesting().VirtioTestDevice;
  const bad: [string, () => unknown][] = [
    ['unknown kind', () => new T('disk' as 'rng', { memorySize: 65536 })],
    ['memory not a multiple of 4096', () => new T('rng', { memorySize: 5000 })],
    ['memory too big', () => new T('rng', { memorySize: 2 ** 31 })],
    ['negative memory', () => new T('rng', { memorySize: -4096 })],
    ['string memory', () => new T('rng', { memorySize: '65536' as unknown as number })],
    ['overlapping regions', () => new T('rng', { memorySize: 65536, regions: [[0, 8192], [4096, 8192]] })],
    ['region past the buffer', () => new T('rng', { memorySize: 65536, regions: [[61440, 8192]] })],
    ['vsock without a path', () => new T('vsock', { memorySize: 65536, guestCid: 3 })],
    ['vsock CID 2', () => new T('vsock', { memorySize: 65536, guestCid: 2, socketPath: '/tmp/x.sock' })],
    ['vsock path too long', () => new T('vsock', { memorySize: 65536, guestCid: 3, socketPath: `/tmp/${'x'.repeat(120)}` })],
  ];
  for (const [what, fn] of bad) assert.throws(fn, undefined, what);

  const d = rng();
  const dev = d.device;
  assert.throws(() => dev.activate([{ size: 70000, ready: true, desc: 0, driver: 0, device: 0 }], 0n), /at most 65535/);
  assert.throws(() => dev.activate([{ size: 8, ready: true, desc: -1, driver: 0, device: 0 }], 0n), /non-negative integer/);
  assert.throws(() => dev.activate([{ size: 8, ready: true, desc: 2n ** 64n, driver: 0, device: 0 }], 0n), /64 bits/);
  assert.throws(() => dev.activate('x' as unknown as [], 0n), /array/);
  assert.throws(() => dev.notify(-1), /non-negative/);
  assert.throws(() => dev.readConfig(0, 1 << 20), /at most 4096/);
  assert.throws(() => dev.writeConfig(0, [1, 2] as unknown as Uint8Array), /Uint8Array/);
  assert.throws(() => dev.stats(), /not a vsock device/);
  d.close();
  d.close(); // twice is fine
  assert.throws(() => dev.notify(0), /closed/);
  // The memory stays valid after close (the buffer holds it).
  d.bytes[100] = 7;
  assert.is(d.bytes[100], 7);
});

// ---- fuzz -----------------------------------------------------------------------

/** xorshift32: a seeded generator so a failing run can be repeated. */
export function prng(seed: number): () => number {
  let s = seed >>> 0 || 1;
  return () => {
    s ^= s << 13;
    s >>>= 0;
    s ^= s >>> 17;
    s ^= s << 5;
    s >>>= 0;
    return s;
  };
}

test('fuzz: random descriptor tables and avail rings (seeded, bounded)', () => {
  const seed = Number(process.env.FUZZ_SEED ?? 0x5eed);
  const rand = prng(seed);
  const pick = <T>(xs: readonly T[]): T => xs[rand() % xs.length]!;
  const size = 16;
  const memSize = 256 << 10;
  const d = new FakeDriver('rng', {
    memorySize: memSize,
    regions: [
      [0, 0x20000],
      [0x30000, memSize - 0x30000],
    ],
  });
  const deadline = Date.now() + 10_000;
  let iterations = 0;
  let failures = 0;
  let served = 0;
  const addrs = [0n, 0x8000n, 0x1fff0n, 0x20000n, 0x2fff0n, 0x30000n, BigInt(memSize - 16), BigInt(memSize), 0xfffffffffffffff0n, 1n << 63n];
  const lens = [0, 1, 16, 4096, 0x10000, 0x20000, 0x7fffffff, 0xffffffff];
  try {
    const mark = d.mark;
    let [q] = d.setup([size]);
    while (iterations < 20_000 && Date.now() < deadline) {
      iterations++;
      // Random table: mostly plausible descriptors, some with one bad field.
      for (let i = 0; i < size; i++) {
        let addr = BigInt(0x8000 + (rand() % 0x10000));
        let len = 1 + (rand() % 4096);
        let flags = pick([DESC_F_WRITE, DESC_F_WRITE, DESC_F_WRITE | DESC_F_NEXT, DESC_F_NEXT, 0]);
        let next = rand() % size;
        if (rand() % 24 === 0) {
          switch (rand() % 5) {
            case 0:
              addr = rand() % 2 ? pick(addrs) + BigInt(rand() % 64) : (BigInt(rand()) << 32n) | BigInt(rand());
              break;
            case 1:
              len = rand() % 2 ? pick(lens) : rand();
              break;
            case 2:
              flags = rand() & 0xffff;
              break;
            case 3:
              flags |= DESC_F_INDIRECT;
              break;
            default:
              next = rand() & 0xffff;
          }
        }
        q!.writeDesc(i, addr, len, flags, next);
      }
      // Indirect tables somewhere in RAM get random bytes too.
      for (let i = 0; i < 64; i++) d.view.setUint32(0x8000 + 4 * i, rand(), true);
      const n = 1 + (rand() % 3);
      for (let i = 0; i < n; i++) q!.publish(rand() % 64 === 0 ? rand() & 0xffff : rand() % size);
      if (rand() % 64 === 0) q!.setAvailIdx(rand());
      q!.kick();
      // (Random writable buffers may cover the rings, so the used ring can hold garbage.)
      served += q!.takeUsed().length;
      const f = d.device.failure();
      if (f !== null) {
        failures++;
        assert.match(f, /^virtio-rng queue: /);
        d.device.reset();
        d.rewind(mark);
        [q] = d.setup([size]);
      }
    }
    assert.ok(iterations >= 1000, `ran ${iterations} iterations`);
    assert.ok(failures > 0 && served > 0, `both outcomes seen (failures ${failures}, served ${served})`);
    // Still a working device afterwards.
    d.device.reset();
    d.rewind(mark);
    [q] = d.setup([size]);
    const buf = d.buffer(64);
    const head = q!.addChain([{ addr: buf, len: 64, write: true }]);
    q!.kick();
    assert.equal(q!.takeUsed(), [{ id: head, len: 64 }]);
    console.log(`  virtqueue fuzz: seed ${seed}, ${iterations} iterations, ${failures} failures, ${served} requests served`);
  } finally {
    d.close();
  }
});

test.run();
