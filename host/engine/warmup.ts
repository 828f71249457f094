// A template's warm-up, the same in both engines: the user's code run in the
// agent's default context, within a time limit. Without one, a warm-up that
// never ends hung `template create` (and, in the process engine, every start
// of that template's zygote) with no word of why.
import { AgentError, type AgentClient } from '../agent/client.ts';
import { UserError } from '../errors.ts';

/** A warm-up's limit unless the template says otherwise: room for large imports in a slow guest, not forever. */
export const DEFAULT_WARMUP_TIMEOUT_MS = 600_000;
/** The largest limit (one day; also what `--warmup-timeout` takes, in seconds). */
export const MAX_WARMUP_TIMEOUT_MS = 86_400_000;
/**
 * How long past its limit the host waits for the agent's answer. The agent
 * interrupts the code at the limit (KeyboardInterrupt, again every second);
 * code that swallows every one, or sits in C, is given up here and its
 * sandbox killed by the caller.
 */
export const WARMUP_GRACE_MS = 3_000;

/** Where a traceback's innermost frame was: `<cell-1>, line 2: time.sleep(1)`. */
function whereInterrupted(traceback: string): string {
  const lines = traceback.split('\n');
  for (let i = lines.length - 1; i >= 0; i--) {
    const m = /^\s*File "([^"]*)", line (\d+)/.exec(lines[i]!);
    if (!m) continue;
    // (its source line, indented below it, is missing where Python has no source: the next is then the exception's)
    const src = /^ {4}\S/.test(lines[i + 1] ?? '') ? lines[i + 1]!.trim() : '';
    return `${m[1]}, line ${m[2]}${src ? `: ${src.slice(0, 120)}` : ''}`;
  }
  return '';
}

/**
 * Template `template`'s warm-up limit in ms: `timeoutMs`, or the default when
 * absent. Checked before a sandbox is started for it (a limit read back from
 * a template's file that someone edited is refused, not booted).
 */
export function warmupLimit(template: string, timeoutMs: number | undefined): number {
  if (timeoutMs === undefined) return DEFAULT_WARMUP_TIMEOUT_MS;
  if (!Number.isSafeInteger(timeoutMs) || timeoutMs < 1 || timeoutMs > MAX_WARMUP_TIMEOUT_MS) {
    throw new UserError(`template ${template}'s warm-up time limit ${JSON.stringify(timeoutMs)} is not a whole number of ms from 1 to ${MAX_WARMUP_TIMEOUT_MS}`, `create it again: forkling template create ${template} ...`);
  }
  return timeoutMs;
}

/**
 * Runs `code` as template `template`'s warm-up; throws a UserError if it
 * fails, takes longer than `timeoutMs` (from warmupLimit), or its agent goes
 * away meanwhile (the caller then kills the sandbox).
 */
export async function runWarmup(agent: AgentClient, template: string, code: string, timeoutMs: number): Promise<void> {
  const what = `the warm-up of template ${template}`;
  const moreTime = `make it finish sooner, or give it more time: forkling template create ${template} ... --warmup-timeout <seconds> (now ${timeoutMs / 1000})`;
  let r: Awaited<ReturnType<AgentClient['eval']>>;
  try {
    r = await agent.eval(code, { timeoutMs, signal: AbortSignal.timeout(timeoutMs + WARMUP_GRACE_MS) });
  } catch (e) {
    if (!(e instanceof AgentError)) throw e;
    if (e.code === 'cancelled') {
      throw new UserError(`${what} did not finish within ${timeoutMs / 1000} s, and went on after it was interrupted (it swallows KeyboardInterrupt, or runs C code that does not return); given up ${WARMUP_GRACE_MS / 1000} s later`, moreTime);
    }
    throw new UserError(`${what} failed: its agent went away (${e.message})`, 'it may have run out of memory: give the template more (--memory <MiB>), or look at what the warm-up does');
  }
  if (r.timedOut) {
    const at = r.exception ? whereInterrupted(r.exception.traceback) : '';
    throw new UserError(`${what} did not finish within ${timeoutMs / 1000} s${at ? ` (interrupted in ${at})` : ''}`, moreTime);
  }
  if (r.exception) {
    throw new UserError(
      `${what} failed: ${r.exception.type}: ${r.exception.message}`,
      r.exception.traceback ? r.exception.traceback.trim().split('\n').slice(-6).join('\n') : undefined,
    );
  }
}
