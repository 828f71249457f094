// Whether a process sleeps: no thread of it wakes (its context switches, all
// threads, stay the same). An idle sandbox's agent sleeps with no timeout;
// the tests check that it does, and that what should wake it does.
import { readdirSync, readFileSync } from 'node:fs';

/** Context switches of all a process's threads so far. */
export function wakeups(pid: number): number {
  return readdirSync(`/proc/${pid}/task`).reduce((t, tid) => {
    let st: string;
    try {
      st = readFileSync(`/proc/${pid}/task/${tid}/status`, 'utf8');
    } catch {
      return t; // (a thread that ended meanwhile)
    }
    return t + Number(/^voluntary_ctxt_switches:\s+(\d+)/m.exec(st)?.[1]) + Number(/^nonvoluntary_ctxt_switches:\s+(\d+)/m.exec(st)?.[1]);
  }, 0);
}

/** Whether no thread of pid woke in `ms` (an awake agent ticks every 0.5 s). */
export async function sleptFor(pid: number, ms: number): Promise<boolean> {
  const before = wakeups(pid);
  await new Promise((r) => setTimeout(r, ms));
  return wakeups(pid) === before;
}

/** Whether pid comes to sleep for 1.5 s within `timeoutMs`. */
export async function comesToSleep(pid: number, timeoutMs: number): Promise<boolean> {
  for (const deadline = Date.now() + timeoutMs; Date.now() < deadline; ) if (await sleptFor(pid, 1500)) return true;
  return false;
}
