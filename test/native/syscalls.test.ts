// The raw syscall layer without KVM: memfd, mmap family, eventfd, errors.
import { existsSync, readFileSync, readSync, writeSync } from 'node:fs';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { isErrnoError, type Mapping, native } from '../../host/native.ts';

const n = native();
const c = n.constants;
const PAGE = c.PAGE_SIZE;
const RW = c.PROT_READ | c.PROT_WRITE;

function bytes(m: Mapping): Uint8Array {
  assert.ok(m.buffer, 'mapping has a buffer');
  return new Uint8Array(m.buffer!);
}

function throwsErrno(fn: () => unknown, code: string, syscall: string): void {
  try {
    fn();
  } catch (e) {
    assert.ok(isErrnoError(e), `expected an errno error, got ${String(e)}`);
    assert.is(e.code, code);
    assert.is(e.syscall, syscall);
    assert.type(e.errno, 'number');
    assert.match(e.message, code);
    return;
  }
  assert.unreachable(`expected ${syscall} to fail with ${code}`);
}

/** Whether some mapping of this process covers the address (VMAs may merge, so not by start). */
function inProcMaps(addr: bigint): boolean {
  return readFileSync('/proc/self/maps', 'utf8')
    .split('\n')
    .some((l) => {
      const m = /^([0-9a-f]+)-([0-9a-f]+) /.exec(l);
      return m !== null && BigInt(`0x${m[1]}`) <= addr && addr < BigInt(`0x${m[2]}`);
    });
}

test('constants are numbers', () => {
  for (const k of ['PROT_READ', 'MAP_SHARED', 'MAP_ANONYMOUS', 'MADV_DONTNEED', 'MFD_CLOEXEC', 'EFD_NONBLOCK', 'KVM_EXIT_HLT', 'PAGE_SIZE']) {
    assert.type(c[k], 'number', k);
  }
  assert.is(c.KVM_API_VERSION, 12);
  assert.is(c.KVM_EXIT_HLT, 5);
  assert.ok(Object.isFrozen(c));
});

test('memfd + ftruncate + two shared mappings see the same bytes', () => {
  const fd = n.memfdCreate('forkling-test');
  try {
    n.ftruncate(fd, 4 * PAGE);
    const a = n.mmap(4 * PAGE, RW, c.MAP_SHARED, fd, 0);
    const b = n.mmap(2 * PAGE, RW, c.MAP_SHARED, fd, 2 * PAGE);
    assert.is(a.length, 4 * PAGE);
    assert.is(typeof a.address, 'bigint');
    bytes(a).set([1, 2, 3], 2 * PAGE + 10);
    assert.equal([...bytes(b).subarray(10, 13)], [1, 2, 3]);
    bytes(b)[PAGE] = 0x5a;
    assert.is(bytes(a)[3 * PAGE], 0x5a);
    a.unmap();
    b.unmap();
  } finally {
    n.close(fd);
  }
});

test('MAP_PRIVATE is copy-on-write: its writes stay private', () => {
  const fd = n.memfdCreate('forkling-cow');
  try {
    n.ftruncate(fd, PAGE);
    const shared = n.mmap(PAGE, RW, c.MAP_SHARED, fd);
    bytes(shared)[0] = 7;
    const priv = n.mmap(PAGE, RW, c.MAP_PRIVATE, fd);
    assert.is(bytes(priv)[0], 7, 'private mapping starts with the file contents');
    bytes(priv)[0] = 9;
    bytes(priv)[1] = 9;
    assert.is(bytes(shared)[0], 7, 'the file did not change');
    assert.is(bytes(shared)[1], 0);
    const again = n.mmap(PAGE, RW, c.MAP_SHARED, fd);
    assert.is(bytes(again)[0], 7);
    bytes(shared)[0] = 8;
    assert.is(bytes(priv)[0], 9, 'a copied page no longer follows the file');
    for (const m of [shared, priv, again]) m.unmap();
  } finally {
    n.close(fd);
  }
});

test('madvise DONTNEED zeroes an anonymous private page; REMOVE frees memfd pages', () => {
  const anon = n.mmap(2 * PAGE, RW, c.MAP_PRIVATE | c.MAP_ANONYMOUS);
  bytes(anon).fill(0xab);
  n.madvise(anon, PAGE, PAGE, c.MADV_DONTNEED);
  assert.is(bytes(anon)[0], 0xab, 'the page outside the range is kept');
  assert.is(bytes(anon)[PAGE], 0);
  assert.is(bytes(anon)[2 * PAGE - 1], 0);
  assert.throws(() => n.madvise(anon, PAGE, 2 * PAGE, c.MADV_DONTNEED), /outside the mapping/);
  anon.unmap();

  const fd = n.memfdCreate('forkling-remove');
  try {
    n.ftruncate(fd, PAGE);
    const a = n.mmap(PAGE, RW, c.MAP_SHARED, fd);
    const b = n.mmap(PAGE, RW, c.MAP_SHARED, fd);
    bytes(a)[5] = 1;
    n.madvise(a, 0, PAGE, c.MADV_REMOVE);
    assert.is(bytes(b)[5], 0, 'the page was punched out of the file');
    a.unmap();
    b.unmap();
  } finally {
    n.close(fd);
  }
});

test('eventfd counts through node:fs reads and writes', () => {
  const fd = n.eventfd(3, c.EFD_CLOEXEC | c.EFD_NONBLOCK);
  try {
    const add = Buffer.alloc(8);
    add.writeBigUInt64LE(4n);
    assert.is(writeSync(fd, add), 8);
    const out = Buffer.alloc(8);
    assert.is(readSync(fd, out), 8);
    assert.is(out.readBigUInt64LE(), 7n);
    try {
      readSync(fd, out);
      assert.unreachable('an empty non-blocking eventfd read must fail');
    } catch (e) {
      assert.is((e as NodeJS.ErrnoException).code, 'EAGAIN');
    }
  } finally {
    n.close(fd);
  }
});

test('failed calls throw errors with the errno name and the call', () => {
  throwsErrno(() => n.close(-1), 'EBADF', 'close');
  throwsErrno(() => n.ftruncate(-1, 0), 'EBADF', 'ftruncate');
  throwsErrno(() => n.mmap(PAGE, RW, c.MAP_SHARED, 12345), 'EBADF', 'mmap');
  throwsErrno(() => n.mmap(0, RW, c.MAP_PRIVATE | c.MAP_ANONYMOUS), 'EINVAL', 'mmap');
  throwsErrno(() => n.memfdCreate('x', 0x7fff0000), 'EINVAL', 'memfd_create');
  throwsErrno(() => n.eventfd(0, 0x7fff0000), 'EINVAL', 'eventfd');
  if (existsSync('/dev/kvm')) {
    const fd = n.openKvm();
    assert.ok(fd >= 0);
    n.close(fd);
  } else {
    throwsErrno(() => n.openKvm(), 'ENOENT', 'open /dev/kvm');
  }
});

test('malformed arguments are refused before any syscall', () => {
  assert.throws(() => n.close('3' as unknown as number), TypeError);
  assert.throws(() => n.close(1.5), RangeError);
  assert.throws(() => n.mmap(-1, RW, c.MAP_PRIVATE | c.MAP_ANONYMOUS), RangeError);
  assert.throws(() => n.mmap(PAGE, RW, c.MAP_PRIVATE | c.MAP_ANONYMOUS | 0x10 /* MAP_FIXED */), /MAP_FIXED/);
  assert.throws(() => n.madvise({} as Mapping, 0, PAGE, c.MADV_DONTNEED), /Mapping returned by mmap/);
  assert.throws(() => new (n as unknown as { Mapping: new () => unknown }).Mapping(), /made by mmap/);
});

test('a mapping without read+write access has no buffer', () => {
  const m = n.mmap(PAGE, c.PROT_READ, c.MAP_PRIVATE | c.MAP_ANONYMOUS);
  assert.is(m.buffer, null);
  assert.ok(m.mapped);
  m.unmap();
});

test('unmap detaches the buffer first and is idempotent', () => {
  const m = n.mmap(PAGE, RW, c.MAP_PRIVATE | c.MAP_ANONYMOUS);
  const buf = m.buffer!;
  const view = new Uint8Array(buf);
  view[0] = 1;
  assert.ok(inProcMaps(m.address));
  m.unmap();
  assert.is(buf.byteLength, 0, 'the old ArrayBuffer is detached');
  assert.is(view.length, 0, 'views over it are empty');
  assert.is(view[0], undefined);
  assert.is(m.buffer, null);
  assert.not.ok(m.mapped);
  assert.not.ok(inProcMaps(m.address), 'the memory is unmapped');
  m.unmap();
  n.munmap(m);
  assert.throws(() => n.madvise(m, 0, PAGE, c.MADV_DONTNEED), /already unmapped/);
});

test('a collected mapping is unmapped', async () => {
  setFlagsFromString('--expose-gc');
  const gc = runInNewContext('gc') as () => void;
  let m: Mapping | null = n.mmap(16 * PAGE, RW, c.MAP_PRIVATE | c.MAP_ANONYMOUS);
  const addr = m.address;
  bytes(m)[0] = 1;
  assert.ok(inProcMaps(addr));
  m = null;
  // Finalizers run after collection, from the event loop: poll, bounded.
  for (let i = 0; i < 50 && inProcMaps(addr); i++) {
    gc();
    await new Promise((r) => setTimeout(r, 10));
  }
  assert.not.ok(inProcMaps(addr), 'the mapping went away with its objects');
});

test.run();
