// KVM templates: a booted, warmed-up VM frozen to the store as
// templates/<name>/{state.bin, memory.bin, template.json} (written into a
// staging directory that replaces the old one atomically). The state and
// memory files are checked when loaded: a missing, truncated or corrupt
// template is refused with an error that names it, never restored.
import { existsSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { type AgentClient, AgentError, answeredWithin, helloAndRestore } from '../../agent/client.ts';
import { checkName, UserError } from '../../errors.ts';
import { buildDirAtomic, storePath } from '../../store.ts';
import type { TemplateInfo, TemplateOptions } from '../engine.ts';
import { runWarmup, warmupLimit } from '../warmup.ts';
import { childId, childRestore } from './fork.ts';
import type { NativeSnapshot } from './native-vm.ts';
import { snapshotNative } from './snapshot-native.ts';
import { AGENT_PORT, type KvmSandbox } from './vm.ts';
import { connectAgent, VsockConnectError } from './vsock.ts';

export const STATE_FILE = 'state.bin';
export const MEMORY_FILE = 'memory.bin';
export const INFO_FILE = 'template.json';

export function templateDir(name: string): string {
  return storePath('templates', checkName('template', name));
}

export function templateExists(name: string): boolean {
  return existsSync(join(templateDir(name), INFO_FILE));
}

/**
 * Which files a template is now: the device, inode, size and mtime of each.
 * A new template of the same name is other inodes (it is made in a directory
 * renamed into place: buildDirAtomic); a file changed in place, cut short
 * for one, has another size or mtime, so it is loaded (and checked) again.
 */
export function templateIdentity(name: string): string {
  return [INFO_FILE, STATE_FILE, MEMORY_FILE]
    .map((f) => {
      const st = statSync(join(templateDir(name), f), { bigint: true });
      return `${st.dev}:${st.ino}:${st.size}:${st.mtimeNs}`;
    })
    .join('/');
}

export function readTemplateInfo(name: string): TemplateInfo {
  const path = join(templateDir(name), INFO_FILE);
  if (!existsSync(path)) throw new UserError(`template ${JSON.stringify(name)} does not exist`, 'create it: forkling template create <name> --image <image>');
  if (!statSync(path).isFile()) {
    // (read, a FIFO put there would block this process for good)
    throw new UserError(`template ${name} is corrupt: ${INFO_FILE} is not a regular file`, `remove it (forkling template rm ${name}) and create it again`);
  }
  let info: TemplateInfo;
  try {
    info = JSON.parse(readFileSync(path, 'utf8')) as TemplateInfo;
  } catch (e) {
    throw new UserError(`template ${name} is corrupt: ${INFO_FILE} is not valid JSON (${(e as Error).message})`, `remove it (forkling template rm ${name}) and create it again`);
  }
  if (info.engine !== 'kvm' || info.name !== name || !Number.isInteger(info.memoryMiB) || !Number.isInteger(info.vcpus)) {
    throw new UserError(`template ${name} is corrupt: ${INFO_FILE} does not describe a kvm template named ${name}`, `remove it (forkling template rm ${name}) and create it again`);
  }
  return info;
}

/**
 * The template's snapshot, checked: state file sections and checksums, and
 * the memory file's size and checksum (the memory check runs once per
 * process per file; the addon caches it by inode and mtime).
 */
export function loadTemplate(name: string): { info: TemplateInfo; snapshot: NativeSnapshot } {
  const info = readTemplateInfo(name);
  try {
    const snapshot = snapshotNative().loadTemplate(templateDir(name), `template ${name}`);
    if (snapshot.memoryMiB !== info.memoryMiB || snapshot.vcpus !== info.vcpus) {
      throw new UserError(`template ${name} is corrupt: its state file and ${INFO_FILE} disagree about memory or vCPUs`, `remove it (forkling template rm ${name}) and create it again`);
    }
    return { info, snapshot };
  } catch (e) {
    if ((e as { code?: string }).code === 'ECORRUPT') {
      throw new UserError((e as Error).message, `remove it (forkling template rm ${name}) and create it again`);
    }
    throw e;
  }
}

/** Waits (polling the device's own counter, bounded) until the guest has no vsock connection left. */
async function waitNoConnections(sb: KvmSandbox, timeoutMs: number): Promise<void> {
  const deadline = performance.now() + timeoutMs;
  for (;;) {
    const s = sb.nativeVm().stats();
    if ((s.counters.vsock_connections ?? 0) === 0) return;
    if (performance.now() > deadline) throw new Error(`the template VM still has ${s.counters.vsock_connections} vsock connections after ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 2));
  }
}

/** How long one connection attempt waits for the guest's answer before the next (the device gives up on it after 5 s too). */
const CONNECT_ATTEMPT_MS = 5_000;

/**
 * A new agent connection within `timeoutMs`; the guest may refuse one for a
 * moment (the previous connection's close still in flight), or, on a slow or
 * loaded host, not answer one in time: tried again.
 */
async function connectRetrying(sb: KvmSandbox, timeoutMs: number): Promise<AgentClient> {
  const deadline = performance.now() + timeoutMs;
  let delay = 1;
  for (;;) {
    sb.throwIfStopped();
    try {
      return await connectAgent(sb.vsockPath, AGENT_PORT, Math.max(1, Math.min(CONNECT_ATTEMPT_MS, deadline - performance.now())));
    } catch (e) {
      if (!(e instanceof VsockConnectError) || !e.retryable || performance.now() + delay > deadline) throw e;
    }
    await new Promise((r) => setTimeout(r, delay));
    delay = Math.min(delay * 2, 50);
  }
}

const REHEARSALS = 16;
/**
 * How long the template's agent has for each rehearsal's connection and
 * requests, and for the freeze (a guest that stops answering fails the
 * template). One limit for both: a connection had 10 s, which a slow or
 * loaded host ran out of (the lab's CI: 'vsock port 1024: no answer within
 * 4955 ms') while the requests after it had 60.
 */
const REHEARSAL_LIMIT_MS = 60_000;
const REHEARSAL_CONTEXT = 'forkling-rehearsal';

/**
 * Does in the template what every child does first (connect over vsock,
 * hello, restore, an eval, ping, and once idle the quiet question), a few times, then fills pymalloc's pool
 * holes and freezes the heap: lazy
 * imports, caches and CPython's specialised bytecode are filled in once here
 * instead of being written, and so copied page by page, in every child, and
 * gc.freeze() keeps the collector in a child from touching every inherited
 * object. The process engine's zygote does the same.
 */
async function rehearse(sb: KvmSandbox): Promise<void> {
  for (let i = 0; i < REHEARSALS; i++) {
    const c = await connectRetrying(sb, REHEARSAL_LIMIT_MS);
    try {
      // (our agent answers these at once; a guest that does not must not hold the template up for ever)
      await answeredWithin(c, REHEARSAL_LIMIT_MS, "the template's agent (rehearsal)", async (x) => {
        // A child's restore, with a child's hostname and id: the same strings, so the same
        // allocations, as in a child (an entropy-only restore left pages unlike a child's).
        await helloAndRestore(x, childRestore(childId('vm')));
        await x.eval('1 + 1', { context: REHEARSAL_CONTEXT });
        await x.ping();
        // An idle child is asked whether it is quiet (vm.ts idlePass): the /proc entries that
        // reads are the guest kernel's objects, made here once rather than in every child.
        await x.request('quiet', {}).catch((e: unknown) => {
          if (!(e instanceof AgentError && e.code === 'unknown_op')) throw e; // (an image's agent older than doze)
        });
      });
    } finally {
      c.close();
    }
  }
  // Last: a collection, the holes of pymalloc's pools filled (the agent's fill_pool_holes: what a
  // child allocates then comes from pools of its own, not from holes spread over the template's
  // pages), and the freeze; in the default context, binding no name there.
  const r = await answeredWithin(sb.agent, REHEARSAL_LIMIT_MS, "the template's agent (freeze)", async (a) => {
    await a.contextDelete(REHEARSAL_CONTEXT);
    return a.eval('__import__("gc").collect()\ngetattr(__import__("sys").modules["__main__"], "fill_pool_holes", lambda: None)()\n__import__("gc").freeze()');
  });
  if (r.exception) throw new Error(`gc.freeze in the template failed: ${r.exception.type}: ${r.exception.message}`);
}

/**
 * Boots `opts.image`, runs the warm-up in the agent's default context,
 * rehearses a child's first requests and freezes the heap (rehearse()),
 * quiesces (the host closes its connection and waits until the device has
 * none), pauses every vCPU and writes the template. The VM is killed after.
 */
export async function createKvmTemplate(
  boot: (o: { image: string; memoryMiB?: number; vcpus?: number }) => Promise<KvmSandbox>,
  opts: TemplateOptions & { memoryMiB: number; vcpus: number },
): Promise<TemplateInfo> {
  checkName('template', opts.name);
  checkName('image', opts.image);
  const warmupMs = warmupLimit(opts.name, opts.warmupTimeoutMs);
  const sb = await boot({ image: opts.image, memoryMiB: opts.memoryMiB, vcpus: opts.vcpus });
  try {
    if (opts.warmup) await runWarmup(sb.agent, opts.name, opts.warmup, warmupMs);
    await rehearse(sb);
    // Quiesce: the warm-up is done; no connection may be copied into children.
    sb.agent.close();
    await waitNoConnections(sb, 10_000);
    const vm = sb.nativeVm();
    vm.pause();
    const info: TemplateInfo = {
      name: opts.name,
      engine: 'kvm',
      image: opts.image,
      createdAt: new Date().toISOString(),
      memoryMiB: opts.memoryMiB,
      vcpus: opts.vcpus,
      ...(opts.warmup !== undefined ? { warmup: opts.warmup } : {}),
      ...(opts.warmupTimeoutMs !== undefined ? { warmupTimeoutMs: opts.warmupTimeoutMs } : {}),
    };
    await buildDirAtomic(templateDir(opts.name), async (staging) => {
      const w = vm.saveTemplate(staging);
      writeFileSync(join(staging, INFO_FILE), `${JSON.stringify({ ...info, memoryFile: w.memory, stateBytes: w.stateBytes }, null, 2)}\n`); // (synced with the directory: buildDirAtomic)
    });
    return info;
  } catch (e) {
    // A connection the agent closed while the template was made (seen once in the lab): the guest's side of it.
    if (e instanceof AgentError && e.code === 'closed') e.message += sb.lastLines();
    throw e;
  } finally {
    await sb.kill();
  }
}
