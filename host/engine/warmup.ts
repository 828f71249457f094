// A template's warm-up, the same in both engines: the user's code run in the
// agent's default context, within a time limit. Without one, a warm-up that
// never ends hung `template create` (and, in the process engine, every start
// of that template's zygote) with no word of why.
import { AgentError, type AgentClient } from '../agent/client.ts';
import { UserError } from '../errors.ts';

/** A warm-up's limit unless the template says otherwise: room for large imports in a slow guest, not forever. */
export const DEFAULT_WARMUP_TIMEOUT_MS = 600_000;
/**
 * How long past its limit the host waits for the agent's answer. The agent
 * interrupts the code at the limit (KeyboardInterrupt, again every second);
 * code that swallows every one, or sits in C, is given up here and its
 * sandbox killed by the caller.
 */
export const WARMUP_GRACE_MS = 3_000;

/** Runs `code` as template `template`'s warm-up; throws a UserError if it fails or takes longer than `timeoutMs`. */
export async function runWarmup(agent: AgentClient, template: string, code: string, timeoutMs = DEFAULT_WARMUP_TIMEOUT_MS): Promise<void> {
  const late = new UserError(
    `the warm-up of template ${template} did not finish within ${timeoutMs / 1000} s`,
    'make it finish sooner, or give it more time: forkling template create ... --warmup-timeout <seconds>',
  );
  let r: Awaited<ReturnType<AgentClient['eval']>>;
  try {
    r = await agent.eval(code, { timeoutMs, signal: AbortSignal.timeout(timeoutMs + WARMUP_GRACE_MS) });
  } catch (e) {
    if (e instanceof AgentError && e.code === 'cancelled') throw late;
    throw e;
  }
  if (r.timedOut) throw late;
  if (r.exception) {
    throw new UserError(
      `the warm-up of template ${template} failed: ${r.exception.type}: ${r.exception.message}`,
      r.exception.traceback ? r.exception.traceback.trim().split('\n').slice(-6).join('\n') : undefined,
    );
  }
}
