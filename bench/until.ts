// Waiting in the bench scripts for state that has no event of its own (the engine's passes,
// a VM's counters).

/** Polls `ok` every 100 ms, up to `ms`; throws "<what>: not within N s". */
export async function until(what: string, ok: () => boolean, ms: number): Promise<void> {
  const deadline = Date.now() + ms;
  while (!ok()) {
    if (Date.now() > deadline) throw new Error(`${what}: not within ${ms / 1000} s`);
    await new Promise((r) => setTimeout(r, 100));
  }
}
