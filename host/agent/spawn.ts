// Runs the guest agent as an ordinary host process on a Unix socket (tests,
// benchmarks; the process engine builds on the same command line). Readiness:
// the agent prints `forkling-agent ready ...` once it listens; the caller then
// connects and does the hello exchange.
import { type ChildProcess, spawn } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { type AgentClient, type AgentClientOptions, connectUnix } from './client.ts';

export const AGENT_SCRIPT = join(dirname(dirname(dirname(fileURLToPath(import.meta.url)))), 'guest-agent', 'forkling_agent.py');
/** Debian's interpreter (has python3-msgpack); override with FORKLING_PYTHON. */
export const AGENT_PYTHON = process.env.FORKLING_PYTHON ?? '/usr/bin/python3';

export interface LocalAgentOptions {
  socketPath: string;
  /** Extra agent options, e.g. ['--max-memory', String(2 ** 31)]. */
  args?: string[];
  env?: NodeJS.ProcessEnv;
  /** A command that runs the agent, e.g. ['unshare', '--pid', '--fork', '--kill-child']. */
  wrapper?: string[];
  /** How long to wait for the ready line (default 10 s). */
  readyTimeoutMs?: number;
}

export interface LocalAgent {
  process: ChildProcess;
  pid: number;
  socketPath: string;
  /** The agent's stderr so far (its log). */
  stderr(): string;
  connect(opts?: AgentClientOptions & { hello?: boolean }): Promise<AgentClient>;
  /** SIGTERM, then SIGKILL after 2 s; resolves when it has exited. */
  stop(): Promise<void>;
  exited: Promise<number | null>;
}

export function startLocalAgent(opts: LocalAgentOptions): Promise<LocalAgent> {
  const argv = [...(opts.wrapper ?? []), AGENT_PYTHON, AGENT_SCRIPT, '--unix', opts.socketPath, ...(opts.args ?? [])];
  const child = spawn(argv[0]!, argv.slice(1), {
    env: opts.env ?? process.env,
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let err = '';
  child.stderr!.setEncoding('utf8');
  child.stderr!.on('data', (d: string) => {
    err = (err + d).slice(-65536);
  });
  const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)));
  return new Promise((resolve, reject) => {
    let out = '';
    let ready = false;
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`agent not ready within ${opts.readyTimeoutMs ?? 10000} ms; stderr: ${err}`));
    }, opts.readyTimeoutMs ?? 10000);
    child.once('error', (e) => {
      clearTimeout(timer);
      reject(new Error(`cannot start ${argv[0]}: ${e.message}`));
    });
    void exited.then((code) => {
      clearTimeout(timer);
      reject(new Error(`agent exited (code ${code}) before it was ready; stderr: ${err}`));
    });
    child.stdout!.setEncoding('utf8');
    child.stdout!.on('data', (d: string) => {
      if (ready) return; // later console output (prints outside evals) is drained and dropped
      out += d;
      if (!out.includes('forkling-agent ready')) return;
      ready = true;
      clearTimeout(timer);
      resolve({
        process: child,
        pid: child.pid!,
        socketPath: opts.socketPath,
        stderr: () => err,
        connect: (o) => connectUnix(opts.socketPath, o),
        exited,
        stop: async () => {
          if (child.exitCode !== null || child.signalCode !== null) return;
          child.kill('SIGTERM');
          const t = setTimeout(() => child.kill('SIGKILL'), 2000);
          await exited;
          clearTimeout(t);
        },
      });
    });
  });
}
