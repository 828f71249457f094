// A tiny 64-bit guest for VMM tests that do not need Linux: an ELF "kernel"
// (entered in long mode with the VMM's identity page tables) that fills 1 MiB
// at 3 MiB with a pattern, prints "R", then counts forever in the memory word
// at 3 MiB and prints "T<16 hex digits>" on the UART every 2^16 increments.
// The counter lives only in guest memory, so a restored VM that continues
// the count proves both its memory and its registers came back.
import { writeFileSync } from 'node:fs';

// as --64 of (intel syntax):
//   mov rbx,0x300000; mov rdi,rbx; mov rcx,0x20000; movabs rax,0x1122334455667788; rep stosq
//   mov qword [rbx],0; mov dx,0x3f8; mov al,'R'; out dx,al; mov al,10; out dx,al
// loop: inc qword [rbx]; mov rsi,[rbx]; test esi,MASK; jnz loop
//   mov al,'T'; out dx,al; mov ecx,16
// hex: rol rsi,4; mov eax,esi; and al,15; add al,'0'; cmp al,'9'; jbe 1f; add al,7
// 1: out dx,al; dec ecx; jnz hex; mov al,10; out dx,al; jmp loop
const COUNTER = '48c7c3000030004889df48c7c10000020048b88877665544332211f348ab48c7030000000066baf803b052eeb00aee48ff03488b33f7c6ffff000075f2b054eeb91000000048c1c60489f0240f04303c3976020407eeffc975ebb00aeeebd0';
// The "dirty" variant: no 1 MiB fill; when the counter reaches AT it writes
// one qword into each of 12800 pages from 4 MiB (50 MiB dirtied) and prints
// "F", then counts on:
//   ... loop: inc qword [rbx]; mov rsi,[rbx]; cmp rsi,AT; jne 2f
//   mov rdi,0x400000; mov ecx,12800; 3: mov [rdi],rsi; add rdi,4096; dec ecx; jnz 3b
//   mov al,'F'; out dx,al; mov al,10; out dx,al; 2: test esi,MASK; jnz loop ...
const DIRTY = '48c7c30000300048c7030000000066baf803b052eeb00aee48ff03488b334881fe00000200752048c7c700004000b9003200004889374881c700100000ffc975f2b046eeb00aeef7c6ffff000075c9b054eeb91000000048c1c60489f0240f04303c3976020407eeffc975ebb00aeeeba7';
const MASK_OPCODE = 'f7c6'; // test esi, imm32
const CMP_OPCODE = '4881fe'; // cmp rsi, imm32

export interface TinyGuestOptions {
  /** A counter line every 2^printShift increments (default 16). */
  printShift?: number;
  /** Dirty 50 MiB (12800 pages from 4 MiB) once the counter reaches this value. */
  dirtyAt?: number;
}

function patchImm32(hex: string, opcode: string, value: number): string {
  const at = hex.indexOf(opcode);
  if (at < 0 || at % 2) throw new Error('tiny guest: opcode not found');
  const imm = Buffer.alloc(4);
  imm.writeUInt32LE(value >>> 0);
  const p = at + opcode.length;
  return hex.slice(0, p) + imm.toString('hex') + hex.slice(p + 8);
}

function code(opts: TinyGuestOptions): Buffer {
  const shift = opts.printShift ?? 16;
  if (!Number.isInteger(shift) || shift < 1 || shift > 30) throw new Error('printShift must be 1..30');
  let hex = opts.dirtyAt === undefined ? COUNTER : patchImm32(DIRTY, CMP_OPCODE, opts.dirtyAt);
  hex = patchImm32(hex, MASK_OPCODE, 2 ** shift - 1);
  return Buffer.from(hex, 'hex');
}

const LOAD_ADDR = 0x100000;
/** Increments between two counter lines. */
export const COUNTER_STEP = 1n << 16n;
/** Guest memory the dirty variant needs (it writes up to 54 MiB). */
export const DIRTY_MEMORY_MIB = 128;

// A hostile guest: enables memory decoding of PCI slot 1 (virtio-vsock, BAR 0 at
// 0xd0000000), then FLAP_ROUNDS times resets the device, accepts VERSION_1, gives
// queue 0 the invalid size 3, enables it and sets DRIVER_OK (which the VMM must
// refuse: a device error); then prints "D" and spins.
//   mov dx,0xcf8; mov eax,0x80000804; out dx,eax; mov dx,0xcfc; mov eax,6; out dx,eax
//   movabs rbx,0xd0000000; mov ecx,500
// 1: mov byte [rbx+0x14],0; mov dword [rbx+8],1; mov dword [rbx+0xc],1
//   mov word [rbx+0x18],3; mov word [rbx+0x1c],1; mov byte [rbx+0x14],0xf; dec ecx; jnz 1b
//   mov dx,0x3f8; mov al,'D'; out dx,al; mov al,10; out dx,al; 2: jmp 2b
const FLAPPER =
  '66baf80cb804080080ef66bafc0cb806000000ef48bb000000d000000000b9f4010000c6431400c7430801000000c7430c0100000066c74318030066c7431c0100c643140fffc975da66baf803b044eeb00aeeebfe';
/** How many times the device-failing guest fails virtio-vsock. */
export const FLAP_ROUNDS = 500;

/** The ELF image of the hostile guest that fails virtio-vsock FLAP_ROUNDS times, then prints "D". */
export function deviceFlapperElf(): Buffer {
  return elfOf(Buffer.from(FLAPPER, 'hex'));
}

/** The ELF image: one PT_LOAD segment at 1 MiB, entry at its start. */
export function tinyGuestElf(opts: TinyGuestOptions = {}): Buffer {
  return elfOf(code(opts));
}

function elfOf(CODE: Buffer): Buffer {
  const ehdr = Buffer.alloc(64);
  ehdr.write('\x7fELF', 0, 'latin1');
  ehdr[4] = 2; // 64-bit
  ehdr[5] = 1; // little-endian
  ehdr[6] = 1; // version
  ehdr.writeUInt16LE(2, 16); // ET_EXEC
  ehdr.writeUInt16LE(62, 18); // EM_X86_64
  ehdr.writeUInt32LE(1, 20);
  ehdr.writeBigUInt64LE(BigInt(LOAD_ADDR), 24); // entry
  ehdr.writeBigUInt64LE(64n, 32); // phoff
  ehdr.writeUInt16LE(64, 52); // ehsize
  ehdr.writeUInt16LE(56, 54); // phentsize
  ehdr.writeUInt16LE(1, 56); // phnum
  const phdr = Buffer.alloc(56);
  phdr.writeUInt32LE(1, 0); // PT_LOAD
  phdr.writeUInt32LE(5, 4); // R+X
  phdr.writeBigUInt64LE(128n, 8); // offset
  phdr.writeBigUInt64LE(BigInt(LOAD_ADDR), 16); // vaddr
  phdr.writeBigUInt64LE(BigInt(LOAD_ADDR), 24); // paddr
  phdr.writeBigUInt64LE(BigInt(CODE.length), 32);
  phdr.writeBigUInt64LE(BigInt(CODE.length), 40);
  phdr.writeBigUInt64LE(0x1000n, 48);
  const pad = Buffer.alloc(128 - 64 - 56);
  return Buffer.concat([ehdr, phdr, pad, CODE]);
}

export function writeTinyGuest(path: string, opts: TinyGuestOptions = {}): string {
  writeFileSync(path, tinyGuestElf(opts));
  return path;
}

/** The counter value of a "T..." console line, or null for any other line. */
export function counterOf(line: string): bigint | null {
  const m = /^T([0-9A-F]{16})$/.exec(line.trim());
  return m ? BigInt(`0x${m[1]}`) : null;
}
