// A KVM sandbox: one in-process VM (native Vm) plus its agent connection over
// virtio-vsock. Boot readiness is the agent answering hello: the host keeps
// connecting (the device refuses while the guest has no listener) with a short
// backoff, bounded by the caller's time limit, never a fixed sleep.
import { randomBytes } from 'node:crypto';
import { lstatSync, mkdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { type AgentClient, AgentError, answeredWithin } from '../../agent/client.ts';
import { UserError } from '../../errors.ts';
import type { ExitInfo, Sandbox, SandboxStats } from '../engine.ts';
import { type NativePack, type NativePreparedVm, type NativeSnapshot, type NativeVm, type NativeVmEvent, nativeVmClass } from './native-vm.ts';
import type { PatternSource } from './pattern.ts';
import { connectAgent, VsockConnectError } from './vsock.ts';

export const AGENT_PORT = 1024;
const CONSOLE_KEEP = 200;

export interface KvmBootSpec {
  kernel: string;
  initrd?: string;
  cmdline: string;
  memoryMiB: number;
  vcpus: number;
  onConsole?: (line: string) => void;
  readyTimeoutMs: number;
  /** Restore this snapshot instead of booting the kernel (fork and branch children, fork.ts). */
  restore?: NativeSnapshot;
  /** A VM already created from `restore` off the JS thread (snapshot.prepareVms), made for vsockPathFor(id). */
  prepared?: NativePreparedVm;
}

/** The vsock socket path of sandbox `id` (fork.ts prepares VMs for it before the sandbox exists). */
export function vsockPathFor(id: string): string {
  return join(socketDir(), `${id}.vsock`);
}

/**
 * Where the VMs' vsock sockets live: $XDG_RUNTIME_DIR or the temp dir, private
 * to this user. One found there already must be a real directory of ours that
 * no one else can enter: in a shared /tmp another user could have made it
 * first, and reach every sandbox's agent through it.
 */
export function socketDir(): string {
  const base = process.env.XDG_RUNTIME_DIR || tmpdir();
  const uid = process.getuid?.() ?? 0;
  const dir = join(base, `forkling-${uid}`);
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  const st = lstatSync(dir);
  if (!st.isDirectory() || st.uid !== uid || (st.mode & 0o077) !== 0) {
    throw new UserError(
      `the socket directory ${dir} is not a private directory of this user (${st.isDirectory() ? `owner ${st.uid}, mode ${(st.mode & 0o777).toString(8)}` : 'not a directory'}): others could reach the sandboxes' agents through it`,
      `remove it, or set XDG_RUNTIME_DIR to a directory only you can enter`,
    );
  }
  return dir;
}

/** Why the VM stopped, in ExitInfo terms. A reset we asked for (agent shutdown) is a clean poweroff. */
function exitFromStop(reason: string, message: string, shutdownRequested: boolean): ExitInfo {
  switch (reason) {
    case 'reset':
      return shutdownRequested ? { reason: 'poweroff', message } : { reason: 'reset', message };
    case 'poweroff':
      return { reason: 'poweroff', message };
    case 'panic':
      return { reason: 'crashed', message: `kernel panic: ${message}` };
    case 'triple-fault':
      return { reason: 'triple-fault', message };
    default:
      return { reason: 'internal-error', message: `${reason}: ${message}` };
  }
}

/** The agent's answer to `quiet` takes ~1 ms; a guest that gives none in this long does not doze. */
const QUIET_TIMEOUT_MS = 5000;
/** Private pages looked at per reclaim slice (16 MiB): a few ms of the event loop at most. */
const RECLAIM_SLICE_PAGES = 4096;

/** What one reclaim pass did. */
export interface ReclaimFigures {
  privatePages: number;
  droppedPages: number;
  /** Private pages now mapped from the template's pattern (pattern.ts). */
  patternPages: number;
  totalUs: number;
  longestPauseUs: number;
}

export class KvmSandbox implements Sandbox {
  readonly engine = 'kvm' as const;
  readonly timings = { startedAt: 0, readyAt: 0 };
  readonly vsockPath: string;
  private readonly lines: string[] = [];
  private vm: NativeVm | null;
  private client: AgentClient | null = null;
  private exitInfo: ExitInfo | null = null;
  private resolveExit!: (e: ExitInfo) => void;
  private shutdownRequested = false;
  private readonly stopWaiters = new Set<(e: ExitInfo) => void>();
  readonly exited: Promise<ExitInfo>;
  /** Device errors reported by the VMM (the VM goes on; the device is marked failed). */
  readonly deviceErrors: string[] = [];

  private constructor(
    readonly id: string,
    private readonly spec: KvmBootSpec,
  ) {
    this.exited = new Promise((r) => {
      this.resolveExit = r;
    });
    this.vsockPath = vsockPathFor(id);
    const Vm = nativeVmClass();
    this.timings.startedAt = performance.now();
    try {
      this.vm = new Vm(
        {
          kernel: spec.kernel,
          initrd: spec.initrd,
          cmdline: spec.cmdline,
          memoryMiB: spec.memoryMiB,
          vcpus: spec.vcpus,
          vsockPath: this.vsockPath,
          ...(spec.restore ? { restore: spec.restore } : {}),
          ...(spec.prepared ? { prepared: spec.prepared } : {}),
        },
        (events) => this.onEvents(events),
      );
    } catch (e) {
      rmSync(this.vsockPath, { force: true });
      throw new UserError(`cannot create the VM: ${(e as Error).message}`, 'check the image (forkling image ls) and /dev/kvm');
    }
  }

  /** Boots and resolves once the agent answered hello; on failure the VM is gone and the error has the last console lines. */
  static async boot(spec: KvmBootSpec): Promise<KvmSandbox> {
    const id = `vm-${randomBytes(6).toString('hex')}`;
    const sb = new KvmSandbox(id, spec);
    try {
      sb.vm?.start();
      await sb.waitReady(spec.readyTimeoutMs);
      sb.timings.readyAt = performance.now();
      return sb;
    } catch (e) {
      await sb.kill();
      throw e;
    }
  }

  /** A VM restored from a snapshot, created but not started (fork.ts starts it and restores its agent). */
  static fromSnapshot(spec: KvmBootSpec, id: string): KvmSandbox {
    return new KvmSandbox(id, spec);
  }

  /** The native VM, for snapshot operations; throws once the sandbox has ended. */
  nativeVm(): NativeVm {
    return this.live();
  }

  /** Hands the sandbox its agent connection (fork.ts, once a restored child's restore answered). */
  attachAgent(client: AgentClient): void {
    this.client = client;
    // A device that fails closes the host's connections just after the VM
    // posted why it stops: requests in flight are told that reason.
    client.onStreamEnd(() => this.vm?.flushEvents());
  }

  // Reclaim (restored VMs): pages the guest wrote back to the template's
  // bytes are given back (vmm/snapshot/reclaim.h) once the agent has been
  // idle a while. Each pass reads every private page, so a sandbox that
  // gives back little is looked at less often (up to once a minute).
  private reclaimTimer: NodeJS.Timeout | null = null;
  private reclaimIdleMs = 0;
  private reclaimDelayMs = 0;
  /** The pass running now (one at a time). */
  private reclaiming: Promise<unknown> | null = null;
  /**
   * Reclaim passes so far and the pages they gave back, those with the
   * template's pattern and the pages they mapped from it; why idle passes
   * stopped, if they failed.
   */
  readonly reclaimed: { passes: number; pages: number; patternPasses: number; patternPages: number; failed?: string } = {
    passes: 0,
    pages: 0,
    patternPasses: 0,
    patternPages: 0,
  };

  /** The pattern of this child's template (pattern.ts), set on the VM once built. */
  private pattern: PatternSource | null = null;
  private patternSet = false;

  /** Maps runs that hold the pattern's bytes from it at reclaim passes, once it is built. */
  usePattern(p: PatternSource): void {
    this.pattern = p;
  }

  /**
   * The pattern was built (or came while a pass ran without it): an idle
   * child runs a pass with it now rather than at its next idle time (a pass
   * armed or running sees to it, the latter at its end).
   */
  patternReady(): void {
    if (this.pattern?.layer && !this.patternSet && this.reclaimIdleMs > 0 && !this.reclaimTimer && !this.reclaiming && this.client?.inFlight === 0)
      this.armReclaim(0);
  }

  // Doze (native-vm.ts): after its idle pass, a child in which nothing would
  // run without input waits for input with its vCPUs out of KVM_RUN, so its
  // timer ticks write no pages (~200 KiB within seconds) and cost no CPU.
  private dozeWanted = false;
  private packWanted = false;
  private shelveWanted = false;
  /** The last pack of this child's pages (idlePass), or null. */
  lastPack: NativePack | null = null;
  /** The agent's `quiet` request of an idle pass in flight (its settling is not the user's idle). */
  private askingQuiet = false;
  /** Why the last idle pass did not doze (the agent's answer), or null. */
  notQuiet: string | null = null;

  /**
   * Reclaims `idleMs` after the agent last went idle (0: never); with `doze`,
   * a child that is quiet then dozes until input comes, and with `pack` too
   * (both default true), its private pages are packed while it dozes, and
   * with `shelve` (default true) its KVM VM is closed while nothing is private.
   */
  reclaimWhenIdle(idleMs: number, opts: { doze?: boolean; pack?: boolean; shelve?: boolean } = {}): void {
    if (!this.spec.restore || !(idleMs > 0) || !this.client) return;
    this.reclaimIdleMs = this.reclaimDelayMs = idleMs;
    this.dozeWanted = opts.doze !== false;
    this.packWanted = this.dozeWanted && opts.pack !== false;
    this.shelveWanted = this.packWanted && opts.shelve !== false;
    this.client.onIdle(() => {
      if (this.askingQuiet) return;
      this.notQuietRetryMs = 0;
      this.armReclaim();
    });
    this.armReclaim();
  }

  private armReclaim(delayMs = this.reclaimDelayMs): void {
    if (this.reclaimTimer) clearTimeout(this.reclaimTimer);
    this.reclaimTimer = null;
    if (!this.vm || this.reclaimed.failed) return;
    this.reclaimTimer = setTimeout(() => {
      this.reclaimTimer = null;
      if (!this.vm || this.client?.inFlight !== 0 || this.reclaiming) return;
      // A dozing child writes nothing: one more pass only to map from a pattern built since.
      if (this.vm.dozing() && (this.patternSet || !this.pattern?.layer)) return;
      // A pass started here gives way to the next request (at a slice's end).
      this.reclaiming = this.idlePass({ busy: () => (this.client?.inFlight ?? 0) > 0 })
        .catch((e: Error) => {
          if (this.vm) this.reclaimed.failed = e.message; // no more idle passes
          return null;
        })
        .finally(() => {
          this.reclaiming = null;
          this.patternReady();
          this.askAgainLater();
        });
    }, delayMs);
    this.reclaimTimer.unref();
  }

  /**
   * What an idle child does at its idle time: asks whether the guest is quiet
   * (first: the question writes pages the pass gives back), runs a pass, and
   * dozes if it is and `doze`, then packs if `pack` and shelves if `shelve` (defaults: as reclaimWhenIdle said). Stops where
   * `busy` says a request came. The pattern's hidden children run it too, so
   * that the pattern holds what a child holds when it dozes (pattern.ts).
   */
  async idlePass(opts: { busy?: () => boolean; doze?: boolean; pack?: boolean; shelve?: boolean } = {}): Promise<void> {
    const busy = opts.busy ?? (() => false);
    const started = this.client?.started ?? 0;
    let quiet = (opts.doze ?? this.dozeWanted) && !this.vm?.dozing() && (await this.askQuiet());
    if (quiet && this.client?.started !== started + 1) {
      // A request went out while the agent answered: its answer may predate what that request
      // started, and the idle that followed was taken for the question's own (askQuiet).
      quiet = false;
      if (!busy()) this.armReclaim();
    }
    if (busy()) return;
    await this.reclaimSlices(busy);
    if (quiet && !busy() && this.vm) this.vm.doze();
    // Dozing (now or since before a pass that only mapped from the pattern): packed until input comes.
    if ((opts.pack ?? this.packWanted) && this.vm?.dozing() && !busy()) this.lastPack = this.vm.pack({ shelve: opts.shelve ?? this.shelveWanted });
  }

  /**
   * A child that was not quiet at its idle pass (a thread in a timed wait, a
   * process that runs) is asked again later, less often each time (up to once
   * a minute) until input comes: what ran may end by itself, and then it dozes.
   */
  private notQuietRetryMs = 0;
  private askAgainLater(): void {
    if (!this.dozeWanted || this.notQuiet === null || this.noQuietOp || this.reclaimTimer || this.reclaimed.failed) return;
    if (!this.vm || this.vm.dozing() || this.client?.inFlight !== 0) return;
    this.notQuietRetryMs = Math.min(Math.max(this.notQuietRetryMs * 2, this.reclaimIdleMs), 60_000);
    this.armReclaim(this.notQuietRetryMs);
  }

  /** The agent's `quiet`; false on any failure (an agent that has no such op is not asked again). */
  private noQuietOp = false;
  private async askQuiet(): Promise<boolean> {
    if (!this.client || this.noQuietOp) return false;
    this.askingQuiet = true;
    try {
      const r = await this.client.request('quiet', {}, { timeoutMs: QUIET_TIMEOUT_MS });
      this.notQuiet = r.quiet === true ? null : String(r.busy ?? 'not quiet');
      return r.quiet === true;
    } catch (e) {
      this.notQuiet = `no answer: ${(e as Error).message}`;
      if (e instanceof AgentError && e.code === 'unknown_op') this.noQuietOp = true; // (an agent older than doze)
      return false;
    } finally {
      this.askingQuiet = false;
    }
  }

  /**
   * Gives back now the private pages that hold the template's bytes again,
   * in slices (the event loop runs between them). A restored VM only.
   */
  async reclaim(): Promise<ReclaimFigures> {
    while (this.reclaiming) await this.reclaiming.catch(() => {});
    const pass = this.reclaimSlices();
    this.reclaiming = pass
      .catch(() => {}) // the caller gets the error
      .finally(() => {
        this.reclaiming = null;
      });
    return pass;
  }

  private async reclaimSlices(stop?: () => boolean): Promise<ReclaimFigures> {
    if (!this.spec.restore) throw new UserError(`sandbox ${this.id} was booted, not forked: it has no template to give pages back to`);
    const f: ReclaimFigures = { privatePages: 0, droppedPages: 0, patternPages: 0, totalUs: 0, longestPauseUs: 0 };
    this.pattern?.want();
    if (this.vm && this.pattern?.layer && !this.patternSet) {
      this.vm.setPattern(this.pattern.layer);
      this.patternSet = true;
    }
    for (let at: number | null = 0; at !== null && this.vm && !stop?.(); ) {
      const r = this.vm.reclaim({ fromPage: at, maxPages: RECLAIM_SLICE_PAGES });
      f.privatePages += r.privatePages;
      f.droppedPages += r.droppedPages;
      f.patternPages += r.patternPages;
      f.totalUs += r.totalUs;
      f.longestPauseUs = Math.max(f.longestPauseUs, r.longestPauseUs);
      at = r.nextPage;
      if (at !== null) await new Promise((res) => setImmediate(res));
    }
    this.reclaimed.passes++;
    this.reclaimed.pages += f.droppedPages;
    this.reclaimed.patternPages += f.patternPages;
    if (this.patternSet) this.reclaimed.patternPasses++;
    const little = (f.droppedPages + f.patternPages) * 16 < f.privatePages;
    // (backing off to a minute at most, or to the idle time asked for where that is longer)
    this.reclaimDelayMs = little ? Math.min(this.reclaimDelayMs * 2, Math.max(60_000, this.reclaimIdleMs)) : this.reclaimIdleMs;
    return f;
  }

  get agent(): AgentClient {
    if (!this.client) throw new Error(`sandbox ${this.id} has no agent connection`);
    return this.client;
  }

  get console(): readonly string[] {
    return this.lines;
  }

  private onEvents(events: NativeVmEvent[]): void {
    for (const e of events) {
      if (e.type === 'console') {
        for (const line of e.lines) {
          this.keepLine(line);
          try {
            this.spec.onConsole?.(line);
          } catch {} // (a caller's callback that throws must not lose the events behind it: a stop)
        }
      } else if (e.type === 'console-dropped') {
        this.keepLine(`[forkling: ${e.count} console lines dropped]`);
      } else if (e.type === 'device-error') {
        // (the VMM reports a few failures per device, then one saying it stops)
        this.deviceErrors.push(`${e.device}: ${e.message}`);
        this.keepLine(`[forkling: device ${e.device} failed: ${e.message}]`);
      } else if (e.type === 'stopped') {
        this.finish(exitFromStop(e.reason, e.message, this.shutdownRequested));
      }
    }
  }

  private keepLine(line: string): void {
    this.lines.push(line);
    if (this.lines.length > CONSOLE_KEEP) this.lines.shift();
  }

  /** The VM is over: free it at once (threads joined, RAM unmapped) and tell the waiters. */
  private finish(info: ExitInfo): void {
    if (this.exitInfo) return;
    this.exitInfo = info;
    if (this.reclaimTimer) clearTimeout(this.reclaimTimer);
    this.vm?.kill();
    this.vm = null;
    // A VM that ended on its own tells requests in flight why, with its last words.
    this.client?.close(info.reason === 'killed' ? undefined : `the VM ${this.id} stopped (${info.reason}${info.message ? `: ${info.message}` : ''})${this.lastLines()}`);
    rmSync(this.vsockPath, { force: true });
    for (const w of this.stopWaiters) w(info);
    this.stopWaiters.clear();
    this.resolveExit(info);
  }

  /** Its last console lines, for an error message (a restored child's show a guest stall: RCU, soft lockup). */
  lastLines(n = 25): string {
    const l = this.lines.slice(-n);
    return l.length ? `\nlast console lines:\n  ${l.join('\n  ')}` : '\n(the guest printed nothing)';
  }

  /** The error for a VM that stopped before its agent was ready: why, and its last console lines. */
  private stoppedBeforeReady(info: ExitInfo): UserError {
    return new UserError(
      `the VM ${this.id} stopped before its agent was ready (${info.reason}${info.message ? `: ${info.message}` : ''})${this.lastLines()}`,
      'see the console lines above; forkling run --console shows the whole boot',
    );
  }

  /** Throws stoppedBeforeReady() if the VM has already stopped (fork.ts checks it while it restores a child). */
  throwIfStopped(): void {
    if (this.exitInfo) throw this.stoppedBeforeReady(this.exitInfo);
  }

  private async waitReady(timeoutMs: number): Promise<void> {
    const deadline = performance.now() + timeoutMs;
    let stopped: ExitInfo | null = null;
    const onStop = (e: ExitInfo) => {
      stopped = e;
    };
    this.stopWaiters.add(onStop);
    let delay = 10;
    let lastError = '';
    try {
      while (true) {
        if (stopped || this.exitInfo) throw this.stoppedBeforeReady((stopped ?? this.exitInfo) as ExitInfo);
        const left = deadline - performance.now();
        if (left <= 0) {
          const regs = this.vm?.debugState() ?? '';
          throw new UserError(
            `the VM's agent did not answer within ${timeoutMs} ms (last attempt: ${lastError || 'none'})${regs ? `\nvCPUs: ${regs.trim()}` : ''}${this.lastLines()}`,
            'a slow host (nested virtualization) may need a longer limit; --console shows the boot',
          );
        }
        try {
          const client = await connectAgent(this.vsockPath, AGENT_PORT, Math.min(left, 10_000));
          // A connected agent answers at once; one that does not (a broken
          // data path) must not stall the boot past its limit.
          await answeredWithin(client, Math.min(deadline - performance.now(), 10_000), 'connected, but the agent', (c) => c.hello());
          this.attachAgent(client);
          return;
        } catch (e) {
          // The VM may have stopped meanwhile (its socket is gone): report that, at the top of the loop.
          if (stopped || this.exitInfo) continue;
          if (e instanceof VsockConnectError && !e.retryable) throw new UserError(`cannot reach the agent: ${e.message}`);
          if (!(e instanceof VsockConnectError) && !(e instanceof AgentError)) throw e;
          lastError = e.message;
        }
        // The agent is not listening yet: back off a little (capped), then try again.
        await new Promise<void>((r) => {
          const wake = () => {
            clearTimeout(t);
            this.stopWaiters.delete(wake);
            r();
          };
          const t = setTimeout(wake, Math.min(delay, Math.max(0, deadline - performance.now())));
          this.stopWaiters.add(wake);
        });
        delay = Math.min(delay * 2, 200);
      }
    } finally {
      this.stopWaiters.delete(onStop);
    }
  }

  /**
   * Clean poweroff: the agent syncs and reboots the guest (`reboot=k`: the
   * kernel pulses the i8042 reset line), which the VMM turns into the VM's
   * end; resolves with the exit once the VM's memory is freed. Falls back to
   * kill() after `timeoutMs`.
   */
  async shutdown(timeoutMs = 30_000): Promise<ExitInfo> {
    if (this.exitInfo) return this.exitInfo;
    this.shutdownRequested = true;
    // The agent answers before it powers off; the connection may also drop first.
    this.client?.shutdown(true).catch(() => {});
    let t: NodeJS.Timeout | undefined;
    const timer = new Promise<'timeout'>((r) => {
      t = setTimeout(() => r('timeout'), timeoutMs).unref();
    });
    const r = await Promise.race([this.exited, timer]);
    clearTimeout(t);
    if (r === 'timeout') {
      this.finish({ reason: 'timeout', message: `the guest did not power off within ${timeoutMs} ms` });
    }
    return this.exited;
  }

  async pause(): Promise<void> {
    this.live().pause();
  }

  async resume(): Promise<void> {
    this.live().resume();
  }

  async kill(): Promise<void> {
    this.finish({ reason: 'killed' });
  }

  /**
   * Memory the VM holds alone now (guest pages, plus its host-side structures:
   * vCPU stacks, kvm_run pages, the host's and KVM's page tables for its RAM) and the VMM's
   * counters (exits by kind, vsock, interrupts). KVM's fixed structures per VM
   * (vmalloc, slab: README, "host memory per child") are not in it.
   */
  async stats(): Promise<SandboxStats> {
    const vm = this.live();
    const s = vm.stats();
    const m = vm.memoryUsage();
    const c = s.counters;
    // KVM keeps a nested table page where the guest touched a 2 MiB span and frees none when
    // reclaim zaps its entries: at least as many as the host's tables, whatever its leaf count says.
    const nptBytes = Math.max(c.host_npt_min_bytes ?? 0, m.guestTableBytes);
    const hostBytes = (c.host_vcpu_stack_bytes ?? 0) + (c.host_kvm_run_bytes ?? 0) + m.guestTableBytes + nptBytes;
    const host = { memoryBytes: s.memoryBytes, hostKiB: hostBytes / 1024, hostPageTableKiB: m.guestTableBytes / 1024, hostNptKiB: nptBytes / 1024 };
    if (this.spec.restore) {
      // A restored VM maps its template: count only the guest pages it owns alone.
      // A dozing child's packed pages (native-vm.ts pack) are its guest memory held in the host's.
      const packedBytes = c.packed_bytes ?? 0;
      return {
        privateKiB: Math.round((m.guestPrivateBytes + packedBytes + hostBytes) / 1024),
        counters: {
          ...c,
          ...host,
          guestPrivateKiB: m.guestPrivateBytes / 1024,
          guestSharedKiB: m.guestSharedBytes / 1024,
          reclaimPasses: this.reclaimed.passes,
          reclaimedKiB: this.reclaimed.pages * 4,
          patternKiB: m.guestPatternBytes / 1024,
          packedKiB: packedBytes / 1024,
        },
      };
    }
    return { privateKiB: Math.round((s.residentBytes + hostBytes) / 1024), counters: { ...c, ...host, guestPrivateKiB: s.residentBytes / 1024 } };
  }

  private live(): NativeVm {
    if (!this.vm) throw new UserError(`sandbox ${this.id} has ended (${this.exitInfo?.reason ?? 'unknown'})`);
    return this.vm;
  }
}
