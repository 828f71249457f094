// Resource limits for process-engine sandboxes: one cgroup per sandbox
// (memory, pids, cpu; freezer for pause), under a directory per engine inside
// the cgroup this process already runs in. cgroup v1 hierarchies are used
// where the controllers are bound there (hybrid hosts), else cgroup v2 where
// the controllers can be enabled below us (moving this process into a leaf
// of its own where it is alone in its cgroup); otherwise no limits, with one
// warning that says why.
import { existsSync, mkdirSync, readdirSync, readFileSync, rmdirSync, writeFileSync } from 'node:fs';
import { writeFile } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { pollUntil } from '../../util/poll.ts';
import { processRunning } from '../../util/process.ts';

export interface CgroupLimits {
  memoryBytes: number;
  pids: number;
  /** CPU time in cores (1 = one core's worth per period). */
  cpus: number;
}

export interface Cgroup {
  name: string;
  /** cgroup.procs of each hierarchy: write a pid to move that process in. */
  procs: string[];
  dirs: string[];
  /** Frozen by freeze() and not thawed since (a v1-frozen process holds its SIGKILL until thawed). */
  frozen?: boolean;
}

type Controller = 'memory' | 'pids' | 'cpu' | 'freezer';
const WANTED: Controller[] = ['memory', 'pids', 'cpu', 'freezer'];

interface MountInfo {
  fstype: string;
  mountPoint: string;
  root: string;
  superOptions: string[];
}

function mounts(): MountInfo[] {
  const out: MountInfo[] = [];
  for (const line of readFileSync('/proc/self/mountinfo', 'utf8').split('\n')) {
    const dash = line.indexOf(' - ');
    if (dash < 0) continue;
    const pre = line.slice(0, dash).split(' ');
    const post = line.slice(dash + 3).split(' ');
    if (pre.length < 5 || post.length < 3) continue;
    out.push({ fstype: post[0]!, mountPoint: unescapeMount(pre[4]!), root: unescapeMount(pre[3]!), superOptions: post[2]!.split(',') });
  }
  return out;
}

const unescapeMount = (s: string) => s.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(Number.parseInt(o, 8)));

/** A process's cgroup paths (default: this process's): v1 controller -> path, and '' -> the v2 path. */
function ownCgroups(pid: number | 'self' = 'self'): Map<string, string> {
  const m = new Map<string, string>();
  for (const line of readFileSync(`/proc/${pid}/cgroup`, 'utf8').split('\n')) {
    const [, ctrls, path] = /^\d+:([^:]*):(.*)$/.exec(line) ?? [];
    if (ctrls === undefined || path === undefined) continue;
    if (ctrls === '') m.set('', path);
    for (const c of ctrls.split(',')) if (c) m.set(c, path);
  }
  return m;
}

function under(mount: MountInfo, path: string): string {
  // The mount shows the hierarchy from mount.root; our path is absolute in the hierarchy.
  const rel = mount.root === '/' ? path : path.startsWith(mount.root) ? path.slice(mount.root.length) : path;
  return join(mount.mountPoint, rel);
}

/**
 * The engine directories (forkling-p<pid>-...) of engine process `pid`, in
 * the pids hierarchy (v1) or the unified one (v2): what a check from outside
 * (tests, benchmarks) counts an engine's cgroups and processes by.
 */
export function engineDirsOf(pid: number): string[] {
  const ms = mounts();
  const paths = ownCgroups(pid);
  const v1 = ms.find((x) => x.fstype === 'cgroup' && x.superOptions.includes('pids'));
  const v2 = ms.find((x) => x.fstype === 'cgroup2');
  const path = v1 ? paths.get('pids') : paths.get('');
  const mount = v1 ?? v2;
  if (!mount || path === undefined) return [];
  const parent = v2Home(under(mount, path), pid); // (v1: no leaf, its own cgroup)
  let names: string[] = [];
  try {
    names = readdirSync(parent);
  } catch {}
  return names.filter((n) => n.startsWith(`forkling-p${pid}-`)).map((n) => join(parent, n));
}

/** The leaf cgroup (v2) this process moves into so that the cgroup it ran in may hold its sandboxes' cgroups. */
const hostLeaf = (pid: number) => `forkling-host-p${pid}`;

/** The cgroup (v2) whose children process `pid`'s engine directories are: its own, or above its leaf once it moved into it. */
function v2Home(own: string, pid = process.pid): string {
  return basename(own) === hostLeaf(pid) ? dirname(own) : own;
}

/** Enables controllers (v2) for the cgroups below `dir`. */
const enableBelow = (dir: string, want: string[]) => writeFileSync(join(dir, 'cgroup.subtree_control'), want.map((c) => `+${c}`).join(' '));

/**
 * Enables controllers (v2) for the cgroups below `mine`; null, or why not.
 * Outside the root, a cgroup that holds processes cannot ("no internal
 * processes"): where the only one is this process (a cgroup given to it
 * alone, e.g. by `systemd-run --scope -p Delegate=yes`), it moves into a leaf
 * of its own below `mine` first, as container runtimes do.
 */
function enableV2(mine: string, want: string[]): string | null {
  const fix = 'run forkling in a cgroup of its own that it may write, e.g. `systemd-run --scope -p Delegate=yes forkling ...`';
  try {
    enableBelow(mine, want);
    return null;
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    if (code !== 'EBUSY') return `${code}; ${fix}`;
  }
  let procs: number[] = [];
  try {
    procs = readFileSync(join(mine, 'cgroup.procs'), 'utf8').split('\n').filter(Boolean).map(Number);
  } catch {}
  const others = procs.filter((p) => p !== process.pid);
  if (others.length) {
    return `other processes are in it (${others.slice(0, 5).join(', ')}${others.length > 5 ? ', ...' : ''}), and a cgroup with processes cannot pass controllers on; ${fix}`;
  }
  try {
    const leaf = join(mine, hostLeaf(process.pid));
    mkdirSync(leaf, { recursive: true });
    writeFileSync(join(leaf, 'cgroup.procs'), String(process.pid));
    enableBelow(mine, want);
    return null;
  } catch (e) {
    return `moving this process into a leaf cgroup of its own failed (${(e as NodeJS.ErrnoException).code}); ${fix}`;
  }
}

/**
 * Engine directories (forkling-p<pid>-...) of processes that are gone. Their
 * sandboxes should have died with them (the lifeline), but one whose code
 * defeated that (its agent is Python it can patch) is killed here first.
 */
function removeStale(parent: string): void {
  let names: string[] = [];
  try {
    names = readdirSync(parent);
  } catch {
    return;
  }
  for (const name of names) {
    const m = /^forkling-(?:host-p(\d+)|p(\d+)-[0-9a-f]+)$/.exec(name);
    if (!m || processRunning(Number(m[1] ?? m[2]))) continue;
    const dir = join(parent, name);
    try {
      for (const e of readdirSync(dir, { withFileTypes: true })) {
        if (!e.isDirectory()) continue;
        const sub = join(dir, e.name);
        for (let tries = 0; rmdirState(sub) === 'busy' && tries < 50; tries++) {
          empty(sub);
          Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 10); // (they die asynchronously; start-up only)
        }
      }
      rmdirSync(dir);
    } catch {}
  }
}

/**
 * A cgroup directory and the cgroups made below it, deepest first: a sandbox
 * whose root is the owner of its cgroup (without root on the host) can mount
 * its cgroup namespace and make some; bounded, as a sandbox could nest them deep.
 */
function withDescendants(dir: string): string[] {
  const out: string[] = [];
  const todo = [dir];
  while (todo.length && out.length < 4096) {
    const d = todo.pop()!;
    out.push(d);
    try {
      for (const e of readdirSync(d, { withFileTypes: true })) if (e.isDirectory()) todo.push(join(d, e.name));
    } catch {}
  }
  return out.reverse();
}

/** rmdir of a cgroup directory, after the cgroups below it: gone, busy (processes are in it) or failed otherwise. */
function rmdirState(dir: string): 'gone' | 'busy' | 'failed' {
  let state: 'gone' | 'busy' | 'failed' = 'gone';
  for (const d of withDescendants(dir)) {
    try {
      rmdirSync(d);
      state = 'gone';
    } catch (e) {
      const code = (e as NodeJS.ErrnoException).code;
      state = code === 'ENOENT' ? 'gone' : code === 'EBUSY' ? 'busy' : 'failed';
    }
  }
  return state;
}

/**
 * What keeps a cgroup directory from going: thaws it and the cgroups below
 * it (a frozen process holds its SIGKILL; v1 freezer or v2) and SIGKILLs the
 * processes in them (cgroup.kill where there is one: v2, Linux 5.14).
 */
function empty(dir: string): void {
  for (const d of withDescendants(dir)) {
    for (const [file, value] of [
      ['freezer.state', 'THAWED'],
      ['cgroup.freeze', '0'],
      ['cgroup.kill', '1'],
    ] as const) {
      try {
        writeFileSync(join(d, file), value);
      } catch {} // (not this version's file, or not a freezer hierarchy)
    }
    let pids: string[] = [];
    try {
      pids = readFileSync(join(d, 'cgroup.procs'), 'utf8').split('\n').filter(Boolean);
    } catch {}
    for (const pid of pids) {
      try {
        process.kill(Number(pid), 'SIGKILL');
      } catch {}
    }
  }
}

/** `cpus` CPUs' worth of time per 100 ms period (a new cgroup's period is the kernel's default, 100000 µs). */
function writeCpuLimit(dir: string, cpus: number, mode: 'v1' | 'v2'): void {
  const quota = Math.max(1000, Math.round(cpus * 100000));
  if (mode === 'v1') writeFileSync(join(dir, 'cpu.cfs_quota_us'), String(quota));
  else writeFileSync(join(dir, 'cpu.max'), `${quota} 100000`);
}

/**
 * A v1 memory cgroup's limit, and its memory + swap limit to the same (as v2's
 * memory.swap.max 0: else a sandbox could swap its way past its limit; the
 * file exists only where the kernel accounts swap). Memory + swap is never
 * below memory alone: raised first, lowered last.
 */
function writeV1MemoryLimit(dir: string, bytes: number): void {
  const memsw = join(dir, 'memory.memsw.limit_in_bytes');
  const swap = existsSync(memsw);
  const raise = swap && bytes > Number(readFileSync(memsw, 'utf8'));
  if (raise) writeFileSync(memsw, String(bytes));
  writeFileSync(join(dir, 'memory.limit_in_bytes'), String(bytes));
  if (swap && !raise) writeFileSync(memsw, String(bytes));
}

export class CgroupTree {
  readonly mode: 'v1' | 'v2' | 'none';
  /** Why there are no (or only some) limits; null when all is well. */
  readonly warning: string | null;
  private readonly v1: Map<Controller, string> = new Map(); // controller -> our engine dir
  private v2dir: string | null = null;
  private readonly roots: string[] = [];

  constructor(tag: string) {
    let warning: string | null = null;
    let mode: 'v1' | 'v2' | 'none' = 'none';
    try {
      const ms = mounts();
      const own = ownCgroups();
      // What engines that are gone left: the freezer's first (a frozen task holds its SIGKILL, and
      // while it lives its other cgroups cannot go).
      for (const c of ['freezer', ...WANTED.filter((x) => x !== 'freezer')]) {
        const m = ms.find((x) => x.fstype === 'cgroup' && x.superOptions.includes(c));
        const path = own.get(c);
        if (m && path !== undefined) removeStale(under(m, path));
      }
      for (const c of WANTED) {
        const m = ms.find((x) => x.fstype === 'cgroup' && x.superOptions.includes(c));
        const path = own.get(c);
        if (!m || path === undefined) continue;
        const dir = join(under(m, path), tag);
        try {
          mkdirSync(dir, { recursive: true });
          this.v1.set(c, dir);
          this.roots.push(dir);
        } catch (e) {
          warning = `cannot create ${dir}: ${(e as NodeJS.ErrnoException).code}`;
        }
      }
      if (this.v1.has('memory') || this.v1.has('pids')) {
        mode = 'v1';
        const missing = WANTED.filter((c) => c !== 'freezer' && !this.v1.has(c));
        if (missing.length) warning = `cgroup v1 without ${missing.join(', ')}: those limits are off`;
      } else {
        const m2 = ms.find((x) => x.fstype === 'cgroup2');
        const path = own.get('');
        if (m2 && path !== undefined) {
          const mine = v2Home(under(m2, path));
          const avail = readFileSync(join(mine, 'cgroup.controllers'), 'utf8').trim().split(/\s+/);
          const want = ['memory', 'pids', 'cpu'].filter((c) => avail.includes(c));
          if (want.length === 0) {
            warning = `${warning ? `${warning}; ` : ''}cgroup v2 at ${mine} offers none of memory, pids, cpu to us`;
          } else {
            removeStale(mine);
            const why = enableV2(mine, want);
            if (why) {
              warning = `cgroup v2: cannot enable ${want.join(', ')} below ${mine}: ${why}`;
            } else {
              const dir = join(mine, tag);
              mkdirSync(dir, { recursive: true });
              this.roots.push(dir);
              enableBelow(dir, want);
              this.v2dir = dir;
              mode = 'v2';
            }
          }
        } else {
          warning = warning ?? 'no usable cgroup hierarchy (v1 or v2) is mounted';
        }
      }
    } catch (e) {
      warning = `cgroups unavailable: ${(e as Error).message}`;
    }
    this.mode = mode;
    this.warning = mode === 'none' ? `${warning ?? 'no cgroups'}; sandboxes run without memory, pids and cpu limits` : warning;
  }

  get canFreeze(): boolean {
    return this.v1.has('freezer') || this.v2dir !== null;
  }

  /** A cgroup for one sandbox with its limits; null when the host gives us none. */
  create(name: string, limits: CgroupLimits): Cgroup | null {
    if (this.mode === 'none') return null;
    const cg: Cgroup = { name, procs: [], dirs: [] };
    try {
      if (this.mode === 'v1') {
        for (const [c, root] of this.v1) {
          const dir = join(root, name);
          mkdirSync(dir);
          cg.dirs.push(dir);
          cg.procs.push(join(dir, 'cgroup.procs'));
          if (c === 'memory') writeV1MemoryLimit(dir, limits.memoryBytes);
          if (c === 'pids') writeFileSync(join(dir, 'pids.max'), String(limits.pids));
          if (c === 'cpu') writeCpuLimit(dir, limits.cpus, 'v1');
        }
      } else if (this.v2dir) {
        const dir = join(this.v2dir, name);
        mkdirSync(dir);
        cg.dirs.push(dir);
        cg.procs.push(join(dir, 'cgroup.procs'));
        const ctl = readFileSync(join(dir, 'cgroup.controllers'), 'utf8');
        if (ctl.includes('memory')) {
          writeFileSync(join(dir, 'memory.max'), String(limits.memoryBytes));
          // (the file exists only where the kernel accounts swap)
          const swap = join(dir, 'memory.swap.max');
          if (existsSync(swap)) writeFileSync(swap, '0');
        }
        if (ctl.includes('pids')) writeFileSync(join(dir, 'pids.max'), String(limits.pids));
        if (ctl.includes('cpu')) writeCpuLimit(dir, limits.cpus, 'v2');
      }
    } catch (e) {
      for (const d of cg.dirs) rmdirState(d); // (empty yet: nothing in it)
      throw e;
    }
    return cg;
  }

  /** Sets the cgroup's memory limit (with swap, where the kernel accounts it, to the same: as create()). */
  setMemoryLimit(cg: Cgroup, bytes: number): void {
    for (const d of cg.dirs) {
      if (existsSync(join(d, 'memory.limit_in_bytes'))) {
        writeV1MemoryLimit(d, bytes);
      } else if (existsSync(join(d, 'memory.max'))) {
        writeFileSync(join(d, 'memory.max'), String(bytes));
      }
    }
  }

  /** Sets the cgroup's CPU limit (CPUs' worth of time per period: as create()). */
  setCpuLimit(cg: Cgroup, cpus: number): void {
    for (const d of cg.dirs) {
      if (existsSync(join(d, 'cpu.cfs_quota_us'))) writeCpuLimit(d, cpus, 'v1');
      else if (existsSync(join(d, 'cpu.max'))) writeCpuLimit(d, cpus, 'v2');
    }
  }

  /** Moves a process (and later its children) into the cgroup. */
  enter(cg: Cgroup, pid: number): void {
    for (const f of cg.procs) writeFileSync(f, String(pid));
  }

  /**
   * Starts, on a thread-pool thread, the wait the next moves would each begin with. Where the
   * hierarchy lacks favordynmods, a move waits for an RCU grace period (7-8 ms here) unless
   * another move ended just before (the kernel's cgroup_threadgroup_rwsem). Moving `pid` into
   * `cg`, where it already is, changes nothing but takes that wait now: moves made meanwhile or
   * within a grace period after it do not wait again. Never throws (an optimisation only).
   */
  async prearm(cg: Cgroup, pid: number): Promise<void> {
    const f = cg.procs[0];
    if (f) await writeFile(f, String(pid)).catch(() => {});
  }

  /** Host pids of every process in the cgroup. */
  pids(cg: Cgroup): number[] {
    const f = cg.procs[0];
    if (!f) return [];
    try {
      return readFileSync(f, 'utf8')
        .split('\n')
        .filter(Boolean)
        .map(Number);
    } catch {
      return [];
    }
  }

  memoryBytes(cg: Cgroup): number | null {
    for (const d of cg.dirs) {
      for (const f of ['memory.usage_in_bytes', 'memory.current']) {
        try {
          return Number(readFileSync(join(d, f), 'utf8'));
        } catch {}
      }
    }
    return null;
  }

  /**
   * Resolves once a freeze asked of the cgroup has taken hold (a freezer
   * finishes asynchronously: v1 reads FREEZING, v2's cgroup.events says
   * frozen 0, until every task has stopped), or after `timeoutMs`.
   */
  async frozen(cg: Cgroup, timeoutMs = 2000): Promise<boolean> {
    const v1 = this.mode === 'v1' ? cg.dirs.find((x) => x.startsWith(this.v1.get('freezer') ?? '\0')) : undefined;
    const check = (): boolean => {
      try {
        if (v1) return readFileSync(join(v1, 'freezer.state'), 'utf8').trim() === 'FROZEN';
        if (this.mode === 'v2' && cg.dirs[0]) return /^frozen 1$/m.test(readFileSync(join(cg.dirs[0], 'cgroup.events'), 'utf8'));
      } catch {}
      return true; // no freezer, or the cgroup is gone: nothing to wait for
    };
    return pollUntil(check, timeoutMs, 20);
  }

  /** Freezes (true) or thaws the cgroup; false when no freezer is available. */
  freeze(cg: Cgroup, frozen: boolean): boolean {
    if (this.mode === 'v1' && this.v1.has('freezer')) {
      const d = cg.dirs.find((x) => x.startsWith(this.v1.get('freezer')!));
      if (!d) return false;
      return this.writeFreeze(cg, join(d, 'freezer.state'), frozen ? 'FROZEN' : 'THAWED', frozen);
    }
    if (this.mode === 'v2' && cg.dirs[0]) return this.writeFreeze(cg, join(cg.dirs[0], 'cgroup.freeze'), frozen ? '1' : '0', frozen);
    return false;
  }

  /** false once the cgroup is gone (removed meanwhile: its sandbox ended), rather than an error for a caller to lose. */
  private writeFreeze(cg: Cgroup, file: string, value: string, frozen: boolean): boolean {
    try {
      writeFileSync(file, value);
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === 'ENOENT') return false;
      throw e;
    }
    cg.frozen = frozen;
    return true;
  }

  /**
   * Removes the cgroup once its processes are gone (they die asynchronously
   * after their pid namespace's init: rmdir is retried until then, and what
   * is still there is thawed and killed again).
   */
  async remove(cg: Cgroup, timeoutMs = 5000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    let wait = 1;
    for (;;) {
      const left = cg.dirs.filter((d) => rmdirState(d) !== 'gone');
      if (left.length === 0) return;
      if (Date.now() > deadline) throw new Error(`cgroup ${cg.name} still busy after ${timeoutMs} ms: ${left.join(', ')}`);
      for (const d of left) empty(d);
      await new Promise((r) => setTimeout(r, wait));
      wait = Math.min(wait * 2, 50);
    }
  }

  /** Removes the engine's directories (after every sandbox cgroup is gone). */
  close(): void {
    for (const r of this.roots) {
      try {
        for (const e of readdirSync(r, { withFileTypes: true })) {
          if (e.isDirectory()) rmdirSync(join(r, e.name));
        }
        rmdirSync(r);
      } catch {}
    }
  }
}
