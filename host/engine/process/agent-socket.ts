// The host's way to a process-engine sandbox's agent. Its socket lives in the
// sandbox's own /run (a tmpfs of its mount namespace: no host directory is
// writable from a sandbox), reached through /proc/<pid>/root without following
// any link the sandbox may have put there; and the process that listens on it
// must be the sandbox's PID 1 itself (a branch's source can reach into its
// branches' roots and could otherwise answer in their place).
import { closeSync } from 'node:fs';
import type { Socket } from 'node:net';
import type { OpArgs } from '../../../protocol/schema.ts';
import { type AgentClient, type AgentClientOptions, answeredWithin, connectUnix, helloAndRestore } from '../../agent/client.ts';
import { sandboxAddon } from './native.ts';

/** The agent's socket, relative to a sandbox's root (it listens on /run/forkling/agent.sock). */
export const AGENT_SOCKET = 'run/forkling/agent.sock';
/** How long a sandbox's agent has to answer its first requests (hello; a fork's restore too). */
export const HANDSHAKE_MS = 30_000;

/** The fd libuv holds for a connected net.Socket (a Unix socket: a Pipe handle). */
function fdOf(sock: Socket): number {
  const fd = (sock as unknown as { _handle?: { fd?: number } })._handle?.fd;
  if (typeof fd !== 'number' || fd < 0) throw new Error('the connection has no file descriptor');
  return fd;
}

/**
 * Connects to the agent of the sandbox whose PID 1 is host pid `pid`; by
 * default also does the hello exchange, and with `restore` a new sandbox's
 * restore sent behind it (`expectId`: the sandbox id hello must report, a
 * fork's). Both must be answered within HANDSHAKE_MS (the agent runs the
 * image's and the template's code).
 */
export async function connectAgent(pid: number, opts: AgentClientOptions & { hello?: boolean; restore?: OpArgs<'restore'>; expectId?: string } = {}): Promise<AgentClient> {
  const addon = sandboxAddon();
  const name = `/${AGENT_SOCKET} of sandbox process ${pid}`;
  let fd: number;
  try {
    fd = addon.sandboxAgentSocket(pid, AGENT_SOCKET);
  } catch (e) {
    throw new Error(`cannot reach the agent at ${name}: ${(e as Error).message}`);
  }
  let client: AgentClient;
  try {
    client = await connectUnix(`/proc/self/fd/${fd}`, {
      ...opts,
      hello: false,
      name,
      check: (sock) => {
        const peer = addon.sandboxPeerPid(fdOf(sock));
        if (peer !== pid) throw new Error(`the agent at ${name} is served by process ${peer}, not by the sandbox`);
      },
    });
  } finally {
    closeSync(fd);
  }
  if (opts.hello === false) return client;
  const restore = opts.restore;
  await answeredWithin(client, HANDSHAKE_MS, `the agent at ${name}`, (c) => (restore ? helloAndRestore(c, restore, opts.expectId) : c.hello().then(() => {})));
  return client;
}
