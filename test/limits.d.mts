// Types of test/limits.mjs (plain JS: test/run.mjs runs without tsx).
export declare const KVM_FILE_LIMIT_S: number;
export declare const RECAP_TITLE: string;
