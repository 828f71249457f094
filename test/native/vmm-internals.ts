// The addon's `vmmInternals` (native/src/vmm_binding.cc), typed for the VMM
// tests that need no KVM: the kernel loader, the MP table, the UART, the
// i8042 and a PCI bus with a virtio-rng behind virtio-pci, over plain Buffers.
import { native } from '../../host/native.ts';

export interface KernelInfoJs {
  kind: 'bzImage' | 'elf';
  protocol?: number;
  setupSects?: number;
  payloadOffset?: number;
  payloadSize?: number;
  xloadflags?: number;
  relocatable?: boolean;
  kernelAlignment?: number;
  prefAddress?: number;
  initSize?: number;
  headerEnd?: number;
  entry?: number;
  segments?: { paddr: number; filesz: number; memsz: number }[];
  cmdlineSize: number;
  initrdAddrMax: number;
}

export interface VmmInternals {
  parseKernel(kernel: Buffer): KernelInfoJs;
  loadLinux(memory: Buffer, kernel: Buffer, cmdline: string, initrdSize: number, vcpus: number): { entry: number; kernelEnd: number; initrdAddr: number };
  e820(ramBytes: number): { addr: number; size: number; type: number }[];
  writeMpTable(memory: Buffer, addr: number, vcpus: number): number;
  /** malloc's bytes in use, all arenas (mallinfo2: uordblks + hblkhd) */
  mallocInUse(): number;
  Uart: new () => { read(off: number): number; write(off: number, v: number): void; input(b: Buffer): void; readonly irqs: number; takeOutput(): string };
  I8042: new () => { read(port: number): number; write(port: number, v: number): void; readonly resets: number };
  PciModel: new (
    memory: Buffer,
  ) => {
    ioRead(port: number, size: number): number;
    ioWrite(port: number, size: number, value: number): void;
    mmioRead(addr: number, len: number): Buffer | null;
    mmioWrite(addr: number, data: Buffer): boolean;
    takeMsis(): { address: number; data: number }[];
    takeErrors(): string[];
    readonly barAddress: number;
  };
  layout: { bootParams: number; cmdline: number; pml4: number; gdt: number; ebda: number; pciMmioBase: number };
}

export const vmm = (native() as unknown as { vmmInternals: VmmInternals }).vmmInternals;
