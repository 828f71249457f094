// How many of its template's memory files a process-engine sandbox holds open:
// the zygote's, its fork server's layer and, once the template has one, its
// pattern (each a memfd named forkling-template, kept by every fork).
import { readdirSync, readlinkSync } from 'node:fs';

/** The template's files process `pid` has fds of (0 once it is gone). */
export function templateFiles(pid: number): number {
  let fds: string[];
  try {
    fds = readdirSync(`/proc/${pid}/fd`);
  } catch {
    return 0;
  }
  return fds.filter((fd) => {
    try {
      return readlinkSync(`/proc/${pid}/fd/${fd}`).startsWith('/memfd:forkling-template');
    } catch {
      return false; // (closed meanwhile)
    }
  }).length;
}
