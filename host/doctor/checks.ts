// Host checks shared by `forkling doctor` and engine selection. Each check is
// quick, reads the system as it is, and says how to fix what fails.
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { accessSync, constants, existsSync, readFileSync, statfsSync } from 'node:fs';
import { release } from 'node:os';
import { dirname } from 'node:path';
import { CgroupTree } from '../engine/process/cgroups.ts';
import { storeRoot } from '../store.ts';
import { probeKvm } from './kvm-probe.ts';

export interface Check {
  name: string;
  status: 'pass' | 'warn' | 'fail';
  detail: string;
  fix?: string;
}

export interface DoctorReport {
  ok: boolean;
  engine: 'kvm' | 'process';
  engineReason: string;
  checks: Check[];
}

const readText = (p: string): string | undefined => {
  try {
    return readFileSync(p, 'utf8').trim();
  } catch {
    return undefined;
  }
};

const which = (cmd: string): boolean => spawnSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' }).status === 0;

function nodeCheck(): Check {
  const major = Number(process.versions.node.split('.')[0]);
  return major >= 20
    ? { name: 'node', status: 'pass', detail: `Node.js ${process.versions.node}` }
    : { name: 'node', status: 'fail', detail: `Node.js ${process.versions.node} is too old`, fix: 'install Node.js 20 or newer' };
}

/** The host kernel: 5.10 or newer; from 5.14 (MADV_POPULATE_WRITE), process-engine forks copy ahead the pages they will write. */
export function kernelCheck(r = release()): Check {
  const [maj = 0, min = 0] = r.split('.').map((x) => Number.parseInt(x, 10));
  const atLeast = (a: number, b: number): boolean => maj > a || (maj === a && min >= b);
  if (!atLeast(5, 10)) return { name: 'host kernel', status: 'warn', detail: `Linux ${r} is older than 5.10; untested`, fix: 'use a host kernel 5.10 or newer' };
  if (!atLeast(5, 14)) {
    return {
      name: 'host kernel',
      status: 'warn',
      detail: `Linux ${r}: process-engine forks cannot copy ahead the pages they will write (MADV_POPULATE_WRITE came in 5.14): each takes a page fault per page instead (1.2-2x the CPU in a fork's own process, measured on a 2-core VM host)`,
      fix: 'use a host kernel 5.14 or newer',
    };
  }
  return { name: 'host kernel', status: 'pass', detail: `Linux ${r}` };
}

/**
 * What the process engine's cgroup set-up does here, found by doing it (and
 * undoing it): v1 or v2 and its warning, e.g. a v2 cgroup shared with other
 * processes, which cannot pass controllers on. (Where this process is alone in
 * its v2 cgroup it moves into a leaf of its own, as the engine does.)
 */
function cgroupCheck(): Check {
  const tree = new CgroupTree(`forkling-p${process.pid}-${randomBytes(4).toString('hex')}`);
  tree.close();
  if (tree.mode === 'none') {
    return {
      name: 'cgroups',
      status: 'warn',
      detail: tree.warning ?? 'no usable cgroup hierarchy',
      fix: 'mount cgroup v2 at /sys/fs/cgroup and run forkling in a cgroup of its own (e.g. `systemd-run --scope -p Delegate=yes forkling ...`) for memory, pids and cpu limits in the process engine',
    };
  }
  if (tree.warning) return { name: 'cgroups', status: 'warn', detail: `${tree.mode}: ${tree.warning}` };
  return { name: 'cgroups', status: 'pass', detail: `${tree.mode}: memory, pids and cpu limits for process-engine sandboxes` };
}

/** The cgroup mounts in a /proc/self/mountinfo text: mount point and super options (favordynmods shows there). */
export function cgroupMounts(mountinfo: string): { at: string; favordynmods: boolean }[] {
  const out: { at: string; favordynmods: boolean }[] = [];
  for (const line of mountinfo.split('\n')) {
    const [left, right] = line.split(' - ');
    const [fstype, , superOpts = ''] = (right ?? '').split(' ');
    if (fstype !== 'cgroup' && fstype !== 'cgroup2') continue;
    const at = left?.split(' ')[4];
    // (mountinfo escapes space, tab, newline and backslash as \ooo)
    if (at) out.push({ at: at.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(Number.parseInt(o, 8))), favordynmods: superOpts.split(',').includes('favordynmods') });
  }
  return out;
}

/**
 * Moving a new sandbox into its cgroup (the process engine, every fork) takes
 * the kernel's cgroup_threadgroup_rwsem for writing; without favordynmods the
 * first move after a pause waits for an RCU grace period (10-15 ms measured on
 * a 2-core host: a fork of 1 answered in ~20 ms instead of ~8). The engine
 * takes that wait while the zygote forks (CgroupTree.prearm); what is left
 * is the part of it longer than the fork.
 */
export function cgroupMoveCheck(mountinfo = readText('/proc/self/mountinfo') ?? ''): Check {
  const name = 'cgroup moves';
  const mounts = cgroupMounts(mountinfo);
  if (mounts.length === 0) return { name, status: 'pass', detail: 'no cgroup mounts (the process engine runs without limits)' };
  const favoring = mounts.filter((m) => m.favordynmods);
  if (favoring.length) return { name, status: 'pass', detail: `favordynmods on (${favoring.map((m) => m.at).join(', ')}): moving a sandbox into its cgroup is quick` };
  const v2 = mounts.find((m) => m.at === '/sys/fs/cgroup') ?? mounts.find((m) => m.at.endsWith('/unified')) ?? mounts[0]!;
  return {
    name,
    status: 'warn',
    detail: 'favordynmods off: the first move of a sandbox into its cgroup after a quiet spell waits ~7-20 ms (an RCU grace period; the process engine starts that wait while the zygote forks, so one fork loses 0-8 ms of it)',
    fix: `as root, on Linux 6.0 or newer: mount -o remount,favordynmods ${JSON.stringify(v2.at)} (makes cgroup moves quick host-wide; forks and exits cost a little more)`,
  };
}

/**
 * KVM makes debugfs files for every VM (its statistics): ~60 KiB of kernel
 * memory per child in the lab (inodes and dentries; none with debugfs=off).
 */
export function kvmDebugfsCheck(filesystems = readText('/proc/filesystems') ?? ''): Check {
  const name = 'KVM debugfs';
  if (!/\sdebugfs$/m.test(filesystems)) return { name, status: 'pass', detail: 'debugfs is off: KVM keeps no files per VM' };
  return {
    name,
    status: 'warn',
    detail: 'debugfs is on: KVM keeps statistics files for every VM there (~60 KiB of kernel memory per sandbox)',
    fix: 'if nothing on this host needs debugfs, add debugfs=off to the host kernel command line',
  };
}

function userNsCheck(): Check {
  const max = Number(readText('/proc/sys/user/max_user_namespaces') ?? '0');
  const clone = readText('/proc/sys/kernel/unprivileged_userns_clone');
  const apparmor = readText('/proc/sys/kernel/apparmor_restrict_unprivileged_userns');
  const root = process.getuid?.() === 0;
  const probe = which('unshare') ? spawnSync('unshare', ['-U', '-r', 'true'], { stdio: 'ignore' }).status === 0 : undefined;
  if (probe === true || (probe === undefined && max > 0 && clone !== '0' && apparmor !== '1')) {
    return { name: 'user namespaces', status: 'pass', detail: `available (max ${max})` };
  }
  return {
    name: 'user namespaces',
    status: root ? 'warn' : 'fail',
    detail: `not available to this user (max_user_namespaces=${max}${clone === '0' ? ', unprivileged_userns_clone=0' : ''}${apparmor === '1' ? ', restricted by AppArmor' : ''})${root ? '; root can still use the other namespaces' : ''}`,
    fix: 'sysctl -w kernel.unprivileged_userns_clone=1 user.max_user_namespaces=15000 (or run as root)',
  };
}

function userfaultfdCheck(): Check {
  const unpriv = readText('/proc/sys/vm/unprivileged_userfaultfd');
  const dev = existsSync('/dev/userfaultfd');
  const root = process.getuid?.() === 0;
  if (root || unpriv === '1' || dev) {
    return { name: 'userfaultfd', status: 'pass', detail: `available${dev ? ' (/dev/userfaultfd)' : ''}` };
  }
  return {
    name: 'userfaultfd',
    status: 'warn',
    detail: 'not available to this user (not needed by the current engines)',
    fix: 'sysctl -w vm.unprivileged_userfaultfd=1',
  };
}

function storeCheck(): Check {
  const root = storeRoot();
  let dir = root;
  while (!existsSync(dir) && dir !== '/') dir = dirname(dir);
  try {
    const s = statfsSync(dir);
    const freeGiB = (Number(s.bavail) * Number(s.bsize)) / 2 ** 30;
    const detail = `${root}: ${freeGiB.toFixed(1)} GiB free`;
    if (freeGiB < 0.5) return { name: 'store space', status: 'fail', detail, fix: `free space on the disk of ${dir} or set FORKLING_HOME elsewhere` };
    if (freeGiB < 4) return { name: 'store space', status: 'warn', detail, fix: 'images and templates take 0.1-2 GiB each; free some space' };
    try {
      accessSync(dir, constants.W_OK);
    } catch {
      return { name: 'store space', status: 'fail', detail: `${dir} is not writable`, fix: 'set FORKLING_HOME to a writable directory' };
    }
    return { name: 'store space', status: 'pass', detail };
  } catch (e) {
    return { name: 'store space', status: 'fail', detail: `cannot stat ${dir}: ${(e as Error).message}`, fix: 'set FORKLING_HOME' };
  }
}

function toolCheck(name: string, cmds: string[], pkg: string, why: string): Check {
  const missing = cmds.filter((c) => !which(c));
  return missing.length === 0
    ? { name, status: 'pass', detail: `${cmds.join(', ')} found` }
    : { name, status: 'warn', detail: `${missing.join(', ')} missing (${why})`, fix: `apt-get install ${pkg}` };
}

export async function runChecks(wanted: 'kvm' | 'process' | 'auto'): Promise<DoctorReport> {
  const kvm = probeKvm();
  const checks: Check[] = [nodeCheck(), ...kvm.checks, ...(kvm.usable ? [kvmDebugfsCheck()] : []), kernelCheck(), cgroupCheck(), cgroupMoveCheck(), userNsCheck(), userfaultfdCheck(), storeCheck()];
  checks.push(toolCheck('image tools', ['mmdebstrap', 'apt-get', 'zstd'], 'mmdebstrap zstd', 'needed to build guest images'));
  checks.push(toolCheck('lab tools', ['qemu-system-x86_64', 'busybox'], 'qemu-system-x86 busybox-static', 'needed only for the KVM lab tests'));

  const nsOk = checks.find((c) => c.name === 'user namespaces')?.status !== 'fail';
  const storeOk = checks.find((c) => c.name === 'store space')?.status !== 'fail';
  let engine: 'kvm' | 'process';
  let engineReason: string;
  let ok: boolean;
  if (wanted === 'kvm' || (wanted === 'auto' && kvm.usable)) {
    engine = 'kvm';
    ok = kvm.usable && storeOk;
    engineReason = kvm.usable ? (wanted === 'auto' ? '/dev/kvm is usable' : 'requested') : kvm.reason;
  } else {
    engine = 'process';
    ok = nsOk && storeOk;
    engineReason =
      wanted === 'auto'
        ? `/dev/kvm is not usable (${kvm.reason}); the process engine isolates with Linux namespaces, weaker than a VM`
        : 'requested; isolation by Linux namespaces, weaker than a VM';
  }
  return { ok, engine, engineReason, checks };
}
