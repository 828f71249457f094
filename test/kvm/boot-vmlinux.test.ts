// The KVM engine boots a plain vmlinux ELF (needs /dev/kvm: runs in the lab).
// The default image's bzImage is unpacked into its vmlinux (images/vmlinux.ts,
// no network needed), which boots through the engine's own path with the
// image's initramfs and command line (KvmBootOptions.kernel); the agent
// answers hello and eval, and the image's modules (vsock) load into it. The
// guest's copy of boot_params (/sys/kernel/boot_params) shows which loader
// path ran: the VMM's synthetic header for the ELF, the file's own setup
// header for the bzImage, which still boots as before with the same command line.
import { readFileSync } from 'node:fs';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { KvmEngine } from '../../host/engine/kvm/engine.ts';
import type { KvmSandbox } from '../../host/engine/kvm/vm.ts';
import { ensureImage, type ImageInfo } from '../../host/images.ts';
import { inspectKernelFile } from '../../images/kernelfile.ts';
import { type ExtractedVmlinux, vmlinuxFromBzImage } from '../../images/vmlinux.ts';
import { labProgress, labRetry as labRetryWith } from './lab-flake.ts';

const engine = new KvmEngine();
const progress = labProgress('boot-vmlinux.test');
// The lab runs the guest under nested virtualization in TCG: boots take tens of seconds.
const READY_MS = Number(process.env.FORKLING_TEST_BOOT_TIMEOUT_MS ?? 180_000);
const figures: string[] = [];
const labRetry = <T>(tag: string, fn: () => Promise<T>) => labRetryWith(tag, fn, progress);

interface Seen {
  release: string;
  cmdline: string;
  modules: string;
  /** /sys/kernel/boot_params/version, e.g. 0x020f */
  version: string;
  /** the setup header part of the guest's boot_params (0x1f1..0x268) */
  header: Buffer;
}

/** Boots the default image with `kernel` (undefined: the image's bzImage); checks hello and eval; powers off. */
async function bootAndLook(tag: string, kernel?: string): Promise<Seen> {
  progress(`${tag}: booting`);
  const sb: KvmSandbox = await labRetry(tag, () =>
    engine.boot({ image: 'default', kernel, readyTimeoutMs: READY_MS, onConsole: (l) => progress(`${tag} console: ${l}`) }),
  );
  try {
    figures.push(`${tag}: boot-to-ready ${(sb.timings.readyAt - sb.timings.startedAt).toFixed(0)} ms`);
    const h = await sb.agent.hello();
    assert.is(h.pid, 1, 'the agent is PID 1');
    assert.ok(h.ops.includes('eval'));
    assert.is((await sb.agent.eval('6 * 7')).value, 42);
    const r = await sb.agent.eval(
      [
        'import platform',
        'def rd(p, mode="r"):',
        '    with open(p, mode) as f:',
        '        return f.read()',
        '(platform.release(), rd("/proc/cmdline").strip(), rd("/proc/modules"), rd("/sys/kernel/boot_params/version").strip(),',
        ' rd("/sys/kernel/boot_params/data", "rb")[0x1f1:0x268])',
      ].join('\n'),
    );
    assert.is(r.exception, undefined, r.exception?.traceback);
    // The guest is not trusted: check the shape before using it.
    const v = r.value as unknown[];
    assert.ok(Array.isArray(v) && v.length === 5, JSON.stringify(r.value)?.slice(0, 200));
    const [release, cmdline, modules, version, header] = v;
    assert.type(release, 'string');
    assert.type(cmdline, 'string');
    assert.type(modules, 'string');
    assert.type(version, 'string');
    assert.instance(header, Uint8Array);
    const exit = await sb.shutdown(60_000);
    assert.is(exit.reason, 'poweroff', JSON.stringify(exit));
    return { release, cmdline, modules, version, header: Buffer.from(header as Uint8Array) } as Seen;
  } finally {
    await sb.kill().catch(() => {});
  }
}

let image: ImageInfo | undefined;
let vmlinux: ExtractedVmlinux | undefined;
let fromElf: Seen | undefined;

test('the vmlinux inside the default image bzImage boots to an agent that answers hello and eval', async () => {
  image = await ensureImage('default');
  progress(`extracting the vmlinux from ${image.kernel}`);
  const t0 = performance.now();
  vmlinux = await vmlinuxFromBzImage(image.kernel);
  figures.push(`vmlinux ${vmlinux.cached ? 'from the cache' : `extracted (${vmlinux.compression})`} in ${(performance.now() - t0).toFixed(0)} ms: ${vmlinux.path}`);
  const info = inspectKernelFile(vmlinux.path);
  assert.is(info.format, 'vmlinux', 'an ELF, not the bzImage again');
  assert.is(info.release, image.manifest.kernel.release);

  fromElf = await bootAndLook('vmlinux', vmlinux.path);
  assert.is(fromElf.release, image.manifest.kernel.release);
  assert.match(fromElf.cmdline, /acpi=off/);
  assert.match(fromElf.cmdline, /rdinit=\/init/);
  assert.match(fromElf.modules, /^vmw_vsock_virtio_transport /m, "the image's modules loaded into this kernel");
  // The ELF path: no setup header in the file, the loader's synthetic one (protocol field 0).
  assert.is(fromElf.version, '0x0000');
  assert.is(fromElf.header[0x210 - 0x1f1], 0xff, 'type_of_loader: undefined loader');
  assert.is(fromElf.header.readUInt16LE(0x1fe - 0x1f1), 0xaa55);
  assert.is(fromElf.header.toString('latin1', 0x202 - 0x1f1, 0x206 - 0x1f1), 'HdrS');
});

test('the bzImage still boots as before, with the same command line and its own setup header', async () => {
  image ??= await ensureImage('default');
  const bz = readFileSync(image.kernel);
  const fromBz = await bootAndLook('bzImage');
  assert.is(fromBz.release, image.manifest.kernel.release);
  assert.is(fromBz.version, `0x${bz.readUInt16LE(0x206).toString(16).padStart(4, '0')}`, "the bzImage's boot protocol");
  assert.is(fromBz.header[0], bz[0x1f1], "setup_sects copied from the bzImage's header");
  if (fromElf) assert.is(fromBz.cmdline, fromElf.cmdline, 'one command line for both kernels');
});

test.after(async () => {
  await engine.close();
  console.log(`figures (measured ${process.env.FORKLING_IN_LAB ? 'in the KVM lab: QEMU TCG, nested SVM; times are not meaningful' : 'on this host'}):`);
  for (const f of figures) console.log(`  ${f}`);
});

test.run();
