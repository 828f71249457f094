// uvu runs a suite's `before` hooks inside a try whose `finally` returns: an
// error they throw is swallowed, the suite's tests are skipped and the file
// prints only "(0 / N)" (test/run.mjs counts them as failed, without a cause).
// Wrapped, the error and its stack are printed first.
export function loud(what: string, fn: () => Promise<unknown> | unknown): () => Promise<void> {
  return async () => {
    try {
      await fn();
    } catch (e) {
      console.error(`\n  FAIL  ${what}: ${e instanceof Error ? (e.stack ?? e.message) : String(e)}\n`);
      throw e;
    }
  };
}
