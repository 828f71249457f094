// A Model Context Protocol server over stdio: JSON-RPC 2.0, one message per
// line (the MCP stdio transport). It answers initialize, ping, tools/list and
// tools/call (tools.ts), and takes notifications/cancelled to stop a call
// (which then gets no answer, as the spec asks). Calls run side by side; each
// answer goes out as its call ends; one that asked for progress
// (`_meta.progressToken`) gets a notifications/progress every few seconds
// while it runs, so a client whose timeout restarts on progress waits. A tool's own
// failure (no such sandbox, a bad argument, an agent's error) is a result with
// isError, so the model reads and mends it; only what is not a valid call of a
// known method is a JSON-RPC error.
import { AgentError } from '../agent/client.ts';
import { UserError } from '../errors.ts';
import type { SandboxManager } from '../server/manager.ts';
import { ServiceError } from '../server/errors.ts';
import { TOOLS, toolArgChecks } from './tools.ts';

/**
 * Protocol revisions this server speaks, newest first (it answers a client's
 * own when listed, else the newest). Not 2025-03-26: that one requires JSON-RPC
 * batches, which the others do not have.
 */
export const MCP_VERSIONS = ['2025-11-25', '2025-06-18', '2024-11-05'] as const;

/** Longest line taken: room for any call the tools' schemas let through (tools.ts: MAX_CONTENT_CHARS); a longer one is skipped unread. */
export const MAX_LINE_BYTES = 112 * 1024 * 1024;

/** How often a call that asked for progress is told that it still runs. */
export const PROGRESS_EVERY_MS = 5_000;

/** What tools/list answers (each schema as plain JSON Schema: TypeBox's symbol keys dropped). */
const TOOL_LIST = JSON.parse(
  JSON.stringify(Object.entries(TOOLS).map(([name, t]) => ({ name, description: t.description, inputSchema: t.args, annotations: t.annotations }))),
) as unknown[];

const PARSE_ERROR = -32700;
const INVALID_REQUEST = -32600;
const METHOD_NOT_FOUND = -32601;
const INVALID_PARAMS = -32602;

type Id = string | number;
type Message = Record<string, unknown>;

const INSTRUCTIONS =
  'forkling gives you sandboxes: isolated Linux machines with a warm Python interpreter, ready in milliseconds. ' +
  'sandbox_create starts one; eval runs Python in it (state persists between calls), exec runs shell commands, files_read/files_write move files. ' +
  'sandbox_branch copies a live sandbox, state and all, to try several continuations; sandbox_kill ends one when you are done.';

export interface McpServerOptions {
  manager: SandboxManager;
  /** Writes one message (the transport adds the newline). */
  send: (line: string) => void;
  version: string;
  log?: (line: string) => void;
}

export class McpServer {
  private readonly calls = new Map<Id, AbortController>();
  private readonly running = new Set<Promise<void>>();
  private closing = false;

  constructor(private readonly opts: McpServerOptions) {}

  /** One line from the client. */
  take(line: string): void {
    if (this.closing || !line.trim()) return;
    let msg: unknown;
    try {
      msg = JSON.parse(line);
    } catch (e) {
      this.error(null, PARSE_ERROR, `not JSON: ${(e as Error).message}`);
      return;
    }
    if (Array.isArray(msg)) {
      this.error(null, INVALID_REQUEST, 'batches are not taken: send one message per line');
      return;
    }
    if (!msg || typeof msg !== 'object' || (msg as Message).jsonrpc !== '2.0' || typeof (msg as Message).method !== 'string') {
      // (a response to us: we send no requests, so there is none to take)
      if (msg && typeof msg === 'object' && ('result' in msg || 'error' in msg)) return;
      this.error(idOf(msg), INVALID_REQUEST, 'not a JSON-RPC 2.0 request: give {"jsonrpc": "2.0", "method": ..., "id": ...}');
      return;
    }
    const m = msg as Message;
    const id = idOf(m);
    const params = (m.params ?? {}) as Message;
    if (!('id' in m)) {
      this.notification(m.method as string, params);
      return;
    }
    if (id === null) {
      this.error(null, INVALID_REQUEST, 'a request id is a string or a number');
      return;
    }
    const p = this.request(id, m.method as string, params)
      .catch((e) => this.error(id, -32603, `internal error: ${(e as Error).message}`))
      .finally(() => this.running.delete(p));
    this.running.add(p);
  }

  /**
   * A line longer than MAX_LINE_BYTES, skipped unread but for its first and
   * last bytes: its id where they show it (clients write it first or last),
   * so that the call is answered, not left to the client's timeout.
   */
  tooLong(head: string, tail: string): void {
    const id = /^\s*\{\s*"jsonrpc"\s*:\s*"2\.0"\s*,\s*"id"\s*:\s*(-?\d+|"[^"\\]*")\s*,/.exec(head)?.[1] ?? /[,{]\s*"id"\s*:\s*(-?\d+|"[^"\\]*")\s*\}\s*$/.exec(tail)?.[1];
    const message = `a message of more than ${MAX_LINE_BYTES} bytes was skipped: send shorter ones (a big file: files_write in parts, append: true)`;
    this.error(id === undefined ? null : (JSON.parse(id) as Id), INVALID_REQUEST, message);
  }

  /** Takes no more lines, stops every open call and waits until each has ended. */
  async close(): Promise<void> {
    this.closing = true;
    for (const c of this.calls.values()) c.abort();
    await Promise.all(this.running);
  }

  private notification(method: string, params: Message): void {
    if (method === 'notifications/cancelled') {
      const id = params.requestId;
      if (typeof id === 'string' || typeof id === 'number') this.calls.get(id)?.abort();
    }
    // (notifications/initialized and any other: nothing to do)
  }

  private async request(id: Id, method: string, params: Message): Promise<void> {
    switch (method) {
      case 'initialize': {
        const asked = params.protocolVersion;
        const protocolVersion = (MCP_VERSIONS as readonly unknown[]).includes(asked) ? asked : MCP_VERSIONS[0];
        this.result(id, {
          protocolVersion,
          capabilities: { tools: { listChanged: false } },
          serverInfo: { name: 'forkling', version: this.opts.version },
          instructions: INSTRUCTIONS,
        });
        return;
      }
      case 'ping':
        this.result(id, {});
        return;
      case 'tools/list':
        this.result(id, { tools: TOOL_LIST });
        return;
      case 'tools/call':
        await this.call(id, params);
        return;
      default:
        this.error(id, METHOD_NOT_FOUND, `no method ${JSON.stringify(method)}: this server has initialize, ping, tools/list and tools/call`);
    }
  }

  private async call(id: Id, params: Message): Promise<void> {
    const name = params.name;
    const tool = typeof name === 'string' && Object.hasOwn(TOOLS, name) ? TOOLS[name] : undefined;
    if (!tool) {
      this.error(id, INVALID_PARAMS, `no tool ${JSON.stringify(name)}: tools/list names them`);
      return;
    }
    const args = params.arguments ?? {};
    const wrong = toolArgChecks.get(name as string)?.(args);
    if (wrong) {
      this.toolError(id, `bad arguments: ${wrong}`);
      return;
    }
    if (this.calls.has(id)) {
      this.error(id, INVALID_REQUEST, `request id ${JSON.stringify(id)} is in use by a call still running`);
      return;
    }
    const abort = new AbortController();
    this.calls.set(id, abort);
    const progress = this.progressOf(params);
    try {
      const out = await tool.run(args as never, { manager: this.opts.manager, signal: abort.signal });
      if (!abort.signal.aborted) this.result(id, { content: [{ type: 'text', text: JSON.stringify(out) }], structuredContent: out });
    } catch (e) {
      if (!abort.signal.aborted) this.toolError(id, messageOf(e, this.opts.log));
    } finally {
      if (progress) clearInterval(progress);
      this.calls.delete(id);
    }
  }

  /** A timer that tells the client the call still runs, where it asked (`_meta.progressToken`). */
  private progressOf(params: Message): NodeJS.Timeout | null {
    const token = (params._meta as Message | undefined)?.progressToken;
    if (typeof token !== 'string' && typeof token !== 'number') return null;
    const t0 = Date.now();
    let n = 0;
    return setInterval(() => {
      const progress = ++n;
      const message = `running for ${Math.round((Date.now() - t0) / 1000)} s`;
      this.opts.send(JSON.stringify({ jsonrpc: '2.0', method: 'notifications/progress', params: { progressToken: token, progress, message } }));
    }, PROGRESS_EVERY_MS);
  }

  private result(id: Id, result: unknown): void {
    this.opts.send(JSON.stringify({ jsonrpc: '2.0', id, result }));
  }

  private toolError(id: Id, text: string): void {
    this.result(id, { content: [{ type: 'text', text }], isError: true });
  }

  private error(id: Id | null, code: number, message: string): void {
    this.opts.send(JSON.stringify({ jsonrpc: '2.0', id, error: { code, message } }));
  }
}

function idOf(msg: unknown): Id | null {
  const id = msg && typeof msg === 'object' ? (msg as Message).id : undefined;
  return typeof id === 'string' || (typeof id === 'number' && Number.isFinite(id)) ? id : null;
}

/** What the model reads of a failure: the error's words (and fix); a bug's stack goes to the log only. */
function messageOf(e: unknown, log?: (line: string) => void): string {
  if (e instanceof UserError) return e.hint ? `${e.message} (fix: ${e.hint})` : e.message;
  if (e instanceof ServiceError || e instanceof AgentError) return `${e.code}: ${e.message}`;
  log?.(`tool call failed: ${e instanceof Error ? (e.stack ?? e.message) : String(e)}`);
  return `internal error: ${e instanceof Error ? e.message : String(e)}`;
}
