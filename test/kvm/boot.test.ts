// The KVM engine end to end (needs /dev/kvm: runs in the lab): the default
// image boots in this process to a ready agent over virtio-vsock; eval, exec
// and a 64 MiB file round trip work; two VMs run at once without seeing each
// other; a guest kernel panic is reported with its console lines and the
// host goes on to boot another VM; a clean poweroff frees the VM's memory.
// Prints boot-to-ready times and memory figures (meaningless times in the lab).
import { createHash, randomBytes } from 'node:crypto';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { runCommand } from '../../host/cli/run.ts';
import { kernelCmdline } from '../../host/engine/kvm/cmdline.ts';
import { KvmEngine } from '../../host/engine/kvm/engine.ts';
import { KvmSandbox } from '../../host/engine/kvm/vm.ts';
import { loadImage } from '../../host/images.ts';
import { labProgress, labRetry as labRetryWith, labTest } from './lab-flake.ts';

const engine = new KvmEngine();
const progress = labProgress('boot.test');
// The lab runs the guest under nested virtualization in TCG: boots take tens of seconds.
const READY_MS = Number(process.env.FORKLING_TEST_BOOT_TIMEOUT_MS ?? 180_000);
const rssMiB = () => process.memoryUsage().rss / 2 ** 20;
const figures: string[] = [];
// Tests share VMs; each boots the ones it needs if an earlier test could not
// (one failure is reported once, not as a cascade).
let a: KvmSandbox | undefined;
let b: KvmSandbox | undefined;
let c: KvmSandbox | undefined;
let bVm: KvmSandbox | undefined;
const vmA = async () => {
  if (!a) {
    const sb = await boot('vm A');
    a = sb;
    // In the lab a running guest may triple-fault (lab-flake.ts): the test runs again with a new A.
    void sb.exited.then((e) => {
      if (a === sb && e.reason === 'triple-fault') a = undefined;
    });
  }
  return a;
};
/** A test of VM A: in the lab it runs again (with a new A) after A triple-faulted while it ran. */
const testOfA = (name: string, fn: () => Promise<void>) => labTest(name, fn, ['running']);
const rss0 = rssMiB();
const labRetry = <T>(tag: string, fn: () => Promise<T>) => labRetryWith(tag, fn, progress);

async function boot(tag: string, vcpus = 1, initOnFree = true): Promise<KvmSandbox> {
  const before = rssMiB();
  progress(`${tag}: booting`);
  const sb = await labRetry(tag, () =>
    engine.boot({
      image: 'default',
      readyTimeoutMs: READY_MS,
      vcpus,
      initOnFree,
      onConsole: (l) => progress(`${tag} console: ${l}`),
    }),
  );
  progress(`${tag}: ready; counters ${JSON.stringify((await sb.stats()).counters)}`);
  const st = await sb.stats();
  figures.push(
    `${tag}: boot-to-ready ${(sb.timings.readyAt - sb.timings.startedAt).toFixed(0)} ms; guest pages ${(st.counters.guestPrivateKiB! / 1024).toFixed(1)} MiB (+ host side ${((st.privateKiB - st.counters.guestPrivateKiB!) / 1024).toFixed(1)} MiB); host RSS +${(rssMiB() - before).toFixed(1)} MiB`,
  );
  return sb;
}

testOfA('boots the default image; the agent answers hello, eval and exec over vsock', async () => {
  progress('boots the default image; the agent answers hello, eval and exec over vsock');
  const a = await vmA();
  const info = await a.agent.info();
  assert.ok(info, 'info answered');
  const r = await a.agent.eval('import platform; (1 + 2, platform.release())');
  assert.is(r.exception, undefined, r.exception?.traceback);
  assert.equal((r.value as unknown[])[0], 3);
  assert.match(String((r.value as unknown[])[1]), /amd64/);
  // PID 1's fds 1 and 2 are the console; in an eval, pipes the agent reads: a subprocess's output is the eval's
  const sub = await a.agent.eval('import os\nos.system("echo from a subprocess; echo to stderr >&2")\nNone');
  assert.equal([sub.stdout, sub.stderr], ['from a subprocess\n', 'to stderr\n']);
  const x = await a.agent.exec('echo hello from $(cat /proc/sys/kernel/hostname); cat /proc/cmdline; ls /dev/hwrng');
  assert.is(x.exitCode, 0, new TextDecoder().decode(x.stderr));
  const out = new TextDecoder().decode(x.stdout);
  assert.match(out, /^hello from /);
  assert.match(out, /acpi=off/);
  assert.match(out, /\/dev\/hwrng/, 'virtio-rng is there');
  const st = await a.stats();
  assert.ok((st.counters.exits_io ?? 0) > 0 && (st.counters.exits_mmio ?? 0) > 0, 'exits are counted');
  assert.ok((st.counters.vsock_rx_packets ?? 0) > 0, 'vsock carried packets');
});

testOfA('a 64 MiB file round-trips through the files API with the same sha256', async () => {
  const a = await vmA();
  progress('a 64 MiB file round-trips through the files API with the same sha256');
  const small = randomBytes(2 ** 20);
  const s0 = performance.now();
  await a.agent.writeFile('/tmp/small.bin', small);
  const back1 = await a.agent.readFile('/tmp/small.bin');
  assert.ok(Buffer.from(back1).equals(small), '1 MiB round trip');
  progress(`1 MiB round trip in ${(performance.now() - s0).toFixed(0)} ms`);
  const data = randomBytes(64 * 2 ** 20);
  const want = createHash('sha256').update(data).digest('hex');
  const t0 = performance.now();
  await a.agent.writeFile('/tmp/big.bin', data);
  const t1 = performance.now();
  progress(`64 MiB written in ${(t1 - t0).toFixed(0)} ms`);
  const inGuest = await a.agent.exec(['sha256sum', '/tmp/big.bin']);
  assert.is(new TextDecoder().decode(inGuest.stdout).split(' ')[0], want, 'sha256 inside the guest');
  const back = await a.agent.readFile('/tmp/big.bin');
  const t2 = performance.now();
  assert.is(back.length, data.length);
  assert.is(createHash('sha256').update(back).digest('hex'), want);
  figures.push(`64 MiB over vsock: write ${(t1 - t0).toFixed(0)} ms, read ${(t2 - t1).toFixed(0)} ms (incl. sha256sum)`);
  await a.agent.remove('/tmp/big.bin');
});

testOfA('two VMs run at once and do not see each other; a VM with 2 vCPUs sees both', async () => {
  const a = await vmA();
  progress('two VMs run at once and do not see each other; a VM with 2 vCPUs sees both');
  const b = await boot('vm B (2 vCPUs, while A runs)', 2);
  bVm = b;
  assert.is((await b.agent.eval('import os; os.cpu_count()')).value, 2, 'the MP table brought up the second CPU');
  await a.agent.writeFile('/tmp/only-in-a', new TextEncoder().encode('a'));
  const [ra, rb] = await Promise.all([
    a.agent.eval('import os; os.path.exists("/tmp/only-in-a")'),
    b.agent.eval('import os; os.path.exists("/tmp/only-in-a")'),
  ]);
  assert.is(ra.value, true);
  assert.is(rb.value, false, 'B does not see A files');
  assert.is.not(a.vsockPath, b.vsockPath);
});

testOfA('a guest kernel panic is reported with its console lines; the host goes on', async () => {
  const a = await vmA();
  b = bVm ?? (await boot('vm B'));
  progress('a guest kernel panic is reported with its console lines; the host goes on');
  const panicked = b.exited;
  b.agent.exec('echo c > /proc/sysrq-trigger').catch(() => {});
  const exit = await panicked;
  assert.is(exit.reason, 'crashed', JSON.stringify(exit));
  assert.ok(
    b.console.some((l) => l.includes('Kernel panic') || l.includes('sysrq')),
    `console shows the panic:\n${b.console.slice(-10).join('\n')}`,
  );
  const r = await a.agent.eval('21 * 2');
  assert.is(r.value, 42, 'the other VM runs on');
  // C also shows what init_on_free=1 costs: without it the guest touches far fewer pages.
  c = await boot('vm C (after the panic; no init_on_free)', 1, false);
  assert.is((await c.agent.eval('6 * 7')).value, 42);
});

testOfA('a clean poweroff ends each VM and frees its memory', async () => {
  const a = await vmA();
  c ??= await boot('vm C');
  progress('a clean poweroff ends each VM and frees its memory');
  const during = rssMiB();
  const guest = ((await a.stats()).counters.guestPrivateKiB! + (await c.stats()).counters.guestPrivateKiB!) / 1024;
  // A: the engine's path (agent reboots, reboot=k resets through the i8042).
  // C: the agent's plain poweroff (no ACPI: every CPU halts with interrupts
  // off after "reboot: Power down"; the VMM confirms that state).
  c.agent.shutdown(false).catch(() => {});
  const [ea, ec] = await Promise.all([a.shutdown(60_000), c.exited]);
  assert.is(ea.reason, 'poweroff', JSON.stringify(ea));
  assert.is(ec.reason, 'poweroff', JSON.stringify(ec));
  const after = rssMiB();
  figures.push(
    `poweroff of A and C: guest pages ${guest.toFixed(1)} MiB; host RSS ${during.toFixed(1)} -> ${after.toFixed(1)} MiB (start ${rss0.toFixed(1)} MiB)`,
  );
  // The guests' pages were in this process's RSS (shared memfd mappings); they must be gone.
  assert.ok(during - after > guest * 0.8, `RSS fell by ${(during - after).toFixed(1)} MiB, guests held ${guest.toFixed(1)} MiB`);
  let ended = '';
  try {
    await a.stats();
  } catch (e) {
    ended = (e as Error).message;
  }
  assert.match(ended, /has ended/);
});

test('a guest that panics before its agent is ready gives an error with its last console lines', async () => {
  progress('a guest that panics before its agent is ready gives an error with its last console lines');
  const image = loadImage('default');
  let msg = '';
  let t0 = 0; // (of the last attempt)
  try {
    // No initramfs: the kernel finds no root and panics; panic=-1 resets at once.
    await labRetryWith(
      'vm without initramfs',
      () => {
        t0 = performance.now();
        return KvmSandbox.boot({ kernel: image.kernel, cmdline: kernelCmdline([]), memoryMiB: 256, vcpus: 1, readyTimeoutMs: READY_MS });
      },
      progress,
      2,
      ['early', 'silent'],
    );
  } catch (e) {
    msg = (e as Error).message;
  }
  assert.match(msg, /stopped before its agent was ready \(crashed/, msg);
  assert.match(msg, /Kernel panic - not syncing/);
  assert.ok(performance.now() - t0 < READY_MS, 'within the time limit');
});

test('forkling run --eval --json: boot, run, clean poweroff, one JSON result', async () => {
  progress('forkling run --eval --json');
  const lines: string[] = [];
  const log = console.log;
  console.log = (...args: unknown[]) => {
    lines.push(args.join(' '));
  };
  let code: number;
  try {
    // (In the lab a boot may triple-fault: the command runs again, loudly, as boots here do.)
    code = await labRetryWith(
      'forkling run',
      () => {
        lines.length = 0;
        return runCommand(['default', '--eval', 'import os; (6 * 7, os.cpu_count())', '--vcpus', '2', '--memory', '384', '--json', '--timeout', String(Math.round(READY_MS / 1000))]);
      },
      progress,
      3,
      ['early', 'silent', 'running'],
    );
  } finally {
    console.log = log;
  }
  assert.is(code, 0, lines.join('\n'));
  const out = JSON.parse(lines.at(-1) ?? '{}') as { engine: string; result: { value: unknown }; exit: { reason: string }; bootMs: number };
  assert.is(out.engine, 'kvm');
  assert.equal(out.result.value, [42, 2]);
  assert.is(out.exit.reason, 'poweroff');
  figures.push(`forkling run (384 MiB, 2 vCPUs): boot-to-ready ${out.bootMs} ms`);
});

test.after(async () => {
  await engine.close();
  console.log(`figures (measured ${process.env.FORKLING_IN_LAB ? 'in the KVM lab: QEMU TCG, nested SVM; times are not meaningful' : 'on this host'}):`);
  for (const f of figures) console.log(`  ${f}`);
});

test.run();
