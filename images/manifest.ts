// manifest.json of an image: what is in it and how to boot it. Engines read it
// to find the kernel, initramfs and rootfs and the kernel command line needs.
import { UserError } from '../host/errors.ts';

export const MANIFEST_FORMAT = 1;

/** vsock port the agent listens on; the image asks for it on the kernel command line. */
export const AGENT_VSOCK_PORT = 1024;

export interface FileDigest {
  size: number;
  sha256: string;
}

export interface ImageManifest {
  format: typeof MANIFEST_FORMAT;
  name: string;
  /** ISO 8601 */
  createdAt: string;
  buildSeconds: number;
  packages: {
    /** what was asked for besides the essential set: python3, python3-msgpack and the extras */
    requested: string[];
    extras: string[];
    /** everything installed, from the tree's dpkg database */
    installed: { name: string; version: string; arch: string }[];
  };
  kernel: {
    /** file name in the image directory */
    file: 'vmlinuz';
    format: 'bzImage' | 'vmlinux';
    /** e.g. 6.1.0-57-amd64, null when a --kernel file does not say */
    release: string | null;
    /** package version (distro) or the kernel's own version string (--kernel) */
    version: string | null;
    /** 'distro:<package>=<version>' or 'file:<absolute path>' */
    source: string;
    sha256: string;
    size: number;
  };
  /** modules the agent loads with finit_module, in order; [] when the kernel builds everything in (--kernel) */
  modules: { name: string; path: string; depends: string[]; size: number }[];
  /** requested modules the kernel builds in */
  builtinModules: string[];
  modulesNote?: string;
  /** what the kernel command line must contain for this image; the VMM adds its own (console, ...) */
  cmdline: string[];
  /** the agent (/init) and its helper modules (absolute guest path -> sha256) */
  agent: { path: '/init'; version: string | null; sha256: string; helpers: Record<string, string> };
  initramfs: {
    file: string;
    compression: 'zstd' | 'gzip';
    /** sha256 of the uncompressed cpio: a digest of the whole tree */
    cpioSha256: string;
    cpioBytes: number;
    entries: number;
  };
  /** the unpacked tree (the process engine's root), relative to the image directory */
  rootfs: { dir: 'rootfs'; bytes: number; entries: number };
  sizes: { compressed: number; unpacked: number; kernel: number };
  /** every file of the image directory except manifest.json and rootfs/ */
  files: Record<string, FileDigest>;
  /** mtime given to files written during the build (newest packaged file's mtime) */
  sourceDateEpoch: number;
}

const isObj = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);

/** Parses manifest.json, checking the fields engines rely on. */
export function parseManifest(text: string, where: string): ImageManifest {
  let m: unknown;
  try {
    m = JSON.parse(text);
  } catch (e) {
    throw new UserError(`${where} is not valid JSON: ${(e as Error).message}`, 'rebuild the image with `forkling image build`');
  }
  const bad = (what: string): never => {
    throw new UserError(`${where} is damaged or from another version (${what})`, 'rebuild the image with `forkling image build`');
  };
  if (!isObj(m)) return bad('not an object');
  if (m.format !== MANIFEST_FORMAT) bad(`format ${String(m.format)}, expected ${MANIFEST_FORMAT}`);
  if (typeof m.name !== 'string') bad('name');
  if (!isObj(m.kernel) || typeof m.kernel.sha256 !== 'string') bad('kernel');
  if (!isObj(m.initramfs) || typeof m.initramfs.file !== 'string' || !/^initramfs\.cpio\.(zst|gz)$/.test(m.initramfs.file)) bad('initramfs');
  if (!Array.isArray(m.modules) || !Array.isArray(m.cmdline)) bad('modules/cmdline');
  if (!isObj(m.files)) bad('files');
  return m as unknown as ImageManifest;
}
