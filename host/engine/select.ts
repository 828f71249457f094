// Which engine runs sandboxes: `--engine kvm|process|auto` or $FORKLING_ENGINE
// (the option wins). `auto` picks kvm where /dev/kvm opens read-write, else
// process, and says which and why in one line; the process engine always
// states its weaker isolation.
import { probeKvm } from '../doctor/kvm-probe.ts';
import { UserError } from '../errors.ts';
import type { Engine, EngineName } from './engine.ts';
import { PROCESS_ISOLATION } from './process/engine.ts';

export type EngineChoice = EngineName | 'auto';

export interface EngineSelection {
  name: EngineName;
  /** The one line for people: which engine and why (and, for process, its isolation). */
  line: string;
}

/** The choice from an option value, else $FORKLING_ENGINE, else auto; a UserError for anything else. */
export function parseEngineChoice(option?: string, env: NodeJS.ProcessEnv = process.env): EngineChoice {
  const raw = option ?? env.FORKLING_ENGINE ?? 'auto';
  const v = raw.trim().toLowerCase();
  if (v === 'kvm' || v === 'process' || v === 'auto') return v;
  const from = option !== undefined ? '--engine' : 'FORKLING_ENGINE';
  throw new UserError(`unknown engine ${JSON.stringify(raw)} (from ${from})`, 'use kvm, process or auto');
}

/** Whether the KVM engine can run here (/dev/kvm usable, API and capabilities, not kvm_pvm). */
export function kvmUsable(device?: string): { ok: boolean; why: string } {
  const p = probeKvm(device);
  return { ok: p.usable, why: p.reason };
}

/** Resolves a choice to an engine name and the line to print. Throws when kvm is asked for and unusable. */
export function resolveEngine(choice: EngineChoice, kvm: { ok: boolean; why: string } = kvmUsable()): EngineSelection {
  if (choice === 'kvm') {
    if (!kvm.ok) throw new UserError(`the kvm engine cannot run: ${kvm.why}`, 'run `forkling doctor` to see what is missing and how to fix it, or use --engine process (weaker isolation)');
    return { name: 'kvm', line: 'forkling: engine kvm (chosen explicitly): sandboxes are microVMs' };
  }
  if (choice === 'process') {
    return { name: 'process', line: `forkling: engine process (chosen explicitly); ${PROCESS_ISOLATION}` };
  }
  if (kvm.ok) return { name: 'kvm', line: `forkling: engine kvm (auto: ${kvm.why}): sandboxes are microVMs` };
  return { name: 'process', line: `forkling: engine process (auto: ${kvm.why}); ${PROCESS_ISOLATION}` };
}

/**
 * Opens the engine for an --engine value (or $FORKLING_ENGINE, or auto),
 * printing the selection line (default: to stderr, so that stdout stays the
 * command's own output).
 */
export async function openEngine(
  option?: string,
  opts: {
    log?: (line: string) => void;
    /** The process engine's spare forks per template (its option `spares`; default: its own, $FORKLING_PROCESS_SPARES or 0). */
    processSpares?: number;
    /** The KVM engine's idle time before a child sleeps (its option `reclaimIdleMs`; default: its own, $FORKLING_KVM_SLEEP_AFTER_MS or 1 s). */
    kvmSleepAfterMs?: number;
  } = {},
): Promise<Engine> {
  const sel = resolveEngine(parseEngineChoice(option));
  const log = opts.log ?? ((l: string) => console.error(l));
  log(sel.line);
  if (sel.name === 'process') {
    const { ProcessEngine } = await import('./process/engine.ts');
    return new ProcessEngine({ progress: log, ...(opts.processSpares !== undefined ? { spares: opts.processSpares } : {}) });
  }
  // Loaded only when chosen: a process-engine host never loads the VMM code.
  const { KvmEngine } = await import('./kvm/engine.ts');
  return new KvmEngine({ progress: log, ...(opts.kvmSleepAfterMs !== undefined ? { reclaimIdleMs: opts.kvmSleepAfterMs } : {}) });
}
