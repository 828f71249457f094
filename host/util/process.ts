// Whether a process runs, by its number (for what only looks: to signal a
// process, hold it by a pidfd, host/engine/process/process-ref.ts).
import { readFileSync } from 'node:fs';

/** Whether process `pid` runs (a zombie, dead but not yet reaped, does not). */
export function processRunning(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat[stat.lastIndexOf(')') + 2] !== 'Z';
  } catch {
    return false;
  }
}
