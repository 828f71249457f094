// The pattern of a template (native/src/vmm/snapshot/pattern.h): once per
// template and engine, three hidden children get a child's first request, go
// idle as long as a child does before its first reclaim pass, run that pass
// as a child does (and doze), and their private pages become a file (where one of them
// alone holds other bytes, those the other two hold alike). Every child of the
// template then maps from that file, at its reclaim passes, the runs of
// pages that hold the same bytes: one copy in the page cache instead of one
// per child. Built in the background when a child of the template first
// runs a pass (a one-shot fork whose children end before they idle builds
// none); children get it at their next pass, an idle one at once.
import { AgentError } from '../../agent/client.ts';
import type { NativeSnapshot } from './native-vm.ts';
import type { DiffLayerHandle } from './snapshot-native.ts';
import type { KvmSandbox } from './vm.ts';

/** The hidden children's request: what the template's rehearsal sends too (template.ts). */
export const PATTERN_EVAL = '1 + 1';
/**
 * Hidden children per pattern, forked together: where one went its own way
 * (in one lab run of four it did, and every child of that template kept
 * ~300 KiB more), the pages the other two hold alike win.
 */
export const PATTERN_SAMPLES = 3;
/** A hidden child that does not answer within this is given up (and killed). */
const PATTERN_EVAL_TIMEOUT_MS = 30_000;
/** A pattern that failed is built again at a fork this much later, not before. */
const RETRY_AFTER_MS = 60_000;

export interface PatternSource {
  /** The pattern file, once built (null until then, or if it failed). */
  readonly layer: DiffLayerHandle | null;
  /** Why building it failed. */
  readonly failed?: string;
  /** A child is about to run a pass: the pattern is built now if it is not yet (once). */
  want(): void;
}

class TemplatePattern implements PatternSource {
  layer: DiffLayerHandle | null = null;
  failed?: string;
  failedAt = 0;
  private started = false;
  /** Children waiting for it: they run a pass once it is ready. */
  readonly waiting = new Set<KvmSandbox>();
  constructor(
    readonly key: string,
    private readonly build: () => void,
  ) {}

  want(): void {
    if (this.started) return;
    this.started = true;
    this.build();
  }
}

export interface PatternBuild {
  /** Forks `n` hidden children, ready. */
  fork(snapshot: NativeSnapshot, n: number): Promise<KvmSandbox[]>;
  /** Where the pattern file goes (an unlinked file there). */
  dir(): string;
  /** How long each hidden child's eval may take (default PATTERN_EVAL_TIMEOUT_MS). */
  evalTimeoutMs?: number;
  /** Whether children doze after their idle pass (the hidden children do as they do). */
  doze: boolean;
}

/** The patterns of the templates this process forked from: one per template name, the newest version. */
export class Patterns {
  private readonly byName = new Map<string, TemplatePattern>();

  constructor(private readonly build: PatternBuild) {}

  /**
   * The pattern of `name` as created at `createdAt` for `children`; built
   * when one of them first runs a pass (its hidden children idle `idleMs`, as
   * children do before a pass).
   */
  attach(name: string, createdAt: string, snapshot: NativeSnapshot, children: KvmSandbox[], idleMs: number): void {
    const key = `${name}\0${createdAt}`;
    let p = this.byName.get(name);
    if (!p || p.key !== key || (p.failed && Date.now() - p.failedAt > RETRY_AFTER_MS)) {
      // A template made again: its old pattern goes (children that map it keep it alive).
      const made: TemplatePattern = new TemplatePattern(key, () => void this.make(made, snapshot, idleMs));
      p = made;
      this.byName.set(name, p);
    }
    for (const c of children) {
      c.usePattern(p);
      if (!p.layer && !p.failed) {
        const w = p;
        w.waiting.add(c);
        void c.exited.then(() => w.waiting.delete(c));
      }
    }
  }

  /** The pattern of `name` now (diagnostics and benchmarks). */
  of(name: string): PatternSource | undefined {
    return this.byName.get(name);
  }

  /** Forgets every pattern (their files go with the last child that maps them). */
  clear(): void {
    this.byName.clear();
  }

  private async make(p: TemplatePattern, snapshot: NativeSnapshot, idleMs: number): Promise<void> {
    let hidden: KvmSandbox[] = [];
    try {
      hidden = await this.build.fork(snapshot, PATTERN_SAMPLES);
      // The limit is the host's (a signal), not the agent's: a child's eval has none there, and the
      // agent's deadline would be objects a child never makes.
      const limit = this.build.evalTimeoutMs ?? PATTERN_EVAL_TIMEOUT_MS;
      await Promise.all(
        hidden.map(async (sb) => {
          const r = await sb.agent.eval(PATTERN_EVAL, { signal: AbortSignal.timeout(limit) }).catch((e: Error) => {
            throw e instanceof AgentError && e.code === 'cancelled' ? new Error(`its eval got no answer within ${limit} ms`) : e;
          });
          if (r.exception) throw new Error(`its eval failed: ${r.exception.type}: ${r.exception.message}`);
        }),
      );
      // Idle as long as a child before its first pass, then that pass as a child runs it, together:
      // the quiet question and the doze too (a child that dozes holds the pages of that moment).
      await new Promise((res) => setTimeout(res, idleMs).unref());
      await Promise.all(hidden.map((sb) => sb.idlePass({ doze: this.build.doze, pack: false })));  // (captured next: nothing to pack)
      const [first, ...others] = hidden;
      p.layer = first!.nativeVm().capturePattern(
        this.build.dir(),
        others.map((o) => o.nativeVm()),
      );
    } catch (e) {
      p.failed = (e as Error).message;
      p.failedAt = Date.now();
    } finally {
      await Promise.all(hidden.map((sb) => sb.kill().catch(() => {})));
    }
    for (const c of p.waiting) c.patternReady();
    p.waiting.clear();
  }
}
