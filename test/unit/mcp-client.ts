// A client of `forkling mcp` for the tests and benchmarks: spawns it and
// speaks JSON-RPC 2.0 to it, a message a line, as an MCP client does.
import { type ChildProcessWithoutNullStreams, spawn } from 'node:child_process';
import { join } from 'node:path';
import * as assert from 'uvu/assert';

const ROOT = join(import.meta.dirname, '..', '..');

// biome-ignore lint/suspicious/noExplicitAny: JSON answers, read field by field by the asserts
export type Msg = Record<string, any>;

export class McpClient {
  readonly p: ChildProcessWithoutNullStreams;
  readonly stderr: string[] = [];
  private buf = '';
  private nextId = 1;
  private readonly waiting = new Map<number | string | null, (m: Msg) => void>();
  /** Notifications the server sent (notifications/progress), in order. */
  readonly notifications: Msg[] = [];
  private onNotification: (() => void) | null = null;
  readonly exited: Promise<number | string | null>;

  /** `forkling mcp` with these options (default: the process engine). */
  constructor(args: string[] = ['--engine', 'process']) {
    this.p = spawn(process.execPath, [join(ROOT, 'bin', 'forkling.mjs'), 'mcp', ...args], { cwd: ROOT, stdio: ['pipe', 'pipe', 'pipe'] });
    this.exited = new Promise((r) => this.p.on('exit', (code, sig) => r(code ?? sig)));
    this.p.stderr.on('data', (d) => this.stderr.push(String(d)));
    this.p.stdout.setEncoding('utf8'); // (a character split between chunks stays whole)
    this.p.stdout.on('data', (d: string) => {
      this.buf += d;
      for (let nl = this.buf.indexOf('\n'); nl >= 0; nl = this.buf.indexOf('\n')) {
        const m = JSON.parse(this.buf.slice(0, nl)) as Msg;
        this.buf = this.buf.slice(nl + 1);
        if (typeof m.method === 'string') {
          this.notifications.push(m);
          this.onNotification?.();
          continue;
        }
        const w = this.waiting.get(m.id);
        assert.ok(w, `an answer nobody asked for: ${JSON.stringify(m)}`);
        this.waiting.delete(m.id);
        w(m);
      }
    });
  }

  /** Sends a raw line (`newline` false: the last, with no newline, and stdin closed); resolves with the answer carrying `id`. */
  raw(line: string, id: number | string | null, newline = true): Promise<Msg> {
    const answer = new Promise<Msg>((r) => this.waiting.set(id, r));
    if (newline) this.p.stdin.write(`${line}\n`);
    else this.p.stdin.end(line);
    return answer;
  }

  request(method: string, params?: unknown): Promise<Msg> {
    return this.start(method, params).answer;
  }

  /** A request and its id (to cancel it). */
  start(method: string, params?: unknown): { id: number; answer: Promise<Msg> } {
    const id = this.nextId++;
    return { id, answer: this.raw(JSON.stringify({ jsonrpc: '2.0', id, method, ...(params !== undefined ? { params } : {}) }), id) };
  }

  notify(method: string, params?: unknown): void {
    this.p.stdin.write(`${JSON.stringify({ jsonrpc: '2.0', method, ...(params !== undefined ? { params } : {}) })}\n`);
  }

  /** tools/call: the tool's result (content, structuredContent, isError). */
  async call(name: string, args: unknown = {}): Promise<Msg> {
    const m = await this.request('tools/call', { name, arguments: args });
    assert.ok(m.result, `${name}: ${JSON.stringify(m)}`);
    return m.result;
  }

  /** A call that must succeed: its structured result (and its text is the same JSON). */
  async ok(name: string, args: unknown = {}): Promise<Msg> {
    const r = await this.call(name, args);
    assert.not.ok(r.isError, `${name}: ${r.content?.[0]?.text}`);
    assert.equal(JSON.parse(r.content[0].text), r.structuredContent);
    return r.structuredContent;
  }

  /** A call that must fail as a tool error the model reads: its text. */
  async fails(name: string, args: unknown = {}): Promise<string> {
    const r = await this.call(name, args);
    assert.is(r.isError, true, `${name} succeeded: ${JSON.stringify(r)}`);
    return r.content[0].text as string;
  }

  async init(version = '2025-06-18'): Promise<Msg> {
    const m = await this.request('initialize', { protocolVersion: version, capabilities: {}, clientInfo: { name: 'test', version: '0' } });
    this.notify('notifications/initialized');
    return m;
  }

  /** Resolves once a notification of `method` has come (at once if one has). */
  async notification(method: string): Promise<Msg> {
    for (;;) {
      const n = this.notifications.find((m) => m.method === method);
      if (n) return n;
      await new Promise<void>((r) => {
        this.onNotification = r;
      });
    }
  }

  async end(): Promise<number | string | null> {
    this.p.stdin.end();
    return this.exited;
  }
}

/**
 * A session with a new `forkling mcp` (the process engine): initialized (its
 * answer to `fn`), then its stdin closed, after which it must exit 0 (what it
 * logged is the message). Resolves with the client, for its log.
 */
export async function withMcp(fn: (c: McpClient, init: Msg) => Promise<void>): Promise<McpClient> {
  const c = new McpClient();
  try {
    await fn(c, await c.init());
  } finally {
    assert.is(await c.end(), 0, c.stderr.join(''));
  }
  return c;
}
