// MemAvailable of the host from /proc/meminfo (null where it cannot be read).
import { readFileSync } from 'node:fs';
import { readFile } from 'node:fs/promises';

function parse(text: string): number | null {
  const m = /^MemAvailable:\s+(\d+) kB/m.exec(text);
  return m ? Number(m[1]) * 1024 : null;
}

export async function memAvailableBytes(): Promise<number | null> {
  try {
    return parse(await readFile('/proc/meminfo', 'utf8'));
  } catch {
    return null;
  }
}

export function memAvailableBytesSync(): number | null {
  try {
    return parse(readFileSync('/proc/meminfo', 'utf8'));
  } catch {
    return null;
  }
}
