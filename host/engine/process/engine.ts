// The process engine: where /dev/kvm is missing, a template is a warm agent
// (the zygote) running as PID 1 of its own user, pid, mount, network, ipc,
// uts and cgroup namespaces with the image's root filesystem as its root and
// a seccomp filter (native/src/sandbox/launch.cc); a fork is fork() of that
// agent (guest-agent/forkling_zygote.py): copy-on-write memory, a private
// overlay layer, its own namespaces, its own cgroup. Same agent, same protocol
// and client as a VM; weaker isolation (one shared kernel), said every time.
import { randomBytes } from 'node:crypto';
import { closeSync, existsSync, lstatSync, mkdirSync, readdirSync, readFileSync } from 'node:fs';
import { Socket } from 'node:net';
import { availableParallelism } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { AgentClient } from '../../agent/client.ts';
import { checkName, UserError } from '../../errors.ts';
import { ensureImage } from '../../images.ts';
import { storePath, writeFileAtomic } from '../../store.ts';
import { envFlag, envWhole } from '../../util/env.ts';
import { processRunning } from '../../util/process.ts';
import type { BootOptions, Engine, ExitInfo, Sandbox, SandboxStats, TemplateInfo, TemplateOptions } from '../engine.ts';
import { runWarmup, warmupLimit } from '../warmup.ts';
import { AGENT_SOCKET, connectAgent } from './agent-socket.ts';
import { ProcessRef } from './process-ref.ts';
import { type Cgroup, type CgroupLimits, CgroupTree } from './cgroups.ts';
import { skeletonFor } from './skeleton.ts';
import { sandboxAddon } from './native.ts';
import { makeEngineDir, newId, removeTree } from './runtime.ts';

export const PROCESS_ISOLATION =
  'process engine: sandboxes are Linux namespaces (user, pid, mount, network, ipc, uts, cgroup) with seccomp and cgroup ' +
  'limits on the host kernel; weaker than a VM: a kernel bug reachable from a sandbox reaches the host';

const AGENT_DIR = join(dirname(dirname(dirname(dirname(fileURLToPath(import.meta.url))))), 'guest-agent');
const PYTHON = '/usr/bin/python3';
const CONSOLE_LINES = 200;
/** Longest console line kept (a longer one is cut). */
const CONSOLE_LINE_CHARS = 16384;
const DEFAULT_MEMORY_MIB = 512;
const DEFAULT_PIDS = 512;
/** How long a killed sandbox's PID 1 is waited for before its cgroup's removal is tried anyway (and retried). */
const EXIT_WAIT_MS = 2000;
/** After a sandbox's PID 1 exited, how long its connection may stay open before the sandbox is ended anyway. */
const EXIT_GRACE_MS = 1000;
/** How long a zygote or a branch's source has to answer a fork or branch request (its fork server gives each child 30 s to be ready). */
const SPAWN_ANSWER_MS = 60_000;
/**
 * As root, sandbox ids 0-65535 are host ids from here ($FORKLING_PROCESS_ID_BASE):
 * unprivileged ones in the range systemd leaves to containers (524288-1879048191).
 * Mapped onto the host's 0-65535, a sandbox's root was the host's root uid,
 * which the kernel's global sysctls check for (it could write
 * kernel.core_pattern through a /proc of its own: a way out of the sandbox).
 */
const DEFAULT_ID_BASE = 0x6f000000;
/** What a held branch child waits for once it is in its own cgroup: SIGRTMAX - 1 (guest-agent/forkling_zygote.py's HOLD_SIGNAL). */
const HOLD_SIGNAL = 63;
/**
 * What a fork writes before the host moves it into its own cgroup is charged
 * to the zygote's, and stays charged there while the fork lives (memory is not
 * moved with a process): 0.9-1.5 MiB per live fork, measured (2026-12-02);
 * 1.65 MiB after its first answer, 0.82 MiB idle (50 forks of the numpy
 * template, 2026-12-03). With the pages it copies ahead (option prefault, at
 * most PREFAULT_MAX_BYTES: ~2 MiB for that template), 2.6 and 0.93 MiB.
 * Between 500 and 600 live forks of a 512 MiB template the zygote's cgroup ran
 * out and the kernel killed processes in it. So its limit is the template's plus, for each
 * fork that may be alive, this much, PREFAULT_MAX_BYTES (with prefault) and what a fork copies of the warm-up's
 * /dev/shm (raised before each request, never lowered: what the warm-up's own
 * threads could take beyond the template's limit is bounded by the forks the
 * user has made).
 */
const FORK_SETUP_BYTES = 3 * 2 ** 20;
/** The most a fork copies ahead (guest-agent/forkling_reclaim.c's FR_PREFAULT_MAX_PAGES). */
const PREFAULT_MAX_BYTES = 4 * 2 ** 20;
/**
 * The bytes of the files under `dir` (sandbox-made: entries are lstat'ed, no
 * link is followed; at most 100,000 of them), 0 where it cannot be read.
 */
function treeBytes(dir: string): number {
  let bytes = 0;
  let left = 100_000;
  const walk = (d: string): void => {
    let names: string[];
    try {
      names = readdirSync(d);
    } catch {
      return;
    }
    for (const name of names) {
      if (--left < 0) return;
      try {
        const st = lstatSync(join(d, name));
        if (st.isDirectory()) walk(join(d, name));
        else if (st.isFile()) bytes += Math.max(st.size, st.blocks * 512);
      } catch {} // (gone meanwhile)
    }
  };
  walk(dir);
  return bytes;
}
/** Most spare forks per template (each holds a child's memory). */
const MAX_SPARES = 1024;
/** Children per fork request to a zygote (measured: 25 beat 10, 50 and one request for 100 on 2 cores). */
const FORK_CHUNK = 25;
// After a fork, its refill of spares waits until the sandboxes just handed out
// have answered a first request (or this long): forking more on the same cores
// meanwhile slowed that first answer (a reclaimed spare's first eval 10.5-11.7
// ms with the refill at once, 7.2-8.1 ms after it, on a 2-core machine).
const REFILL_DEFER_MS = 250;

export interface ProcessEngineOptions {
  /** Called with warnings (e.g. no cgroup limits); default: console.error. */
  warn?: (line: string) => void;
  /** Called with a line about slow first-use work (building the image `default`, creating the template `default`); default: nothing. */
  progress?: (line: string) => void;
  /** Maximum processes per sandbox (pids cgroup). Default 512. */
  pidsPerSandbox?: number;
  /** Resolves an image name to its unpacked root filesystem. Default: host/images.ts ensureImage(). */
  rootfsOf?: (image: string) => Promise<string>;
  /**
   * Forks to keep ready per template (set up, connected and restored, not yet
   * handed out): a fork takes these first and is refilled in the background.
   * Each costs a child's memory while it waits. Default $FORKLING_PROCESS_SPARES or 0.
   */
  spares?: number;
  /**
   * Let KSM share identical pages between a zygote and its forks (Linux >= 6.4;
   * works only where the host runs KSM, /sys/kernel/mm/ksm/run = 1). Cuts what
   * an idle child holds alone, at the price of a timing side channel between
   * sandboxes (a write to a merged page is slower: one sandbox can tell whether
   * another holds a page with the same content). Default $FORKLING_PROCESS_KSM === '1'.
   */
  ksm?: boolean;
  /**
   * Seconds a new fork waits for the host's first connection before it exits
   * (the host gave up on its request after the zygote answered). Default 60.
   */
  unclaimedForkS?: number;
  /**
   * The zygote's memory becomes a sealed file mapped copy-on-write where it
   * was, and an idle fork gives back the pages it copied that hold the
   * template's bytes again (guest-agent/forkling_reclaim.c). Default on;
   * $FORKLING_PROCESS_RECLAIM=0 turns it off.
   */
  reclaim?: boolean;
  /**
   * With reclaim and the template's pattern: each fork copies, in one call per
   * run, the pages the pattern child wrote (a fork writes them at its first
   * requests too), before it runs anything (forkling_reclaim.c's fr_prefault), instead of
   * one write fault each later. Default on; $FORKLING_PROCESS_PREFAULT=0
   * turns it off (for measuring what it does).
   */
  prefault?: boolean;
}

/** A launched namespace root (zygote or cold-booted sandbox) and what the host holds for it. */
interface Root {
  pid: number;
  /** Its PID 1, by pidfd: signals go there only. */
  proc: ProcessRef;
  keeperPid: number;
  dir: string;
  console: string[];
  cgroup: Cgroup | null;
  /** Our end of its lifeline pipe: closing it (or our death) ends the root. */
  lifeline: number;
}

interface Zygote extends Root {
  info: TemplateInfo;
  client: AgentClient;
  limits: CgroupLimits;
  dead: boolean;
  /** Forked, connected and restored, not handed out yet: fork() takes these first. */
  spares: ProcessSandbox[];
  refilling: Promise<void> | null;
  /** Set while a refill waits for first answers (REFILL_DEFER_MS): starts it now. */
  refillNow: (() => void) | null;
  /** Fork requests whose children may still be in the zygote's cgroup: two at a time (see chunks()). */
  requests: Gate;
  /** The template frozen and the fork server started (a fork with no children): prepare(). */
  prepared: Promise<void> | null;
  /** prepare() done: the template's pattern made (or given up on), so forks from here on map it. */
  patterned: boolean;
  /** The memory limit of its cgroup now: the template's, plus what each fork may leave charged to it (see forkAllowance). */
  memoryLimit: number;
  /** What a fork copies of the warm-up's /dev/shm in its set-up (read once the warm-up has run). */
  shmBytes: number;
  /** Children of its fork requests not moved into their own cgroups yet, and its cgroup's CPU limit now (see forkCpu). */
  forking: number;
  cpuLimit: number;
}

/**
 * The CPU limit of a zygote's cgroup while `forking` of its forks are set up
 * there (forked, namespaces, mounts, agent: all before the host moves each into
 * its own cgroup): the template's vCPUs for the zygote and as many again for
 * each such fork, as each will have in its own cgroup, but no more than the
 * host's CPUs. With the template's limit alone (1 vCPU by default) the set-up
 * of a fork of 100 ran on one CPU's time however many the host had.
 */
export function zygoteCpus(templateCpus: number, forking: number, hostCpus: number): number {
  return Math.max(templateCpus, Math.min(hostCpus, templateCpus * (1 + forking)));
}

/** At most n holders at a time, first come first served. */
class Gate {
  private readonly queue: (() => void)[] = [];
  constructor(private free: number) {}

  async enter(): Promise<void> {
    if (this.free > 0) this.free--;
    else await new Promise<void>((r) => this.queue.push(r));
  }

  leave(): void {
    const next = this.queue.shift();
    if (next) next();
    else this.free++;
  }
}

function pushLine(ring: string[], line: string) {
  ring.push(line);
  if (ring.length > CONSOLE_LINES) ring.splice(0, ring.length - CONSOLE_LINES);
}

/** The child pids of each thread of `pid`, thread by thread, oldest child first ([] once it is gone). */
function childrenByThread(pid: number): number[][] {
  let tasks: string[];
  try {
    tasks = readdirSync(`/proc/${pid}/task`);
  } catch {
    return [];
  }
  const out: number[][] = [];
  for (const t of tasks) {
    try {
      out.push(readFileSync(`/proc/${pid}/task/${t}/children`, 'utf8').split(' ').filter(Boolean).map(Number));
    } catch {}
  }
  return out;
}

/**
 * Host pids of the forks of `pid` that have the given pids in the namespace where `pid` lives: its
 * children that are PID 1 of their own pid namespace, and with `viaServer` those of its other
 * children (a zygote's forks are children of its fork server). Newest children first, and only
 * until every wanted pid is found (a zygote may have hundreds of live forks).
 */
function forksByNsPid(pid: number, want: ReadonlySet<number>, viaServer: boolean): Map<number, ProcessRef> {
  const out = new Map<number, ProcessRef>();
  const nsPids = (k: number): number[] | undefined => {
    try {
      return /^NSpid:\s+(.*)$/m.exec(readFileSync(`/proc/${k}/status`, 'utf8'))?.[1]?.trim().split(/\s+/).map(Number);
    } catch {
      return undefined;
    }
  };
  const scan = (parent: number, deeper: boolean): void => {
    for (const kids of childrenByThread(parent)) {
      for (let i = kids.length - 1; i >= 0 && out.size < want.size; i--) {
        const k = kids[i]!;
        const ns = nsPids(k);
        if (!ns) continue;
        // NSpid: host pid, then the pid in each nested namespace. A fork is 1 in
        // its own; the namespace of the process that forked it is the one before.
        if (ns.length >= 3 && ns[ns.length - 1] === 1) {
          const inParent = ns[ns.length - 2]!;
          if (!want.has(inParent) || out.has(inParent)) continue;
          // Held by a pidfd from here on; read again through it, so that it is this process's, not a later one's.
          let ref: ProcessRef;
          try {
            ref = new ProcessRef(k);
          } catch {
            continue;
          }
          if (nsPids(k)?.join(' ') === ns.join(' ')) out.set(inParent, ref);
          else ref.release();
        } else if (deeper) scan(k, false);
      }
    }
  };
  scan(pid, viaServer);
  return out;
}

/** Host pids of every descendant of `pid` (through all its threads), not entering the subtrees of `skip`. */
function descendants(pid: number, skip: ReadonlySet<number>): number[] {
  const out: number[] = [];
  const todo = [pid];
  while (todo.length) {
    const p = todo.pop()!;
    for (const kids of childrenByThread(p)) {
      for (const k of kids) {
        if (skip.has(k)) continue;
        out.push(k);
        todo.push(k);
      }
    }
  }
  return out;
}

/**
 * A fork of many as several requests to the zygote, sent at once: it answers
 * them one after the other, so the host connects and restores the children
 * of one while it forks the next (and those children set themselves up).
 */
function chunks(n: number, pids: number): number[] {
  // Until the host moves them to their own cgroups, new children (2 tasks
  // each: the agent and its service thread) count against the zygote's
  // pids limit: two requests' worth at a time (Zygote.requests).
  const size = Math.max(1, Math.min(FORK_CHUNK, Math.floor((pids - 16) / 4)));
  const out: number[] = [];
  for (let left = n; left > 0; left -= size) out.push(Math.min(size, left));
  return out;
}

function median(xs: number[]): number {
  const s = xs.filter((x) => !Number.isNaN(x)).sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)] ?? Number.NaN;
}

function privateKiB(pid: number): number {
  try {
    const s = readFileSync(`/proc/${pid}/smaps_rollup`, 'utf8');
    let kib = 0;
    for (const m of s.matchAll(/^Private_(?:Clean|Dirty|Hugetlb):\s+(\d+) kB$/gm)) kib += Number(m[1]);
    return kib;
  } catch {
    return 0;
  }
}

class ProcessSandbox implements Sandbox {
  readonly engine = 'process' as const;
  readonly console: string[] = [];
  readonly exited: Promise<ExitInfo>;
  private resolveExit!: (e: ExitInfo) => void;
  killing = false;
  /** A spare made before its template's pattern (renewSpares replaces it). */
  beforePattern = false;
  private ended = false;

  /** Not ended (its agent's connection is open). */
  get running(): boolean {
    return !this.ended;
  }

  constructor(
    readonly id: string,
    readonly agent: AgentClient,
    /** Set again when a spare is handed out (its fork call is when it started, for the caller). */
    public timings: { startedAt: number; readyAt: number },
    /** The sandbox's PID 1 (its agent). */
    readonly proc: ProcessRef,
    readonly cgroup: Cgroup | null,
    private readonly owner: ProcessEngine,
    readonly template: string,
    readonly limits: CgroupLimits,
  ) {
    this.exited = new Promise((r) => {
      this.resolveExit = r;
    });
    this.finished = new Promise((r) => {
      this.resolveFinished = r;
    });
    // The engine's connection is the sandbox's lifeline: when it ends (the
    // agent died, or it was closed), the sandbox is killed and cleaned up.
    // So is its PID 1's exit, in case the connection outlives it (its code
    // can pass the socket on to another process): after a grace period in
    // which the connection's last frames and its end normally arrive.
    void agent.closed.then((why) => this.endQuietly(why.message));
    void proc.exited.then(() => {
      if (this.ended) return;
      setTimeout(() => void this.endQuietly('its PID 1 exited; another process held its connection open'), EXIT_GRACE_MS).unref();
    });
  }

  /** Host pid of the sandbox's PID 1. */
  get hostPid(): number {
    return this.proc.pid;
  }

  /** end(), for the lifelines: a failure of ours is reported, never thrown where no one catches it. */
  private endQuietly(why: string): Promise<void> {
    return this.end(why).catch((e: Error) => this.owner.warnLine(`forkling: sandbox ${this.id}: ending it failed: ${e.stack ?? e.message}`));
  }

  /** Set for a branch: the sandbox it was branched from. */
  parent: ProcessSandbox | null = null;
  /** The zygote it was forked from (a branch: its source's), whose pid namespace it lives in; null for a cold-booted one. */
  zygote: Zygote | null = null;
  /** Its branches that have not been cleaned up yet (live, or retired and still holding theirs). */
  readonly branches = new Set<ProcessSandbox>();
  /**
   * Killed while branches lived: its PID 1 is stopped (not killed: it is the
   * init of the pid namespace its branches' namespaces are nested in) and
   * every other process of it killed; cleaned up when its last branch goes.
   */
  retired = false;
  /** Resolves once everything it held is gone (process, cgroup, directories). */
  readonly finished: Promise<void>;
  private resolveFinished!: () => void;

  async end(why: string): Promise<void> {
    if (this.ended) return this.exited.then(() => {});
    this.ended = true;
    const info: ExitInfo = this.killing ? { reason: 'killed' } : { reason: 'crashed', message: why };
    if (this.branches.size > 0 && (await this.retire())) {
      this.agent.close();
      this.owner.forget(this);
      if (this.retired) this.owner.holding.add(this); // (its last branch may have gone meanwhile)
      this.resolveExit(info);
      return;
    }
    this.proc.signal('SIGKILL'); // its pid namespace dies with it
    if (this.cgroup?.frozen) this.owner.cgroups.freeze(this.cgroup, false); // (v1: a frozen process holds its SIGKILL)
    this.agent.close();
    // Its cgroup can go once its PID 1 has exited (the kernel has then reaped the rest of its
    // namespace): waited for on a pidfd rather than trying rmdir until it works (~2.5 tries each).
    await this.proc.exitedWithin(EXIT_WAIT_MS);
    const cleanup = await this.cleanup();
    this.owner.forget(this);
    if (cleanup.length) info.message = `${info.message ? `${info.message}; ` : ''}cleanup: ${cleanup.join('; ')}`;
    this.resolveExit(info);
    this.finish();
  }

  /**
   * Its branches live in pid namespaces nested in its own, so killing its PID
   * 1 would kill them too. Instead: stop its PID 1 (SIGSTOP from an ancestor
   * namespace cannot be caught or ignored by a namespace's init, and nothing
   * left in the sandbox can send SIGCONT), then kill every other process of
   * it (its descendants outside its branches' process trees) until none is left.
   */
  private async retire(): Promise<boolean> {
    if (!this.proc.signal('SIGSTOP')) return false; // already gone: so are its branches
    this.retired = true;
    if (this.cgroup) this.owner.cgroups.freeze(this.cgroup, false); // a frozen process would hold its SIGKILL (cgroup v1)
    const skip = new Set([...this.branches].map((b) => b.hostPid));
    // Until none is left (they may fork meanwhile); bounded: one that cannot die (D state) is reported.
    const deadline = Date.now() + 5000;
    for (let wait = 0; ; wait = Math.min(wait * 2 || 1, 50)) {
      const rest = descendants(this.hostPid, skip).filter((p) => processRunning(p));
      if (rest.length === 0) break;
      if (Date.now() > deadline) {
        this.owner.warnLine(`forkling: sandbox ${this.id}: processes ${rest.join(' ')} did not die; they go with its PID 1 later`);
        break;
      }
      for (const p of rest) {
        try {
          process.kill(p, 'SIGKILL');
        } catch {}
      }
      await new Promise((r) => setTimeout(r, wait));
    }
    // A second lock where there is a freezer: a SIGCONT from a process that can still see it
    // (the sandbox it was branched from, the zygote) does not thaw a frozen cgroup.
    // (unless its last branch went meanwhile: branchGone() has killed it and removed its cgroup)
    if (this.retired && this.cgroup && this.owner.cgroups.freeze(this.cgroup, true)) await this.owner.cgroups.frozen(this.cgroup);
    return true;
  }

  /** A branch is gone: a retired source with no branch left goes too. */
  private branchGone(b: ProcessSandbox): void {
    this.branches.delete(b);
    if (this.retired && this.branches.size === 0) {
      this.retired = false;
      this.proc.signal('SIGKILL');
      void this.cleanup()
        .then(async (errors) => {
          // A task leaves its cgroup before it is done exiting: wait until it is (a zombie, or reaped).
          if (!(await this.proc.exitedWithin(5000))) {
            errors.push(`sandbox ${this.id}: its PID 1 (host pid ${this.hostPid}) did not exit within 5 s of SIGKILL`);
          }
          return errors;
        })
        .then((errors) => {
          for (const e of errors) this.owner.warnLine(`forkling: ${e}`);
          this.owner.holding.delete(this);
          this.owner.pruneRetired();
          this.finish();
        });
    }
  }

  private async cleanup(): Promise<string[]> {
    const errors: string[] = [];
    if (this.cgroup) {
      try {
        await this.owner.cgroups.remove(this.cgroup);
      } catch (e) {
        errors.push((e as Error).message);
      }
    }
    return errors;
  }

  private finish(): void {
    this.proc.release();
    this.resolveFinished();
    this.parent?.branchGone(this);
  }

  async pause(): Promise<void> {
    if (!(this.cgroup && this.owner.cgroups.freeze(this.cgroup, true))) this.proc.signal('SIGSTOP');
    else await this.owner.cgroups.frozen(this.cgroup);
  }

  async resume(): Promise<void> {
    if (!(this.cgroup && this.owner.cgroups.freeze(this.cgroup, false))) this.proc.signal('SIGCONT');
  }

  async kill(): Promise<void> {
    this.killing = true;
    await this.end('killed');
  }

  async stats(): Promise<SandboxStats> {
    const pids = this.cgroup ? this.owner.cgroups.pids(this.cgroup) : [this.hostPid];
    let kib = 0;
    for (const p of pids) kib += privateKiB(p);
    const counters: Record<string, number> = { processes: pids.length };
    const mem = this.cgroup ? this.owner.cgroups.memoryBytes(this.cgroup) : null;
    if (mem !== null) counters.cgroupMemoryBytes = mem;
    return { privateKiB: kib, counters };
  }
}

export class ProcessEngine implements Engine {
  readonly name = 'process' as const;
  readonly isolation = PROCESS_ISOLATION;
  readonly cgroups: CgroupTree;
  private readonly dir: string;
  private readonly zygotes = new Map<string, Zygote>();
  private readonly retired: Zygote[] = [];
  private readonly creating = new Map<string, Promise<Zygote>>();
  /** Zygotes being started, each settled once it is in `zygotes` (close() waits for them, not for a template being made). */
  private readonly starting = new Set<Promise<unknown>>();
  private closing: Promise<void> | null = null;
  private readonly sandboxes = new Set<ProcessSandbox>();
  private readonly booted = new Set<Root>();
  private readonly warn: (line: string) => void;
  private readonly progress: ((line: string) => void) | undefined;
  /** Killed sources whose PID 1 is held (stopped) until their last branch goes. */
  readonly holding = new Set<ProcessSandbox>();
  private readonly rootfsOf: (image: string) => Promise<string>;
  private readonly pidsPerSandbox: number;
  private readonly spareTarget: number;
  private readonly ksm: boolean;
  private readonly unclaimedForkS: number | undefined;
  private readonly reclaim: boolean;
  private readonly prefault: boolean;
  /** As root: the host uid (and gid) of the sandboxes' root, the first of 65536 (null without root). */
  private readonly idBase: number | null;
  private closed = false;
  private readonly onExit = () => this.killAllNow();

  constructor(opts: ProcessEngineOptions = {}) {
    this.warn = opts.warn ?? ((l) => console.error(l));
    this.progress = opts.progress;
    this.rootfsOf = opts.rootfsOf ?? (async (image) => (await ensureImage(image, { progress: this.progress })).rootfs);
    this.pidsPerSandbox = opts.pidsPerSandbox ?? DEFAULT_PIDS;
    if (opts.spares !== undefined && !(Number.isInteger(opts.spares) && opts.spares >= 0 && opts.spares <= MAX_SPARES)) {
      throw new UserError(`spares: ${opts.spares} is not a whole number from 0 to ${MAX_SPARES}`, 'give the number of forks to keep ready per template, e.g. 8');
    }
    this.spareTarget = opts.spares ?? envWhole('FORKLING_PROCESS_SPARES', 0, 0, MAX_SPARES);
    this.ksm = opts.ksm ?? envFlag('FORKLING_PROCESS_KSM');
    if (opts.unclaimedForkS !== undefined && !(Number.isFinite(opts.unclaimedForkS) && opts.unclaimedForkS >= 1 && opts.unclaimedForkS <= 3600)) {
      throw new UserError(`unclaimedForkS: ${opts.unclaimedForkS} is not a number of seconds from 1 to 3600`, 'give how long a new fork waits for its host, e.g. 60');
    }
    this.unclaimedForkS = opts.unclaimedForkS;
    this.reclaim = opts.reclaim ?? process.env.FORKLING_PROCESS_RECLAIM !== '0';
    this.prefault = this.reclaim && (opts.prefault ?? process.env.FORKLING_PROCESS_PREFAULT !== '0'); // (it takes the pattern: reclaim's)
    this.idBase = process.getuid?.() === 0 ? envWhole('FORKLING_PROCESS_ID_BASE', DEFAULT_ID_BASE, 1, 0xffff0000) : null;
    if (this.ksm && ksmRun() !== '1') {
      this.warn(`forkling: KSM sharing asked for, but the host's KSM is not running (/sys/kernel/mm/ksm/run = ${ksmRun() ?? 'absent'}): no effect until it is`);
    }
    sandboxAddon(); // fail early when the addon lacks the launcher
    this.dir = makeEngineDir();
    this.cgroups = new CgroupTree(`forkling-${this.dir.split('/').pop()}`);
    if (this.cgroups.warning) this.warn(`forkling: ${this.cgroups.warning}`);
    process.once('exit', this.onExit);
  }

  // ---------------------------------------------------------------- launching

  private async launch(opts: {
    rootfs: string;
    role: 'zygote' | 'sandbox';
    hostname: string;
    limits: CgroupLimits;
    cgName: string;
    readyTimeoutMs?: number;
  }): Promise<Root> {
    const a = sandboxAddon();
    const dir = join(this.dir, opts.cgName);
    const stage = join(dir, 'stage');
    mkdirSync(stage, { recursive: true });
    let cgroup: Cgroup | null = null;
    const fds: number[] = [];
    let launched: { pid: number; keeperPid: number };
    try {
      cgroup = this.cgroups.create(opts.cgName, opts.limits);
      fds.push(...a.sandboxPipe(), ...a.sandboxPipe());
      const [, w, lifeR] = fds as [number, number, number, number];
      launched = a.sandboxLaunch({
        rootfs: opts.rootfs,
        skeleton: skeletonFor(opts.rootfs, this.idBase),
        ...(this.idBase !== null ? { idBase: this.idBase } : {}),
        stage,
        agentDir: AGENT_DIR,
        hostname: opts.hostname,
        argv: [PYTHON, '/run/forkling-agent/forkling_agent.py', '--unix', `/${AGENT_SOCKET}`],
        env: [
          'PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin',
          'HOME=/root',
          'LANG=C.UTF-8',
          'PYTHONDONTWRITEBYTECODE=1',
          `FORKLING_PROCESS_ROLE=${opts.role}`,
          'FORKLING_LIFELINE_FD=5',
          ...(this.ksm && opts.role === 'zygote' ? ['FORKLING_PROCESS_KSM=1'] : []),
          ...(this.unclaimedForkS !== undefined && opts.role === 'zygote' ? [`FORKLING_PROCESS_UNCLAIMED_S=${this.unclaimedForkS}`] : []),
          ...(this.reclaim && opts.role === 'zygote' ? ['FORKLING_PROCESS_RECLAIM=1'] : []),
          ...(this.reclaim && !this.prefault && opts.role === 'zygote' ? ['FORKLING_PROCESS_PREFAULT=0'] : []),
        ],
        cgroupProcs: cgroup?.procs ?? [],
        layerSizeMiB: Math.max(64, Math.round(opts.limits.memoryBytes / 2 ** 20)),
        stdoutFd: w,
        lifelineFd: lifeR,
        seccomp: true,
      });
    } catch (e) {
      for (const fd of fds) closeSync(fd);
      if (cgroup) await this.cgroups.remove(cgroup).catch(() => {});
      this.removeDir(dir);
      const err = e as Error & { step?: string };
      throw new UserError(
        `cannot start a process-engine sandbox: ${err.message}`,
        'the process engine needs user namespaces, overlayfs and /dev/kvm-free Linux >= 5.11; see `forkling doctor --engine process`',
      );
    }
    const [r, w, lifeR, lifeW] = fds as [number, number, number, number];
    closeSync(w);
    closeSync(lifeR);
    const ring: string[] = [];
    let ready!: () => void;
    const readyLine = new Promise<void>((res) => {
      ready = res;
    });
    let partial = '';
    // A net.Socket, not fs.createReadStream: a pipe read through fs blocks a thread-pool thread.
    const stream = new Socket({ fd: r, readable: true, writable: false });
    stream.setEncoding('utf8');
    stream.unref();
    stream.on('data', (d: string | Buffer) => {
      partial += d.toString();
      const lines = partial.split('\n');
      partial = lines.pop() ?? '';
      // Every fork holds this console: a line without end must not grow here without bound
      // (re-split on every chunk, then a string too long for V8: a throw that ended Node).
      if (partial.length > CONSOLE_LINE_CHARS) {
        lines.push(partial);
        partial = '';
      }
      for (const l of lines) {
        pushLine(ring, l.length > CONSOLE_LINE_CHARS ? `${l.slice(0, CONSOLE_LINE_CHARS)} [line cut at ${CONSOLE_LINE_CHARS} characters]` : l);
        if (l.startsWith('forkling-agent ready')) ready();
      }
    });
    stream.on('error', () => {});
    void a.sandboxWait(launched.keeperPid).catch(() => {}); // reaps the keeper, gone once the sandbox runs
    let proc: ProcessRef;
    try {
      proc = new ProcessRef(launched.pid, { reap: true }); // (our child: CLONE_PARENT, to die with us by PR_SET_PDEATHSIG)
    } catch (e) {
      closeSync(lifeW);
      stream.destroy();
      if (cgroup) await this.cgroups.remove(cgroup).catch(() => {});
      this.removeDir(dir);
      throw new UserError(`process-engine sandbox did not start: its PID 1 is gone (${(e as Error).message}); its output:\n${ring.slice(-20).join('\n')}`);
    }
    const root: Root = { ...launched, proc, dir, console: ring, cgroup, lifeline: lifeW };
    const timeoutMs = opts.readyTimeoutMs ?? 30000;
    let timer: ReturnType<typeof setTimeout> | undefined;
    try {
      await Promise.race([
        readyLine,
        proc.exited.then(() => {
          throw new Error(`the agent exited before it was ready; its output:\n${ring.slice(-20).join('\n')}`);
        }),
        new Promise((_, rej) => {
          timer = setTimeout(() => rej(new Error(`the agent was not ready within ${timeoutMs} ms`)), timeoutMs);
        }),
      ]);
    } catch (e) {
      await this.destroyRoot(root);
      throw new UserError(`process-engine sandbox did not start: ${(e as Error).message}`);
    } finally {
      clearTimeout(timer);
    }
    return root;
  }

  private async destroyRoot(root: Root): Promise<void> {
    root.proc.signal('SIGKILL');
    await root.proc.exitedWithin(10000);
    if (root.lifeline >= 0) {
      closeSync(root.lifeline);
      root.lifeline = -1;
    }
    if (root.cgroup) await this.cgroups.remove(root.cgroup).catch((e: Error) => this.warn(`forkling: ${e.message}`));
    root.proc.release();
    const failed = this.removeDir(root.dir);
    if (failed) this.warn(`forkling: ${failed}`);
  }

  /** Removes a directory below the engine's (sandboxes write there): what failed, or null. */
  removeDir(dir: string): string | null {
    return removeTree(this.dir, dir);
  }

  private limitsFor(memoryMiB: number, vcpus: number): CgroupLimits {
    return { memoryBytes: memoryMiB * 2 ** 20, pids: this.pidsPerSandbox, cpus: vcpus };
  }

  // ---------------------------------------------------------------- Engine

  async boot(opts: BootOptions): Promise<Sandbox> {
    this.checkOpen();
    const startedAt = performance.now();
    const rootfs = await this.rootfsOf(checkName('image', opts.image));
    const id = newId();
    const limits = this.limitsFor(opts.memoryMiB ?? DEFAULT_MEMORY_MIB, opts.vcpus ?? 1);
    const root = await this.launch({ rootfs, role: 'sandbox', hostname: id, limits, cgName: `c-${id}`, readyTimeoutMs: opts.readyTimeoutMs });
    for (const l of root.console) opts.onConsole?.(l);
    this.booted.add(root);
    let agent: AgentClient;
    try {
      agent = await connectAgent(root.pid, { restore: { entropy: randomBytes(64), hostname: id, sandboxId: id } });
    } catch (e) {
      this.booted.delete(root);
      await this.destroyRoot(root);
      throw e;
    }
    const sb = new ProcessSandbox(id, agent, { startedAt, readyAt: performance.now() }, root.proc, root.cgroup, this, '', limits);
    this.sandboxes.add(sb);
    // Its root (keeper, cgroup, stage) goes when it ends.
    void sb.exited
      .then(() => {
        this.booted.delete(root);
        return this.destroyRoot(root);
      })
      .catch((e: Error) => this.warn(`forkling: removing sandbox ${id}'s root failed: ${e.message}`));
    return sb;
  }

  async createTemplate(opts: TemplateOptions): Promise<TemplateInfo> {
    this.checkOpen();
    checkName('template', opts.name);
    const info: TemplateInfo = {
      name: opts.name,
      engine: 'process',
      image: checkName('image', opts.image),
      createdAt: new Date().toISOString(),
      memoryMiB: opts.memoryMiB ?? DEFAULT_MEMORY_MIB,
      vcpus: opts.vcpus ?? 1,
      ...(opts.warmup !== undefined ? { warmup: opts.warmup } : {}),
      ...(opts.warmupTimeoutMs !== undefined ? { warmupTimeoutMs: opts.warmupTimeoutMs } : {}),
    };
    const z = await this.startZygote(info);
    const old = this.zygotes.get(info.name);
    if (old) {
      this.retired.push(old); // its children live on; it goes with the last of them (pruneRetired)
      for (const s of old.spares.splice(0)) void s.kill().catch(() => {}); // (end() reports its own failures)
      this.pruneRetired();
    }
    this.zygotes.set(info.name, z);
    writeFileAtomic(templateFile(info.name), `${JSON.stringify(info, null, 2)}\n`);
    this.refill(z);
    return info;
  }

  private async startZygote(info: TemplateInfo): Promise<Zygote> {
    const warmupMs = warmupLimit(info.name, info.warmupTimeoutMs);
    const rootfs = await this.rootfsOf(info.image);
    const limits = this.limitsFor(info.memoryMiB, info.vcpus);
    const root = await this.launch({ rootfs, role: 'zygote', hostname: 'zygote', limits, cgName: `z-${newId()}` });
    let client: AgentClient;
    try {
      client = await connectAgent(root.pid);
    } catch (e) {
      await this.destroyRoot(root);
      throw e;
    }
    const z: Zygote = { ...root, info, client, limits, dead: false, spares: [], refilling: null, refillNow: null, requests: new Gate(2), prepared: null, patterned: false, memoryLimit: limits.memoryBytes, shmBytes: 0, forking: 0, cpuLimit: limits.cpus };
    void client.closed
      .then(() => {
        z.dead = true;
        if (this.zygotes.get(info.name) === z) this.zygotes.delete(info.name);
        if (this.retired.includes(z)) this.retired.splice(this.retired.indexOf(z), 1);
        return this.destroyRoot(z);
      })
      .catch((e: Error) => this.warn(`forkling: removing the zygote of ${info.name} failed: ${e.message}`));
    if (info.warmup) {
      try {
        await runWarmup(client, info.name, info.warmup, warmupMs);
      } catch (e) {
        client.close();
        await this.destroyRoot(z);
        throw e;
      }
    }
    // (at most the template's limit, which charges the zygote's tmpfs pages: a walk through
    // /proc/<pid>/root that a warm-up thread races, swapping a directory for a link, counts host files)
    z.shmBytes = Math.min(treeBytes(`/proc/${z.pid}/root/dev/shm`), limits.memoryBytes);
    return z;
  }

  /** The live zygote of a template: started from its saved definition (or `default`) when needed. */
  private zygote(template: string): Promise<Zygote> {
    const live = this.zygotes.get(template);
    if (live && !live.dead) return Promise.resolve(live);
    let p = this.creating.get(template);
    if (!p) {
      p = (async () => {
        const file = templateFile(checkName('template', template));
        let info: TemplateInfo;
        if (existsSync(file)) info = JSON.parse(readFileSync(file, 'utf8')) as TemplateInfo;
        else if (template === 'default') {
          this.progress?.('forkling: creating template default (first use: image default, no warm-up)');
          info = await this.createTemplate({ name: 'default', image: 'default' });
        }
        else throw new UserError(`template ${JSON.stringify(template)} does not exist`, 'create it: forkling template create <name> --image <image>');
        const existing = this.zygotes.get(template);
        if (existing && !existing.dead) return existing;
        this.checkOpen(); // (closed while the template was being made)
        const registered = this.startZygote(info!).then((z) => {
          this.zygotes.set(template, z);
          return z;
        });
        this.starting.add(registered);
        const z = await registered.finally(() => this.starting.delete(registered));
        this.checkOpen();
        this.refill(z);
        return z;
      })().finally(() => this.creating.delete(template));
      this.creating.set(template, p);
    }
    return p;
  }

  async prepare(template: string): Promise<void> {
    this.checkOpen();
    const z = await this.zygote(template);
    this.checkOpen();
    await this.prepared(z);
  }

  /** What the first fork would do: freeze the template, start the fork server; and wait (up to 10 s) for its pattern. Once. */
  private prepared(z: Zygote): Promise<void> {
    if (!z.prepared) {
      this.forkCpu(z, 1); // (the template's pattern child is a fork set up in the zygote's cgroup too)
      z.prepared = z.client
        .request('fork', { children: [] })
        .then(
          () => {
            z.patterned = true;
          },
          (e) => {
            z.prepared = null; // the next prepare (or fork) tries again
            throw e;
          },
        )
        .finally(() => this.forkCpu(z, -1));
    }
    return z.prepared;
  }

  async fork(template: string, n: number): Promise<Sandbox[]> {
    this.checkOpen();
    if (!Number.isInteger(n) || n < 1 || n > 1024) throw new UserError(`cannot fork ${n} children`, 'n must be an integer from 1 to 1024');
    const startedAt = performance.now();
    const z = await this.zygote(template);
    this.checkOpen(); // (closed while its zygote started)
    // Spares being made now are ready sooner than new forks, which would queue behind them at the zygote.
    z.refillNow?.();
    if (z.spares.length < n && z.refilling) await z.refilling.catch(() => {});
    const take: ProcessSandbox[] = [];
    while (take.length < n && z.spares.length > 0) {
      const s = z.spares.shift()!;
      if (s.running) take.push(this.handOut(s, startedAt)); // (one whose agent died meanwhile has cleaned up after itself)
    }
    const parts = await Promise.allSettled([
      ...take,
      ...chunks(n - take.length, z.limits.pids).map((k) =>
        this.spawnChildren(z, k, true, startedAt),
      ),
    ]);
    const got: ProcessSandbox[] = [];
    const errors: string[] = [];
    for (const p of parts) {
      if (p.status === 'rejected') errors.push((p.reason as Error).message);
      else got.push(...(Array.isArray(p.value) ? p.value : [p.value]));
    }
    this.refill(z, true, got);
    if (errors.length) {
      await Promise.all(got.map((s) => s.kill()));
      throw new UserError(`fork: ${errors.join('; ')}`);
    }
    return got;
  }

  /** Hands out a spare (restored when it was made: its entropy is its own, it answers at once). */
  private handOut(s: ProcessSandbox, startedAt: number): ProcessSandbox {
    s.timings = { startedAt, readyAt: performance.now() };
    this.sandboxes.add(s);
    return s;
  }

  /**
   * Tops the template's spares up to the target, in the background (one refill at a time, in requests of chunks()).
   * `followUp`: once this refill is done, one more for spares handed out meanwhile (not again after that:
   * a template whose forks die at once must not make them forever).
   */
  private refill(z: Zygote, followUp = true, after: ProcessSandbox[] = []): void {
    z.spares = z.spares.filter((s) => s.running);
    const want = this.spareTarget - z.spares.length;
    if (want <= 0 || z.refilling || z.dead || this.closed) return;
    let failed = false;
    const patterned = z.patterned;
    z.refilling = this.firstAnswers(z, after)
      .then(() => (z.dead || this.closed ? [] : Promise.allSettled(chunks(want, z.limits.pids).map((k) => this.spawnChildren(z, k, false)))))
      .then((parts) => {
        for (const p of parts) {
          if (p.status === 'rejected') {
            failed = true;
            this.warn(`forkling: refilling the spare forks of ${z.info.name} failed: ${(p.reason as Error).message}`);
          } else if (z.dead || this.closed || this.zygotes.get(z.info.name) !== z) void Promise.all(p.value.map((s) => s.kill())).catch(() => {}); // (retired meanwhile)
          else {
            if (!patterned) for (const s of p.value) s.beforePattern = true;
            z.spares.push(...p.value);
          }
        }
      })
      .finally(() => {
        z.refilling = null;
        this.pruneRetired();
        // Spares handed out while this refill ran are made now, not at the next fork (after a failure: at the next fork).
        if (followUp && !failed && this.zygotes.get(z.info.name) === z) this.refill(z, false);
        if (!patterned && !failed) void this.renewSpares(z);
      });
  }

  /**
   * The first spares are made at once (a first request waits for them), before the template's
   * pattern: each would hold ~600 KiB more than a spare made after it, for as long as it waits.
   * Once the pattern is there, those still waiting are replaced.
   */
  private async renewSpares(z: Zygote): Promise<void> {
    await this.prepared(z).catch(() => {});
    while (z.refilling) await z.refilling.catch(() => {}); // (its own `want` would not count the spares replaced here)
    if (!z.patterned || z.dead || this.closed || this.zygotes.get(z.info.name) !== z) return;
    const old = z.spares.filter((s) => s.beforePattern);
    if (!old.length) return;
    z.spares = z.spares.filter((s) => !s.beforePattern);
    this.refill(z); // (at once: sparesReady() waits for it)
    await Promise.all(old.map((s) => s.kill().catch(() => {})));
  }

  /** Resolves once each of `sandboxes` has answered a request (or after REFILL_DEFER_MS, or at z.refillNow()). */
  private firstAnswers(z: Zygote, sandboxes: ProcessSandbox[]): Promise<void> {
    if (sandboxes.length === 0) return Promise.resolve();
    return new Promise((resolve) => {
      let left = sandboxes.length;
      const offs: (() => void)[] = [];
      const done = () => {
        if (z.refillNow !== done) return;
        z.refillNow = null;
        clearTimeout(timer);
        for (const off of offs) off();
        resolve();
      };
      const timer = setTimeout(done, REFILL_DEFER_MS);
      timer.unref();
      z.refillNow = done;
      for (const s of sandboxes) {
        const off = s.agent.onIdle(() => {
          off(); // (its first answer only)
          if (--left === 0) done();
        });
        offs.push(off);
      }
    });
  }

  /** Resolves once the template's spare forks (if any are configured) are ready (benchmarks, tests). */
  async sparesReady(template: string): Promise<number> {
    this.checkOpen();
    const z = await this.zygote(template);
    while (z.refilling) await z.refilling;
    return z.spares.length;
  }

  async branch(source: Sandbox, n: number): Promise<Sandbox[]> {
    this.checkOpen();
    if (!(source instanceof ProcessSandbox) || !this.sandboxes.has(source)) {
      throw new UserError('branch: the source is not a live sandbox of this process engine');
    }
    if (!Number.isInteger(n) || n < 1 || n > 1024) throw new UserError(`cannot branch ${n} children`, 'n must be an integer from 1 to 1024');
    return this.spawnChildren(source, n, true);
  }

  /** Asks `parent` (a zygote or a sandbox) for n forks; places, connects and restores each; `handOut`: they are live sandboxes now (not spares). */
  private async spawnChildren(from: Zygote | ProcessSandbox, n: number, handOut: boolean, startedAt = performance.now()): Promise<ProcessSandbox[]> {
    const source = from instanceof ProcessSandbox ? from : undefined;
    const zygote = source ? source.zygote : (from as Zygote);
    const [parent, parentPid, sub, limits, template, gate] = source
      ? [source.agent, source.hostPid, 'b' as const, source.limits, source.template, undefined]
      : [zygote!.client, zygote!.pid, 's' as const, zygote!.limits, zygote!.info.name, zygote!.requests];
    await gate?.enter();
    // A zygote's request holds a place at its gate and counts its children in its CPU limit
    // (forkCpu) while they may be in its cgroup; both are given back together.
    let holding = gate !== undefined;
    if (holding) this.forkCpu(zygote!, n);
    const leave = () => {
      if (holding) {
        gate!.leave();
        this.forkCpu(zygote!, -n);
      }
      holding = false;
    };
    const ids = Array.from({ length: n }, newId);
    const op = sub === 's' ? 'fork' : 'branch';
    const children = ids.map((id) => ({ id, hostname: id }));
    if (!source) this.forkAllowance(zygote!, n);
    const cgroups = new Map<string, Cgroup | null>();
    const made: ProcessSandbox[] = [];
    let slowestMoveMs = 0; // (the first move after a quiet spell may wait for an RCU grace period: doctor's "cgroup moves")
    // The parent's children found (by pidfd), not sandboxes yet: killed if we give up on them.
    const found = new Map<number, ProcessRef>();
    const placed = new Set<string>(); // children already in their own cgroups
    const taken = this.hostPids();
    const place = (id: string, ref: ProcessRef) => {
      const cg = cgroups.get(id);
      const at = performance.now();
      if (cg) this.cgroups.enter(cg, ref.pid);
      slowestMoveMs = Math.max(slowestMoveMs, performance.now() - at);
      placed.add(id);
    };
    // A branch child is charged to its source's cgroup until it is in its own, and the copy of
    // the source's writable layer it makes can be as large as the source's memory limit: held
    // (hold), each child waits until we have moved it and sent it HOLD_SIGNAL, and the source
    // says each child's pid (event forked) as soon as it is forked.
    const onForked = (ev: { ev: 'forked'; child: string; pid: number }) => {
      if (!cgroups.has(ev.child) || placed.has(ev.child) || found.has(ev.pid)) return; // (not asked for, or twice: the answer is checked)
      const ref = forksByNsPid(parentPid, new Set([ev.pid]), false).get(ev.pid);
      if (!ref) return; // (gone, or not a fork of the source: it fails at its time limit, and the answer says so)
      if (taken.has(ref.pid)) {
        ref.release(); // (another sandbox of ours: refused again with the answer)
        return;
      }
      found.set(ev.pid, ref);
      place(ev.child, ref);
      ref.signal(HOLD_SIGNAL);
    };
    const hold = sub === 'b' && this.cgroups.mode !== 'none';
    // The kernel's wait before our first move into a child's cgroup, taken while the parent forks
    // (a move of the parent into the cgroup it is in): one fork at a time answered in 13-14 ms, not 22-24 (paired runs).
    const parentCgroup = source ? source.cgroup : zygote!.cgroup;
    if (parentCgroup) void this.cgroups.prearm(parentCgroup, parentPid);
    // (bounded: a branch's source is user code, which may never answer; a fork server waits READY_TIMEOUT_S for its children)
    const reply =
      sub === 'b'
        ? parent.request('branch', { children, ...(hold ? { hold } : {}) }, { timeoutMs: SPAWN_ANSWER_MS, ...(hold ? { onEvent: onForked } : {}) })
        : parent.request('fork', { children }, { timeoutMs: SPAWN_ANSWER_MS });
    const killFound = () => {
      for (const ref of found.values()) {
        ref.signal('SIGKILL');
        ref.release();
      }
      found.clear();
    };
    try {
      // While the parent forks: the children's cgroups (made before any event of the request is handled).
      for (const id of ids) cgroups.set(id, this.cgroups.create(id, limits));
      const cgroupsAt = performance.now();
      const res = await reply;
      const replyAt = performance.now();
      // The parent (a branch's source: a sandbox) must answer for exactly the children asked for, once each.
      const answered = res.children.map((c) => c.id);
      const unseen = new Set(res.children.flatMap((c) => (c.ok && c.pid !== undefined && !found.has(c.pid) ? [c.pid] : [])));
      for (const [nsPid, ref] of forksByNsPid(parentPid, unseen, sub === 's')) found.set(nsPid, ref);
      // A branch's source (user code in its PID 1) chooses the pids it answers with: never one
      // of a sandbox we already have (we would move, restore and on failure kill it).
      const foreign = new Map<number, number>();
      for (const [nsPid, ref] of found) {
        if (!taken.has(ref.pid)) continue;
        foreign.set(nsPid, ref.pid);
        ref.release();
        found.delete(nsPid);
      }
      if (answered.length !== n || new Set(answered).size !== n || !answered.every((id) => cgroups.has(id))) {
        throw new UserError(`${op}: the parent answered for ${answered.length} children, not for the ${n} asked for, each once`);
      }
      const failed = res.children.filter((c) => !c.ok);
      const settled = Promise.allSettled(
        res.children
          .filter((c) => c.ok)
          .map(async (c) => {
            const other = foreign.get(c.pid ?? -1);
            if (other !== undefined) throw new Error(`child ${c.id}: the ${op} parent answered with process ${other}, which is another sandbox's`);
            const ref = found.get(c.pid ?? -1);
            if (!ids.includes(c.id) || ref === undefined) throw new Error(`child ${c.id}: no such process under the ${op} parent`);
            found.delete(c.pid ?? -1); // (ours to kill or to keep, from here; a pid answered twice is found once)
            const cg = cgroups.get(c.id) ?? null;
            let agent: AgentClient;
            try {
              if (!placed.has(c.id)) place(c.id, ref);
              // (connectAgent checks that the child itself listens there: a branch's source can reach its branches' roots)
              agent = await connectAgent(ref.pid, { restore: { entropy: randomBytes(64), hostname: c.id, sandboxId: c.id }, expectId: c.id });
            } catch (e) {
              ref.signal('SIGKILL');
              ref.release();
              throw new Error(`child ${c.id}: ${(e as Error).message}`);
            }
            const sb = new ProcessSandbox(c.id, agent, { startedAt, readyAt: performance.now() }, ref, cg, this, template, limits);
            cgroups.delete(c.id);
            sb.zygote = zygote;
            if (source) {
              sb.parent = source;
              source.branches.add(sb);
            }
            if (handOut) this.sandboxes.add(sb);
            made.push(sb);
            return sb;
          }),
      );
      leave(); // each child is in its own cgroup now (entered before the first await above), or failed
      const results = await settled;
      this.lastSpawn = {
        n,
        cgroupsMs: cgroupsAt - startedAt,
        replyMs: replyAt - startedAt,
        readyMs: performance.now() - startedAt,
        childSetupMsMedian: median(res.children.map((c) => c.setupMs ?? Number.NaN)),
        slowestMoveMs,
      };
      killFound(); // (answered for, but not ok: none should be left)
      const errors = [...failed.map((c) => `${c.id}: ${c.error ?? 'failed'}`), ...results.filter((r) => r.status === 'rejected').map((r) => String((r as PromiseRejectedResult).reason?.message ?? r))];
      if (errors.length) throw new UserError(`${op}: ${errors.length} of ${n} children failed: ${errors.slice(0, 3).join('; ')}`);
      return ids.map((id) => made.find((s) => s.id === id)!);
    } catch (e) {
      leave();
      killFound();
      await Promise.all(made.map((s) => s.kill()));
      await reply.catch(() => {});
      for (const cg of cgroups.values()) if (cg) await this.cgroups.remove(cg).catch(() => {});
      throw e;
    }
  }

  /** Raises the zygote's memory limit for `n` more forks (FORK_SETUP_BYTES each, and what each copies ahead) beside those alive now. */
  private forkAllowance(z: Zygote, n: number): void {
    if (!z.cgroup) return;
    const live = [...this.sandboxes, ...this.holding].filter((s) => s.zygote === z).length + z.spares.length;
    const perFork = FORK_SETUP_BYTES + (this.prefault ? PREFAULT_MAX_BYTES : 0) + z.shmBytes;
    const want = z.limits.memoryBytes + (live + n + 1) * perFork; // (+1: the template's pattern child)
    if (want <= z.memoryLimit) return;
    try {
      this.cgroups.setMemoryLimit(z.cgroup, want);
      z.memoryLimit = want;
    } catch (e) {
      this.warn(`forkling: raising the memory limit of the zygote of ${z.info.name} for its forks failed: ${(e as Error).message}`);
    }
  }

  /** Counts `delta` more (or fewer) of the zygote's forks in its cgroup and sets its CPU limit to match (zygoteCpus). */
  private forkCpu(z: Zygote, delta: number): void {
    z.forking += delta;
    const want = zygoteCpus(z.limits.cpus, z.forking, availableParallelism());
    if (!z.cgroup || z.dead || want === z.cpuLimit) return;
    try {
      this.cgroups.setCpuLimit(z.cgroup, want);
      z.cpuLimit = want;
    } catch (e) {
      this.warn(`forkling: setting the CPU limit of the zygote of ${z.info.name} for its forks failed: ${(e as Error).message}`);
    }
  }

  /** Where the time of the last fork or branch request went (benchmarks; a fork of more than 25 is several requests: the last one to finish): cgroups made, parent's reply (every child listening), all restored. */
  lastSpawn: { n: number; cgroupsMs: number; replyMs: number; readyMs: number; childSetupMsMedian: number; slowestMoveMs: number } | null = null;

  /** Host pids of the PID 1s of every sandbox this engine holds (live, spare or held). */
  private hostPids(): Set<number> {
    const pids = new Set<number>();
    for (const s of this.sandboxes) pids.add(s.hostPid);
    for (const s of this.holding) pids.add(s.hostPid);
    for (const z of [...this.zygotes.values(), ...this.retired]) {
      pids.add(z.pid);
      for (const s of z.spares) pids.add(s.hostPid);
    }
    return pids;
  }

  warnLine(line: string): void {
    this.warn(line);
  }

  forget(sb: ProcessSandbox): void {
    this.sandboxes.delete(sb);
    for (const z of [...this.zygotes.values(), ...this.retired]) {
      const i = z.spares.indexOf(sb);
      if (i >= 0) z.spares.splice(i, 1);
    }
    this.pruneRetired();
  }

  /**
   * A zygote replaced by a new template of its name lives on while sandboxes
   * forked from it do (they are in its pid namespace): it goes with the last.
   */
  pruneRetired(): void {
    for (const z of [...this.retired]) {
      const inUse = z.refilling !== null || [...this.sandboxes, ...this.holding].some((s) => s.zygote === z);
      if (inUse && !z.dead) continue;
      this.retired.splice(this.retired.indexOf(z), 1);
      z.client.close(); // (its connection's end destroys its root)
    }
  }

  private checkOpen() {
    if (this.closed) throw new Error('the process engine is closed');
  }

  /** Console lines of a template's zygote (the output of its warm-up and of every fork's stray prints). */
  zygoteConsole(template: string): readonly string[] {
    return this.zygotes.get(template)?.console ?? [];
  }

  /** Host pid of a template's zygote (tests, benchmarks). */
  zygotePid(template: string): number | null {
    return this.zygotes.get(template)?.pid ?? null;
  }

  async close(): Promise<void> {
    if (!this.closing) this.closing = this.closeOnce();
    return this.closing;
  }

  private async closeOnce(): Promise<void> {
    this.closed = true;
    // A template's zygote being started (a first prepare or fork) is one of the roots once it is: else it would
    // outlive the engine. (A template still being made is not waited for: it finds the engine closed.)
    await Promise.allSettled([...this.starting]);
    const roots = [...this.zygotes.values(), ...this.retired];
    for (const z of roots) await z.refilling;
    await Promise.all([...this.sandboxes, ...roots.flatMap((z) => z.spares)].map((s) => s.kill()));
    await Promise.all([...this.holding].map((s) => s.finished));
    this.zygotes.clear();
    for (const z of roots) z.client.close();
    await Promise.all([...roots, ...this.booted].map((r) => this.destroyRoot(r)));
    this.cgroups.close();
    const failed = removeTree(dirname(this.dir), this.dir);
    if (failed) this.warn(`forkling: the engine's runtime directory: ${failed}`);
    process.removeListener('exit', this.onExit);
  }

  /** process 'exit': no more event loop; kill what we started (PDEATHSIG does the rest). */
  private killAllNow(): void {
    for (const r of [...this.zygotes.values(), ...this.retired, ...this.booted]) {
      try {
        r.proc.signal('SIGKILL');
      } catch {}
    }
  }
}

/** The host's KSM switch (0 off, 1 running, 2 unmerging), or null where the kernel has no KSM. */
export function ksmRun(): string | null {
  try {
    return readFileSync('/sys/kernel/mm/ksm/run', 'utf8').trim();
  } catch {
    return null;
  }
}

function templateFile(name: string): string {
  return storePath('process-templates', `${name}.json`);
}
