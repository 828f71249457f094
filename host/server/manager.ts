// The sandbox manager: owns every sandbox of a `forkling serve` process across
// client connections. It hands out ids, keeps each sandbox's timeout (default
// 5 minutes; set or extend at any time) and kills it when the timeout passes,
// enforces --max-sandboxes and the memory limits before asking the engine for
// more, and kills everything on shutdown. A client that drops does not touch
// its sandboxes: only a timeout, a kill or the sandbox's own end removes one.
import type { SandboxInfo } from '../../protocol/server-ops.ts';
import { MAX_TIMEOUT_MS } from '../../protocol/server-ops.ts';
import type { BootOptions, Engine, ExitInfo, Sandbox } from '../engine/engine.ts';
import { UserError } from '../errors.ts';
import { ServiceError } from './errors.ts';
import { memAvailableBytes } from './meminfo.ts';
import type { ServerMetrics } from './telemetry.ts';

export interface ManagerOptions {
  engine: Engine;
  /** Most live sandboxes at once (pending forks count). */
  maxSandboxes?: number;
  defaultTimeoutMs?: number;
  maxTimeoutMs?: number;
  /** Limit on the summed private memory of all sandboxes (MiB); 0 = none. */
  maxMemoryMiB?: number;
  /** Refuse new sandboxes while the host has less memory available than this (MiB); 0 = never. */
  minFreeMiB?: number;
  /** How often the private memory of the sandboxes is sampled. */
  memorySampleMs?: number;
  metrics?: ServerMetrics;
  log?: (line: string) => void;
}

export type EndReason = 'timeout' | 'killed' | 'shutdown' | ExitInfo['reason'];

interface Entry {
  sb: Sandbox;
  template: string | null;
  parent: string | null;
  createdAt: number;
  timeoutMs: number;
  expiresAt: number;
  timer: NodeJS.Timeout;
  privateKiB: number;
  /** Set once a kill started: the sandbox takes no new requests. */
  ending: EndReason | null;
}

const ENDED_KEEP = 4096;

export class SandboxManager {
  readonly engine: Engine;
  readonly maxSandboxes: number;
  readonly defaultTimeoutMs: number;
  readonly maxTimeoutMs: number;
  readonly maxMemoryMiB: number;
  readonly minFreeMiB: number;
  private readonly entries = new Map<string, Entry>();
  /** Recently ended ids with why, so a late request hears "ended (timeout)" rather than "no such sandbox". */
  private readonly ended = new Map<string, string>();
  private readonly endListeners = new Set<(id: string, reason: string) => void>();
  private pending = 0;
  private draining = false;
  private sampler: NodeJS.Timeout | null = null;
  private sampling = false;
  private readonly metrics: ServerMetrics | undefined;
  private readonly log: (line: string) => void;

  constructor(opts: ManagerOptions) {
    this.engine = opts.engine;
    this.maxSandboxes = opts.maxSandboxes ?? 100;
    this.defaultTimeoutMs = opts.defaultTimeoutMs ?? 5 * 60 * 1000;
    this.maxTimeoutMs = Math.min(opts.maxTimeoutMs ?? 24 * 3600 * 1000, MAX_TIMEOUT_MS);
    this.maxMemoryMiB = opts.maxMemoryMiB ?? 0;
    this.minFreeMiB = opts.minFreeMiB ?? 0;
    this.metrics = opts.metrics;
    this.log = opts.log ?? (() => {});
    const every = opts.memorySampleMs ?? 2000;
    if (every > 0) {
      this.sampler = setInterval(() => void this.sampleMemory(), every);
      this.sampler.unref();
    }
  }

  get size(): number {
    return this.entries.size;
  }

  /** Sandboxes asked of the engine and not ready yet. */
  get starting(): number {
    return this.pending;
  }

  get isDraining(): boolean {
    return this.draining;
  }

  /** Sum of the last sampled private memory of all sandboxes, KiB. */
  get privateKiB(): number {
    let sum = 0;
    for (const e of this.entries.values()) sum += e.privateKiB;
    return sum;
  }

  onEnd(fn: (id: string, reason: string) => void): () => void {
    this.endListeners.add(fn);
    return () => this.endListeners.delete(fn);
  }

  async create(template: string, timeoutMs?: number): Promise<SandboxInfo> {
    const [info] = await this.spawn('create', template, 1, timeoutMs, () => this.engine.fork(template, 1));
    return info as SandboxInfo;
  }

  /** Cold-boots an image (no template involved). */
  async boot(image: string, opts: { memoryMiB?: number; vcpus?: number; timeoutMs?: number } = {}): Promise<SandboxInfo> {
    const bootOpts: BootOptions = { image };
    if (opts.memoryMiB !== undefined) bootOpts.memoryMiB = opts.memoryMiB;
    if (opts.vcpus !== undefined) bootOpts.vcpus = opts.vcpus;
    const [info] = await this.spawn('boot', null, 1, opts.timeoutMs, async () => [await this.engine.boot(bootOpts)]);
    return info as SandboxInfo;
  }

  fork(template: string, n: number, timeoutMs?: number): Promise<SandboxInfo[]> {
    return this.spawn('fork', template, n, timeoutMs, () => this.engine.fork(template, n));
  }

  branch(sourceId: string, n: number, timeoutMs?: number): Promise<SandboxInfo[]> {
    const src = this.entry(sourceId);
    return this.spawn('branch', src.template, n, timeoutMs, () => this.engine.branch(src.sb, n), sourceId);
  }

  list(): SandboxInfo[] {
    return [...this.entries].map(([id, e]) => this.info(id, e));
  }

  /** The live sandbox, or a not_found / sandbox_ended error naming it. */
  sandbox(id: string): Sandbox {
    return this.entry(id).sb;
  }

  get(id: string): SandboxInfo {
    return this.info(id, this.entry(id));
  }

  setTimeout(id: string, timeoutMs: number): SandboxInfo {
    const e = this.entry(id);
    this.checkTimeout(timeoutMs);
    clearTimeout(e.timer);
    e.timeoutMs = timeoutMs;
    e.expiresAt = Date.now() + timeoutMs;
    e.timer = this.arm(id, timeoutMs);
    return this.info(id, e);
  }

  async stats(id: string): Promise<{ privateKiB: number; counters: Record<string, number> }> {
    const e = this.entry(id);
    const s = await e.sb.stats();
    e.privateKiB = s.privateKiB;
    return { privateKiB: s.privateKiB, counters: s.counters };
  }

  /** Kills a sandbox. False when it had already ended; not_found when it never existed. */
  async kill(id: string, reason: EndReason = 'killed'): Promise<boolean> {
    const e = this.entries.get(id);
    if (!e) {
      if (this.ended.has(id)) return false;
      throw new ServiceError('not_found', `no sandbox ${JSON.stringify(id)}`);
    }
    if (e.ending) {
      await e.sb.exited;
      return false;
    }
    e.ending = reason;
    this.forget(id, e, reason);
    try {
      await e.sb.kill();
    } catch (err) {
      this.log(`kill ${id}: ${err instanceof Error ? err.message : String(err)}`);
    }
    return true;
  }

  /** From now on no new sandboxes (shutdown has begun); the live ones go on until close(). */
  beginDrain(): void {
    this.draining = true;
  }

  /** Stops taking sandboxes, kills every one, closes the engine. */
  async close(): Promise<void> {
    this.draining = true;
    if (this.sampler) clearInterval(this.sampler);
    this.sampler = null;
    await Promise.all([...this.entries.keys()].map((id) => this.kill(id, 'shutdown')));
    await this.engine.close();
  }

  // ------------------------------------------------------------------ internals

  private async spawn(
    kind: 'create' | 'fork' | 'branch' | 'boot',
    template: string | null,
    n: number,
    timeoutMs: number | undefined,
    make: () => Promise<Sandbox[]>,
    parent: string | null = null,
  ): Promise<SandboxInfo[]> {
    const timeout = timeoutMs ?? this.defaultTimeoutMs;
    this.checkTimeout(timeout);
    await this.admit(n); // (counts the n as pending)
    const t0 = performance.now();
    let made: Sandbox[];
    try {
      made = await make();
    } catch (err) {
      throw engineError(err);
    } finally {
      this.pending -= n;
    }
    this.metrics?.spawnLatency.observe({ kind }, (performance.now() - t0) / 1000);
    if (this.draining) {
      await Promise.allSettled(made.map((sb) => sb.kill()));
      throw new ServiceError('shutting_down', 'the server is shutting down');
    }
    this.metrics?.created.inc({ kind }, made.length);
    if (kind === 'branch') this.metrics?.branches.inc();
    else this.metrics?.forks.inc();
    return made.map((sb) => this.adopt(sb, template, parent, timeout));
  }

  private adopt(sb: Sandbox, template: string | null, parent: string | null, timeoutMs: number): SandboxInfo {
    const now = Date.now();
    const e: Entry = {
      sb,
      template,
      parent,
      createdAt: now,
      timeoutMs,
      expiresAt: now + timeoutMs,
      timer: this.arm(sb.id, timeoutMs),
      privateKiB: 0,
      ending: null,
    };
    this.entries.set(sb.id, e);
    sb.exited.then(
      (x) => this.onExit(sb.id, e, x),
      () => this.onExit(sb.id, e, { reason: 'crashed' }),
    );
    return this.info(sb.id, e);
  }

  private onExit(id: string, e: Entry, x: ExitInfo): void {
    if (this.entries.get(id) !== e) return; // already forgotten by kill()
    const reason = x.message ? `${x.reason}: ${x.message}` : x.reason;
    this.log(`sandbox ${id} ended (${reason})`);
    this.forget(id, e, x.reason, reason);
  }

  private forget(id: string, e: Entry, reason: EndReason, detail: string = reason): void {
    clearTimeout(e.timer);
    this.entries.delete(id);
    this.ended.set(id, detail);
    if (this.ended.size > ENDED_KEEP) {
      const oldest = this.ended.keys().next();
      if (!oldest.done) this.ended.delete(oldest.value);
    }
    this.metrics?.ended.inc({ reason });
    for (const fn of this.endListeners) fn(id, detail);
  }

  private arm(id: string, ms: number): NodeJS.Timeout {
    return setTimeout(() => {
      this.log(`sandbox ${id} timed out`);
      void this.kill(id, 'timeout').catch((e: Error) => this.log(`sandbox ${id}: ending it after its timeout failed: ${e.message}`));
    }, ms);
  }

  private entry(id: string): Entry {
    const e = this.entries.get(id);
    if (e && !e.ending) return e;
    const why = e?.ending ?? this.ended.get(id);
    if (why) throw new ServiceError('sandbox_ended', `sandbox ${id} has ended (${why})`);
    throw new ServiceError('not_found', `no sandbox ${JSON.stringify(id)} on this server`);
  }

  private info(id: string, e: Entry): SandboxInfo {
    return {
      id,
      template: e.template,
      parent: e.parent,
      engine: e.sb.engine,
      state: 'running',
      createdAt: e.createdAt,
      expiresAt: e.expiresAt,
      timeoutMs: e.timeoutMs,
    };
  }

  private checkTimeout(ms: number): void {
    if (!Number.isInteger(ms) || ms < 1 || ms > this.maxTimeoutMs) {
      throw new ServiceError(
        'bad_request',
        `timeoutMs must be an integer from 1 to ${this.maxTimeoutMs} (this server's --max-timeout-ms), got ${ms}`,
      );
    }
  }

  /**
   * Refuses what would break a limit; else counts the n as pending, before
   * any await (concurrent requests all passed the check and then all counted:
   * five forks of 2 with --max-sandboxes 2 made 10). The caller uncounts them.
   */
  private async admit(n: number): Promise<void> {
    if (this.draining) throw new ServiceError('shutting_down', 'the server is shutting down');
    const live = this.entries.size + this.pending;
    if (live + n > this.maxSandboxes) {
      throw new ServiceError(
        'unavailable',
        `cannot start ${n} more sandbox${n === 1 ? '' : 'es'}: ${live} of at most ${this.maxSandboxes} are in use (kill some, or start the server with a higher --max-sandboxes)`,
      );
    }
    if (this.maxMemoryMiB > 0) {
      const usedMiB = this.privateKiB / 1024;
      if (usedMiB >= this.maxMemoryMiB) {
        throw new ServiceError(
          'unavailable',
          `sandboxes use ${usedMiB.toFixed(0)} MiB of private memory, the limit is ${this.maxMemoryMiB} MiB (kill some, or raise --max-memory-mib)`,
        );
      }
    }
    this.pending += n;
    if (this.minFreeMiB <= 0) return;
    try {
      const bytes = await memAvailableBytes();
      const avail = bytes === null ? null : bytes / 1048576;
      if (avail !== null && avail < this.minFreeMiB) {
        throw new ServiceError(
          'unavailable',
          `the host has ${avail.toFixed(0)} MiB of memory available, below the --min-free-mib floor of ${this.minFreeMiB} MiB (kill some sandboxes)`,
        );
      }
    } catch (e) {
      this.pending -= n;
      throw e;
    }
  }

  private async sampleMemory(): Promise<void> {
    if (this.sampling) return;
    this.sampling = true;
    try {
      await Promise.all(
        [...this.entries.values()].map(async (e) => {
          try {
            e.privateKiB = (await e.sb.stats()).privateKiB;
          } catch {
            // ended between listing and sampling: its entry goes away on exit
          }
        }),
      );
    } finally {
      this.sampling = false;
    }
  }
}

/** An engine failure as the client sees it: people-facing errors keep their text. */
function engineError(err: unknown): ServiceError {
  if (err instanceof ServiceError) return err;
  if (err instanceof UserError) {
    const text = err.hint ? `${err.message} (${err.hint})` : err.message;
    const code = /not found|no such|does not exist|unknown template/i.test(err.message) ? 'not_found' : 'bad_request';
    return new ServiceError(code, text);
  }
  const msg = err instanceof Error ? err.message : String(err);
  return new ServiceError('internal', `the engine failed: ${msg}`);
}
