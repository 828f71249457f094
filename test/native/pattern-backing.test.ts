// The bookkeeping of a VM's pattern runs (native/src/vmm/snapshot/pattern.h),
// without KVM: which pages are mapped from the pattern, the mappings that
// costs (a stretch of pages in a row is one, however it was mapped: runs
// mapped over or next to earlier ones join them), and the budget every VM of
// the process shares. A reclaim pass maps only while mapsLeft() > 0; the
// out-of-memory fallback (reclaim.cc) hands a range back with remove(), which
// must split a stretch and give its mappings back.
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { vmmTesting } from './virtio-driver.ts';

const t = vmmTesting();
const PER_VM = 128;

test('pattern bookkeeping: stretches joined and split, mappings counted, the budget shared and given back', () => {
  const before = t.patternMapsInProcess();
  const a = new t.PatternBackingProbe();
  a.add(10, 3);
  assert.equal(a.pages(), [10, 11, 12]);
  assert.is(a.maps(), 1);
  a.add(14, 2);
  assert.is(a.maps(), 2, 'a stretch apart');
  a.add(13, 1);
  assert.is(a.maps(), 1, 'the page between joins them (one file, one offset per page)');
  a.add(11, 4);
  assert.equal(a.pages(), [10, 11, 12, 13, 14, 15], 'mapped over pages mapped before: no page twice');
  assert.is(a.maps(), 1);
  assert.is(a.mapsLeft(), PER_VM - 1);
  assert.is(t.patternMapsInProcess(), before + 1);

  // The fallback: the memory file mapped back over [12, 14).
  a.remove(12, 2);
  assert.equal(a.pages(), [10, 11, 14, 15]);
  assert.ok(a.has(11) && !a.has(12) && !a.has(13) && a.has(14));
  assert.is(a.maps(), 2, 'the stretch split in two');
  assert.is(t.patternMapsInProcess(), before + 2);
  a.remove(0, 100);
  assert.equal(a.pages(), []);
  assert.is(a.maps(), 0);
  assert.is(t.patternMapsInProcess(), before);

  // Another VM's mappings count against the process's budget, and are given back when it ends.
  const b = new t.PatternBackingProbe();
  for (let i = 0; i < 5; i++) b.add(i * 10, 1);
  assert.is(b.maps(), 5);
  assert.is(t.patternMapsInProcess(), before + 5);
  b.close();
  assert.is(t.patternMapsInProcess(), before);

  // A VM's own budget: at most PER_VM runs; then none left.
  for (let i = 0; i < PER_VM; i++) a.add(1000 + i * 2, 1);
  assert.is(a.maps(), PER_VM);
  assert.is(a.mapsLeft(), 0);
  a.remove(1000, 2);
  assert.is(a.mapsLeft(), 1);
  // A failed mmap: no more runs for this VM, whatever its count.
  a.exhaust();
  assert.is(a.mapsLeft(), 0);
  a.close();
  assert.is(t.patternMapsInProcess(), before);
  assert.throws(() => a.maps(), /closed/);
});

test('pattern bookkeeping: 2,000 random adds and removes agree with a plain set of pages', () => {
  const before = t.patternMapsInProcess();
  const a = new t.PatternBackingProbe();
  const model = new Set<number>();
  let seed = 7;
  const rand = (n: number) => {
    seed = (Math.imul(seed, 1103515245) + 12345) >>> 0; // (32-bit: a product past 2^53 loses its low bits)
    return (seed >>> 8) % n; // (an LCG's low bits cycle fast)
  };
  for (let i = 0; i < 2000; i++) {
    const first = rand(300);
    const count = 1 + rand(12);
    if (rand(3) === 0) {
      a.remove(first, count);
      for (let p = first; p < first + count; p++) model.delete(p);
    } else {
      a.add(first, count);
      for (let p = first; p < first + count; p++) model.add(p);
    }
    if (i % 50 === 0 || i === 1999) {
      const pages = [...model].sort((x, y) => x - y);
      assert.equal(a.pages(), pages, `after step ${i}`);
      const stretches = pages.filter((p, k) => k === 0 || pages[k - 1] !== p - 1).length;
      assert.is(a.maps(), stretches, `stretches after step ${i}`);
      assert.is(t.patternMapsInProcess(), before + stretches);
      for (let p = 0; p < 320; p++) if (a.has(p) !== model.has(p)) assert.unreachable(`has(${p}) after step ${i}`);
    }
  }
  a.close();
  assert.is(t.patternMapsInProcess(), before);
});

test('pattern bookkeeping: bad arguments are refused with a clear error', () => {
  const a = new t.PatternBackingProbe();
  assert.throws(() => a.add(-1, 1), /first/);
  assert.throws(() => a.add(1, 2 ** 21), /count/);
  assert.throws(() => (a.has as (p: unknown) => boolean)('x'), /page/);
  assert.equal(a.pages(), []);
  a.close();
});

test.run();
