// Reading the lab machine's serial console: the LAB-* marker lines printed by
// init.sh and the inner suite's closing lines (its recap of what failed,
// `failed: ...`, `N passed, N failed`).
import { RECAP_TITLE } from '../limits.mjs';

export type LabStage = 'kernel-up' | 'kvm-ready' | 'mounted' | 'node-start' | 'first-output' | 'exit' | 'poweroff';

export interface LabOutcome {
  /** the inner suite's counts, from its last `N passed, N failed` line */
  summary: { passed: number; failed: number; failures: string[]; details: string[] } | null;
  /** the inner suite's exit status (LAB-EXIT), null if it never ended */
  exitCode: number | null;
  /** LAB-FAIL reason (set-up inside the machine failed) */
  setupFailure: string | null;
  innerTimeout: boolean;
}

const SUMMARY_RE = /^(\d+) passed, (\d+) failed$/;
// (also as init.sh shows a soft lockup's report from dmesg: `kernel: [ ... ] ...`)
const KERNEL_LOG_RE = /^(kernel: )?\[\s*\d+\.\d+\] /;
const SOFT_LOCKUP_RE = /^\[\s*\d+\.\d+\] watchdog: BUG: soft lockup - CPU#(\d+) stuck for (\d+)s!/;

export class LabConsole {
  readonly stages = new Map<LabStage, number>();
  readonly outcome: LabOutcome = { summary: null, exitCode: null, setupFailure: null, innerTimeout: false };
  /** The test file the inner suite started last (its LAB-FILE line), and when its last line came
   * (the lab kernel's own log lines do not count: a stuck CPU reports itself every ~30 s). */
  runningFile: string | null = null;
  lastLineAt: number;
  /** The longest time a CPU of the lab has been stuck in its kernel (a soft lockup report), seconds. */
  stuckS = 0;
  /** Each CPU's last soft lockup report: seconds stuck, and when it came. */
  readonly stuckByCpu = new Map<number, { s: number; at: number }>();
  /** When the lab's last heartbeat (LAB-BEAT, from its init) came; null before the first. */
  lastBeatAt: number | null = null;
  private readonly tail: string[] = [];
  private pendingFailures: string[] = [];
  /** The inner suite's recap of what failed (the lines under RECAP_TITLE), while it is being read. */
  private recap: string[] | null = null;
  private pendingDetails: string[] = [];
  private partial = '';

  constructor(
    private readonly onLine: (line: string) => void = () => {},
    private readonly now: () => number = Date.now,
    private readonly keep = 60,
  ) {
    this.lastLineAt = now();
  }

  /** Feeds raw console bytes; complete lines are handled, the rest waits. */
  feed(chunk: string): void {
    const text = this.partial + chunk;
    const lines = text.split('\n');
    this.partial = lines.pop() ?? '';
    for (const l of lines) this.line(l);
  }

  /** Handles whatever is left without a newline (at the end). */
  flush(): void {
    if (this.partial) this.line(this.partial);
    this.partial = '';
  }

  /** The last console lines, for error reports. */
  lastLines(n = this.keep): string[] {
    return this.tail.slice(-n);
  }

  private mark(stage: LabStage): void {
    if (!this.stages.has(stage)) this.stages.set(stage, this.now());
  }

  line(raw: string): void {
    // Serial output carries CRs and, at boot, escape sequences from the firmware.
    const line = raw.replace(/\r/g, '').replace(/\x1b\[[0-9;?]*[A-Za-z]/g, '');
    if (line.startsWith('LAB-BEAT ')) {
      this.lastBeatAt = this.now(); // (not output: neither shown nor counted against silence)
      return;
    }
    if (!KERNEL_LOG_RE.test(line)) this.lastLineAt = this.now();
    const stuck = SOFT_LOCKUP_RE.exec(line);
    if (stuck) {
      this.stuckS = Math.max(this.stuckS, Number(stuck[2]));
      this.stuckByCpu.set(Number(stuck[1]), { s: Number(stuck[2]), at: this.now() });
    }
    this.tail.push(line);
    if (this.tail.length > this.keep) this.tail.shift();
    this.onLine(line);

    if (this.stages.has('node-start') && !this.stages.has('first-output') && !line.startsWith('LAB-')) this.mark('first-output');
    const stage = /^LAB-STAGE (kernel-up|kvm-ready|mounted)\b/.exec(line);
    const exit = /^LAB-EXIT (\d+)/.exec(line);
    const setup = /^LAB-FAIL (.*)$/.exec(line);
    const inSuite = this.stages.has('node-start') && !this.stages.has('exit');
    const failedList = inSuite ? /^failed: (.+)$/.exec(line) : null;
    const summary = inSuite ? SUMMARY_RE.exec(line) : null;
    if (inSuite && line === RECAP_TITLE) {
      this.recap = [];
      return;
    }
    if (this.recap && (failedList || summary)) {
      this.pendingDetails = this.recap.filter((l) => l.trim() !== '' && !KERNEL_LOG_RE.test(l));
      this.recap = null;
    } else if (this.recap) {
      this.recap.push(line);
      return;
    }
    if (stage) this.mark(stage[1] as LabStage);
    else if (line.startsWith('LAB-NODE-START')) this.mark('node-start');
    else if (line.startsWith('LAB-FILE ')) this.runningFile = line.slice('LAB-FILE '.length).trim();
    else if (exit) {
      this.outcome.exitCode = Number(exit[1]);
      this.mark('exit');
    } else if (line.startsWith('LAB-POWEROFF')) this.mark('poweroff');
    else if (line.startsWith('LAB-TIMEOUT')) this.outcome.innerTimeout = true;
    else if (setup) this.outcome.setupFailure ??= setup[1] ?? 'unknown';
    else if (failedList) this.pendingFailures = failedList[1]!.split(', ').filter(Boolean);
    else if (summary) {
      this.outcome.summary = { passed: Number(summary[1]), failed: Number(summary[2]), failures: this.pendingFailures, details: this.pendingDetails };
      this.pendingFailures = [];
      this.pendingDetails = [];
    }
  }
}
