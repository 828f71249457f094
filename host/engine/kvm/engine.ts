// The KVM engine: every sandbox is a microVM in this process (native/src/vmm),
// booted from an image's kernel and initramfs; the agent is reached over
// virtio-vsock. Templates, fork and branch are part 2 (issue 6).
import { resolve } from 'node:path';
import { inspectKernelFile } from '../../../images/kernelfile.ts';
import { kvmHostProblem } from '../../doctor/kvm-probe.ts';
import { UserError } from '../../errors.ts';
import { ensureImage, type ImageInfo } from '../../images.ts';
import type { BootOptions, Engine, Sandbox, TemplateInfo, TemplateOptions } from '../engine.ts';
import { type BranchFigures, branchChildren, diffDir } from './branch.ts';
import { kernelCmdline } from './cmdline.ts';
import { startChildren } from './fork.ts';
import { type PatternSource, Patterns } from './pattern.ts';
import { createKvmTemplate, loadTemplate, templateExists, templateIdentity } from './template.ts';
import { defaultReclaimIdleMs, MAX_SLEEP_AFTER_MS } from './sleep-after.ts';
import { KvmSandbox } from './vm.ts';

export const KVM_ISOLATION = 'each sandbox is a KVM virtual machine with its own kernel';
export const DEFAULT_MEMORY_MIB = 512;
export const DEFAULT_READY_TIMEOUT_MS = 120_000;

export interface KvmBootOptions extends BootOptions {
  /** Print every kernel message (drops `quiet`). */
  verbose?: boolean;
  /** Extra kernel arguments. */
  kernelArgs?: string[];
  /** init_on_free=1 (default true): see cmdline.ts for what it costs. */
  initOnFree?: boolean;
  /**
   * Boot this kernel file (a bzImage or an x86-64 vmlinux ELF) instead of the
   * image's own, with the image's initramfs and command line. It must be the
   * release the image's modules are for (e.g. images/vmlinux.ts's vmlinux of
   * the image's bzImage).
   */
  kernel?: string;
}

/** The kernel to boot for `image`: its own, or `override` once checked against the image's modules. */
export function kernelForImage(
  image: Pick<ImageInfo, 'name' | 'kernel'> & { manifest: { kernel: { release: string | null }; modules: readonly unknown[] } },
  override?: string,
): string {
  if (override === undefined) return image.kernel;
  const path = resolve(override);
  const info = inspectKernelFile(path);
  const want = image.manifest.kernel.release;
  // The image's initramfs carries modules (virtio, vsock) for one release only.
  if (want && info.release !== want && image.manifest.modules.length > 0) {
    throw new UserError(
      `kernel ${path} is ${info.release ? `release ${info.release}` : 'of an unknown release'}, but image ${image.name}'s modules are for ${want}`,
      `boot a ${want} kernel with it, or build an image for this one: forkling image build <name> --kernel ${path}`,
    );
  }
  return path;
}

function checkResources(memoryMiB: number, vcpus: number): void {
  if (!Number.isInteger(memoryMiB) || memoryMiB < 64 || memoryMiB > 1 << 20 || memoryMiB % 2 !== 0) {
    throw new UserError(`invalid memory size ${memoryMiB} MiB`, 'use an even number of MiB from 64 (the default is 512)');
  }
  if (!Number.isInteger(vcpus) || vcpus < 1 || vcpus > 64) {
    throw new UserError(`invalid vCPU count ${vcpus}`, 'use 1 to 64 vCPUs');
  }
}

export interface KvmEngineOptions {
  /** How long each fork or branch child may take to answer restore (default CHILD_READY_TIMEOUT_MS; an emulated lab needs minutes for 100). */
  childReadyTimeoutMs?: number;
  /**
   * A forked or branched child gives back the pages it wrote back to the
   * template's bytes once its agent has been idle this long (default
   * defaultReclaimIdleMs, sleep-after.ts; 0: never). See KvmSandbox.reclaim.
   */
  reclaimIdleMs?: number;
  /**
   * Children of a template map what they hold alike from its pattern at
   * their reclaim passes (pattern.ts; default true).
   */
  pattern?: boolean;
  /**
   * After an idle pass, a child in which nothing would run without input (the
   * agent's `quiet`) dozes: its vCPUs wait until input for it comes, so its
   * timer ticks write no pages (KvmSandbox.reclaimWhenIdle; default true).
   */
  doze?: boolean;
  /**
   * A dozing child's private pages are packed: each kept as the bytes in which
   * it differs from its template's (or pattern's) page, and given back, until
   * input wakes it (KvmSandbox.idlePass, native-vm.ts `pack`; default true).
   */
  pack?: boolean;
  /**
   * A packed child with nothing left private is shelved: its KVM VM closed and
   * KVM's state of it kept in the host, so that KVM's kernel structures for it
   * (VM, vCPUs, their threads) go too, until input makes it again (native-vm.ts
   * `pack`; default true).
   */
  shelve?: boolean;
  /** Called with a line about slow first-use work (building the image `default`, creating the template `default`); default: nothing. */
  progress?: (line: string) => void;
}

export class KvmEngine implements Engine {
  readonly name = 'kvm' as const;
  readonly isolation = KVM_ISOLATION;
  private readonly live = new Set<KvmSandbox>();
  private closed = false;

  /** opts.reclaimIdleMs, else the default (checked here: a bad $FORKLING_KVM_SLEEP_AFTER_MS fails at once, not at a fork). */
  private readonly idleMs: number;

  constructor(private readonly opts: KvmEngineOptions = {}) {
    this.idleMs = opts.reclaimIdleMs ?? defaultReclaimIdleMs();
    if (!Number.isSafeInteger(this.idleMs) || this.idleMs < 0 || this.idleMs > MAX_SLEEP_AFTER_MS) {
      throw new UserError(`reclaimIdleMs ${opts.reclaimIdleMs} is not a whole number of ms from 0 to ${MAX_SLEEP_AFTER_MS}`, 'give e.g. 1000, or 0 for never');
    }
    this.patterns = new Patterns({
      // Named as children ('vm-'): a hostname and id of another length are strings of another size
      // in the guest, which moved the agent's allocations and left pages unlike the children's.
      fork: async (snapshot, n) => this.adopt(await startChildren(snapshot, n, { prefix: 'vm', readyTimeoutMs: opts.childReadyTimeoutMs })),
      dir: diffDir,
      doze: opts.doze !== false,
    });
  }

  private checkOpen(): void {
    if (this.closed) throw new Error('the kvm engine is closed');
  }

  async boot(opts: KvmBootOptions): Promise<KvmSandbox> {
    this.checkOpen();
    const memoryMiB = opts.memoryMiB ?? DEFAULT_MEMORY_MIB;
    const vcpus = opts.vcpus ?? 1;
    checkResources(memoryMiB, vcpus);
    const problem = kvmHostProblem();
    if (problem) throw new UserError(problem, 'run `forkling doctor` for this host; use --engine process here, or run the KVM tests in the lab (npm run test:kvm); FORKLING_ALLOW_PVM=1 tries anyway');
    const image = await ensureImage(opts.image, { progress: this.opts.progress });
    // The initramfs is unpacked into RAM (tmpfs, at most half of it) while its
    // compressed copy is still there; below this the guest panics with
    // "Initramfs unpacking failed" (measured: the default image at 256 MiB).
    const { unpacked, compressed } = image.manifest.sizes;
    const minMiB = Math.ceil((2 * (unpacked + compressed)) / 2 ** 20 + 64);
    if (memoryMiB < minMiB) {
      throw new UserError(
        `image ${image.name} needs about ${minMiB} MiB of guest memory (its initramfs unpacks to ${Math.round(unpacked / 2 ** 20)} MiB in RAM); ${memoryMiB} MiB is too little`,
        `use --memory ${Math.ceil(minMiB / 64) * 64} or more`,
      );
    }
    const cmdline = kernelCmdline(image.manifest.cmdline, {
      verbose: opts.verbose,
      initOnFree: opts.initOnFree,
      extra: opts.kernelArgs,
    });
    const sb = await KvmSandbox.boot({
      kernel: kernelForImage(image, opts.kernel),
      initrd: image.initramfs,
      cmdline,
      memoryMiB,
      vcpus,
      onConsole: opts.onConsole,
      readyTimeoutMs: opts.readyTimeoutMs ?? DEFAULT_READY_TIMEOUT_MS,
    });
    return (await this.adopt([sb]))[0]!;
  }

  // Templates, fork and branch (part 2): template.ts, fork.ts, branch.ts.
  /** Figures of the last branch (pause of the source, pages copied), for benchmarks. */
  lastBranch: BranchFigures | null = null;
  private readonly creatingTemplates = new Map<string, Promise<TemplateInfo>>();
  /**
   * Each template as loaded, while its files stay the same (templateIdentity):
   * the children of every fork of it then share one copy of its state (~11
   * KiB) and one descriptor of its memory file, where each fork loaded its
   * own and its children kept it for as long as they lived.
   */
  private readonly loadedTemplates = new Map<string, { identity: string; loaded: ReturnType<typeof loadTemplate> }>();

  /** `boot` tunes the template VM's kernel (its children inherit that kernel as it is). */
  async createTemplate(opts: TemplateOptions & { boot?: Pick<KvmBootOptions, 'initOnFree' | 'kernelArgs'> }): Promise<TemplateInfo> {
    const memoryMiB = opts.memoryMiB ?? DEFAULT_MEMORY_MIB;
    const vcpus = opts.vcpus ?? 1;
    checkResources(memoryMiB, vcpus);
    const problem = kvmHostProblem();
    if (problem) throw new UserError(problem, 'run `forkling doctor` for this host; use --engine process here, or run the KVM tests in the lab (npm run test:kvm); FORKLING_ALLOW_PVM=1 tries anyway');
    const { boot, ...templateOpts } = opts;
    return createKvmTemplate((o) => this.boot({ ...o, ...boot }), { ...templateOpts, memoryMiB, vcpus });
  }

  async prepare(template: string): Promise<void> {
    await this.loaded(template);
  }

  async fork(template: string, n: number): Promise<KvmSandbox[]> {
    this.checkOpen();
    const { info, snapshot } = await this.loaded(template);
    const children = await this.track(await startChildren(snapshot, n, { prefix: 'vm', readyTimeoutMs: this.opts.childReadyTimeoutMs }));
    if (this.idleMs > 0 && this.opts.pattern !== false) this.patterns.attach(template, info.createdAt, snapshot, children, this.idleMs);
    return children;
  }

  /** What the children of each template share through its pattern (pattern.ts). */
  private readonly patterns: Patterns;

  /** The pattern of a template this engine forked from (benchmarks, diagnostics). */
  patternOf(template: string): PatternSource | undefined {
    return this.patterns.of(template);
  }

  /** Sandboxes made by a call that began before close(): killed, not kept; else live. */
  private async adopt<T extends KvmSandbox>(made: T[]): Promise<T[]> {
    if (this.closed) {
      await Promise.all(made.map((s) => s.kill()));
      throw new UserError('the kvm engine was closed while its sandboxes were being made');
    }
    for (const s of made) {
      this.live.add(s);
      void s.exited.then(() => this.live.delete(s));
    }
    return made;
  }

  /** The template, checked as it is loaded (its memory file's checksum once per process: cached); `default` made on first use. */
  private async loaded(template: string): Promise<ReturnType<typeof loadTemplate>> {
    if (!templateExists(template)) {
      if (template !== 'default') loadTemplate(template); // throws "does not exist"
      let p = this.creatingTemplates.get(template);
      if (!p) {
        this.opts.progress?.('forkling: creating template default (first use: image default, no warm-up)');
        p = this.createTemplate({ name: 'default', image: 'default' }).finally(() => this.creatingTemplates.delete(template));
        this.creatingTemplates.set(template, p);
      }
      await p;
    }
    // (read before the files: a template replaced in between is loaded again next time)
    let identity: string;
    try {
      identity = templateIdentity(template);
    } catch {
      this.loadedTemplates.delete(template); // (removed: its memory file is not held open for it)
      return loadTemplate(template); // (gone meanwhile: it says so)
    }
    const hit = this.loadedTemplates.get(template);
    if (hit?.identity === identity) return hit.loaded;
    this.loadedTemplates.delete(template);
    const loaded = loadTemplate(template);
    if (!this.closed) this.loadedTemplates.set(template, { identity, loaded });
    return loaded;
  }

  async branch(source: Sandbox, n: number): Promise<KvmSandbox[]> {
    this.checkOpen();
    if (!(source instanceof KvmSandbox) || !this.live.has(source)) throw new UserError('branch: the source is not a live sandbox of this kvm engine');
    const { children, figures } = await branchChildren(source, n, this.opts.childReadyTimeoutMs);
    this.lastBranch = figures;
    return this.track(children);
  }

  private async track(children: KvmSandbox[]): Promise<KvmSandbox[]> {
    await this.adopt(children);
    for (const c of children) c.reclaimWhenIdle(this.idleMs, { doze: this.opts.doze !== false, pack: this.opts.pack !== false, shelve: this.opts.shelve !== false });
    return children;
  }

  async close(): Promise<void> {
    this.closed = true;
    this.patterns.clear();
    this.loadedTemplates.clear();
    await Promise.all([...this.live].map((s) => s.kill()));
    this.live.clear();
  }
}

export function createKvmEngine(): KvmEngine {
  return new KvmEngine();
}
