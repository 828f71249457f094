// The few kernel modules a guest needs, with their dependencies, in load order.
// Dependencies come from each module's own .modinfo section ("depends="), the
// same data depmod turns into modules.dep; reading it directly works on a
// kernel package that was unpacked without running depmod (no modules.dep)
// and needs no kmod on the host.
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { gunzipSync } from 'node:zlib';
import { UserError } from '../host/errors.ts';

/**
 * Modules the guest loads, in this order (each after its dependencies):
 * virtio core and ring, both transports (the VMM picks PCI or MMIO; the other
 * finds no device and stays idle), the vsock stack the agent talks over, and
 * virtio-rng so the guest has entropy at once.
 */
export const GUEST_MODULES = [
  'virtio',
  'virtio_ring',
  'virtio_pci_modern_dev',
  'virtio_pci_legacy_dev',
  'virtio_pci',
  'virtio_mmio',
  'vsock',
  'vmw_vsock_virtio_transport_common',
  'vmw_vsock_virtio_transport',
  'rng_core',
  'virtio_rng',
] as const;

export interface GuestModule {
  /** module name as the kernel knows it (underscores) */
  name: string;
  /** path of the uncompressed .ko relative to the guest's / */
  path: string;
  /** names of the modules it depends on */
  depends: string[];
  size: number;
}

export interface ModuleSelection {
  /** modular ones, dependencies first */
  modules: GuestModule[];
  /** requested ones the kernel has built in */
  builtin: string[];
}

const norm = (n: string): string => n.replace(/-/g, '_');
const KO_RE = /\.ko(\.xz|\.zst|\.gz)?$/;

/** key=value pairs of an ELF64 module's .modinfo section. */
export function readModinfo(ko: Buffer, what = 'module'): Map<string, string[]> {
  if (ko.length < 64 || ko.readUInt32BE(0) !== 0x7f454c46 || ko[4] !== 2 || ko[5] !== 1) {
    throw new UserError(`${what} is not a 64-bit little-endian ELF file`);
  }
  const shoff = Number(ko.readBigUInt64LE(0x28));
  const shentsize = ko.readUInt16LE(0x3a);
  const shnum = ko.readUInt16LE(0x3c);
  const shstrndx = ko.readUInt16LE(0x3e);
  const sh = (i: number): { name: number; off: number; size: number } => {
    const o = shoff + i * shentsize;
    if (o + 64 > ko.length) throw new UserError(`${what}: section header out of range`);
    return { name: ko.readUInt32LE(o), off: Number(ko.readBigUInt64LE(o + 24)), size: Number(ko.readBigUInt64LE(o + 32)) };
  };
  const strtab = sh(shstrndx);
  const out = new Map<string, string[]>();
  for (let i = 0; i < shnum; i++) {
    const s = sh(i);
    const nameStart = strtab.off + s.name;
    const nameEnd = ko.indexOf(0, nameStart);
    if (ko.toString('latin1', nameStart, nameEnd) !== '.modinfo') continue;
    if (s.off + s.size > ko.length) throw new UserError(`${what}: .modinfo out of range`);
    for (const kv of ko.toString('utf8', s.off, s.off + s.size).split('\0')) {
      const eq = kv.indexOf('=');
      if (eq <= 0) continue;
      const k = kv.slice(0, eq);
      out.set(k, [...(out.get(k) ?? []), kv.slice(eq + 1)]);
    }
    return out;
  }
  throw new UserError(`${what} has no .modinfo section`);
}

function decompress(file: string): Buffer {
  if (file.endsWith('.ko')) return readFileSync(file);
  if (file.endsWith('.gz')) return gunzipSync(readFileSync(file));
  const tool = file.endsWith('.xz') ? 'xz' : 'zstd';
  try {
    return execFileSync(tool, ['-dc', file], { maxBuffer: 256 * 1024 * 1024 });
  } catch (e) {
    throw new UserError(`cannot decompress ${file} with ${tool}: ${(e as Error).message}`, `install ${tool === 'xz' ? 'xz-utils' : 'zstd'}`);
  }
}

/** normalized module name -> path relative to modulesDir, for every module file. */
function indexModules(modulesDir: string): Map<string, string> {
  const idx = new Map<string, string>();
  const visit = (rel: string): void => {
    for (const d of readdirSync(join(modulesDir, rel), { withFileTypes: true })) {
      const p = rel ? `${rel}/${d.name}` : d.name;
      if (d.isDirectory()) visit(p);
      else if (KO_RE.test(d.name)) idx.set(norm(d.name.replace(KO_RE, '')), p);
    }
  };
  visit('kernel');
  return idx;
}

function builtinModules(modulesDir: string): Set<string> {
  const f = join(modulesDir, 'modules.builtin');
  if (!existsSync(f)) return new Set();
  return new Set(
    readFileSync(f, 'utf8')
      .split('\n')
      .filter(Boolean)
      .map((l) => norm(l.split('/').at(-1)!.replace(KO_RE, ''))),
  );
}

export interface ResolvedModule {
  /** module name as the kernel knows it (underscores) */
  name: string;
  /** path of the packaged (maybe compressed) file relative to modulesDir */
  rel: string;
  /** the module, uncompressed */
  ko: Buffer;
  /** names of the modules it depends on */
  depends: string[];
}

/**
 * The wanted modules and their dependencies from `modulesDir`
 * (lib/modules/<release>), uncompressed, dependencies first, each module's
 * vermagic checked against `release`. `missingHint` is what the user is told
 * when the kernel has a wanted module neither as a file nor built in.
 */
export function resolveModules(
  modulesDir: string,
  release: string,
  wanted: readonly string[] = GUEST_MODULES,
  missingHint = 'use a kernel with virtio, virtio-pci/mmio, vsock and virtio-rng enabled',
): { modules: ResolvedModule[]; builtin: string[] } {
  if (!existsSync(join(modulesDir, 'kernel'))) {
    throw new UserError(`no kernel modules at ${modulesDir}`, 'the kernel package looks incomplete; remove the kernel cache and retry');
  }
  const idx = indexModules(modulesDir);
  const builtin = builtinModules(modulesDir);
  const modules: ResolvedModule[] = [];
  const done = new Set<string>();
  const builtinHit: string[] = [];
  const visit = (name: string, chain: string[]): void => {
    const n = norm(name);
    if (done.has(n)) return;
    if (chain.includes(n)) throw new UserError(`module dependency cycle: ${[...chain, n].join(' -> ')}`);
    const rel = idx.get(n);
    if (!rel) {
      if (builtin.has(n)) {
        done.add(n);
        builtinHit.push(n);
        return;
      }
      throw new UserError(`kernel ${release} has no module ${n}${chain.length ? ` (needed by ${chain.at(-1)})` : ''} and does not build it in`, missingHint);
    }
    const ko = decompress(join(modulesDir, rel));
    const info = readModinfo(ko, rel);
    const vermagic = info.get('vermagic')?.[0] ?? '';
    if (vermagic.split(' ')[0] !== release) {
      throw new UserError(`module ${rel} was built for ${vermagic.split(' ')[0] || 'an unknown kernel'}, not ${release}`);
    }
    const depends = (info.get('depends')?.[0] ?? '').split(',').filter(Boolean).map(norm);
    for (const d of depends) visit(d, [...chain, n]);
    modules.push({ name: n, rel, ko, depends });
    done.add(n);
  };
  for (const w of wanted) {
    // rng_core is only needed when modular; a kernel that builds it in lists it in modules.builtin.
    if (w === 'rng_core' && !idx.has('rng_core') && !builtin.has('rng_core')) continue;
    visit(w, []);
  }
  return { modules, builtin: builtinHit };
}

/**
 * Copies the wanted modules (uncompressed, so finit_module needs no in-kernel
 * decompression) and their dependencies from `modulesDir` (lib/modules/<release>)
 * into `root` at `destRel` (e.g. usr/lib/modules/<release>), checking each
 * module's vermagic against `release`. Returns them in load order.
 */
export function installModules(
  modulesDir: string,
  release: string,
  root: string,
  destRel: string,
  wanted: readonly string[] = GUEST_MODULES,
): ModuleSelection {
  const { modules, builtin } = resolveModules(modulesDir, release, wanted);
  const installed = modules.map(({ name, rel, ko, depends }): GuestModule => {
    const outRel = `${destRel}/${rel.replace(KO_RE, '.ko')}`;
    mkdirSync(dirname(join(root, outRel)), { recursive: true });
    writeFileSync(join(root, outRel), ko, { mode: 0o644 });
    return { name, path: outRel, depends, size: ko.length };
  });
  return { modules: installed, builtin };
}

/** /etc/forkling/modules: one `<path relative to /> [params]` line per module, in load order. */
export function modulesListText(sel: ModuleSelection): string {
  return sel.modules.map((m) => `${m.path}\n`).join('');
}
