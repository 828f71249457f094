// The VMM's device models without KVM: the 8250 UART as Linux's driver probes
// and drives it, the i8042 reset paths, and PCI configuration mechanism #1
// with a virtio-rng behind the virtio-pci transport (capabilities, BAR sizing,
// feature negotiation, a real request through a split ring, MSI-X delivery,
// masking and pending bits, and hostile queue layouts).
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { vmm } from './vmm-internals.ts';

test('UART: scratch, LSR, loopback MSR as the 8250 probe checks it', () => {
  const u = new vmm.Uart();
  u.write(7, 0xa5);
  assert.is(u.read(7), 0xa5, 'scratch register');
  assert.is(u.read(5) & 0x60, 0x60, 'THR empty, transmitter empty');
  assert.is(u.read(2), 0xc1, 'IIR: no interrupt, FIFOs (16550A)');
  u.write(4, 0x10 | 0x0a); // loopback + OUT2 + RTS, what autoconfig writes
  assert.is(u.read(6) & 0xf0, 0x90, 'loopback: CTS and DCD follow RTS and OUT2');
  u.write(4, 0x08);
  assert.is(u.read(6), 0xb0, 'a connected terminal: DCD, DSR, CTS');
});

test('UART: output bytes, THRE interrupts, divisor latch, input', () => {
  const u = new vmm.Uart();
  u.write(0, 0x41);
  assert.is(u.takeOutput(), 'A');
  assert.is(u.irqs, 0, 'no interrupt while IER is 0');
  u.write(1, 0x02); // enable THRI: interrupt at once since THR is empty
  assert.is(u.irqs, 1);
  assert.is(u.read(2), 0xc2, 'IIR: THR empty');
  assert.is(u.read(2), 0xc1, 'reading IIR acknowledged it');
  u.write(0, 0x42);
  assert.is(u.irqs, 2, 'each byte sent raises THRE again');
  u.write(3, 0x80); // DLAB
  u.write(0, 0x01);
  u.write(1, 0x00);
  assert.is(u.read(0), 0x01, 'DLL');
  assert.is(u.takeOutput(), 'B', 'divisor writes are not output');
  u.write(3, 0x03);
  u.write(1, 0x01); // receive interrupts only
  u.input(Buffer.from('hi'));
  assert.is(u.read(2), 0xc4, 'IIR: data available');
  assert.is(u.read(5) & 1, 1, 'LSR: data ready');
  assert.is(String.fromCharCode(u.read(0), u.read(0)), 'hi');
  assert.is(u.read(5) & 1, 0);
});

test('UART: input in order however reads and input interleave; at most 4096 bytes wait', () => {
  const u = new vmm.Uart();
  const readAll = () => {
    let out = '';
    while (u.read(5) & 1) out += String.fromCharCode(u.read(0));
    return out;
  };
  u.input(Buffer.from('abc'));
  assert.is(String.fromCharCode(u.read(0)), 'a');
  u.input(Buffer.from('def'));
  assert.is(readAll(), 'bcdef');
  // One byte in and one out, many times over, with a few waiting all along.
  u.input(Buffer.from('012'));
  let got = '';
  let sent = '012';
  for (let i = 0; i < 5000; i++) {
    const c = String.fromCharCode(33 + (i % 90));
    u.input(Buffer.from(c));
    sent += c;
    got += String.fromCharCode(u.read(0));
  }
  got += readAll();
  assert.is(got, sent);
  u.input(Buffer.alloc(5000, 0x78));
  assert.is(readAll().length, 4096, 'input past 4096 waiting bytes is dropped');
  assert.is(u.read(0), 0, 'empty: reads 0');
});

test('i8042: command byte, self test, and both reset paths', () => {
  const k = new vmm.I8042();
  assert.is(k.read(0x64) & 1, 0, 'output buffer empty');
  k.write(0x64, 0x20);
  assert.is(k.read(0x64) & 1, 1);
  assert.is(k.read(0x60), 0x45, 'command byte');
  k.write(0x64, 0x60);
  k.write(0x60, 0x47);
  k.write(0x64, 0x20);
  assert.is(k.read(0x60), 0x47, 'written command byte');
  k.write(0x64, 0xaa);
  assert.is(k.read(0x60), 0x55, 'self test passed');
  assert.is(k.resets, 0);
  k.write(0x64, 0xfe);
  assert.is(k.resets, 1, 'pulse reset line (reboot=k)');
  k.write(0x64, 0xd1);
  k.write(0x60, 0x00);
  assert.is(k.resets, 2, 'output port bit 0 low resets the CPU');
});

// ---- PCI -------------------------------------------------------------------

type Pci = InstanceType<typeof vmm.PciModel>;
const cfgAddr = (slot: number, reg: number) => 0x80000000 | (slot << 11) | (reg & 0xfc);
function cfgRead(p: Pci, slot: number, reg: number, size = 4): number {
  p.ioWrite(0xcf8, 4, cfgAddr(slot, reg));
  return p.ioRead(0xcfc + (reg & 3), size) >>> 0;
}
function cfgWrite(p: Pci, slot: number, reg: number, size: number, value: number): void {
  p.ioWrite(0xcf8, 4, cfgAddr(slot, reg));
  p.ioWrite(0xcfc + (reg & 3), size, value);
}
function rd(p: Pci, addr: number, len: number): number {
  const b = p.mmioRead(addr, len);
  assert.ok(b, `MMIO read at ${addr.toString(16)} claimed`);
  return len === 1 ? b.readUInt8(0) : len === 2 ? b.readUInt16LE(0) : b.readUInt32LE(0);
}
function wr(p: Pci, addr: number, len: number, v: number): void {
  const b = Buffer.alloc(len);
  if (len === 1) b.writeUInt8(v);
  else if (len === 2) b.writeUInt16LE(v);
  else b.writeUInt32LE(v >>> 0);
  assert.ok(p.mmioWrite(addr, b));
}

/** Capabilities of a device: id -> offset (vendor caps keyed by 0x100 + cfg_type). */
function caps(p: Pci, slot: number): Map<number, number> {
  const m = new Map<number, number>();
  let at = cfgRead(p, slot, 0x34, 1);
  for (let n = 0; at && n < 48; n++) {
    const id = cfgRead(p, slot, at, 1);
    m.set(id === 0x09 ? 0x100 + cfgRead(p, slot, at + 3, 1) : id, at);
    at = cfgRead(p, slot, at + 1, 1);
  }
  return m;
}

test('PCI: conf1 address readback, host bridge, empty slots, virtio device identity', () => {
  const p = new vmm.PciModel(Buffer.alloc(1 << 20));
  p.ioWrite(0xcf8, 4, 0x80000000);
  assert.is(p.ioRead(0xcf8, 4) >>> 0, 0x80000000, 'pci_check_type1 reads the address back');
  assert.is(cfgRead(p, 0, 0x0a, 2), 0x0600, 'host bridge class');
  assert.is(cfgRead(p, 5, 0) >>> 0, 0xffffffff, 'empty slot');
  assert.is(cfgRead(p, 1, 0, 2), 0x1af4);
  assert.is(cfgRead(p, 1, 2, 2), 0x1044, 'modern virtio-rng (0x1040 + 4)');
  assert.ok(cfgRead(p, 1, 8, 1) >= 1, 'revision 1: modern only');
  const c = caps(p, 1);
  for (const k of [0x11, 0x101, 0x102, 0x103, 0x104]) assert.ok(c.has(k), `capability ${k.toString(16)}`);
  const msix = c.get(0x11) as number;
  assert.is(cfgRead(p, 1, msix + 2, 2) & 0x7ff, 1, 'MSI-X table size 2 (queue + config)');
  const notify = c.get(0x102) as number;
  assert.is(cfgRead(p, 1, notify + 16), 4, 'notify_off_multiplier');
});

test('PCI: BAR sizing and MMIO decoding follow the command register', () => {
  const p = new vmm.PciModel(Buffer.alloc(1 << 20));
  const bar = p.barAddress;
  assert.is(cfgRead(p, 1, 0x10) >>> 0, (bar | 4) >>> 0, 'assigned 64-bit BAR');
  assert.is(p.mmioRead(bar, 4), null, 'no decoding before the OS enables memory space');
  cfgWrite(p, 1, 0x10, 4, 0xffffffff);
  cfgWrite(p, 1, 0x14, 4, 0xffffffff);
  assert.is(cfgRead(p, 1, 0x10) >>> 0, 0xffff8004, 'size mask 32 KiB, 64-bit memory');
  assert.is(cfgRead(p, 1, 0x14) >>> 0, 0xffffffff);
  cfgWrite(p, 1, 0x10, 4, 0xe0000000);
  cfgWrite(p, 1, 0x14, 4, 0);
  cfgWrite(p, 1, 0x04, 2, 0x0006);
  assert.is(p.mmioRead(bar, 4), null, 'old address no longer decodes');
  assert.is(rd(p, 0xe0000000 + 0x12, 2), 1, 'num_queues at the moved BAR');
});

const COMMON = 0x0;
const NOTIFY = 0x3000;
const TABLE = 0x4000;
const PBA = 0x5000;

/** Brings a virtio-rng up to DRIVER_OK with queue 0 of `size` at the given addresses. */
function driverUp(p: Pci, q: { size: number; desc: number; avail: number; used: number }) {
  const bar = p.barAddress;
  cfgWrite(p, 1, 0x04, 2, 0x0006);
  const msix = caps(p, 1).get(0x11) as number;
  cfgWrite(p, 1, msix + 2, 2, 0x8000); // MSI-X enable
  wr(p, bar + TABLE + 16, 4, 0xfee00000); // vector 1: queue 0
  wr(p, bar + TABLE + 20, 4, 0);
  wr(p, bar + TABLE + 24, 4, 0x4041);
  wr(p, bar + TABLE + 28, 4, 0); // unmasked
  wr(p, bar + COMMON + 0x14, 1, 3); // ACKNOWLEDGE | DRIVER
  wr(p, bar + COMMON + 0x00, 4, 1);
  assert.is(rd(p, bar + COMMON + 0x04, 4) & 1, 1, 'VIRTIO_F_VERSION_1 offered');
  wr(p, bar + COMMON + 0x08, 4, 1);
  wr(p, bar + COMMON + 0x0c, 4, 1);
  wr(p, bar + COMMON + 0x08, 4, 0);
  wr(p, bar + COMMON + 0x0c, 4, 0);
  wr(p, bar + COMMON + 0x14, 1, 0x0b);
  assert.is(rd(p, bar + COMMON + 0x14, 1), 0x0b, 'FEATURES_OK accepted');
  wr(p, bar + COMMON + 0x16, 2, 0);
  assert.is(rd(p, bar + COMMON + 0x18, 2), 256, 'max queue size');
  wr(p, bar + COMMON + 0x18, 2, q.size);
  wr(p, bar + COMMON + 0x1a, 2, 1);
  assert.is(rd(p, bar + COMMON + 0x1a, 2), 1, 'vector accepted');
  for (const [off, v] of [
    [0x20, q.desc],
    [0x28, q.avail],
    [0x30, q.used],
  ] as const) {
    wr(p, bar + COMMON + off, 4, v);
    wr(p, bar + COMMON + off + 4, 4, 0);
  }
  wr(p, bar + COMMON + 0x1c, 2, 1);
  wr(p, bar + COMMON + 0x14, 1, 0x0f); // DRIVER_OK
}

test('virtio-pci: a driver negotiates, posts a buffer, kicks, and gets entropy and an MSI', () => {
  const mem = Buffer.alloc(1 << 20);
  const p = new vmm.PciModel(mem);
  const q = { size: 8, desc: 0x10000, avail: 0x11000, used: 0x12000 };
  driverUp(p, q);
  assert.equal(p.takeErrors(), []);
  // desc 0: 64 device-writable bytes at 0x20000
  mem.writeBigUInt64LE(0x20000n, q.desc);
  mem.writeUInt32LE(64, q.desc + 8);
  mem.writeUInt16LE(2, q.desc + 12);
  mem.writeUInt16LE(0, q.avail + 4); // ring[0] = desc 0
  mem.writeUInt16LE(1, q.avail + 2); // avail idx
  wr(p, p.barAddress + NOTIFY, 2, 0);
  assert.is(mem.readUInt16LE(q.used + 2), 1, 'used idx');
  assert.is(mem.readUInt32LE(q.used + 4), 0, 'used id');
  assert.is(mem.readUInt32LE(q.used + 8), 64, 'used len');
  assert.ok(mem.subarray(0x20000, 0x20040).some((x) => x !== 0), 'random bytes written');
  assert.equal(p.takeMsis(), [{ address: 0xfee00000, data: 0x4041 }]);
  assert.is(rd(p, p.barAddress + 0x1000, 1), 1, 'ISR: queue interrupt, cleared on read');
  assert.is(rd(p, p.barAddress + 0x1000, 1), 0);
});

test('virtio-pci: a masked vector leaves a pending bit; unmasking delivers it', () => {
  const mem = Buffer.alloc(1 << 20);
  const p = new vmm.PciModel(mem);
  const q = { size: 8, desc: 0x10000, avail: 0x11000, used: 0x12000 };
  driverUp(p, q);
  wr(p, p.barAddress + TABLE + 28, 4, 1); // mask vector 1
  mem.writeBigUInt64LE(0x20000n, q.desc);
  mem.writeUInt32LE(16, q.desc + 8);
  mem.writeUInt16LE(2, q.desc + 12);
  mem.writeUInt16LE(1, q.avail + 2);
  wr(p, p.barAddress + NOTIFY, 2, 0);
  assert.is(mem.readUInt16LE(q.used + 2), 1);
  assert.equal(p.takeMsis(), [], 'nothing while masked');
  assert.is(rd(p, p.barAddress + PBA, 4), 2, 'pending bit of vector 1');
  wr(p, p.barAddress + TABLE + 28, 4, 0);
  assert.equal(p.takeMsis(), [{ address: 0xfee00000, data: 0x4041 }]);
  assert.is(rd(p, p.barAddress + PBA, 4), 0);
});

test('virtio-pci: a legacy driver (no VERSION_1) is refused FEATURES_OK', () => {
  const p = new vmm.PciModel(Buffer.alloc(1 << 20));
  const bar = p.barAddress;
  cfgWrite(p, 1, 0x04, 2, 0x0006);
  wr(p, bar + 0x14, 1, 3);
  wr(p, bar + 0x08, 4, 1);
  wr(p, bar + 0x0c, 4, 0);
  wr(p, bar + 0x14, 1, 0x0b);
  assert.is(rd(p, bar + 0x14, 1) & 0x08, 0);
});

test('virtio-pci: hostile queue layouts fail the device, not the host; a reset clears it', () => {
  for (const q of [
    { size: 3, desc: 0x10000, avail: 0x11000, used: 0x12000 }, // not a power of two
    { size: 8, desc: 0x10008, avail: 0x11000, used: 0x12000 }, // misaligned descriptor table
    { size: 8, desc: 0x7fff0000, avail: 0x11000, used: 0x12000 }, // outside guest RAM
    { size: 8, desc: 0x10000, avail: 0x11000, used: 0xffff8 }, // used ring runs past the end of RAM
    { size: 512, desc: 0x10000, avail: 0x11000, used: 0x12000 }, // larger than the maximum
  ]) {
    const p = new vmm.PciModel(Buffer.alloc(1 << 20));
    driverUp(p, q);
    const errs = p.takeErrors();
    assert.is(errs.length, 1, JSON.stringify(q));
    assert.match(errs[0] ?? '', /invalid size or layout/);
    assert.is(rd(p, p.barAddress + 0x14, 1) & 0x40, 0x40, 'DEVICE_NEEDS_RESET');
    wr(p, p.barAddress + NOTIFY, 2, 0); // kicks of a failed device are ignored
    wr(p, p.barAddress + 0x14, 1, 0);
    assert.is(rd(p, p.barAddress + 0x14, 1), 0, 'reset clears the failure');
  }
});

test('virtio-pci: out-of-range offsets and vectors are harmless', () => {
  const p = new vmm.PciModel(Buffer.alloc(1 << 20));
  const bar = p.barAddress;
  cfgWrite(p, 1, 0x04, 2, 0x0006);
  wr(p, bar + 0x16, 2, 7); // queue_select beyond num_queues
  assert.is(rd(p, bar + 0x18, 2), 0, 'no such queue: size reads 0');
  wr(p, bar + 0x18, 2, 8);
  wr(p, bar + 0x16, 2, 0);
  wr(p, bar + 0x1a, 2, 99);
  assert.is(rd(p, bar + 0x1a, 2), 0xffff, 'a vector beyond the table reads back NO_VECTOR');
  assert.is(p.mmioRead(bar + 0x8000, 4), null, 'past the BAR');
  wr(p, bar + TABLE + 0x100, 4, 1); // past the MSI-X table: ignored
  wr(p, bar + NOTIFY + 0x40, 2, 0); // notify of a queue that does not exist
  assert.equal(p.takeErrors(), []);
});

test.run();
