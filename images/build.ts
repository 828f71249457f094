// `forkling image build`: packages from the host's apt sources -> a pruned root
// tree with the agent as /init and the guest's kernel modules -> a reproducible
// compressed newc initramfs, next to the kernel and manifest.json, written to
// the store atomically (a failed build leaves no half image and the old one intact).
import { spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import { chmodSync, copyFileSync, createReadStream, createWriteStream, existsSync, mkdirSync, readdirSync, readFileSync, readlinkSync, rmSync, writeFileSync } from 'node:fs';
import { basename, dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createGzip } from 'node:zlib';
import { checkName, UserError } from '../host/errors.ts';
import { buildDirAtomic, storePath } from '../host/store.ts';
import { runTool } from '../host/util/exec.ts';
import { aptContext, checkPackages, listsDate, PACKAGE_RE, refreshLists } from './apt.ts';
import { cacheRoot } from './cache.ts';
import { writeCpio } from './cpio.ts';
import { distroKernel } from './kernel.ts';
import { inspectKernelFile } from './kernelfile.ts';
import { withLock } from './lock.ts';
import { AGENT_VSOCK_PORT, type FileDigest, type ImageManifest, MANIFEST_FORMAT, parseManifest } from './manifest.ts';
import { GUEST_MODULES, installModules, type ModuleSelection, modulesListText } from './modules.ts';
import { installedPackages, installTree, normalizeTimes, prune } from './rootfs.ts';

/** What every image holds besides the essential set. */
export const BASE_PACKAGES = ['python3', 'python3-msgpack'];

export const DEFAULT_AGENT = fileURLToPath(new URL('../guest-agent/forkling_agent.py', import.meta.url));

export type BuildStep = 'resolve' | 'download' | 'unpack' | 'modules' | 'pack' | 'note';

export interface BuildOptions {
  name: string;
  /** more Debian packages, e.g. python3-numpy */
  extras?: string[];
  /** a bzImage or vmlinux to use instead of the distribution's kernel */
  kernel?: string;
  /** the agent to install as /init (default guest-agent/forkling_agent.py) */
  agentPath?: string;
  onProgress?: (step: BuildStep, detail: string) => void;
  /** build only when the image does not exist yet or holds another agent than `agentPath` (checked under the build lock) */
  ifMissing?: boolean;
}

export const imagesDir = (): string => storePath('images');
export const imageDir = (name: string): string => join(imagesDir(), checkName('image', name));

export const sha256File = (path: string): Promise<FileDigest> =>
  new Promise((res, rej) => {
    const h = createHash('sha256');
    let size = 0;
    createReadStream(path)
      .on('data', (d) => {
        h.update(d);
        size += d.length;
      })
      .on('error', rej)
      .on('end', () => res({ size, sha256: h.digest('hex') }));
  });

export interface AgentFiles {
  text: Buffer;
  /** from `__version__ = "x"` or `AGENT_VERSION = "x"` */
  version: string | null;
  sha256: string;
  /** the other guest-agent/*.py modules (forkling_zygote.py ...): name -> contents */
  helpers: Map<string, Buffer>;
}

/** Where the agent's helper modules go: on every python3's path, wherever /init is run from. */
export const AGENT_HELPERS_DIR = 'usr/lib/python3/dist-packages';

/** The agent file, the version it declares and its sibling modules. */
export function readAgent(path: string): AgentFiles {
  if (!existsSync(path)) {
    throw new UserError(`the guest agent ${path} does not exist`, 'the image needs guest-agent/forkling_agent.py from the forkling source tree');
  }
  const text = readFileSync(path);
  const m = /^(?:__version__|AGENT_VERSION)\s*=\s*['"]([^'"]+)['"]/m.exec(text.toString('utf8'));
  const helpers = new Map<string, Buffer>();
  const dir = dirname(path);
  for (const f of readdirSync(dir).sort()) {
    if (f.endsWith('.py') && f !== basename(path) && !f.startsWith('test_')) helpers.set(f, readFileSync(join(dir, f)));
  }
  return { text, version: m?.[1] ?? null, sha256: createHash('sha256').update(text).digest('hex'), helpers };
}

/** The manifest's record of an agent: its sha256 and its helpers' (guest path -> sha256). */
function agentDigest(agent: AgentFiles): Pick<ImageManifest['agent'], 'sha256' | 'helpers'> {
  return {
    sha256: agent.sha256,
    helpers: Object.fromEntries([...agent.helpers].map(([f, d]) => [`/${AGENT_HELPERS_DIR}/${f}`, createHash('sha256').update(d).digest('hex')])),
  };
}

/** True when the image was built with another agent than `agent` (an older guest-agent/, say). */
export function agentDiffers(m: ImageManifest, agent: AgentFiles): boolean {
  const want = agentDigest(agent);
  const same = (a: Record<string, string>, b: Record<string, string>) =>
    Object.keys(a).length === Object.keys(b).length && Object.entries(a).every(([k, v]) => b[k] === v);
  return m.agent.sha256 !== want.sha256 || !same(m.agent.helpers, want.helpers);
}

interface KernelChoice {
  vmlinuz: string;
  format: 'bzImage' | 'vmlinux';
  release: string | null;
  version: string | null;
  source: string;
  /** lib/modules/<release> of the distro kernel; null for --kernel (built-in drivers assumed) */
  modulesDir: string | null;
  compression: 'zstd' | 'gzip';
}

function chooseKernel(path: string | undefined): KernelChoice {
  if (path) {
    const abs = resolve(path);
    const info = inspectKernelFile(abs);
    // gzip: every kernel with initramfs support can read it (zstd needs CONFIG_RD_ZSTD, which we cannot check here).
    return { vmlinuz: abs, format: info.format, release: info.release, version: info.version, source: `file:${abs}`, modulesDir: null, compression: 'gzip' };
  }
  const k = distroKernel();
  const info = inspectKernelFile(k.vmlinuz);
  const config = join(k.modulesDir, '..', '..', '..', 'boot', `config-${k.release}`);
  const zstd = existsSync(config) && /^CONFIG_RD_ZSTD=y$/m.test(readFileSync(config, 'utf8'));
  return {
    vmlinuz: k.vmlinuz,
    format: info.format,
    release: k.release,
    version: k.version,
    source: `distro:linux-image-${k.release}=${k.version}`,
    modulesDir: k.modulesDir,
    compression: zstd ? 'zstd' : 'gzip',
  };
}

/** Packs `root` into `out` (compressed newc cpio). */
export async function pack(root: string, out: string, compression: 'zstd' | 'gzip'): Promise<{ cpioSha256: string; cpioBytes: number; entries: number; dataBytes: number }> {
  const file = createWriteStream(out);
  const fileDone = new Promise<void>((res, rej) => {
    file.on('finish', () => res());
    file.on('error', rej);
  });
  let input: NodeJS.WritableStream;
  let compressorDone: Promise<void>;
  if (compression === 'zstd') {
    // -T0: threads do not change zstd's output, only its speed. Level 9: within 15% of level 19's size at 1/20 of its time.
    const z = spawn('zstd', ['-q', '-T0', '-9', '-c'], { stdio: ['pipe', 'pipe', 'pipe'] });
    let err = '';
    z.stderr.on('data', (d) => {
      err += d;
    });
    z.stdout.pipe(file);
    input = z.stdin;
    compressorDone = new Promise((res, rej) => {
      z.on('error', (e: NodeJS.ErrnoException) => rej(new UserError(`cannot run zstd: ${e.code ?? e.message}`, 'install zstd: apt-get install zstd')));
      z.on('close', (code) => (code === 0 ? res() : rej(new UserError(`zstd failed (exit ${code}): ${err.trim()}`))));
    });
  } else {
    const g = createGzip({ level: 9 });
    g.pipe(file);
    input = g;
    compressorDone = new Promise((res, rej) => {
      g.on('end', () => res());
      g.on('error', rej);
    });
  }
  const h = createHash('sha256');
  let broken: Error | null = null;
  input.on('error', (e: Error) => {
    broken = e;
  });
  const stats = await writeCpio(root, async (chunk) => {
    if (broken) throw broken;
    h.update(chunk);
    if (!input.write(chunk)) await new Promise<void>((res) => input.once('drain', () => res()));
  });
  input.end();
  await Promise.all([compressorDone, fileDone]);
  return { cpioSha256: h.digest('hex'), cpioBytes: stats.archiveBytes, entries: stats.entries, dataBytes: stats.dataBytes };
}

/** lib/modules/<release> of the tree: under usr/lib when /lib is the merged-/usr symlink. */
function modulesBase(root: string, release: string): string {
  let merged = false;
  try {
    merged = readlinkSync(join(root, 'lib')) === 'usr/lib';
  } catch {}
  return `${merged ? 'usr/lib' : 'lib'}/modules/${release}`;
}

/**
 * Removes what interrupted builds left (we hold the build lock, so no build is
 * running): staging and old directories. A killed mmdebstrap can leave /proc,
 * /sys or /dev/pts mounted inside its tree: those are unmounted first, never
 * recursed into.
 */
function removeStale(dir: string): void {
  if (!existsSync(dir)) return;
  for (const d of readdirSync(dir)) {
    if (!/^\.(staging|old|rm)-/.test(d)) continue;
    const p = join(dir, d);
    const mounts = readFileSync('/proc/self/mounts', 'utf8')
      .split('\n')
      .map((l) => l.split(' ')[1]?.replace(/\\040/g, ' ') ?? '')
      .filter((m) => m === p || m.startsWith(`${p}/`))
      .sort((a, b) => b.length - a.length);
    try {
      for (const m of mounts) runTool('umount', ['-l', m]);
      rmSync(p, { recursive: true, force: true });
    } catch {
      // Left for a later build; it is not an image (its name starts with a dot).
    }
  }
}

const isNoSpace = (e: unknown): boolean => (e as NodeJS.ErrnoException)?.code === 'ENOSPC';

/** Checks everything that needs no network or store change; throws a UserError on bad input. */
function checkInput(o: BuildOptions): { extras: string[]; agent: ReturnType<typeof readAgent> } {
  checkName('image', o.name);
  const extras = [...new Set(o.extras ?? [])];
  for (const p of extras) {
    if (!PACKAGE_RE.test(p)) {
      throw new UserError(`invalid package name ${JSON.stringify(p)}`, 'use a Debian package name such as python3-numpy (optionally name=version)');
    }
  }
  if (o.kernel) inspectKernelFile(resolve(o.kernel));
  if (process.getuid?.() !== 0) {
    // mmdebstrap's unshare mode would work without root but leaves a tree owned by subordinate ids.
    throw new UserError('building an image needs root: dpkg installs the packages into a chroot', 'run the build as root (sudo forkling image build ...)');
  }
  return { extras, agent: readAgent(o.agentPath ?? DEFAULT_AGENT) };
}

/**
 * Builds image `name` into the store and returns its manifest. Bad input
 * (name, package, kernel file, unreachable sources, full disk) throws a
 * UserError and leaves the store's images as they were.
 */
export async function buildImage(o: BuildOptions): Promise<ImageManifest> {
  const started = Date.now();
  const progress = o.onProgress ?? (() => {});
  const { extras, agent } = checkInput(o);
  return withLock(
    join(imagesDir(), '.build.lock'),
    async () => {
      removeStale(imagesDir());
      const existing = join(imageDir(o.name), 'manifest.json');
      if (o.ifMissing && existsSync(existing)) {
        const m = parseManifest(readFileSync(existing, 'utf8'), existing);
        if (!agentDiffers(m, agent)) return m;
        progress('note', `image ${o.name} holds another agent than ${o.agentPath ?? DEFAULT_AGENT}: rebuilding it`);
      }
      progress('resolve', 'refreshing package lists');
      const ctx = aptContext(cacheRoot());
      const { offline } = await refreshLists(ctx, (msg) => progress('note', msg));
      const include = [...BASE_PACKAGES, ...extras.filter((e) => !BASE_PACKAGES.includes(e))];
      checkPackages(ctx, include);
      progress('resolve', o.kernel ? `kernel ${o.kernel}` : 'distribution kernel');
      const kernel = chooseKernel(o.kernel);
      let manifest: ImageManifest | undefined;
      try {
        await buildDirAtomic(imageDir(o.name), async (staging) => {
          const root = join(staging, 'rootfs');
          // Files the build writes are recognized by being newer than this (see normalizeTimes).
          const buildStartSec = Math.floor(Date.now() / 1000) - 1;
          progress('download', offline ? 'from the cache (offline)' : 'packages missing from the cache');
          await installTree(root, {
            ctx,
            include,
            sourceDateEpoch: listsDate(ctx) || buildStartSec,
            onLine: (l) => {
              if (/^I: (extracting|installing)/.test(l)) progress('unpack', l.slice(3).replace(/\.\.\.$/, ''));
            },
          });
          const installed = installedPackages(root);
          prune(root);
          writeFileSync(join(root, 'init'), agent.text);
          chmodSync(join(root, 'init'), 0o755);
          mkdirSync(join(root, AGENT_HELPERS_DIR), { recursive: true });
          for (const [f, data] of agent.helpers) writeFileSync(join(root, AGENT_HELPERS_DIR, f), data, { mode: 0o644 });
          progress('modules', kernel.modulesDir ? `for ${kernel.release}` : 'none: --kernel must build its drivers in');
          let sel: ModuleSelection = { modules: [], builtin: [] };
          if (kernel.modulesDir && kernel.release) {
            sel = installModules(kernel.modulesDir, kernel.release, root, modulesBase(root, kernel.release), GUEST_MODULES);
          }
          mkdirSync(join(root, 'etc', 'forkling'), { recursive: true });
          writeFileSync(join(root, 'etc', 'forkling', 'modules'), modulesListText(sel));
          writeFileSync(join(root, 'etc', 'hostname'), 'forkling\n');
          const epoch = normalizeTimes(root, buildStartSec);
          progress('pack', `${kernel.compression} cpio`);
          const initramfsFile = kernel.compression === 'zstd' ? 'initramfs.cpio.zst' : 'initramfs.cpio.gz';
          const packed = await pack(root, join(staging, initramfsFile), kernel.compression);
          copyFileSync(kernel.vmlinuz, join(staging, 'vmlinuz'));
          const files: Record<string, FileDigest> = {
            vmlinuz: await sha256File(join(staging, 'vmlinuz')),
            [initramfsFile]: await sha256File(join(staging, initramfsFile)),
          };
          manifest = {
            format: MANIFEST_FORMAT,
            name: o.name,
            createdAt: new Date().toISOString(),
            buildSeconds: Math.round((Date.now() - started) / 100) / 10,
            packages: { requested: include, extras, installed },
            kernel: {
              file: 'vmlinuz',
              format: kernel.format,
              release: kernel.release,
              version: kernel.version,
              source: kernel.source,
              sha256: files.vmlinuz!.sha256,
              size: files.vmlinuz!.size,
            },
            modules: sel.modules,
            builtinModules: sel.builtin,
            ...(kernel.modulesDir ? {} : { modulesNote: 'kernel given with --kernel: no modules copied; it must build in virtio, virtio-pci/mmio, vsock and virtio-rng' }),
            cmdline: ['rdinit=/init', `forkling.port=${AGENT_VSOCK_PORT}`],
            agent: {
              path: '/init',
              version: agent.version,
              ...agentDigest(agent),
            },
            initramfs: { file: initramfsFile, compression: kernel.compression, cpioSha256: packed.cpioSha256, cpioBytes: packed.cpioBytes, entries: packed.entries },
            rootfs: { dir: 'rootfs', bytes: packed.dataBytes, entries: packed.entries },
            sizes: { compressed: files[initramfsFile]!.size, unpacked: packed.dataBytes, kernel: files.vmlinuz!.size },
            files,
            sourceDateEpoch: epoch,
          };
          writeFileSync(join(staging, 'manifest.json'), `${JSON.stringify(manifest, null, 2)}\n`);
        });
      } catch (e) {
        if (isNoSpace(e)) {
          throw new UserError(`the disk is full: image ${o.name} did not fit in ${imagesDir()}`, 'free space (or point FORKLING_HOME at a larger disk) and build again; the old image is unchanged');
        }
        throw e;
      }
      return manifest!;
    },
    () => progress('note', 'waiting for another image build to finish'),
  );
}
