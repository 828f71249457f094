// How long a KVM child is idle before it sleeps (its reclaim passes, then
// doze, pack and shelve: KvmSandbox.reclaimWhenIdle). Apart from engine.ts
// so that `forkling serve` can check and print it without loading the VMM.
import { envWhole } from '../../util/env.ts';

/** Idle time before a child's first reclaim pass. */
export const RECLAIM_IDLE_MS = 1000;

/** The most $FORKLING_KVM_SLEEP_AFTER_MS (and `forkling serve --sleep-after-ms`) may be: a day. */
export const MAX_SLEEP_AFTER_MS = 86_400_000;

/**
 * $FORKLING_KVM_SLEEP_AFTER_MS where set (a user trading memory for the time
 * a sleeping child takes to answer: 0 never sleeps). Otherwise
 * RECLAIM_IDLE_MS, but off inside the KVM lab: each pass's MADV_DONTNEED
 * flushes the TLB of every CPU running this process, and the lab's QEMU
 * (emulated nested SVM) now and then loses that IPI to a CPU in guest mode,
 * leaving the lab's kernel spinning (soft lockup). Tests there ask for passes.
 */
export function defaultReclaimIdleMs(): number {
  return envWhole('FORKLING_KVM_SLEEP_AFTER_MS', process.env.FORKLING_IN_LAB ? 0 : RECLAIM_IDLE_MS, 0, MAX_SLEEP_AFTER_MS);
}
