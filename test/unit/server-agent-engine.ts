// TEST HELPER (not an engine of the product): an Engine whose sandboxes are
// real guest agents started as plain host processes,
// `/usr/bin/python3 guest-agent/forkling_agent.py --unix <sock>`, without any
// isolation. It lets the server and SDK tests drive real agents over the real
// protocol where the process engine is not wanted (e.g. in-process server
// tests). `branch` starts fresh agents: it does NOT carry state over, so tests
// of branch semantics use the process engine.
import { type ChildProcess, spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { connect as netConnect } from 'node:net';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import { AgentClient, connectUnix } from '../../host/agent/client.ts';
import type { BootOptions, Engine, ExitInfo, Sandbox, SandboxStats, TemplateInfo } from '../../host/engine/engine.ts';
import { UserError } from '../../host/errors.ts';

const AGENT = join(import.meta.dirname, '..', '..', 'guest-agent', 'forkling_agent.py');

class AgentProcessSandbox implements Sandbox {
  readonly engine = 'process' as const;
  readonly console: string[] = [];
  readonly exited: Promise<ExitInfo>;
  private killed = false;

  constructor(
    readonly id: string,
    readonly agent: AgentClient,
    private readonly child: ChildProcess,
    readonly timings: { startedAt: number; readyAt: number },
  ) {
    this.exited = new Promise((resolve) => {
      child.once('exit', (code, signal) => {
        agent.close();
        resolve(
          this.killed
            ? { reason: 'killed' }
            : { reason: code === 0 ? 'poweroff' : 'crashed', message: `agent exited ${code ?? signal}` },
        );
      });
    });
  }

  async pause(): Promise<void> {
    this.child.kill('SIGSTOP');
  }
  async resume(): Promise<void> {
    this.child.kill('SIGCONT');
  }
  async kill(): Promise<void> {
    this.killed = true;
    this.child.kill('SIGKILL');
    await this.exited;
  }
  async stats(): Promise<SandboxStats> {
    const status = readFileSync(`/proc/${this.child.pid}/status`, 'utf8');
    const kb = (k: string) => Number(new RegExp(`^${k}:\\s+(\\d+)`, 'm').exec(status)?.[1] ?? 0);
    return { privateKiB: kb('RssAnon'), counters: {} };
  }
}

export class AgentProcessEngine implements Engine {
  readonly name = 'process' as const;
  readonly isolation = 'none (test helper: plain host processes)';
  private readonly dir = mkdtempSync(join(tmpdir(), 'forkling-agents-'));
  private readonly live = new Set<AgentProcessSandbox>();
  private n = 0;
  /** How many agents were started (tests check fork counts). */
  started = 0;

  async boot(opts: BootOptions): Promise<Sandbox> {
    if (opts.image !== 'default') throw new UserError(`image ${JSON.stringify(opts.image)} does not exist`);
    return this.start();
  }

  async createTemplate(): Promise<TemplateInfo> {
    throw new UserError('the test agent engine has no templates beyond "default"');
  }

  async prepare(template: string): Promise<void> {
    if (template !== 'default') throw new UserError(`template ${JSON.stringify(template)} not found`);
  }

  async fork(template: string, n: number): Promise<Sandbox[]> {
    if (template !== 'default') throw new UserError(`template ${JSON.stringify(template)} not found`);
    return Promise.all(Array.from({ length: n }, () => this.start()));
  }

  async branch(_source: Sandbox, n: number): Promise<Sandbox[]> {
    return Promise.all(Array.from({ length: n }, () => this.start()));
  }

  async close(): Promise<void> {
    await Promise.all([...this.live].map((s) => s.kill()));
    rmSync(this.dir, { recursive: true, force: true });
  }

  private async start(): Promise<AgentProcessSandbox> {
    const startedAt = performance.now();
    const id = `sb-${randomBytes(6).toString('hex')}`;
    const sock = join(this.dir, `${this.n++}.sock`);
    const child = spawn('/usr/bin/python3', [AGENT, '--unix', sock], { stdio: ['ignore', 'pipe', 'inherit'] });
    this.started++;
    await new Promise<void>((resolve, reject) => {
      let out = '';
      child.stdout?.on('data', (d: Buffer) => {
        out += d.toString();
        if (out.includes('forkling-agent ready')) resolve();
      });
      child.once('exit', (code) => reject(new Error(`agent exited ${code} before it was ready`)));
    });
    const agent = await connectUnix(sock, { timeoutMs: 5000 });
    await agent.restore({ sandboxId: id, time: Date.now() / 1000 });
    const sb = new AgentProcessSandbox(id, agent, child, { startedAt, readyAt: performance.now() });
    this.live.add(sb);
    sb.exited.then(() => this.live.delete(sb));
    return sb;
  }
}

/**
 * An Engine whose every sandbox's agent is a new connection to `sockPath`, a
 * socket server of the test (a fake, or hostile, agent); sandbox ids are
 * `<prefix>1`, `<prefix>2`, ... Only fork (sandbox.create) and kill work.
 */
export function socketAgentEngine(sockPath: string, prefix: string): Engine {
  let made = 0;
  return {
    name: 'process',
    isolation: 'a fake engine for tests',
    async fork(): Promise<Sandbox[]> {
      const sock = netConnect(sockPath);
      await new Promise((r) => sock.once('connect', r));
      let ended: (e: ExitInfo) => void = () => {};
      const exited = new Promise<ExitInfo>((r) => {
        ended = r;
      });
      const sb = {
        id: `${prefix}${++made}`,
        engine: 'process',
        agent: new AgentClient(sock),
        timings: { startedAt: 0, readyAt: 0 },
        console: [],
        exited,
        async kill() {
          sb.agent.close();
          ended({ reason: 'killed' });
        },
        async stats() {
          return { privateKiB: 0, counters: {} };
        },
        async pause() {},
        async resume() {},
      };
      return [sb as unknown as Sandbox];
    },
    async close() {},
  } as unknown as Engine;
}
