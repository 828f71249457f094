// The distribution's kernel: found through the host's apt sources, downloaded
// once into the store's cache, unpacked (vmlinuz + modules). Used for guest
// images and for the KVM lab's outer machine alike.
import { existsSync, mkdirSync, readdirSync } from 'node:fs';
import { join } from 'node:path';
import { UserError } from '../host/errors.ts';
import { runTool } from '../host/util/exec.ts';
import { cacheRoot } from './cache.ts';

export interface DistroKernel {
  /** e.g. 6.1.0-57-amd64 */
  release: string;
  /** package version, e.g. 6.1.192-3 */
  version: string;
  vmlinuz: string;
  /** lib/modules/<release> inside the unpacked package */
  modulesDir: string;
}

const APT_HINT = 'check the host apt sources (/etc/apt/sources.list.d) and run: apt-get update';

/** Name of the versioned kernel package that linux-image-amd64 points at. */
function resolveKernelPackage(): string {
  const deps = runTool('apt-cache', ['depends', 'linux-image-amd64'], { hint: APT_HINT }).stdout;
  const m = /Depends: (linux-image-[0-9][^\s]*)/.exec(deps);
  if (!m?.[1]) throw new UserError('apt does not know linux-image-amd64', APT_HINT);
  return m[1];
}

/**
 * Returns the unpacked distribution kernel, downloading it through apt on first
 * use. A later call works offline from the cache.
 */
export function distroKernel(): DistroKernel {
  const cache = join(cacheRoot(), 'kernel');
  mkdirSync(cache, { recursive: true });
  let pkg: string | undefined;
  try {
    pkg = resolveKernelPackage();
  } catch (e) {
    // Offline or no lists: fall back to whatever is cached.
    const cached = readdirSync(cache).filter((f) => f.startsWith('linux-image-') && f.endsWith('.deb'));
    if (cached.length === 0) throw e;
    pkg = cached.sort().at(-1)!.split('_')[0]!;
  }
  let deb = readdirSync(cache).find((f) => f.startsWith(`${pkg}_`) && f.endsWith('.deb'));
  if (!deb) {
    runTool('apt-get', ['download', pkg], { cwd: cache, hint: APT_HINT });
    deb = readdirSync(cache).find((f) => f.startsWith(`${pkg}_`) && f.endsWith('.deb'));
    if (!deb) throw new UserError(`apt-get download ${pkg} produced no .deb`, APT_HINT);
  }
  const version = deb.split('_')[1] ?? 'unknown';
  const release = pkg.replace(/^linux-image-/, '');
  const root = join(cache, `${pkg}_${version}`);
  const vmlinuz = join(root, 'boot', `vmlinuz-${release}`);
  if (!existsSync(vmlinuz)) {
    const tmp = `${root}.tmp`;
    runTool('rm', ['-rf', tmp]);
    runTool('dpkg-deb', ['-x', join(cache, deb), tmp]);
    runTool('mv', ['-T', tmp, root]);
  }
  return { release, version, vmlinuz, modulesDir: join(root, 'lib', 'modules', release) };
}
