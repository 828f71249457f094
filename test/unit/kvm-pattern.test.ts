// The KVM engine's pattern lifecycle (host/engine/kvm/pattern.ts) with a
// stand-in for the hidden child: built once when a child first wants it, its
// eval as a child's (no deadline sent to the agent), the hidden child always
// killed, and the children waiting for it told either way. What the pattern
// holds is tested with Linux children in the lab (test/kvm/fork.test.ts).
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { AgentError } from '../../host/agent/client.ts';
import type { NativeSnapshot } from '../../host/engine/kvm/native-vm.ts';
import { type PatternSource, Patterns } from '../../host/engine/kvm/pattern.ts';
import type { DiffLayerHandle } from '../../host/engine/kvm/snapshot-native.ts';
import type { KvmSandbox } from '../../host/engine/kvm/vm.ts';

const LAYER: DiffLayerHandle = { handle: null, pageCount: 1, runCount: 1, ramSize: 4096 };
const SNAPSHOT = {} as NativeSnapshot;

type EvalOpts = { timeoutMs?: number; signal?: AbortSignal };

/** A hidden child whose agent answers evals with `answer`. */
function hiddenChild(answer: (opts: EvalOpts) => Promise<unknown>) {
  const seen = { evals: [] as { code: string; opts: EvalOpts }[], reclaims: 0, captures: 0, kills: 0 };
  const sb = {
    agent: {
      eval: (code: string, opts: EvalOpts = {}) => {
        seen.evals.push({ code, opts });
        return answer(opts);
      },
    },
    reclaim: async () => {
      seen.reclaims++;
    },
    nativeVm: () => ({
      capturePattern: () => {
        seen.captures++;
        return LAYER;
      },
    }),
    kill: async () => {
      seen.kills++;
    },
  };
  return { sb: sb as unknown as KvmSandbox, seen };
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

test('built once, when a child first wants it; its eval sends the agent no deadline; the hidden child is killed', async () => {
  const hidden = hiddenChild(async () => ({ value: 2, stdout: '', stderr: '' }));
  let forks = 0;
  const patterns = new Patterns({
    fork: async () => {
      forks++;
      return hidden.sb;
    },
    dir: () => '/nonexistent',
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
  assert.is(forks, 1, 'one hidden child for the template');
  assert.is(hidden.seen.evals.length, 1);
  // A child's first eval carries no timeoutMs; one here would make objects in the agent no child has.
  assert.is(hidden.seen.evals[0]!.opts.timeoutMs, undefined);
  assert.ok(hidden.seen.evals[0]!.opts.signal, 'the limit is the host side (a signal)');
  assert.is(hidden.seen.reclaims, 1);
  assert.is(hidden.seen.captures, 1);
  await until('the hidden child killed', () => hidden.seen.kills === 1);
  assert.is(a.c.ready, 1);
  assert.is(b.c.ready, 1);
  // The same template again: the same pattern, nothing built.
  const c = child();
  patterns.attach('t', '2026-12-04T00:00:00Z', SNAPSHOT, [c.sb], 1);
  c.c.source!.want();
  assert.is(c.c.source, a.c.source);
  assert.is(forks, 1);
});

test('a hidden child that does not answer is given up within the limit, killed, and the pattern says why', async () => {
  // Answers only when the request is cancelled, as the agent client does on its signal.
  const hidden = hiddenChild(
    (opts) =>
      new Promise((_, reject) => {
        opts.signal?.addEventListener('abort', () => reject(new AgentError('cancelled', 'eval cancelled')), { once: true });
      }),
  );
  const patterns = new Patterns({ fork: async () => hidden.sb, dir: () => '/nonexistent', evalTimeoutMs: 50 });
  const a = child();
  patterns.attach('t', '2026-12-04T00:00:00Z', SNAPSHOT, [a.sb], 1);
  a.c.source!.want();
  await until('the pattern to fail', () => !!a.c.source!.failed);
  assert.match(a.c.source!.failed!, 'its eval got no answer within 50 ms');
  assert.is(a.c.source!.layer, null);
  assert.is(hidden.seen.captures, 0);
  await until('the hidden child killed', () => hidden.seen.kills === 1);
  assert.is(a.c.ready, 1, 'a waiting child is told, so it runs its passes without the pattern');
});

test.run();
