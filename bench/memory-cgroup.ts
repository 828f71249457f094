// A memory cgroup (v2) of this process's own, for benchmarks that charge what
// the kernel allocates for our VMs (KVM's structures, page tables, kernel
// stacks) to one account: memory.current and memory.stat count it all, where
// /proc/meminfo is system-wide and smaps sees only user memory. Needs root.
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, readdirSync, readFileSync, rmdirSync, writeFileSync } from 'node:fs';

const ROOT = '/sys/fs/cgroup';

export interface MemoryCgroup {
  readonly dir: string;
  /** memory.current, KiB. */
  currentKiB(): number;
  /** memory.stat, KiB (byte fields only: counters of events are left out). */
  stat(): Record<string, number>;
  /** Moves this process back to the root and removes the cgroup. */
  leave(): void;
}

/** Fields of memory.stat that count events or pages, not bytes. */
const NOT_BYTES = /^(pg|workingset_|thp_|numa_)|_(fault|events)$/;

/** Moves this process into a new memory cgroup; mounts cgroup v2 where nothing is mounted (the lab). */
export function enterMemoryCgroup(name: string): MemoryCgroup {
  if (!existsSync(`${ROOT}/cgroup.controllers`)) {
    // Mounted here only where nothing is (the lab): a host with cgroup v1 there keeps it.
    if (readdirSync(ROOT).length > 0) throw new Error(`a memory cgroup needs cgroup v2 at ${ROOT} (this host has v1 there): run it in the lab`);
    execFileSync('mount', ['-t', 'cgroup2', 'none', ROOT]);
  }
  writeFileSync(`${ROOT}/cgroup.subtree_control`, '+memory');
  const dir = `${ROOT}/${name}-${process.pid}`;
  mkdirSync(dir);
  try {
    writeFileSync(`${dir}/cgroup.procs`, String(process.pid));
  } catch (e) {
    rmdirSync(dir);
    throw e;
  }
  let left = false;
  return {
    dir,
    currentKiB: () => Number(readFileSync(`${dir}/memory.current`, 'utf8')) / 1024,
    stat: () => {
      const out: Record<string, number> = {};
      for (const line of readFileSync(`${dir}/memory.stat`, 'utf8').split('\n')) {
        const [k, v] = line.split(' ');
        if (k && v && !NOT_BYTES.test(k)) out[k] = Number(v) / 1024;
      }
      return out;
    },
    leave: () => {
      if (left) return;
      left = true;
      try {
        writeFileSync(`${ROOT}/cgroup.procs`, String(process.pid));
        rmdirSync(dir);
      } catch (e) {
        console.error(`could not remove the bench's cgroup ${dir}: ${(e as Error).message}`);
      }
    },
  };
}
