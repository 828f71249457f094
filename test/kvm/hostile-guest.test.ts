// A guest that misbehaves on purpose, with a tiny guest (test/kvm/tiny-guest.ts):
// it ends, or is contained in, its own VM; the host process is not flooded.
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { type NativeVmEvent, nativeVmClass } from '../../host/engine/kvm/native-vm.ts';
import { deviceFlapperElf, FLAP_ROUNDS } from './tiny-guest.ts';

const dir = mkdtempSync(join(tmpdir(), 'forkling-hostile-'));
const Vm = nativeVmClass();

test('a guest that fails a virtio device again and again gets a few reports, not one event per failure', async () => {
  const kernel = join(dir, 'flapper.elf');
  writeFileSync(kernel, deviceFlapperElf());
  const events: NativeVmEvent[] = [];
  let done: () => void = () => {};
  const finished = new Promise<void>((r) => {
    done = r;
  });
  const vm = new Vm({ kernel, cmdline: '', memoryMiB: 64, vcpus: 1, vsockPath: join(dir, 'v.sock') }, (evs) => {
    events.push(...evs);
    // The guest prints "D" after its last round (or the VM stopped: the assertions say why).
    if (evs.some((e) => (e.type === 'console' && e.lines.some((l) => l.trim() === 'D')) || e.type === 'stopped')) done();
  });
  try {
    vm.start();
    await finished;
    const stopped = events.find((e) => e.type === 'stopped');
    assert.is(stopped, undefined, `the VM goes on: ${JSON.stringify(stopped)}`);
    const errors = events.filter((e) => e.type === 'device-error');
    assert.ok(FLAP_ROUNDS > 100);
    assert.is(errors.length, 9, `${errors.length} device-error events for ${FLAP_ROUNDS} failures`);
    assert.ok(errors.every((e) => e.device === 'virtio-vsock'));
    assert.match(errors[0]!.message, /virtio queue 0 has an invalid size or layout/);
    assert.match(errors[8]!.message, /further failures are not reported/);
  } finally {
    vm.kill();
  }
});

test.after(() => rmSync(dir, { recursive: true, force: true }));
test.run();
