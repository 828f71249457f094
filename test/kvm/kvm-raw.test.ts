// The addon drives real KVM from TypeScript: a VM with memory at guest
// physical 0, one vCPU in real mode running a few instructions; the exits
// (port I/O, HLT) and guest memory writes are checked. Needs /dev/kvm (runs in
// the lab, or directly on a host with KVM).
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { type KvmExit, type Mapping, native } from '../../host/native.ts';

const n = native();
const c = n.constants;
const RW = c.PROT_READ | c.PROT_WRITE;
const MEM_SIZE = 0x10000;
const CODE = 0x1000;

interface Vm {
  kvm: number;
  vm: number;
  vcpu: number;
  mem: Mapping;
  run: Mapping;
  fds: number[];
  maps: Mapping[];
}

/** A VM whose RAM (MEM_SIZE bytes at gpa 0) is `mem`; the vCPU starts in real mode at CODE. */
function createVm(code: number[], mem: Mapping): Vm {
  const kvm = n.openKvm();
  const fds = [kvm];
  const maps = [mem];
  assert.is(n.kvmGetApiVersion(kvm), 12, 'KVM API version');
  assert.ok(n.kvmCheckExtension(kvm, c.KVM_CAP_USER_MEMORY) > 0, 'KVM_CAP_USER_MEMORY');
  const vm = n.kvmCreateVm(kvm);
  fds.push(vm);
  // Intel without unrestricted guest needs a TSS for real mode; harmless elsewhere.
  if (n.kvmCheckExtension(kvm, c.KVM_CAP_SET_TSS_ADDR) > 0) n.kvmSetTssAddr(vm, 0xfffbd000);
  new Uint8Array(mem.buffer!).set(code, CODE);
  n.kvmSetUserMemoryRegion(vm, { slot: 0, flags: 0, guestPhysAddr: 0n, memorySize: BigInt(MEM_SIZE), userspaceAddr: mem.address });
  const vcpu = n.kvmCreateVcpu(vm, 0);
  fds.push(vcpu);
  const runSize = n.kvmGetVcpuMmapSize(kvm);
  assert.ok(runSize >= c.KVM_RUN_SIZE, 'vCPU mmap size covers struct kvm_run');
  const run = n.mmap(runSize, RW, c.MAP_SHARED, vcpu, 0);
  maps.push(run);

  const sregs = n.kvmGetSregs(vcpu);
  sregs.cs = { ...sregs.cs, base: 0n, selector: 0 };
  sregs.ds = { ...sregs.ds, base: 0n, selector: 0 };
  n.kvmSetSregs(vcpu, sregs);
  const regs = n.kvmGetRegs(vcpu);
  n.kvmSetRegs(vcpu, { ...regs, rip: BigInt(CODE), rflags: 2n, rsp: 0x8000n });
  const check = n.kvmGetSregs(vcpu);
  assert.is(check.cs.base, 0n, 'sregs round-trip');
  assert.is(n.kvmGetRegs(vcpu).rip, BigInt(CODE), 'regs round-trip');
  return { kvm, vm, vcpu, mem, run, fds, maps };
}

function destroy(v: Vm): void {
  for (const m of v.maps) m.unmap();
  for (const fd of v.fds.reverse()) n.close(fd);
}

/** Runs until HLT (or a bounded number of exits), answering IN with `inValue`. */
function runToHalt(v: Vm, inValue = 0): KvmExit[] {
  const exits: KvmExit[] = [];
  for (let i = 0; i < 16; i++) {
    const e = n.kvmRun(v.vcpu, v.run);
    if (e.reason === c.KVM_EXIT_INTR) continue;
    exits.push(e);
    if (e.io && e.io.direction === c.KVM_EXIT_IO_IN) new Uint8Array(v.run.buffer!).fill(inValue, e.io.dataOffset, e.io.dataOffset + e.io.size * e.io.count);
    if (e.reason !== c.KVM_EXIT_IO) break;
  }
  return exits;
}

function describe(exits: KvmExit[]): string {
  return exits.map((e) => (e.io ? `IO(${e.io.direction ? 'out' : 'in'} ${e.io.port.toString(16)} ${[...e.io.data]})` : e.reasonName)).join(', ');
}

test('real-mode guest writes "K!" to port 0x3f8, then halts', () => {
  const fd = n.memfdCreate('kvm-raw-ram');
  n.ftruncate(fd, MEM_SIZE);
  const mem = n.mmap(MEM_SIZE, RW, c.MAP_SHARED, fd, 0);
  n.close(fd);
  // mov dx,0x3f8; mov al,'K'; out dx,al; mov al,'!'; out dx,al; hlt
  const code = [0xba, 0xf8, 0x03, 0xb0, 0x4b, 0xee, 0xb0, 0x21, 0xee, 0xf4];
  const v = createVm(code, mem);
  try {
    const exits = runToHalt(v);
    assert.is(exits.length, 3, describe(exits));
    for (const [i, ch] of ['K', '!'].entries()) {
      const e = exits[i]!;
      assert.is(e.reason, c.KVM_EXIT_IO, describe(exits));
      assert.is(e.io?.port, 0x3f8);
      assert.is(e.io?.direction, c.KVM_EXIT_IO_OUT);
      assert.is(e.io?.size, 1);
      assert.is(e.io?.count, 1);
      assert.is(String.fromCharCode(...e.io!.data), ch);
    }
    assert.is(exits[2]!.reason, c.KVM_EXIT_HLT, describe(exits));
    assert.is(exits[2]!.reasonName, 'HLT');
    assert.is(n.kvmGetRegs(v.vcpu).rip, BigInt(CODE + code.length), 'rip is past the hlt');
  } finally {
    destroy(v);
  }
});

test('guest memory writes show in the host mapping; IN answers reach the guest', () => {
  const mem = n.mmap(MEM_SIZE, RW, c.MAP_PRIVATE | c.MAP_ANONYMOUS);
  // mov dx,0x3f8; in al,dx; inc al; mov [0x2000],al; out dx,al; hlt
  const code = [0xba, 0xf8, 0x03, 0xec, 0xfe, 0xc0, 0xa2, 0x00, 0x20, 0xee, 0xf4];
  const v = createVm(code, mem);
  try {
    const host = new Uint8Array(mem.buffer!);
    assert.is(host[0x2000], 0);
    const exits = runToHalt(v, 0x41);
    assert.equal(
      exits.map((e) => e.reasonName),
      ['IO', 'IO', 'HLT'],
      describe(exits),
    );
    assert.is(exits[0]!.io?.direction, c.KVM_EXIT_IO_IN);
    assert.is(exits[1]!.io?.direction, c.KVM_EXIT_IO_OUT);
    assert.equal([...exits[1]!.io!.data], [0x42], 'the guest saw the IN answer and incremented it');
    assert.is(host[0x2000], 0x42, 'the host mapping sees the guest store');
    assert.is(n.kvmGetRegs(v.vcpu).rax & 0xffn, 0x42n);
  } finally {
    destroy(v);
  }
});

test('memory slots must be backed by a live mapping', () => {
  const kvm = n.openKvm();
  const vm = n.kvmCreateVm(kvm);
  const mem = n.mmap(MEM_SIZE, RW, c.MAP_PRIVATE | c.MAP_ANONYMOUS);
  try {
    const region = { slot: 0, flags: 0, guestPhysAddr: 0n, memorySize: BigInt(MEM_SIZE) };
    assert.throws(() => n.kvmSetUserMemoryRegion(vm, { ...region, userspaceAddr: 0x1000n }), /live Mapping/);
    assert.throws(() => n.kvmSetUserMemoryRegion(vm, { ...region, userspaceAddr: mem.address + 4096n }), /live Mapping/);
    n.kvmSetUserMemoryRegion(vm, { ...region, userspaceAddr: mem.address });
    n.kvmSetUserMemoryRegion(vm, { ...region, memorySize: 0n, userspaceAddr: 0n });
    mem.unmap();
    assert.throws(() => n.kvmSetUserMemoryRegion(vm, { ...region, userspaceAddr: mem.address }), /live Mapping/);
  } finally {
    if (mem.mapped) mem.unmap();
    n.close(vm);
    n.close(kvm);
  }
});

test.run();
