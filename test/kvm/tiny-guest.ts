// A tiny 64-bit guest for VMM tests that do not need Linux: an ELF "kernel"
// (entered in long mode with the VMM's identity page tables) that fills 1 MiB
// at 3 MiB with a pattern, prints "R", then counts forever in the memory word
// at 3 MiB and prints "T<16 hex digits>" on the UART every 2^16 increments.
// The counter lives only in guest memory, so a restored VM that continues
// the count proves both its memory and its registers came back.
import { writeFileSync } from 'node:fs';

// as --64 of the program in the comment above (intel syntax):
//   mov rbx,0x300000; mov rdi,rbx; mov rcx,0x20000; movabs rax,0x1122334455667788; rep stosq
//   mov qword [rbx],0; mov dx,0x3f8; mov al,'R'; out dx,al; mov al,10; out dx,al
// loop: inc qword [rbx]; mov rsi,[rbx]; test esi,0xffff; jnz loop
//   mov al,'T'; out dx,al; mov ecx,16
// hex: rol rsi,4; mov eax,esi; and al,15; add al,'0'; cmp al,'9'; jbe 1f; add al,7
// 1: out dx,al; dec ecx; jnz hex; mov al,10; out dx,al; jmp loop
const CODE = Buffer.from(
  '48c7c3000030004889df48c7c10000020048b88877665544332211f348ab48c7030000000066baf803b052eeb00aee48ff03488b33f7c6ffff000075f2b054eeb91000000048c1c60489f0240f04303c3976020407eeffc975ebb00aeeebd0',
  'hex',
);
const LOAD_ADDR = 0x100000;
/** Increments between two counter lines. */
export const COUNTER_STEP = 1n << 16n;

/** The ELF image: one PT_LOAD segment at 1 MiB, entry at its start. */
export function tinyGuestElf(): Buffer {
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

export function writeTinyGuest(path: string): string {
  writeFileSync(path, tinyGuestElf());
  return path;
}

/** The counter value of a "T..." console line, or null for any other line. */
export function counterOf(line: string): bigint | null {
  const m = /^T([0-9A-F]{16})$/.exec(line.trim());
  return m ? BigInt(`0x${m[1]}`) : null;
}
