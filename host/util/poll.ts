// Polling for a state the kernel gives no event for (a cgroup frozen, a
// process done exiting), with a short backoff.

/** Resolves true once `done()` holds (checked at once, then after waits of 1 ms doubling up to `maxWaitMs`), false after `timeoutMs`. */
export async function pollUntil(done: () => boolean, timeoutMs: number, maxWaitMs = 50): Promise<boolean> {
  for (let wait = 1, deadline = Date.now() + timeoutMs; !done(); wait = Math.min(wait * 2, maxWaitMs)) {
    if (Date.now() > deadline) return false;
    await new Promise((r) => setTimeout(r, wait));
  }
  return true;
}
