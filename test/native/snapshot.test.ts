// Snapshot file formats without KVM: the state-file container, the sparse
// memory file and its checksum, pagemap accounting of private pages, and diff
// layers (write, map over a base, chains of depth 9, collapse, corruption).
import { spawnSync } from 'node:child_process';
import { chmodSync, closeSync, fstatSync, mkdirSync, mkdtempSync, openSync, readFileSync, rmSync, statSync, truncateSync, writeFileSync, writeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { sectionTag, snapshotNative } from '../../host/engine/kvm/snapshot-native.ts';
import { native } from '../../host/native.ts';

const s = snapshotNative();
const n = native();
const c = n.constants;
const PAGE = 4096;
const dir = mkdtempSync(join(tmpdir(), 'forkling-snap-'));

function throwsCorrupt(fn: () => unknown, match: RegExp): void {
  try {
    fn();
  } catch (e) {
    assert.is((e as { code?: string }).code, 'ECORRUPT', String(e));
    assert.match((e as Error).message, match);
    return;
  }
  assert.unreachable(`expected a corrupt-file error matching ${match}`);
}

function fillPage(buf: Uint8Array, page: number, seed: number): void {
  for (let i = 0; i < PAGE; i += 4) buf[page * PAGE + i] = (seed * 31 + i) & 0xff || 1;
}

test('crc32c: standard check value, continuation', () => {
  const data = new TextEncoder().encode('123456789');
  assert.is(s.crc32c(data), 0xe3069283);
  assert.is(s.crc32c(data.subarray(4), s.crc32c(data.subarray(0, 4))), 0xe3069283);
  assert.is(s.crc32c(new Uint8Array(0)), 0);
});

test('state file: round trip of sections', () => {
  const secs = [
    { tag: sectionTag('VCPU'), index: 0, data: new Uint8Array([1, 2, 3]) },
    { tag: sectionTag('VCPU'), index: 1, data: new Uint8Array(1000).fill(7) },
    { tag: sectionTag('META'), index: 0, data: new Uint8Array(0) },
  ];
  const file = s.encodeStateFile(secs);
  assert.is(file.length % 8, 0);
  const back = s.decodeStateFile(file, 'template t');
  assert.is(back.length, 3);
  for (let i = 0; i < 3; i++) {
    assert.is(back[i]!.tag, secs[i]!.tag);
    assert.is(back[i]!.index, secs[i]!.index);
    assert.equal([...back[i]!.data], [...secs[i]!.data]);
  }
});

test('state file: every single-byte corruption and every truncation is refused', () => {
  const file = s.encodeStateFile([
    { tag: sectionTag('VCPU'), index: 0, data: new Uint8Array(64).fill(9) },
    { tag: sectionTag('KVMV'), index: 0, data: new Uint8Array(40).fill(3) },
  ]);
  for (let i = 0; i < file.length; i++) {
    const bad = Uint8Array.from(file);
    bad[i]! ^= 0x5a;
    throwsCorrupt(() => s.decodeStateFile(bad, 'template t'), /^template t is corrupt: state file /);
  }
  for (const len of [0, 7, 24, 40, file.length - 9, file.length - 1]) {
    throwsCorrupt(() => s.decodeStateFile(file.subarray(0, len), 'template t'), /template t is corrupt: state file (is truncated|has no end marker)/);
  }
  const longer = new Uint8Array(file.length + 8);
  longer.set(file);
  throwsCorrupt(() => s.decodeStateFile(longer, 'template t'), /bytes too many/);
});

test('state file: another format version is refused with a hint', () => {
  const file = Uint8Array.from(s.encodeStateFile([]));
  new DataView(file.buffer).setUint32(8, 99, true);
  throwsCorrupt(() => s.decodeStateFile(file, 'template v'), /format version 99.*create the template again/);
});

test('memory file: sparse, holes for zero pages, checksum verified, corruption refused', () => {
  const pages = 256; // 1 MiB
  const fd = n.memfdCreate('snap-test');
  n.ftruncate(fd, pages * PAGE);
  const m = n.mmap(pages * PAGE, c.PROT_READ | c.PROT_WRITE, c.MAP_SHARED, fd, 0);
  const mem = new Uint8Array(m.buffer!);
  const written = [0, 1, 2, 50, 200, 255];
  for (const p of written) fillPage(mem, p, p);
  mem[100 * PAGE + 5] = 0; // touched but zero: a data page of the memfd that must stay a hole
  const path = join(dir, 'memory.bin');
  const info = s.writeMemoryFile(m, path, fd);
  assert.equal(info.size, pages * PAGE);
  assert.is(info.dataPages, written.length);
  const st = statSync(path);
  assert.is(st.size, pages * PAGE);
  assert.ok(st.blocks * 512 <= (written.length + 2) * PAGE, `file is sparse (${st.blocks * 512} bytes allocated)`);
  const back = readFileSync(path);
  assert.ok(Buffer.compare(back, Buffer.from(mem)) === 0, 'file content equals guest RAM');
  assert.equal(s.scanMemoryFile(path, 'template m'), info);
  s.verifyMemoryFile(path, info, 'template m');
  // Without the memfd (no SEEK_DATA on the source) the result is the same.
  const info2 = s.writeMemoryFile(m, join(dir, 'memory2.bin'));
  assert.equal(info2, info);

  // One flipped byte in a data page.
  const wfd = openSync(path, 'r+');
  writeSync(wfd, Buffer.from([mem[50 * PAGE]! ^ 1]), 0, 1, 50 * PAGE);
  closeSync(wfd);
  throwsCorrupt(() => s.verifyMemoryFile(path, info, 'template m'), /^template m is corrupt: memory file .* fails its checksum/);
  // A non-zero byte where a hole was.
  writeFileSync(path, back);
  s.verifyMemoryFile(path, info, 'template m');
  const wfd2 = openSync(path, 'r+');
  writeSync(wfd2, Buffer.from([1]), 0, 1, 77 * PAGE);
  closeSync(wfd2);
  throwsCorrupt(() => s.verifyMemoryFile(path, info, 'template m'), /fails its checksum/);
  // Truncated, missing.
  writeFileSync(path, back);
  truncateSync(path, 100 * PAGE);
  throwsCorrupt(() => s.verifyMemoryFile(path, info, 'template m'), /has 409600 bytes, the state file says 1048576 \(truncated\)/);
  rmSync(path);
  throwsCorrupt(() => s.verifyMemoryFile(path, info, 'template m'), /memory file .* is missing/);
  // What another user may write, a FIFO (which would block the reader for good) and a directory are refused.
  writeFileSync(path, back);
  chmodSync(path, 0o666);
  throwsCorrupt(() => s.verifyMemoryFile(path, info, 'template m'), /^template m is refused: .* may be written by other users \(mode 0666; chmod go-w /);
  rmSync(path);
  assert.is(spawnSync('mkfifo', [path]).status, 0);
  throwsCorrupt(() => s.verifyMemoryFile(path, info, 'template m'), /^template m is refused: .* is not a regular file/);
  rmSync(path);
  mkdirSync(path);
  throwsCorrupt(() => s.scanMemoryFile(path, 'template m'), /^template m is refused: .* is not a regular file/);
  rmSync(path, { recursive: true });
  n.munmap(m);
  n.close(fd);
});

test('pagemap: written pages of a MAP_PRIVATE file mapping are private, read ones shared', () => {
  const pages = 64;
  const path = join(dir, 'base-pm.bin');
  const base = new Uint8Array(pages * PAGE);
  for (let p = 0; p < pages; p++) fillPage(base, p, p + 1);
  writeFileSync(path, base);
  const fd = openSync(path, 'r');
  const m = n.mmap(pages * PAGE, c.PROT_READ | c.PROT_WRITE, c.MAP_PRIVATE, fd, 0);
  const mem = new Uint8Array(m.buffer!);
  assert.equal(s.privatePages(m), []);
  let sum = 0;
  for (let p = 0; p < 32; p++) sum += mem[p * PAGE]!;
  assert.ok(sum > 0);
  mem[3 * PAGE] = 1;
  mem[40 * PAGE + 100] = 2;
  mem[41 * PAGE] = 3;
  assert.equal(s.privatePages(m), [3, 40, 41]);
  const counts = s.pageCounts(m);
  assert.is(counts.private, 3);
  assert.ok(counts.shared >= 31, `read pages are shared (${counts.shared})`);
  n.munmap(m);
  closeSync(fd);
});

test('pageCounts: the 2 MiB spans with a page present, one page-table page each', () => {
  const SPAN = 2 << 20;
  const m = n.mmap(4 * SPAN, c.PROT_READ | c.PROT_WRITE, c.MAP_PRIVATE | c.MAP_ANONYMOUS, -1, 0);
  const mem = new Uint8Array(m.buffer!);
  assert.is(s.pageCounts(m).tableSpans, 0, 'nothing present, no span');
  // Pages in the spans of three addresses, two of them in the same span: as the address says.
  const offsets = [PAGE, PAGE * 3, SPAN + 5 * PAGE, 3 * SPAN + 7 * PAGE];
  for (const o of offsets) mem[o] = 1;
  const spans = new Set(offsets.map((o) => (m.address + BigInt(o)) >> 21n));
  assert.is(s.pageCounts(m).tableSpans, spans.size);
  n.munmap(m);
});

test('fillGaps: closes the smallest gaps first, within the budget', () => {
  assert.equal(s.fillGaps([1, 2, 3], 1), [1, 2, 3]);
  assert.equal(s.fillGaps([0, 2, 10, 11, 20], 4), [0, 2, 10, 11, 20]);
  assert.equal(s.fillGaps([0, 2, 10, 11, 20], 3), [0, 1, 2, 10, 11, 20]);
  assert.equal(s.fillGaps([0, 2, 10, 11, 20], 2), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 20]);
  assert.equal(s.fillGaps([0, 2, 4, 6], 2), [0, 1, 2, 3, 4, 6]);
  const many = Array.from({ length: 1000 }, (_, i) => i * 3);
  const filled = s.fillGaps(many, 128);
  let runs = 1;
  for (let i = 1; i < filled.length; i++) if (filled[i] !== filled[i - 1]! + 1) runs++;
  assert.ok(runs <= 128, `${runs} runs`);
});

test('diff layers: chain of depth 9 over a base, each child sees its parents, collapse gives the same memory', () => {
  const pages = 512; // 2 MiB
  const size = pages * PAGE;
  const basePath = join(dir, 'base-diff.bin');
  const expect = new Uint8Array(size);
  for (let p = 0; p < pages; p += 2) fillPage(expect, p, p);
  writeFileSync(basePath, expect);
  const baseFd = openSync(basePath, 'r');
  const chain: ReturnType<typeof s.openDiff>[] = [];
  let source = new Uint8Array(s.mapLayered(baseFd, size, []));
  for (let level = 0; level < 9; level++) {
    // The source writes a few pages (some new, some written by earlier levels).
    for (let k = 0; k < 20; k++) {
      const p = (level * 37 + k * 13) % pages;
      source[p * PAGE + 8] = level + 1;
      source[p * PAGE + 9] = k;
      expect[p * PAGE + 8] = level + 1;
      expect[p * PAGE + 9] = k;
    }
    const priv = s.privatePages(source);
    // (page 0 too, from the previous level's own write)
    assert.ok(priv.length >= 1 && priv.length <= 21, `level ${level}: ${priv.length} private pages`);
    const dfd = s.createTempDiffFile(dir);
    s.writeDiff(dfd, source, s.fillGaps(priv, 8), false);
    const layer = s.openDiff(dfd, `branch ${level}`);
    closeSync(dfd);
    assert.ok(layer.runCount <= 8);
    chain.push(layer);
    const child = new Uint8Array(s.mapLayered(baseFd, size, chain));
    assert.ok(Buffer.compare(Buffer.from(child), Buffer.from(expect)) === 0, `level ${level}: child equals its source`);
    assert.is(s.pageCounts(child).private, 0, 'a fresh child owns no pages');
    child[5] = 99; // the child's write is its own
    assert.is(source[5], expect[5]);
    assert.equal(s.privatePages(child), [0]);
    source = child;
    source[5] = expect[5]!;
  }
  const cfd = s.createTempDiffFile(dir);
  s.collapseDiffs(chain, cfd);
  const collapsed = s.openDiff(cfd, 'collapsed');
  closeSync(cfd);
  const union = new Set(chain.flatMap((l) => s.diffPages(l)));
  assert.is(collapsed.pageCount, union.size);
  const flat = new Uint8Array(s.mapLayered(baseFd, size, [collapsed]));
  // `source` is the last child with page 0 restored: equal to `expect` except
  // for pages the last child wrote after its diff; compare the collapsed
  // mapping with the 9-layer mapping instead.
  const deep = new Uint8Array(s.mapLayered(baseFd, size, chain));
  assert.ok(Buffer.compare(Buffer.from(flat), Buffer.from(deep)) === 0, 'collapsed chain maps the same memory');
  closeSync(baseFd);
});

test('diff layers: a corrupt or truncated diff file is refused', () => {
  const pages = 16;
  const mem = new Uint8Array(pages * PAGE);
  for (let p = 0; p < pages; p++) fillPage(mem, p, p);
  const path = join(dir, 'diff.bin');
  const fd = openSync(path, 'w+');
  s.writeDiff(fd, mem, [1, 2, 7]);
  closeSync(fd);
  const good = readFileSync(path);
  const open = () => {
    const f = openSync(path, 'r');
    try {
      return s.openDiff(f, 'branch b');
    } finally {
      closeSync(f);
    }
  };
  assert.is(open().pageCount, 3);
  // header, index and data each checked
  for (const [off, what] of [
    [12, /header fails its checksum/],
    [PAGE, /index fails its checksum/],
    [fstatSync(openSync(path, 'r')).size - 1, /data fails its checksum/],
  ] as const) {
    const bad = Buffer.from(good);
    bad[off]! ^= 1;
    writeFileSync(path, bad);
    throwsCorrupt(open, what);
  }
  // A RAM size no VM may have (over 1 TiB), its header checksum made right: refused before a
  // collapse would allocate per page of it.
  const huge = Buffer.from(good);
  huge.writeBigUInt64LE(1n << 41n, 16);
  huge.writeUInt32LE(s.crc32c(huge.subarray(0, 64)), 64);
  writeFileSync(path, huge);
  throwsCorrupt(open, /^branch b is corrupt: diff layer has a bad page or RAM size/);
  writeFileSync(path, good.subarray(0, good.length - PAGE));
  throwsCorrupt(open, /^branch b is corrupt: diff layer is truncated/);
  writeFileSync(path, good);
  assert.is(open().runCount, 2);
});

test.after(() => rmSync(dir, { recursive: true, force: true }));
test.run();
