// Packing a dozing VM's pages (native/src/vmm/snapshot/packed_pages.h),
// without KVM: each page is kept as the runs of bytes in which it differs
// from the page that backs it, and written back over that backing it must be
// the page again, byte for byte; a page too unlike its backing is kept whole,
// and a store that does not fit the RAM writes nothing past it. The
// lab test (test/kvm/fork.test.ts, "pack") does it to a dozing Linux child.
import { Buffer } from 'node:buffer';
import { randomBytes } from 'node:crypto';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { vmmTesting } from './virtio-driver.ts';

const t = vmmTesting();
/** packRoundTrip with its restored pages as a Buffer. */
function roundTrip(changed: Buffer, bases: Buffer, ramPages?: number) {
  const r = t.packRoundTrip(changed, bases, ramPages);
  return { ...r, restored: Buffer.from(r.restored) };
}
/** Flips bits of one byte. */
function flip(b: Buffer, at: number, mask: number): void {
  b[at] = (b[at] ?? 0) ^ mask;
}
const PAGE = 4096;
const MAX_PAGE_BYTES = 3072;

function pages(n: number, fill: (i: number) => Buffer): Buffer {
  return Buffer.concat(Array.from({ length: n }, (_, i) => fill(i)));
}

test('pack: pages with a few changed bytes come back byte for byte, in little room', () => {
  const bases = pages(64, () => randomBytes(PAGE));
  const changed = Buffer.from(bases);
  let changedBytes = 0;
  for (let p = 0; p < 64; p++) {
    // p changes per page, some next to each other, some at the page's ends
    for (let k = 0; k < p; k++) {
      const at = p * PAGE + ((k * 997 + p * 13) % PAGE);
      flip(changed, at, 0x5a);
      changedBytes++;
    }
  }
  flip(changed, PAGE - 1, 1); // the last byte of page 0
  flip(changed, PAGE, 1); // the first byte of page 1
  const r = roundTrip(changed, bases);
  assert.ok(r.applied);
  assert.ok(r.added.every(Boolean), 'every page kept');
  assert.ok(r.restored.equals(changed), 'every byte as it was');
  assert.is(r.packedPages, 64);
  // 6 bytes per page, at most 4 more per changed byte (a run of its own)
  assert.ok(r.encodedBytes <= 64 * 6 + changedBytes * 5 + 10, `${r.encodedBytes} bytes for ${changedBytes} changed`);
  assert.is(r.hostBytes, Math.ceil(r.encodedBytes / PAGE) * PAGE, 'the store is one page-rounded mapping');
});

test('pack: equal pages keep nothing; a page too unlike its backing is kept whole; all zeros and all ones', () => {
  const zero = Buffer.alloc(PAGE);
  const ones = Buffer.alloc(PAGE, 0xff);
  const half = Buffer.alloc(PAGE);
  half.fill(0xff, 0, 2048); // 2048 changed bytes in one run: 2054 bytes
  const most = Buffer.alloc(PAGE);
  most.fill(0xff, 0, MAX_PAGE_BYTES); // one run that does not fit: whole
  const sparse = Buffer.alloc(PAGE);
  for (let i = 0; i < PAGE; i += 8) sparse[i] = 1; // a byte in every 8: 512 runs of 5 bytes
  const pages = Buffer.concat([zero, ones, half, most, sparse]);
  const r = roundTrip(pages, Buffer.concat([zero, zero, zero, zero, zero]));
  assert.equal(r.added, [true, true, true, true, true]);
  assert.is(r.packedPages, 4, 'the equal page has no entry');
  assert.is(r.encodedBytes, 6 + 4 + PAGE + (6 + 4 + 2048) + (6 + 4 + PAGE) + (6 + 512 * 5));
  assert.ok(r.applied);
  assert.ok(r.restored.equals(pages), 'every page written back');
});

test('pack: a page freed to zeros, or with a little data, over a backing that held other data: kept against zeros', () => {
  const backing = Buffer.concat([randomBytes(PAGE), randomBytes(PAGE)]);
  const zero = Buffer.alloc(PAGE);
  const little = Buffer.alloc(PAGE);
  little.write('a little data', 1000);
  const r = roundTrip(Buffer.concat([zero, little]), backing);
  assert.equal(r.added, [true, true]);
  assert.is(r.encodedBytes, 6 + (6 + 4 + 13), 'the zero page in its header alone; the data in one run');
  assert.ok(r.restored.equals(Buffer.concat([zero, little])));
});

test('pack: runs join over a gap shorter than their header and no longer', () => {
  const base = Buffer.alloc(PAGE);
  const page = Buffer.alloc(PAGE);
  page[100] = 1;
  page[104] = 1; // 3 equal bytes between: one run of 5 bytes
  page[200] = 1;
  page[205] = 1; // 4 equal bytes between: two runs of 1
  const r = roundTrip(page, base);
  assert.is(r.encodedBytes, 6 + (4 + 5) + (4 + 1) + (4 + 1));
  assert.ok(r.restored.equals(page));
});

test('pack: a store written back into RAM smaller than its pages writes nothing past that RAM', () => {
  const bases = pages(4, () => Buffer.alloc(PAGE));
  const changed = pages(4, (i) => Buffer.alloc(PAGE, i + 1));
  changed.fill(0, 2 * PAGE + 8, 3 * PAGE);
  changed.fill(0, 3 * PAGE + 8, 4 * PAGE);
  const r = roundTrip(changed, bases, 3);
  assert.equal(r.added, [true, true, true, true]);
  assert.not.ok(r.applied, 'page 3 is past a RAM of 3 pages');
  assert.ok(r.restored.subarray(0, 3 * PAGE).equals(changed.subarray(0, 3 * PAGE)), 'what fits was written');
  assert.ok(r.restored.subarray(3 * PAGE).equals(bases.subarray(3 * PAGE)), 'nothing written past the RAM');
});

test('pack: random pages and random changes, 200 rounds', () => {
  for (let round = 0; round < 200; round++) {
    const n = 1 + (round % 7);
    const bases = pages(n, () => randomBytes(PAGE));
    const changed = Buffer.from(bases);
    const flips = randomBytes(4 * n);
    for (let k = 0; k < flips.length; k += 2) {
      const len = 1 + ((flips[k] ?? 0) % (round % 3 === 0 ? 200 : 9));
      const at = ((flips[k + 1] ?? 0) * 4099 * (k + 1) + round) % (n * PAGE - len);
      for (let i = 0; i < len; i++) flip(changed, at + i, 0xff);
    }
    const r = roundTrip(changed, bases);
    assert.ok(r.applied);
    assert.ok(r.added.every(Boolean));
    assert.ok(r.restored.equals(changed), `round ${round}`);
  }
});

test.run();
