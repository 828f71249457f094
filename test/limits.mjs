// Limits shared by test/run.mjs and the lab runner (test/lab/run.ts).

/** Seconds one KVM test file may run (directly or inside the lab) before it is killed and counted failed. */
export const KVM_FILE_LIMIT_S = 600;
