// Children of a snapshot (a template, or a branch of a running sandbox): each
// is a new VM whose RAM is the template's memory file mapped MAP_PRIVATE (plus
// the branch's diff layers), with the saved vCPU, KVM and device state. Once
// its vCPUs run, the host connects over vsock and calls the agent's
// `restore` (fresh entropy, wall clock, hostname, sandbox id) before anything
// else; the child is ready when that call returns.
import { randomBytes } from 'node:crypto';
import type { OpArgs } from '../../../protocol/schema.ts';
import { type AgentClient, answeredWithin, helloAndRestore } from '../../agent/client.ts';
import { UserError } from '../../errors.ts';
import type { NativePreparedVm, NativeSnapshot } from './native-vm.ts';
import { snapshotNative } from './snapshot-native.ts';
import { AGENT_PORT, KvmSandbox, vsockPathFor } from './vm.ts';
import { connectAgent, VsockConnectError } from './vsock.ts';

export const MAX_CHILDREN = 1024;
/** A restored guest answers within milliseconds; this bounds a broken one. */
export const CHILD_READY_TIMEOUT_MS = 30_000;

/** A new child's id (also its hostname): one shape for every child. */
export function childId(prefix: string): string {
  return `${prefix}-${randomBytes(6).toString('hex')}`;
}

/** What a child's agent is told first; the template's rehearsal sends the same (template.ts). */
export function childRestore(id: string): OpArgs<'restore'> {
  return { entropy: randomBytes(64), time: Date.now() / 1000, hostname: id, sandboxId: id };
}

/** Connects to a restored child's agent: the listener survived the snapshot, the connection attempts back off briefly. */
async function restoreAgent(sb: KvmSandbox, timeoutMs: number): Promise<AgentClient> {
  const deadline = performance.now() + timeoutMs;
  let delay = 1;
  let last = '';
  for (;;) {
    sb.throwIfStopped();
    const left = deadline - performance.now();
    if (left <= 0) throw new Error(`child ${sb.id}: its agent did not answer within ${timeoutMs} ms (${last})${sb.lastLines(10)}`);
    try {
      const client = await connectAgent(sb.vsockPath, AGENT_PORT, Math.min(left, 5000));
      // A restored agent answers at once; one that does not must not stall the fork past its limit.
      await answeredWithin(client, deadline - performance.now(), 'the restored agent', (c) =>
        helloAndRestore(c, childRestore(sb.id)),
      );
      return client;
    } catch (e) {
      // A child whose VM stopped has no socket any more: say why it stopped, not ENOENT.
      sb.throwIfStopped();
      if (e instanceof VsockConnectError && !e.retryable) throw e;
      last = (e as Error).message;
    }
    await new Promise((r) => setTimeout(r, delay));
    delay = Math.min(delay * 2, 50);
  }
}

/** n children of `snapshot`, all ready; on any failure every child made here is killed and the error thrown. */
export async function startChildren(
  snapshot: NativeSnapshot,
  n: number,
  opts: { prefix: string; onConsole?: (id: string, line: string) => void; readyTimeoutMs?: number } = { prefix: 'vm' },
): Promise<KvmSandbox[]> {
  if (!Number.isInteger(n) || n < 1 || n > MAX_CHILDREN) throw new UserError(`cannot start ${n} children`, `n must be an integer from 1 to ${MAX_CHILDREN}`);
  const children: KvmSandbox[] = [];
  const t0 = performance.now();
  let prepared: NativePreparedVm[] = [];
  try {
    // VM creation and state restore run in C++ on worker threads (creation
    // mostly waits on the kernel: an SRCU grace period per memory slot), then
    // each VM is wrapped and started here.
    const ids = Array.from({ length: n }, () => childId(opts.prefix));
    prepared = await snapshotNative().prepareVms(
      snapshot,
      ids.map((id) => ({ vsockPath: vsockPathFor(id) })),
    );
    for (let i = 0; i < n; i++) {
      const id = ids[i]!;
      const sb = KvmSandbox.fromSnapshot(
        {
          kernel: '',
          cmdline: '',
          memoryMiB: snapshot.memoryMiB,
          vcpus: snapshot.vcpus,
          readyTimeoutMs: opts.readyTimeoutMs ?? CHILD_READY_TIMEOUT_MS,
          restore: snapshot,
          prepared: prepared[i]!,
          ...(opts.onConsole ? { onConsole: (l: string) => opts.onConsole?.(id, l) } : {}),
        },
        id,
      );
      sb.timings.startedAt = t0; // creation began with the fork, before the wrapper existed
      children.push(sb);
      sb.nativeVm().start();
    }
    await Promise.all(
      children.map(async (sb) => {
        const client = await restoreAgent(sb, opts.readyTimeoutMs ?? CHILD_READY_TIMEOUT_MS);
        sb.attachAgent(client);
        sb.timings.readyAt = performance.now();
      }),
    );
    return children;
  } catch (e) {
    await Promise.all(children.map((c) => c.kill().catch(() => {})));
    for (const p of prepared) snapshotNative().releasePrepared(p); // (those no sandbox took over)
    throw e;
  }
}
