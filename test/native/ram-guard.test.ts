// The SIGBUS guard for guest RAM (native/src/vmm/ram_guard.h): guest RAM
// mapped from a file that is cut short reads as zeros and says it is lost,
// where it would end the host process; other mappings and other SIGBUS are
// left as they were.
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync, truncateSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { vmmTesting } from './virtio-driver.ts';

const PAGE = 4096;
const dir = mkdtempSync(join(tmpdir(), 'forkling-ramguard-'));
const Probe = vmmTesting().GuestRamProbe;

/** A file of `pages` pages, page i filled with the byte i + 1. */
function pagesFile(name: string, pages: number): string {
  const path = join(dir, name);
  const b = Buffer.alloc(pages * PAGE);
  for (let i = 0; i < pages; i++) b.fill(i + 1, i * PAGE, (i + 1) * PAGE);
  writeFileSync(path, b);
  return path;
}

const filled = (b: Uint8Array | null, v: number) => b !== null && b.length > 0 && b.every((x) => x === v);

test('guest RAM whose file is cut short reads as zeros and is lost; the process and other RAM go on', () => {
  const cut = new Probe(pagesFile('cut.bin', 4), 4 * PAGE);
  const other = new Probe(pagesFile('other.bin', 4), 4 * PAGE);
  try {
    assert.ok(filled(cut.read(2 * PAGE, 64), 3));
    assert.is(cut.lost(), false);
    truncateSync(join(dir, 'cut.bin'), PAGE);
    // Page 3 was never read: past the file's end now, a SIGBUS without the guard.
    assert.ok(filled(cut.read(3 * PAGE, 64), 0), 'a page past the end reads as zeros');
    assert.is(cut.lost(), true);
    assert.ok(filled(cut.read(0, PAGE), 0), 'the whole RAM reads as zeros once lost');
    assert.is(other.lost(), false, 'another VM is untouched');
    assert.ok(filled(other.read(3 * PAGE, 64), 4));
  } finally {
    cut.close();
    other.close();
  }
  // A slot used again starts not lost.
  const next = new Probe(pagesFile('next.bin', 2), 2 * PAGE);
  assert.is(next.lost(), false);
  assert.ok(filled(next.read(PAGE, 16), 2));
  next.close();
});

test('a SIGBUS outside guest RAM still ends the process (the guard passes it on)', () => {
  // A child process: guard installed (a probe), then a plain mapping of a cut file read past its end.
  const script = `
    import { native } from './host/native.ts';
    import { vmmTesting } from './test/native/virtio-driver.ts';
    import { openSync, truncateSync, writeFileSync } from 'node:fs';
    const path = ${JSON.stringify(join(dir, 'plain.bin'))};
    writeFileSync(path, Buffer.alloc(${4 * PAGE}, 7));
    const probe = new (vmmTesting().GuestRamProbe)(${JSON.stringify(pagesFile('guarded.bin', 2))}, ${2 * PAGE});
    const n = native();
    const fd = openSync(path, 'r');
    const m = n.mmap(${4 * PAGE}, n.constants.PROT_READ | n.constants.PROT_WRITE, n.constants.MAP_PRIVATE, fd, 0);
    truncateSync(path, ${PAGE});
    console.log('reading');
    console.log('read', new Uint8Array(m.buffer)[${3 * PAGE}], probe.lost());
  `;
  const r = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script], { encoding: 'utf8', timeout: 60_000 });
  assert.is(r.error, undefined, String(r.error));
  assert.match(r.stdout, /reading/, `the child did not get as far as the read: ${r.stderr}`);
  assert.not.match(r.stdout, /read \d/, 'the read past the end of an unguarded mapping returned');
  assert.is(r.signal, 'SIGBUS', `exit ${r.status} ${r.signal}: ${r.stderr.slice(-400)}`);
});

test('a SIGBUS sent by kill() still ends the process with the guard in place', () => {
  const script = `
    import { vmmTesting } from './test/native/virtio-driver.ts';
    const probe = new (vmmTesting().GuestRamProbe)(${JSON.stringify(pagesFile('sent.bin', 1))}, ${PAGE});
    console.log('guarded', probe.lost());
    process.kill(process.pid, 'SIGBUS');
    setTimeout(() => console.log('still alive'), 2000);
  `;
  const r = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script], { encoding: 'utf8', timeout: 60_000 });
  assert.match(r.stdout, /guarded false/, r.stderr);
  assert.not.match(r.stdout, /still alive/);
  assert.is(r.signal, 'SIGBUS', `exit ${r.status} ${r.signal}: ${r.stderr.slice(-400)}`);
});

test.after(() => rmSync(dir, { recursive: true, force: true }));
test.run();
