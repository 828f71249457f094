// The kernel loader without KVM: bzImage setup-header parsing (the real
// distribution kernel and broken ones), a synthetic vmlinux ELF, the
// boot_params zero page, command line, e820 map, initrd placement, identity
// page tables, GDT, and the MP table's layout and checksums.
import { existsSync, readFileSync } from 'node:fs';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { distroKernel } from '../../images/kernel.ts';
import { vmm } from './vmm-internals.ts';

const MiB = 2 ** 20;
const kernelPath = (() => {
  try {
    return distroKernel().vmlinuz;
  } catch {
    return '';
  }
})();
const haveKernel = kernelPath !== '' && existsSync(kernelPath);
const bz = haveKernel ? readFileSync(kernelPath) : Buffer.alloc(0);

function throws(fn: () => unknown, re: RegExp): void {
  let msg = '';
  try {
    fn();
  } catch (e) {
    msg = (e as Error).message;
  }
  assert.match(msg, re);
}

/** A minimal bzImage-shaped buffer: boot sector signature, HdrS, protocol, flags. */
function fakeBz(opts: { protocol?: number; xloadflags?: number; setupSects?: number; size?: number } = {}): Buffer {
  const b = Buffer.alloc(opts.size ?? 0x10000);
  b[0x1f1] = opts.setupSects ?? 4;
  b.writeUInt16LE(0xaa55, 0x1fe);
  b[0x201] = 0x66; // header ends at 0x268
  b.write('HdrS', 0x202, 'latin1');
  b.writeUInt16LE(opts.protocol ?? 0x020f, 0x206);
  b[0x211] = 0x01; // LOADED_HIGH
  b.writeUInt32LE(0x200000, 0x230);
  b[0x234] = 1;
  b.writeUInt16LE(opts.xloadflags ?? 0x1, 0x236);
  b.writeUInt32LE(2047, 0x238);
  b.writeUInt32LE(0x7fffffff, 0x22c);
  b.writeBigUInt64LE(0x1000000n, 0x258);
  b.writeUInt32LE(0x100000, 0x260);
  return b;
}

test('parses the distribution bzImage (64-bit entry, relocatable, protocol >= 2.12)', () => {
  if (!haveKernel) {
    console.log('  (no distribution kernel in the store cache: skipped this check)');
    return;
  }
  const k = vmm.parseKernel(bz);
  assert.is(k.kind, 'bzImage');
  assert.ok((k.protocol ?? 0) >= 0x20c, `protocol ${k.protocol?.toString(16)}`);
  assert.ok(((k.xloadflags ?? 0) & 1) === 1, 'XLF_KERNEL_64');
  assert.ok(k.relocatable);
  assert.is(k.payloadOffset, ((k.setupSects ?? 0) + 1) * 512);
  assert.is((k.payloadOffset ?? 0) + (k.payloadSize ?? 0), bz.length);
  assert.ok((k.initSize ?? 0) > 0 && (k.prefAddress ?? 0) >= MiB);
  assert.ok(k.cmdlineSize >= 255);
});

test('refuses files that are not bootable kernels', () => {
  throws(() => vmm.parseKernel(Buffer.alloc(100)), /too small/);
  throws(() => vmm.parseKernel(Buffer.alloc(0x2000)), /not a Linux bzImage/);
  throws(() => vmm.parseKernel(fakeBz({ protocol: 0x0204 })), /too old/);
  throws(() => vmm.parseKernel(fakeBz({ xloadflags: 0 })), /no 64-bit entry/);
  throws(() => vmm.parseKernel(fakeBz({ setupSects: 200, size: 0x2000 })), /past the end/);
  assert.is(vmm.parseKernel(fakeBz()).kind, 'bzImage');
});

/** ELF64 with one PT_LOAD segment of `filesz` bytes (memsz = filesz + 0x1000) at paddr. */
function fakeElf(paddr: number, filesz: number, opts: { badClass?: boolean; offsetPastEnd?: boolean } = {}): Buffer {
  const b = Buffer.alloc(0x1000 + filesz);
  b.write('\x7fELF', 0, 'latin1');
  b[4] = opts.badClass ? 1 : 2; // ELFCLASS64
  b[5] = 1; // little endian
  b[6] = 1;
  b.writeUInt16LE(2, 16); // ET_EXEC
  b.writeUInt16LE(62, 18); // EM_X86_64
  b.writeUInt32LE(1, 20);
  b.writeBigUInt64LE(BigInt(paddr), 24); // e_entry (physical, as vmlinux's)
  b.writeBigUInt64LE(64n, 32); // e_phoff
  b.writeUInt16LE(64, 52); // e_ehsize
  b.writeUInt16LE(56, 54); // e_phentsize
  b.writeUInt16LE(1, 56); // e_phnum
  const ph = 64;
  b.writeUInt32LE(1, ph); // PT_LOAD
  b.writeUInt32LE(5, ph + 4);
  b.writeBigUInt64LE(opts.offsetPastEnd ? 0x100000n : 0x1000n, ph + 8); // p_offset
  b.writeBigUInt64LE(0xffffffff80000000n + BigInt(paddr), ph + 16); // p_vaddr
  b.writeBigUInt64LE(BigInt(paddr), ph + 24); // p_paddr
  b.writeBigUInt64LE(BigInt(filesz), ph + 32);
  b.writeBigUInt64LE(BigInt(filesz + 0x1000), ph + 40);
  for (let i = 0; i < filesz; i++) b[0x1000 + i] = (i * 7) & 0xff;
  return b;
}

test('parses and loads a vmlinux ELF: segments at their physical address, bss zeroed', () => {
  const elf = fakeElf(0x1000000, 0x3000);
  const k = vmm.parseKernel(elf);
  assert.is(k.kind, 'elf');
  assert.is(k.entry, 0x1000000);
  assert.equal(k.segments, [{ paddr: 0x1000000, filesz: 0x3000, memsz: 0x4000 }]);
  const mem = Buffer.alloc(64 * MiB, 0xee);
  const r = vmm.loadLinux(mem, elf, 'console=ttyS0', 0, 1);
  assert.is(r.entry, 0x1000000);
  assert.is(r.kernelEnd, 0x1004000);
  assert.ok(mem.subarray(0x1000000, 0x1003000).equals(elf.subarray(0x1000, 0x4000)));
  assert.ok(mem.subarray(0x1003000, 0x1004000).every((x) => x === 0), 'bss zeroed');
  const zp = mem.subarray(vmm.layout.bootParams, vmm.layout.bootParams + 4096);
  assert.is(zp.readUInt16LE(0x1fe), 0xaa55);
  assert.is(zp.toString('latin1', 0x202, 0x206), 'HdrS', 'synthesized setup header');
  throws(() => vmm.parseKernel(fakeElf(0x1000000, 0x100, { badClass: true })), /not a 64-bit/);
  throws(() => vmm.parseKernel(fakeElf(0x1000000, 0x100, { offsetPastEnd: true })), /outside the file/);
  throws(() => vmm.loadLinux(Buffer.alloc(8 * MiB), elf, '', 0, 1), /does not fit/);
});

test('boot_params, command line, e820, initrd, page tables and GDT for the bzImage', () => {
  if (!haveKernel) return;
  const mem = Buffer.alloc(256 * MiB);
  const cmdline = 'console=ttyS0 reboot=k panic=-1 acpi=off rdinit=/init forkling.port=1024';
  const initrd = 20 * MiB + 123;
  const r = vmm.loadLinux(mem, bz, cmdline, initrd, 2);
  const k = vmm.parseKernel(bz);
  assert.is(r.entry, 0x100000 + 0x200, '64-bit entry = load address + 0x200');
  assert.ok(mem.subarray(0x100000, 0x100000 + 4096).equals(bz.subarray(k.payloadOffset, (k.payloadOffset ?? 0) + 4096)));
  const zp = mem.subarray(0x7000, 0x8000);
  // The setup header is the image's, with the loader's fields filled in.
  assert.ok(zp.subarray(0x1f1, 0x210).equals(bz.subarray(0x1f1, 0x210)), 'header copied');
  assert.is(zp[0x210], 0xff, 'type_of_loader');
  assert.is((zp[0x211] ?? 0) & 0x81, 0x81, 'LOADED_HIGH | CAN_USE_HEAP');
  assert.is(zp.readUInt16LE(0x224), 0xfe00, 'heap_end_ptr');
  assert.is(zp.readUInt32LE(0x228), vmm.layout.cmdline);
  assert.is(mem.toString('latin1', vmm.layout.cmdline, vmm.layout.cmdline + cmdline.length), cmdline);
  assert.is(mem[vmm.layout.cmdline + cmdline.length], 0, 'NUL-terminated');
  // initrd: page aligned, above the kernel's boot footprint, inside RAM and below initrd_addr_max.
  const ird = zp.readUInt32LE(0x218);
  assert.is(ird, r.initrdAddr);
  assert.is(zp.readUInt32LE(0x21c), initrd);
  assert.is(ird % 4096, 0);
  assert.ok(ird >= r.kernelEnd && ird + initrd <= 256 * MiB && ird + initrd - 1 <= k.initrdAddrMax);
  // e820
  const n = zp[0x1e8] ?? 0;
  const e820 = Array.from({ length: n }, (_, i) => ({
    addr: Number(zp.readBigUInt64LE(0x2d0 + i * 20)),
    size: Number(zp.readBigUInt64LE(0x2d0 + i * 20 + 8)),
    type: zp.readUInt32LE(0x2d0 + i * 20 + 16),
  }));
  assert.equal(e820, vmm.e820(256 * MiB));
  assert.equal(e820, [
    { addr: 0, size: 0x9fc00, type: 1 },
    { addr: 0x9fc00, size: 0x100000 - 0x9fc00, type: 2 },
    { addr: 0x100000, size: 256 * MiB - 0x100000, type: 1 },
  ]);
  // Identity page tables: PML4[0] -> PDPT, 4 PDs of 2 MiB pages covering 4 GiB.
  assert.is(mem.readBigUInt64LE(0x9000), 0xa003n);
  for (let i = 0; i < 4; i++) assert.is(mem.readBigUInt64LE(0xa000 + i * 8), BigInt(0xb000 + i * 4096) | 3n);
  assert.is(mem.readBigUInt64LE(0xb000), 0x83n);
  assert.is(mem.readBigUInt64LE(0xb000 + 8), 0x200083n);
  assert.is(mem.readBigUInt64LE(0xb000 + 3 * 4096 + 511 * 8), (2047n << 21n) | 0x83n, 'last 2 MiB page below 4 GiB');
  // GDT: __BOOT_CS (0x10) 64-bit code, __BOOT_DS (0x18) data.
  assert.is(mem.readBigUInt64LE(0x500 + 0x10), 0x00af9b000000ffffn);
  assert.is(mem.readBigUInt64LE(0x500 + 0x18), 0x00cf93000000ffffn);
});

test('command line and memory limits give clear errors', () => {
  if (!haveKernel) return;
  throws(() => vmm.loadLinux(Buffer.alloc(256 * MiB), bz, 'x'.repeat(5000), 0, 1), /command line is 5000 bytes/);
  throws(() => vmm.loadLinux(Buffer.alloc(256 * MiB), bz, 'a', 250 * MiB, 1), /initrd does not fit/);
  throws(() => vmm.loadLinux(Buffer.alloc(16 * MiB), bz, 'a', 0, 1), /too small/);
});

test('e820 splits RAM around the PCI hole', () => {
  assert.equal(vmm.e820(4 * 1024 * MiB).slice(2), [
    { addr: 0x100000, size: 3 * 1024 * MiB - 0x100000, type: 1 },
    { addr: 4 * 1024 * MiB, size: 1024 * MiB, type: 1 },
  ]);
});

function checksum(b: Buffer): number {
  let s = 0;
  for (const x of b) s = (s + x) & 0xff;
  return s;
}

test('MP table: floating pointer, checksums, one CPU entry per vCPU, IOAPIC, ISA IRQs', () => {
  for (const vcpus of [1, 4, 64]) {
    const mem = Buffer.alloc(2 * MiB);
    const size = vmm.writeMpTable(mem, vmm.layout.ebda, vcpus);
    const fp = mem.subarray(0x9fc00, 0x9fc10);
    assert.is(fp.toString('latin1', 0, 4), '_MP_');
    assert.is(checksum(fp), 0, 'floating pointer checksum');
    const at = fp.readUInt32LE(4);
    assert.is(at, 0x9fc10);
    const len = mem.readUInt16LE(at + 4);
    assert.is(mem.toString('latin1', at, at + 4), 'PCMP');
    assert.is(checksum(mem.subarray(at, at + len)), 0, 'config table checksum');
    assert.is(mem.readUInt32LE(at + 36), 0xfee00000, 'LAPIC address');
    assert.is(mem.readUInt16LE(at + 34), vcpus + 1 + 1 + 16 + 2, 'entry count');
    assert.is(16 + len, size);
    let p = at + 44;
    for (let i = 0; i < vcpus; i++) {
      assert.is(mem[p], 0, 'processor entry');
      assert.is(mem[p + 1], i, 'APIC id');
      assert.is(mem[p + 3], i === 0 ? 3 : 1, 'enabled, BSP on CPU 0');
      p += 20;
    }
    assert.is(mem[p], 1, 'bus entry');
    assert.is(mem.toString('latin1', p + 2, p + 5), 'ISA');
    p += 8;
    assert.is(mem[p], 2, 'IOAPIC entry');
    assert.is(mem[p + 1], vcpus, 'IOAPIC id after the CPUs');
    assert.is(mem.readUInt32LE(p + 4), 0xfec00000);
    p += 8;
    for (let irq = 0; irq < 16; irq++, p += 8) {
      assert.is(mem[p], 3);
      assert.is(mem[p + 5], irq, 'source IRQ');
      assert.is(mem[p + 7], irq, 'IOAPIC pin = IRQ (KVM default routing)');
    }
  }
  throws(() => vmm.writeMpTable(Buffer.alloc(2 * MiB), vmm.layout.ebda, 0), /vcpus must be/);
  throws(() => vmm.writeMpTable(Buffer.alloc(2 * MiB), vmm.layout.ebda, 65), /vcpus must be/);
  throws(() => vmm.writeMpTable(Buffer.alloc(0x9fc00), vmm.layout.ebda, 1), /does not fit/);
});

test.run();
