// The KVM lab: boots a software-emulated x86 machine (QEMU TCG, AMD SVM) in
// which KVM works, and runs test/kvm/*.test.ts inside it with this host's own
// node and this checkout (the host's root is shared read-only over 9p).
//
//   npx tsx test/lab/run.ts            (npm run test:kvm calls it via test/run.mjs)
//
// Settings (environment):
//   FORKLING_LAB_TIMEOUT_S  overall limit for one boot of the lab, seconds (default 1800)
//   FORKLING_LAB_SILENCE_S  no console output for this long means the lab froze: it is booted again
//                           for the unfinished files (default 690: the inner limit per file + 90)
//   FORKLING_LAB_LOCKUP_S   a CPU of the lab stuck in its kernel this long (its soft lockup report)
//                           also means it froze (default 180)
//   FORKLING_LAB_BEAT_S     no heartbeat (LAB-BEAT, every 20 s from the lab's init) for this long
//                           also means it froze (default 150)
//   FORKLING_LAB_CRASH_REBOOTS  boots again after a crash or freeze of the lab itself (default 8)
//   FORKLING_LAB_MEM_MB     the lab machine's RAM (default 6144: nested guests take 1-2 GiB, the
//                           store overlay and /tmp live in RAM; QEMU only backs what is touched)
//   FORKLING_LAB_CPUS       its vCPUs (default 2)
//   FORKLING_LAB_CPU        QEMU CPU model (default EPYC,+svm,+npt)
//   FORKLING_LAB_ACCEL      QEMU -accel (default tcg; e.g. tcg,thread=single)
//   FORKLING_LAB_BUSYBOX    static busybox to use (default /bin/busybox)
//   FORKLING_LAB_KERNEL_ARGS  more arguments for the lab's own kernel (e.g. debugfs=off)
//   FORKLING_LAB_KVM_AMD_ARGS  parameters for the lab's kvm_amd module (e.g. 'vgif=0 vls=0')
//   FORKLING_HOME           the store; mounted inside (writes go to an overlay in the lab's RAM)
//   FORKLING_TEST_FILTER, CI  passed to the inner suite
//   FORKLING_LAB_COMMAND    a shell command to run in the checkout instead of the suite, e.g.
//                           'npx tsx bench/kvm-fork.ts --guest linux' (its exit status is the result)
// Writes <repo>/.lab/last-summary.json = {startedAt, passed, failed, failures, details}
// and exits 0 only if every inner test passed.
import { type ChildProcess, spawn } from 'node:child_process';
import { existsSync, mkdirSync, readdirSync, realpathSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { UserError } from '../../host/errors.ts';
import { ensureImage } from '../../host/images.ts';
import { ADDON_PATH } from '../../host/native.ts';
import { storeRoot, writeFileAtomic } from '../../host/store.ts';
import { envWhole } from '../../host/util/env.ts';
import { distroKernel } from '../../images/kernel.ts';
import { vmlinuxFromBzImage } from '../../images/vmlinux.ts';
import { KVM_FILE_LIMIT_S } from '../limits.mjs';
import { LabConsole, type LabStage } from './console.ts';
import { baseInitramfs, runInitrd } from './initramfs.ts';

const REPO = dirname(dirname(dirname(fileURLToPath(import.meta.url))));
const LAB_DIR = join(REPO, '.lab');
const SUMMARY = join(LAB_DIR, 'last-summary.json');
const QEMU = 'qemu-system-x86_64';
/** A soft lockup this long on every CPU of the lab at once ends the boot (see the watch in main). */
const ALL_STUCK_S = 40;

interface Summary {
  startedAt: number;
  passed: number;
  failed: number;
  failures: string[];
  /** the inner suite's recap of what failed (its FAIL blocks), for the outer runner to print again */
  details: string[];
}

/** Every console line of the current lab boot (to recover from a crash of the lab itself). */
let consoleLog: string[] = [];

const say = (line: string) => process.stdout.write(`[lab] ${line}\n`);

function writeSummary(s: Summary): void {
  mkdirSync(LAB_DIR, { recursive: true });
  writeFileAtomic(SUMMARY, `${JSON.stringify(s, null, 2)}\n`);
}


let qemu: ChildProcess | undefined;
function killQemu(): void {
  if (qemu && qemu.exitCode === null && qemu.signalCode === null) {
    try {
      qemu.kill('SIGKILL');
    } catch {}
  }
}
process.on('exit', killQemu);
for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) {
  process.on(sig, () => {
    killQemu();
    process.exit(130);
  });
}

async function main(startedAt: number): Promise<Summary> {
  const timeoutS = envWhole('FORKLING_LAB_TIMEOUT_S', 1800, 30, 86400);
  const memMb = envWhole('FORKLING_LAB_MEM_MB', 6144, 1024, 1 << 20);
  const cpus = envWhole('FORKLING_LAB_CPUS', 2, 1, 64);
  const cpu = process.env.FORKLING_LAB_CPU || 'EPYC,+svm,+npt';
  const accel = process.env.FORKLING_LAB_ACCEL || 'tcg';
  const fail = (why: string): Summary => ({ startedAt, passed: 0, failed: 1, failures: [why], details: [] });

  if (!existsSync(ADDON_PATH)) {
    throw new UserError(`the native addon is not built (${ADDON_PATH})`, 'run npm install (or npm run build:native) before the KVM lab');
  }
  const kernel = distroKernel();
  // The lab has no network: the images its tests boot are built out here first.
  const image = await ensureImage('default');
  say(`image default: ${image.initramfs}`);
  // boot-vmlinux.test.ts boots the ELF inside that bzImage: extracted here, where it is 10-100x faster.
  say(`vmlinux: ${(await vmlinuxFromBzImage(image.kernel)).path}`);
  mkdirSync(LAB_DIR, { recursive: true });
  const initramfs = baseInitramfs(LAB_DIR, kernel);
  say(
    `kernel ${kernel.release} (${kernel.version}); initramfs ${initramfs.cached ? 'cached' : 'built'}: ${initramfs.path} ` +
      `(modules: ${initramfs.modules.join(' ')})`,
  );
  // Symlinks would resolve against the lab's own root, not /host: pass real paths.
  const real = (p: string) => (existsSync(p) ? realpathSync(p) : p);
  const store = real(resolve(storeRoot()));
  const initrd = runInitrd(LAB_DIR, initramfs.path, {
    LAB_REPO: real(REPO),
    LAB_NODE: process.execPath,
    LAB_PATH: `${dirname(process.execPath)}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin`,
    LAB_STORE: store,
    LAB_CI: process.env.CI ?? '',
    LAB_FILTER: process.env.FORKLING_TEST_FILTER ?? '',
    LAB_COMMAND: process.env.FORKLING_LAB_COMMAND ?? '',
    LAB_KVM_AMD_ARGS: process.env.FORKLING_LAB_KVM_AMD_ARGS ?? '',
    // The inner watchdog fires first so that the kernel log still gets printed.
    LAB_INNER_TIMEOUT: String(Math.max(20, timeoutS - 60)),
  });

  const args = [
    '-M', 'q35', '-accel', accel, '-cpu', cpu, '-m', String(memMb), '-smp', String(cpus),
    '-kernel', kernel.vmlinuz, '-initrd', initrd,
    '-append', `console=ttyS0 quiet loglevel=4 panic=-1 rdinit=/init ${process.env.FORKLING_LAB_KERNEL_ARGS ?? ''}`.trim(),
    '-display', 'none', '-vga', 'none', '-monitor', 'none', '-serial', 'stdio', '-nic', 'none', '-no-reboot',
    '-virtfs', 'local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap',
  ];
  say(`booting: ${QEMU} ${args.join(' ')}`);
  say(`store ${store} (read-only below an overlay in the lab), limit ${timeoutS}s`);

  const bootAt = Date.now();
  // TCG lacks some features of the EPYC model; qemu warns per feature and vCPU.
  const missing = new Set<string>();
  const reportMissing = () => {
    if (missing.size) say(`qemu: TCG does not emulate these CPU features of ${cpu} (harmless): ${[...missing].join(' ')}`);
    missing.clear();
  };
  consoleLog = [];
  const con = new LabConsole((l) => {
    reportMissing();
    consoleLog.push(l);
    say(l);
  });
  const child = spawn(QEMU, args, { stdio: ['pipe', 'pipe', 'pipe'] });
  qemu = child;
  child.stdout?.setEncoding('utf8').on('data', (d: string) => con.feed(d));
  let errPartial = '';
  const errLine = (l: string) => {
    const f = /TCG doesn't support requested feature: \S*?([\w-]+) \[bit/.exec(l);
    if (f?.[1]) missing.add(f[1]);
    else if (l.trim()) say(`qemu: ${l}`);
  };
  child.stderr?.setEncoding('utf8').on('data', (d: string) => {
    const lines = (errPartial + d).split('\n');
    errPartial = lines.pop() ?? '';
    for (const l of lines) errLine(l);
  });
  let timedOut = false;
  const timer = setTimeout(() => {
    timedOut = true;
    say(`TIMEOUT: the lab ran past ${timeoutS}s (FORKLING_LAB_TIMEOUT_S); killing qemu`);
    killQemu();
  }, timeoutS * 1000);
  // Silence longer than the inner suite's own limit per test file (it prints when it kills one)
  // means the lab machine itself froze: nothing in it runs any more, not even that timer. So does
  // a CPU stuck in the lab's kernel for minutes (seen with a vCPU thread of ours under QEMU's
  // nested SVM: no kill reaches it, and the kernel's reports of it are all the console says).
  let frozen: string | null = null;
  const silenceS = envWhole('FORKLING_LAB_SILENCE_S', KVM_FILE_LIMIT_S + 90, 30, 86400);
  const lockupS = envWhole('FORKLING_LAB_LOCKUP_S', 180, 30, 86400);
  const beatS = envWhole('FORKLING_LAB_BEAT_S', 150, 30, 86400);
  const watch = setInterval(() => {
    if (frozen || timedOut) return;
    const now = Date.now();
    // Every CPU stuck at once has never come back (2026-12-04: both for 131 s, in kthreadd and the
    // idle task, three boots in a row, until the heartbeat's limit): no need to wait that long.
    const stuck = [...con.stuckByCpu.values()].filter((r) => r.s >= ALL_STUCK_S && now - r.at < 60_000);
    const allStuck = stuck.length >= cpus;
    if (con.stuckS >= lockupS) frozen = `a CPU of the lab was stuck in its kernel for ${con.stuckS}s (soft lockup; FORKLING_LAB_LOCKUP_S=${lockupS})`;
    else if (allStuck) frozen = `every CPU of the lab was stuck in its kernel for ${ALL_STUCK_S}s or more (soft lockups)`;
    else if (con.lastBeatAt !== null && now - con.lastBeatAt >= beatS * 1000) frozen = `no heartbeat from the lab's shell for ${beatS}s (FORKLING_LAB_BEAT_S)`;
    else if (now - con.lastLineAt >= silenceS * 1000) {
      const beat = con.lastBeatAt === null ? 'no heartbeat came' : `its heartbeat came ${((now - con.lastBeatAt) / 1000).toFixed(0)}s ago: its kernel ran`;
      frozen = `no console output for ${silenceS}s (FORKLING_LAB_SILENCE_S; ${beat})`;
    } else return;
    say(`LAB FROZEN: ${frozen} while ${con.runningFile ?? 'the suite'} ran; killing qemu`);
    killQemu();
  }, 5000);
  const exit = await new Promise<{ code: number | null; error?: NodeJS.ErrnoException }>((res) => {
    child.on('error', (error: NodeJS.ErrnoException) => res({ code: null, error }));
    child.on('close', (code) => res({ code }));
  });
  clearTimeout(timer);
  clearInterval(watch);
  con.flush();
  errLine(errPartial);
  reportMissing();
  if (exit.error) {
    throw new UserError(`cannot run ${QEMU}: ${exit.error.code ?? exit.error.message}`, 'install it with: apt-get install qemu-system-x86');
  }

  const t = (s: LabStage) => con.stages.get(s);
  const secs = (a?: number, b?: number) => (a !== undefined && b !== undefined ? `${((b - a) / 1000).toFixed(1)}s` : '-');
  say(
    `timings: boot to init ${secs(bootAt, t('kernel-up'))}, modules/kvm ${secs(t('kernel-up'), t('kvm-ready'))}, ` +
      `mounts ${secs(t('kvm-ready'), t('mounted'))}, node start to first output ${secs(t('node-start'), t('first-output'))}, ` +
      `suite ${secs(t('node-start'), t('exit'))}, total ${secs(startedAt, Date.now())}`,
  );

  const o = con.outcome;
  const showTail = () => {
    say('last console lines:');
    for (const l of con.lastLines(40)) say(`  | ${l}`);
  };
  if (timedOut) {
    showTail();
    return fail(`timed out after ${timeoutS}s`);
  }
  if (frozen) {
    showTail();
    return fail(`the lab machine froze while ${con.runningFile ?? 'the suite'} ran (${frozen})`);
  }
  if (o.setupFailure) return fail(`set-up inside the lab failed: ${o.setupFailure}`);
  if (o.exitCode === null) {
    showTail();
    return fail(`the lab machine stopped (qemu exit ${exit.code}) before the suite ended`);
  }
  if (!o.summary) {
    showTail();
    return fail(`the inner suite ended (exit ${o.exitCode}) without a "N passed, N failed" line${o.innerTimeout ? ' (inner time limit)' : ''}`);
  }
  const s: Summary = { startedAt, ...o.summary };
  if (o.exitCode !== 0 && s.failed === 0) {
    s.failed = 1;
    s.failures = [...s.failures, `inner suite exit status ${o.exitCode}`];
  }
  return s;
}

/**
 * The lab's own kernel (not a nested guest) panicked: QEMU's emulated nested
 * SVM has crashed it a few times in a vCPU thread of ours ("corrupted stack
 * end detected inside scheduler", a stack guard page hit in error_entry).
 */
const labKernelPanicked = (lines: string[]) => lines.some((l) => /^\[\s*\d+\.\d+\] Kernel panic - not syncing/.test(l));

/** Results of the test files that finished before the lab stopped, from their uvu summaries. */
function finishedFiles(lines: string[]): Map<string, { total: number; passed: number }> {
  const done = new Map<string, { total: number; passed: number }>();
  let file: string | undefined;
  let total: number | undefined;
  for (const l of lines) {
    const f = /^--- (test\/kvm\/\S+\.test\.ts) \(/.exec(l);
    if (f) {
      file = f[1];
      total = undefined;
      continue;
    }
    const t = /^\s*Total:\s+(\d+)\s*$/.exec(l);
    if (t && file) total = Number(t[1]);
    const p = /^\s*Passed:\s+(\d+)\s*$/.exec(l);
    if (p && file && total !== undefined) {
      done.set(file, { total, passed: Number(p[1]) });
      file = undefined;
    }
  }
  return done;
}

/**
 * When the lab machine itself crashed or froze, boot it again for the test
 * files that had not finished (or the whole FORKLING_LAB_COMMAND), and count
 * the finished ones as they ended. Said loudly each time; after
 * FORKLING_LAB_CRASH_REBOOTS reboots (default 8: one run on 2026-12-02 needed three, one on 2026-12-04
 * four, and was killed before its fifth and last; a frozen lab costs minutes, not 11.5) another one fails the run.
 * Both are the lab's own kernel under QEMU's nested SVM, several times a day on
 * a loaded machine: a panic in one of our vCPU threads, a reset with no word
 * (once, 2026-12-04, in snapshot-vm.test.ts), no output at all while
 * both of the lab's CPUs spin, or one of its CPUs stuck in the kernel (a file
 * that froze it is run again, so one that does it every time still fails).
 */
async function rerunAfterLabCrash(first: Summary, startedAt: number): Promise<Summary> {
  const reboots = envWhole('FORKLING_LAB_CRASH_REBOOTS', 8, 0, 10);
  const filter = process.env.FORKLING_TEST_FILTER ? new RegExp(process.env.FORKLING_TEST_FILTER) : null;
  const all = readdirSync(join(REPO, 'test', 'kvm'))
    .filter((f) => f.endsWith('.test.ts'))
    .map((f) => `test/kvm/${f}`)
    .filter((f) => !filter || filter.test(f));
  const done = new Map<string, { total: number; passed: number }>();
  let last = first;
  for (let crash = 1; ; crash++) {
    const why = last.failures.length === 1 ? (last.failures[0] ?? '') : '';
    // (the lab's init always says LAB-EXIT and powers off: a machine that stopped without it
    // panicked, or reset with no word, as a triple fault of its kernel does under -no-reboot)
    const stopped = /^the lab machine stopped/.test(why);
    const froze = /^the lab machine froze/.test(why);
    if (!(stopped || froze) || crash > reboots) break;
    const what = stopped ? (labKernelPanicked(consoleLog) ? "the lab's own kernel panicked" : `${why}, with no panic line: it reset`) : why;
    if (process.env.FORKLING_LAB_COMMAND) {
      say(`LAB CRASH ${crash}/${reboots}: ${what}; booting the lab again for the command`);
      last = await main(startedAt);
      continue;
    }
    for (const [f, r] of finishedFiles(consoleLog)) done.set(f, r);
    const left = all.filter((f) => !done.has(f));
    if (left.length === 0) break;
    say(`LAB CRASH ${crash}/${reboots}: ${what}; ${done.size} test files had finished; booting the lab again for: ${left.join(' ')}`);
    const escaped = left.map((f) => f.replace(/[.*+?^${}()|[\]\\/]/g, '\\$&'));
    process.env.FORKLING_TEST_FILTER = `^(${escaped.join('|')})$`;
    last = await main(startedAt);
  }
  if (done.size === 0) return last;
  let passed = last.passed;
  let failed = last.failed;
  const failures = [...last.failures];
  for (const [f, r] of done) {
    passed += r.passed;
    failed += r.total - r.passed;
    if (r.total !== r.passed) failures.push(f);
  }
  return { startedAt, passed, failed, failures, details: last.details };
}

let summary: Summary;
const startedAt = Date.now();
try {
  summary = await rerunAfterLabCrash(await main(startedAt), startedAt);
} catch (e) {
  const msg = e instanceof UserError ? `${e.message}${e.hint ? ` (${e.hint})` : ''}` : e instanceof Error ? (e.stack ?? e.message) : String(e);
  say(`ERROR: ${msg}`);
  summary = { startedAt, passed: 0, failed: 1, failures: [`could not run: ${msg.split('\n')[0]}`], details: [] };
} finally {
  killQemu();
}
writeSummary(summary);
say(`inner result: ${summary.passed} passed, ${summary.failed} failed${summary.failures.length ? ` (${summary.failures.join(', ')})` : ''}`);
process.exit(summary.failed === 0 ? 0 : 1);
