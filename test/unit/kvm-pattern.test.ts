// The KVM engine's pattern lifecycle (host/engine/kvm/pattern.ts) with
// stand-ins for the hidden children: built once when a child first wants it,
// their evals as a child's (no deadline sent to the agent), captured from one
// with the others as its fellow samples, all killed, and the children waiting
// for it told either way. What the pattern
// holds is tested with Linux children in the lab (test/kvm/fork.test.ts).
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { AgentError } from '../../host/agent/client.ts';
import type { NativeSnapshot } from '../../host/engine/kvm/native-vm.ts';
import { PATTERN_SAMPLES, type PatternSource, Patterns } from '../../host/engine/kvm/pattern.ts';
import type { DiffLayerHandle } from '../../host/engine/kvm/snapshot-native.ts';
import type { KvmSandbox } from '../../host/engine/kvm/vm.ts';

const LAYER: DiffLayerHandle = { handle: null, pageCount: 1, runCount: 1, ramSize: 4096 };
const SNAPSHOT = {} as NativeSnapshot;

type EvalOpts = { timeoutMs?: number; signal?: AbortSignal };

/** Hidden children whose agents answer evals with `answer`; what was asked of them, together. */
function hiddenChildren(answer: (opts: EvalOpts) => Promise<unknown>) {
  const seen = { evals: [] as { code: string; opts: EvalOpts }[], idlePasses: [] as { doze?: boolean; pack?: boolean }[], captures: [] as { by: unknown; others: unknown[] }[], kills: 0 };
  const make = () => {
    const vm = {
      capturePattern: (_dir: string, others: unknown[] = []) => {
        seen.captures.push({ by: vm, others });
        return LAYER;
      },
    };
    return {
    agent: {
      eval: (code: string, opts: EvalOpts = {}) => {
        seen.evals.push({ code, opts });
        return answer(opts);
      },
    },
      idlePass: async (opts: { doze?: boolean; pack?: boolean }) => {
        seen.idlePasses.push(opts);
      },
      nativeVm: () => vm,
      kill: async () => {
        seen.kills++;
      },
    } as unknown as KvmSandbox;
  };
  return { fork: async (_s: NativeSnapshot, n: number) => Array.from({ length: n }, make), seen };
}

/** A child of the template: takes the pattern source and counts the calls that say it is ready. */
function child() {
  const c = { source: null as PatternSource | null, ready: 0, exited: new Promise<never>(() => {}) };
  const sb = {
    usePattern: (p: PatternSource) => {
      c.source = p;
    },
    patternReady: () => {
      c.ready++;
    },
    exited: c.exited,
  };
  return { sb: sb as unknown as KvmSandbox, c };
}

async function until(what: string, ok: () => boolean): Promise<void> {
  const deadline = Date.now() + 5000;
  while (!ok()) {
    if (Date.now() > deadline) throw new Error(`${what}: not within 5 s`);
    await new Promise((r) => setTimeout(r, 5));
  }
}

test('built once, when a child first wants it, from hidden children whose evals send the agent no deadline; all are killed', async () => {
  const hidden = hiddenChildren(async () => ({ value: 2, stdout: '', stderr: '' }));
  let forks = 0;
  const patterns = new Patterns({
    fork: (s, n) => {
      forks++;
      return hidden.fork(s, n);
    },
    dir: () => '/nonexistent',
    doze: true,
  });
  const a = child();
  const b = child();
  patterns.attach('t', '2026-12-04T00:00:00Z', SNAPSHOT, [a.sb, b.sb], 1);
  assert.is(forks, 0, 'nothing is built before a child wants it');
  a.c.source!.want();
  b.c.source!.want();
  await until('the pattern', () => !!a.c.source!.layer || !!a.c.source!.failed);
  assert.is(a.c.source!.failed, undefined);
  assert.is(a.c.source!.layer, LAYER);
  assert.is(forks, 1, 'one fork of hidden children for the template');
  assert.is(hidden.seen.evals.length, PATTERN_SAMPLES);
  for (const e of hidden.seen.evals) {
    // A child's first eval carries no timeoutMs; one here would make objects in the agent no child has.
    assert.is(e.opts.timeoutMs, undefined);
    assert.ok(e.opts.signal, 'the limit is the host side (a signal)');
  }
  // Each ran a child's idle pass, dozing as children do (not packed: it is captured next).
  assert.equal(hidden.seen.idlePasses, Array.from({ length: PATTERN_SAMPLES }, () => ({ doze: true, pack: false })));
  assert.is(hidden.seen.captures.length, 1);
  const capture = hidden.seen.captures[0]!;
  assert.is(capture.others.length, PATTERN_SAMPLES - 1, 'captured from one, with the others as its fellow samples');
  assert.not.ok(capture.others.includes(capture.by));
  await until('the hidden children killed', () => hidden.seen.kills === PATTERN_SAMPLES);
  assert.is(a.c.ready, 1);
  assert.is(b.c.ready, 1);
  // The same template again: the same pattern, nothing built.
  const c = child();
  patterns.attach('t', '2026-12-04T00:00:00Z', SNAPSHOT, [c.sb], 1);
  c.c.source!.want();
  assert.is(c.c.source, a.c.source);
  assert.is(forks, 1);
});

test('hidden children that do not answer are given up within the limit, killed, and the pattern says why', async () => {
  // Answers only when the request is cancelled, as the agent client does on its signal.
  const hidden = hiddenChildren(
    (opts) =>
      new Promise((_, reject) => {
        opts.signal?.addEventListener('abort', () => reject(new AgentError('cancelled', 'eval cancelled')), { once: true });
      }),
  );
  const patterns = new Patterns({ fork: hidden.fork, dir: () => '/nonexistent', evalTimeoutMs: 50, doze: true });
  const a = child();
  patterns.attach('t', '2026-12-04T00:00:00Z', SNAPSHOT, [a.sb], 1);
  a.c.source!.want();
  await until('the pattern to fail', () => !!a.c.source!.failed);
  assert.match(a.c.source!.failed!, 'its eval got no answer within 50 ms');
  assert.is(a.c.source!.layer, null);
  assert.is(hidden.seen.captures.length, 0);
  await until('the hidden children killed', () => hidden.seen.kills === PATTERN_SAMPLES);
  assert.is(a.c.ready, 1, 'a waiting child is told, so it runs its passes without the pattern');
});

test.run();
