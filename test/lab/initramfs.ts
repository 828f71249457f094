// The lab's initramfs: static busybox, /init (init.sh) and the kernel modules
// for KVM (AMD SVM, which QEMU's TCG emulates), virtio 9p and overlayfs, taken
// from the same distribution kernel package. Cached under <repo>/.lab/ by a
// key over all inputs; per-run settings go into a small second archive that is
// appended (the kernel unpacks concatenated archives in order).
import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { basename, dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { gzipSync } from 'node:zlib';
import { UserError } from '../../host/errors.ts';
import { writeFileAtomic } from '../../host/store.ts';
import type { DistroKernel } from '../../images/kernel.ts';
import { type CpioEntry, cpioArchive } from './cpio.ts';

const HERE = dirname(fileURLToPath(import.meta.url));
/** Bump when the layout of the archive changes in a way the inputs do not show. */
const FORMAT = 1;
/** What the lab needs; their dependencies are found from each module's own modinfo. */
const WANTED = ['kvm_amd', 'virtio_pci', '9pnet_virtio', '9p', 'overlay'];

const normal = (name: string) => name.replace(/-/g, '_');

interface Module {
  name: string;
  path: string;
}

/** Index of the package's modules by normalised name (kvm-amd -> kvm_amd). */
function indexModules(modulesDir: string): Map<string, Module> {
  const index = new Map<string, Module>();
  const walk = (dir: string) => {
    for (const e of readdirSync(dir, { withFileTypes: true })) {
      const p = join(dir, e.name);
      if (e.isDirectory()) walk(p);
      else {
        const m = /^(.*)\.ko(\.xz|\.zst|\.gz)?$/.exec(e.name);
        if (m?.[1]) index.set(normal(m[1]), { name: normal(m[1]), path: p });
      }
    }
  };
  walk(join(modulesDir, 'kernel'));
  return index;
}

function builtinModules(modulesDir: string): Set<string> {
  const f = join(modulesDir, 'modules.builtin');
  if (!existsSync(f)) return new Set();
  return new Set(
    readFileSync(f, 'utf8')
      .split('\n')
      .filter(Boolean)
      .map((l) => normal(basename(l).replace(/\.ko.*$/, ''))),
  );
}

/** The module file's contents, decompressed (busybox insmod takes plain .ko only). */
function moduleBytes(path: string): Buffer {
  if (path.endsWith('.ko')) return readFileSync(path);
  const tool = path.endsWith('.xz') ? 'xz' : path.endsWith('.zst') ? 'zstd' : 'gzip';
  const pkg = tool === 'xz' ? 'xz-utils' : tool;
  const r = spawnSync(tool, ['-dc', path], { maxBuffer: 256 * 1024 * 1024 });
  if (r.error || r.status !== 0 || !r.stdout?.length) {
    throw new UserError(`cannot decompress ${path} with ${tool}`, `install it with: apt-get install ${pkg}`);
  }
  return r.stdout;
}

/** `depends=` from the module's .modinfo section. */
function moduleDepends(bytes: Buffer): string[] {
  const i = bytes.indexOf('\0depends=');
  if (i < 0) return [];
  const start = i + '\0depends='.length;
  const end = bytes.indexOf(0, start);
  return bytes
    .subarray(start, end)
    .toString('latin1')
    .split(',')
    .filter(Boolean)
    .map(normal);
}

/** Modules in load order (dependencies first), with their decompressed bytes. */
export function resolveModules(modulesDir: string, wanted = WANTED): { name: string; bytes: Buffer }[] {
  const index = indexModules(modulesDir);
  const builtin = builtinModules(modulesDir);
  const order: { name: string; bytes: Buffer }[] = [];
  const state = new Map<string, 'visiting' | 'done'>();
  const visit = (name: string, chain: string[]) => {
    if (state.get(name) === 'done' || builtin.has(name)) return;
    if (state.get(name) === 'visiting') throw new Error(`module dependency cycle: ${[...chain, name].join(' -> ')}`);
    const mod = index.get(name);
    if (!mod) throw new UserError(`kernel module ${name} is not in ${modulesDir}`, `the lab needs ${chain.concat(name).join(' -> ')}`);
    state.set(name, 'visiting');
    const bytes = moduleBytes(mod.path);
    for (const dep of moduleDepends(bytes)) visit(dep, [...chain, name]);
    state.set(name, 'done');
    order.push({ name, bytes });
  };
  for (const w of wanted) visit(normal(w), []);
  return order;
}

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
  const modules = resolveModules(kernel.modulesDir);
  const entries: CpioEntry[] = [
    ...['bin', 'sbin', 'dev', 'proc', 'sys', 'tmp', 'host', 'modules'].map((d): CpioEntry => ({ kind: 'dir', path: d })),
    // The kernel opens /dev/console for init before devtmpfs is mounted.
    { kind: 'chardev', path: 'dev/console', major: 5, minor: 1 },
    { kind: 'file', path: 'bin/busybox', data: bb, mode: 0o755 },
    { kind: 'symlink', path: 'bin/sh', target: 'busybox' },
    { kind: 'file', path: 'init', data: init, mode: 0o755 },
    { kind: 'file', path: 'modules/order', data: Buffer.from(modules.map((m) => m.name).join('\n') + '\n') },
    ...modules.map((m): CpioEntry => ({ kind: 'file', path: `modules/${m.name}.ko`, data: m.bytes })),
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
