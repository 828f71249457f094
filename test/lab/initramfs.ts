// The lab's initramfs: static busybox, /init (init.sh) and the kernel modules
// for KVM (AMD SVM, which QEMU's TCG emulates), virtio 9p and overlayfs, taken
// from the same distribution kernel package. Cached under <repo>/.lab/ by a
// key over all inputs; per-run settings go into a small second archive that is
// appended (the kernel unpacks concatenated archives in order).
import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { gzipSync } from 'node:zlib';
import { UserError } from '../../host/errors.ts';
import { writeFileAtomic } from '../../host/store.ts';
import { type CpioMember, cpioArchive } from '../../images/cpio.ts';
import type { DistroKernel } from '../../images/kernel.ts';
import { resolveModules } from '../../images/modules.ts';

const HERE = dirname(fileURLToPath(import.meta.url));
/** Bump when the layout of the archive changes in a way the inputs do not show. */
const FORMAT = 1;
/** What the lab needs; their dependencies are found from each module's own modinfo. */
const WANTED = ['kvm_amd', 'virtio_pci', '9pnet_virtio', '9p', 'overlay'];

/** Path of static busybox; a dynamic one cannot run in the bare initramfs. */
function findBusybox(): string {
  const path = process.env.FORKLING_LAB_BUSYBOX || '/bin/busybox';
  if (!existsSync(path)) throw new UserError(`${path} not found: the KVM lab needs a static busybox`, 'install it with: apt-get install busybox-static');
  const b = readFileSync(path);
  if (b.readUInt32BE(0) !== 0x7f454c46) throw new UserError(`${path} is not an ELF binary`, 'install it with: apt-get install busybox-static');
  const phoff = Number(b.readBigUInt64LE(0x20));
  const phentsize = b.readUInt16LE(0x36);
  const phnum = b.readUInt16LE(0x38);
  for (let i = 0; i < phnum; i++) {
    if (b.readUInt32LE(phoff + i * phentsize) === 3 /* PT_INTERP */) {
      throw new UserError(`${path} is dynamically linked; the KVM lab needs a static busybox`, 'install it with: apt-get install busybox-static');
    }
  }
  return path;
}

export interface LabInitramfs {
  path: string;
  cached: boolean;
  modules: string[];
}

/** Builds (or reuses) the base initramfs for this kernel; returns its path. */
export function baseInitramfs(labDir: string, kernel: DistroKernel): LabInitramfs {
  const busybox = findBusybox();
  const init = readFileSync(join(HERE, 'init.sh'));
  const bb = readFileSync(busybox);
  const h = createHash('sha256');
  h.update(`format ${FORMAT}\nkernel ${kernel.release} ${kernel.version}\nwanted ${WANTED.join(',')}\n`);
  h.update(createHash('sha256').update(bb).digest()).update(init);
  const key = h.digest('hex').slice(0, 16);
  const path = join(labDir, `initramfs-${key}.cpio.gz`);
  const listPath = `${path}.modules`;
  if (existsSync(path) && existsSync(listPath) && statSync(path).size > 0) {
    return { path, cached: true, modules: readFileSync(listPath, 'utf8').split('\n').filter(Boolean) };
  }
  const { modules } = resolveModules(kernel.modulesDir, kernel.release, WANTED, `the KVM lab needs ${WANTED.join(', ')} from the distribution kernel`);
  const entries: CpioMember[] = [
    ...['bin', 'sbin', 'dev', 'proc', 'sys', 'tmp', 'host', 'modules'].map((d): CpioMember => ({ kind: 'dir', path: d })),
    // The kernel opens /dev/console for init before devtmpfs is mounted.
    { kind: 'chardev', path: 'dev/console', major: 5, minor: 1 },
    { kind: 'file', path: 'bin/busybox', data: bb, mode: 0o755 },
    { kind: 'symlink', path: 'bin/sh', target: 'busybox' },
    { kind: 'file', path: 'init', data: init, mode: 0o755 },
    { kind: 'file', path: 'modules/order', data: Buffer.from(modules.map((m) => m.name).join('\n') + '\n') },
    ...modules.map((m): CpioMember => ({ kind: 'file', path: `modules/${m.name}.ko`, data: m.ko })),
  ];
  mkdirSync(labDir, { recursive: true });
  for (const f of readdirSync(labDir)) if (f.startsWith('initramfs-')) rmSync(join(labDir, f), { force: true });
  writeFileAtomic(path, gzipSync(cpioArchive(entries), { level: 6 }));
  writeFileAtomic(listPath, modules.map((m) => m.name).join('\n') + '\n');
  return { path, cached: false, modules: modules.map((m) => m.name) };
}

/** Shell-quotes a value for /lab.env (sourced by busybox sh). */
function shq(v: string): string {
  return `'${v.replace(/'/g, `'\\''`)}'`;
}

/** Writes base + a per-run archive holding /lab.env; returns the combined file. */
export function runInitrd(labDir: string, base: string, env: Record<string, string>): string {
  for (const [k, v] of Object.entries(env)) {
    if (!/^[A-Z_][A-Z0-9_]*$/.test(k)) throw new Error(`bad lab env name ${k}`);
    if (v.includes('\0') || v.includes('\n')) throw new UserError(`lab setting ${k} contains a newline or NUL`, 'use a single-line value');
  }
  const text = Object.entries(env)
    .map(([k, v]) => `${k}=${shq(v)}`)
    .join('\n');
  const extra = gzipSync(cpioArchive([{ kind: 'file', path: 'lab.env', data: Buffer.from(`${text}\n`) }]));
  const out = join(labDir, 'run-initrd.img');
  writeFileSync(out, Buffer.concat([readFileSync(base), extra]));
  return out;
}
