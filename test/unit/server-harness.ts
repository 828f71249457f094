// Test harness for the server tests: starts a `forkling serve` and hands back
// its URL. Default: the real CLI process (`node bin/forkling.mjs serve
// --listen 127.0.0.1:0 --engine process ...`), reading the port from its
// first stdout line `listening <url>`. With FORKLING_TEST_SERVER=inproc (or
// before the process engine exists) the server runs in this process over the
// test helper engine of plain agent processes (server-agent-engine.ts).
import { type ChildProcess, spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { constants, tmpdir } from 'node:os';
import { join } from 'node:path';
import WebSocket from 'ws';
import { decodeFrame, encodeFrame } from '../../protocol/codec.ts';
import { callAgentClient } from '../../host/server/agent-bridge.ts';
import { TokenAuth } from '../../host/server/auth.ts';
import { createContext } from '../../host/server/context.ts';
import { SandboxManager } from '../../host/server/manager.ts';
import { ForklingServer } from '../../host/server/server.ts';
import { ServerMetrics } from '../../host/server/telemetry.ts';
import { AgentProcessEngine } from './server-agent-engine.ts';

const ROOT = join(import.meta.dirname, '..', '..');

export interface Served {
  url: string;
  mode: 'cli' | 'inproc';
  /** stderr of the CLI process (empty in-process). */
  log: string[];
  /** SIGTERM (CLI) or shutdown (in-process); resolves with the exit code (128 + the signal's number if one killed it). */
  stop(): Promise<number>;
  /** The CLI process, when there is one. */
  proc: ChildProcess | null;
}

export interface ServeOptions {
  token?: string;
  maxSandboxes?: number;
  defaultTimeoutMs?: number;
  maxInFlight?: number;
  tls?: { certFile: string; keyFile: string };
  /** Engine of the CLI server (default process); the in-process server always uses the helper engine. */
  engine?: 'process' | 'kvm';
  extraArgs?: string[];
}

export function processEngineAvailable(): boolean {
  return existsSync(join(ROOT, 'host', 'engine', 'select.ts')) && existsSync(join(ROOT, 'host', 'engine', 'process', 'engine.ts'));
}

export function serverMode(): 'cli' | 'inproc' {
  const forced = process.env.FORKLING_TEST_SERVER;
  if (forced === 'inproc' || forced === 'cli') return forced;
  return processEngineAvailable() ? 'cli' : 'inproc';
}

export function tokenFile(token: string): string {
  const dir = mkdtempSync(join(tmpdir(), 'forkling-token-'));
  const path = join(dir, 'token');
  writeFileSync(path, `# test token\n${token}\n`, { mode: 0o600 });
  return path;
}

export async function serve(opts: ServeOptions = {}): Promise<Served> {
  if (opts.engine === 'kvm') return serveCli(opts);
  return serverMode() === 'cli' ? serveCli(opts) : serveInProcess(opts);
}

async function serveCli(opts: ServeOptions): Promise<Served> {
  const args = ['serve', '--listen', '127.0.0.1:0', '--engine', opts.engine ?? 'process', '--drain-ms', '2000'];
  if (opts.token) args.push('--token-file', tokenFile(opts.token));
  if (opts.maxSandboxes) args.push('--max-sandboxes', String(opts.maxSandboxes));
  if (opts.defaultTimeoutMs) args.push('--default-timeout-ms', String(opts.defaultTimeoutMs));
  if (opts.maxInFlight) args.push('--max-in-flight', String(opts.maxInFlight));
  if (opts.tls) args.push('--tls-cert', opts.tls.certFile, '--tls-key', opts.tls.keyFile);
  args.push(...(opts.extraArgs ?? []));
  // Until the lead registers `serve` in host/cli/main.ts, call the command module directly.
  const registered = readFileSync(join(ROOT, 'host', 'cli', 'main.ts'), 'utf8').includes('serveCommand');
  const argv = registered
    ? [join(ROOT, 'bin', 'forkling.mjs'), ...args]
    : [
        '--import',
        'tsx/esm',
        '--input-type=module',
        '-e',
        `const { serveCommand } = await import(${JSON.stringify(join(ROOT, 'host', 'cli', 'serve.ts'))}); process.exitCode = await serveCommand(${JSON.stringify(args.slice(1))});`,
      ];
  const proc = spawn(process.execPath, argv, { cwd: ROOT, stdio: ['ignore', 'pipe', 'pipe'] });
  const log: string[] = [];
  proc.stderr?.on('data', (d: Buffer) => log.push(d.toString()));
  const exited = new Promise<number>((resolve) => proc.once('exit', (code, sig) => resolve(code ?? 128 + (sig ? constants.signals[sig] : 0))));
  const url = await new Promise<string>((resolve, reject) => {
    let out = '';
    const onData = (d: Buffer) => {
      out += d.toString();
      const nl = out.indexOf('\n');
      if (nl < 0) return;
      proc.stdout?.off('data', onData);
      const m = /^listening (\S+)$/.exec(out.slice(0, nl));
      if (m) resolve(m[1] as string);
      else reject(new Error(`unexpected first line from forkling serve: ${out.slice(0, nl)}`));
    };
    proc.stdout?.on('data', onData);
    exited.then((code) => reject(new Error(`forkling serve exited ${code} before listening:\n${log.join('')}`)));
  });
  return {
    url,
    mode: 'cli',
    log,
    proc,
    stop: async () => {
      if (proc.exitCode === null) proc.kill('SIGTERM');
      return exited;
    },
  };
}

async function serveInProcess(opts: ServeOptions): Promise<Served> {
  const engine = new AgentProcessEngine();
  const metrics = new ServerMetrics();
  const log: string[] = [];
  const manager = new SandboxManager({
    engine,
    metrics,
    maxSandboxes: opts.maxSandboxes ?? 100,
    defaultTimeoutMs: opts.defaultTimeoutMs ?? 300_000,
    log: (l) => log.push(l),
  });
  const ctx = createContext({
    manager,
    metrics,
    maxInFlight: opts.maxInFlight ?? 256,
    callAgent: callAgentClient,
    log: (l) => log.push(l),
  });
  const auth = opts.token ? await TokenAuth.fromFile(tokenFile(opts.token)) : null;
  const server = new ForklingServer({ ctx, auth, ...(opts.tls ? { tls: opts.tls } : {}) });
  const { url } = await server.listen('127.0.0.1', 0);
  return {
    url,
    mode: 'inproc',
    log,
    proc: null,
    stop: async () => {
      await server.shutdown(2000);
      return 0;
    },
  };
}

// ---------------------------------------------------------------- raw WebSocket client


export type Frame = Record<string, unknown>;

/** A bare protocol client: frames in and out, nothing hidden (for bad-input tests). */
export class RawClient {
  private readonly queue: Frame[] = [];
  private waiters: ((f: Frame) => void)[] = [];
  private nextId = 1;
  readonly closed: Promise<{ code: number; reason: string }>;

  private constructor(readonly ws: WebSocket) {
    ws.on('message', (data) => {
      const f = decodeFrame(data as Buffer) as Frame;
      const w = this.waiters.shift();
      if (w) w(f);
      else this.queue.push(f);
    });
    this.closed = new Promise((r) => ws.once('close', (code, reason) => r({ code, reason: reason.toString() })));
  }

  static async open(
    url: string,
    opts: { token?: string; via?: 'header' | 'protocol' | 'query'; hello?: boolean } = {},
  ): Promise<RawClient> {
    const u = new URL(url.replace(/^http/, 'ws'));
    u.pathname = '/v1/ws';
    const protocols = ['forkling.v1'];
    const headers: Record<string, string> = {};
    if (opts.token !== undefined) {
      const via = opts.via ?? 'header';
      if (via === 'header') headers.authorization = `Bearer ${opts.token}`;
      else if (via === 'protocol') protocols.push(`forkling.bearer.${opts.token}`);
      else u.searchParams.set('token', opts.token);
    }
    const ws = new WebSocket(u, protocols, { headers, perMessageDeflate: false, maxPayload: 64 << 20 });
    await new Promise<void>((resolve, reject) => {
      ws.once('open', () => resolve());
      ws.once('unexpected-response', (_req, res) => reject(new Error(`HTTP ${res.statusCode}`)));
      ws.once('error', reject);
    });
    const c = new RawClient(ws);
    if (opts.hello !== false) {
      const r = await c.request('hello', { versions: [1] });
      if (r.t !== 'res') throw new Error(`hello failed: ${JSON.stringify(r)}`);
    }
    return c;
  }

  id(): number {
    return this.nextId++;
  }

  send(frame: Frame): void {
    this.ws.send(encodeFrame(frame));
  }

  sendRaw(data: Uint8Array | string): void {
    this.ws.send(data);
  }

  /** The next frame from the server (in arrival order). */
  next(timeoutMs = 10_000): Promise<Frame> {
    const f = this.queue.shift();
    if (f) return Promise.resolve(f);
    return new Promise((resolve, reject) => {
      const t = setTimeout(() => {
        this.waiters = this.waiters.filter((w) => w !== done);
        reject(new Error(`no frame within ${timeoutMs} ms`));
      }, timeoutMs);
      const done = (x: Frame) => {
        clearTimeout(t);
        resolve(x);
      };
      this.waiters.push(done);
    });
  }

  /** Sends a request and returns its final frame (res or err); events go to `events`. */
  async request(op: string, fields: Frame = {}, events?: Frame[]): Promise<Frame> {
    const id = this.id();
    this.send({ ...fields, t: 'req', id, op });
    for (;;) {
      const f = await this.next();
      if (f.id !== id) throw new Error(`frame for another request: ${JSON.stringify(f)}`);
      if (f.t === 'ev') events?.push(f);
      else return f;
    }
  }

  close(): void {
    this.ws.close();
  }
}
