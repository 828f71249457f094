// In the lab only: about 1 Linux boot in 4-25, and now and then one child
// restored from a template (1 of 3 in one run), triple-faults (KVM_EXIT_SHUTDOWN)
// before the guest prints anything. On SVM KVM re-initialises the vCPU after a
// shutdown, so the registers we can read are the reset state, not the fault's.
// Common to both: a VM whose nested page table starts empty, so the guest
// takes nested page faults everywhere, also while the CPU delivers an
// interrupt or exception. QEMU 7.2's emulated #VMEXIT (do_vmexit in its
// svm_helper.c) reports in EXITINTINFO only the event L1 injected, not one the
// emulated CPU was delivering natively, and its double-fault bookkeeping runs
// in the same paths: our suspect (not proven). Not seen outside the lab (a
// restored tiny guest too, once, 2026-11-30: snapshot-vm.test.ts). Such
// a boot or fork is retried, loudly, so the lab tests what it can; a
// third one fails the test (a benchmark of 100 children may allow more
// tries: one in 100 children is enough to fail a fork; a test of children
// retries as a whole, labTest). Anywhere else there is no retry.
//
// The lab's own kernel has its own trouble under load (test/lab/run.ts boots
// it again, LAB CRASH): recursive page faults in exception entry in one of
// our vCPU threads until a stack guard page ("corrupted stack end detected
// inside scheduler"). A fork of 100 Linux children crashed it in 3 of 3
// boots (2026-11-30); with single-threaded TCG (FORKLING_LAB_ACCEL=
// tcg,thread=single) the same signature struck the nested guest instead,
// during a cold boot; with fsgsbase off (FORKLING_LAB_CPU=EPYC,+svm,+npt,
// -fsgsbase) a vCPU thread of ours spun in the lab's kernel (soft lockup,
// 300+ s). So 100 children are not measured in the lab. Without nested paging
// in the lab (FORKLING_LAB_CPU=EPYC,+svm,-npt: its KVM shadows the guests'
// page tables), 2026-12-05: that fork of 100 ran through twice (with NPT it
// froze the lab again the same day), but a whole suite froze twice in
// fork.test.ts: not the cure for the freezes below (and the boot tests ran
// 10-30% longer). The lab's kvm_amd has no vGIF nor virtual VMLOAD/VMSAVE
// (QEMU's TCG offers neither: the kvm-ready line prints its parameters), so
// those are not where its "GS base wrong" panics come from. And now and then the
// whole lab freezes: no console output at all, both of its CPUs spinning in
// QEMU (seen in fork.test.ts's Linux reclaim test, now skipped in the lab, and
// once in snapshot-vm.test.ts, 2026-11-30): after 690 s of silence the runner
// boots the lab again for the unfinished files (LAB FROZEN), within the same
// reboot budget (FORKLING_LAB_CRASH_REBOOTS). Twice (2026-11-30) node itself died of SIGILL inside the lab
// ("trap invalid opcode" at an address in no file: V8's generated code, exit
// 132, both times in server-kvm.test.ts, which passed in every other run): the
// inner runner (test/run.mjs) now runs such a file once more (LAB SIGILL). The
// cause is not known; QEMU 7.2's TCG, whose AVX support was new in 7.2, runs
// the lab's user space too: a lab CPU model without AVX (FORKLING_LAB_CPU)
// would be the next thing to try if it keeps coming. Its kin, once (2026-12-03,
// cli-kvm.test.ts): a `forkling` run died of V8's WebAssembly bounds trap
// while loading its modules, before it made a VM; test/run.mjs runs such a
// file once more too (LAB WASM TRAP).
import { appendFileSync } from 'node:fs';
import { basename } from 'node:path';
import { test } from 'uvu';

/**
 * A test file's progress lines, stamped with seconds since it started; in the
 * lab also written to its console at once (the file's own output comes only
 * when it ends: if the lab freezes, these say where; whole lines through the
 * tty, never cut by another's) and to the kernel log (which the lab prints
 * when a run fails or hangs).
 */
export function labProgress(file: string): (line: string) => void {
  const t0 = performance.now();
  return (line) => {
    const l = `[${file} +${((performance.now() - t0) / 1000).toFixed(1)}s] ${line}`;
    console.error(l);
    if (process.env.FORKLING_IN_LAB) {
      for (const dev of ['/dev/console', '/dev/kmsg']) {
        try {
          appendFileSync(dev, `${l}\n`);
        } catch {}
      }
    }
  };
}

/** The lab's flakes: what an error says, and what to call it. */
const FLAKES = {
  early: { what: 'a triple fault with no guest output', is: (m: string) => /triple-fault/.test(m) && /the guest printed nothing/.test(m) },
  // A restored child whose agent never answered hello/restore (twice in the lab over ~15 runs of
  // fork.test, 2026-11; the error has the child's last console lines).
  // Also a hidden child of a template's pattern (fork.test.ts says so before the error).
  stall: { what: 'a restored child that did not answer', is: (m: string) => /^(building the pattern failed: )?child \S+: its agent did not answer within/.test(m) },
  // A booted guest that ran fine and then triple-faulted (reboot=k: Linux never resets that way;
  // boot.test's VM A once, 2026-11-30): what a request in flight then says (vm.ts).
  running: { what: 'a triple fault of a running guest', is: (m: string) => /^the VM \S+ stopped \(triple-fault/.test(m) },
  // A VM that triple-faulted after its first console lines, before its agent answered: a
  // template's rehearsal child once (fork.test's set-up, 2026-12-05; the line was the
  // template's agent's "ready"). Linux never resets that way (reboot=k): the early one's kin.
  ready: { what: 'a triple fault before the agent answered', is: (m: string) => /stopped before its agent was ready \(triple-fault/.test(m) },
  // A boot that printed nothing at all in its whole ready time, its vCPU registers not even the
  // guest's (cr3 past the guest's RAM): boot.test's panic VM once, 2026-12-01 (it panics within
  // seconds everywhere else), boot-vmlinux.test's vmlinux boot once the same day (cr3 at 4 GiB
  // for a 512 MiB guest). The early triple fault's kin: the nested emulation, not the guest.
  silent: { what: 'a boot with no guest output at all', is: (m: string) => /did not answer within/.test(m) && /the guest printed nothing/.test(m) },
  // The lab kernel's own trouble (above), struck in a nested guest: a booted VM in use panicked
  // on recursive page faults in error_entry, its stack at the entry stack's guard page
  // (server-kvm.test's boot, 2026-12-04, 19 s after boot).
  entry: { what: 'a guest panic of recursive faults in exception entry', is: (m: string) => /kernel panic/.test(m) && /RIP: 0010:error_entry\+/.test(m) },
};
export type LabFlake = keyof typeof FLAKES;

/**
 * Runs `fn`; in the lab, retries it after one of the flakes in `kinds`
 * (default: a boot's, a triple fault before the agent answered or no output at all, or the entry panic),
 * `attempts` times in all (default 3: a CI run boots Linux dozens of times in
 * the lab, and one boot that flakes on every try fails the whole run).
 */
export async function labRetry<T>(
  tag: string,
  fn: () => Promise<T>,
  log: (line: string) => void = console.error,
  attempts = 3,
  kinds: LabFlake[] = ['early', 'ready', 'silent', 'entry'],
): Promise<T> {
  for (let attempt = 1; ; attempt++) {
    try {
      return await fn();
    } catch (e) {
      const msg = (e as Error).message;
      const flake = kinds.map((k) => FLAKES[k]).find((f) => f.is(msg));
      if (!process.env.FORKLING_IN_LAB || !flake) throw e;
      if (attempt >= attempts) {
        // (test/run.mjs runs a file once more when each of its failures is this)
        console.log(`LAB FLAKE OUT OF TRIES (${tag}): ${flake.what}, ${attempts} times`);
        throw e;
      }
      log(`${tag}: LAB FLAKE: ${flake.what}; trying again (${attempt + 1} of ${attempts}) (${msg.split('\n')[0]})`);
      console.log(`LAB FLAKE (${tag}): ${flake.what}; tried again`);
    }
  }
}

/**
 * A uvu test whose Linux children may triple-fault in the lab at any moment,
 * also after they answered (2 of 150 restored children in one lab run,
 * 2026-11-30), or not answer at all: there the whole test runs again after
 * either, 3 times in all; anywhere else it runs once.
 */
export function labTest(name: string, fn: () => Promise<void>, kinds: LabFlake[] = ['early', 'stall']): void {
  const progress = labProgress(basename(process.argv[1] ?? 'test', '.ts'));
  test(name, () => {
    progress(`test: ${name}`);
    return labRetry(name, fn, progress, 3, kinds);
  });
}
