// What test/run.mjs and the lab runner (test/lab/run.ts) share: limits and a heading.

/** Seconds one KVM test file may run (directly or inside the lab) before it is killed and counted failed. */
export const KVM_FILE_LIMIT_S = 600;

/** The heading before the inner suite's recap of what failed; the lab runner reads the lines under it. */
export const RECAP_TITLE = '=== what failed (the details above, again)';
