// The zero-run squeeze that keeps a shelved VM's KVM state small
// (native/src/vmm/snapshot/zero_runs.h): round trips of bytes shaped like
// that state, and squeezed bytes that would read past their end or expand
// past the limit refused.
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { vmmTesting } from './virtio-driver.ts';

const t = vmmTesting();

function roundTrip(bytes: Buffer): Buffer {
  const squeezed = t.squeezeZeros(bytes);
  const back = t.expandZeros(squeezed, bytes.length);
  assert.ok(back.equals(bytes), `${bytes.length} bytes came back changed`);
  return squeezed;
}

test('zero runs: round trips of empty, all-zero, zero-free and mixed bytes', () => {
  assert.is(roundTrip(Buffer.alloc(0)).length, 0);
  assert.ok(roundTrip(Buffer.alloc(10_000)).length <= 4, 'all zeros: one run');
  const dense = Buffer.alloc(3000, 0x5a);
  assert.ok(roundTrip(dense).length <= 3000 + 4, 'no zeros: the bytes and two numbers');
  for (const n of [1, 2, 3, 4, 5, 7]) {
    roundTrip(Buffer.alloc(n));
    roundTrip(Buffer.from([...Array(n).keys()].map((i) => (i % 2 ? 0 : 9))));
  }
  // Like a vCPU's state: a few words set in a mostly zero area, short zero gaps between bytes.
  const area = Buffer.alloc(12_288);
  let seed = 11;
  const rand = (n: number) => {
    seed = (Math.imul(seed, 1103515245) + 12345) >>> 0; // (32-bit: a product past 2^53 loses its low bits)
    return (seed >>> 8) % n; // (an LCG's low bits cycle fast)
  };
  for (let i = 0; i < 300; i++) area.writeUInt32LE(rand(2 ** 31), rand(area.length / 4) * 4);
  const squeezed = roundTrip(area);
  assert.ok(squeezed.length < area.length / 4, `${squeezed.length} bytes kept of a ${area.length}-byte area with 300 words set`);
  for (let i = 0; i < 200; i++) {
    const b = Buffer.alloc(rand(600));
    for (let k = 0; k < b.length; k++) if (rand(3) === 0) b[k] = 1 + rand(255);
    roundTrip(b);
  }
});

test('zero runs: squeezed bytes it cannot have made are refused, never read past', () => {
  const good = t.squeezeZeros(Buffer.from([0, 0, 0, 0, 0, 7, 8, 9]));
  assert.throws(() => t.expandZeros(good.subarray(0, good.length - 1), 100), /inside a literal/);
  assert.throws(() => t.expandZeros(Buffer.from([0x80]), 100), /inside a number/);
  assert.throws(() => t.expandZeros(Buffer.alloc(11, 0xff), 100), /too long/);
  assert.throws(() => t.expandZeros(good, 7), /past their limit/);
  assert.throws(() => t.expandZeros(Buffer.from([0xff, 0xff, 0xff, 0xff, 0x0f, 0]), 1 << 20), /past their limit/, 'a huge run of zeros');
  assert.is(t.expandZeros(good, 8).length, 8);
  // Tokens each under the limit, together over it: (3 zeros, 2 bytes) twice is 10 bytes.
  const twice = Buffer.from([3, 2, 1, 1, 3, 2, 1, 1]);
  assert.is(t.expandZeros(twice, 10).length, 10);
  assert.throws(() => t.expandZeros(twice, 9), /past their limit/);
  assert.throws(() => t.expandZeros(Buffer.from([0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02, 0]), 100), /too long/, 'a number past 64 bits');
});

test.run();
