// The tools `forkling mcp` offers a model: sandboxes made, branched and killed
// through the same SandboxManager as `forkling serve` (ids, timeouts, limits),
// and Python, commands and files in them through each sandbox's agent. Each
// tool's arguments are one TypeBox schema: the JSON Schema the client is shown
// and the check its calls pass. What a call returns is plain JSON; output is
// cut to a head and a tail so that no answer floods the model's context.
import { type Static, type TObject, type TProperties, type TString, Type } from '@sinclair/typebox';
import { MAX_FORK_N, MAX_TIMEOUT_MS, SandboxIdSchema, TemplateNameSchema } from '../../protocol/server-ops.ts';
import { MAX_CHUNK, MAX_CODE } from '../../protocol/schema.ts';
import type { AgentClient } from '../agent/client.ts';
import { UserError } from '../errors.ts';
import type { SandboxManager } from '../server/manager.ts';
import { compileCheck } from '../server/validate.ts';

/** Output kept of each stream of a call: its first and its last half of this many characters. */
export const MAX_OUTPUT_CHARS = 64 * 1024;
/**
 * Default limit of one eval or command (the model may give another, up to a
 * day): under the 60 s after which common clients give up on a call, so that
 * the model reads `timedOut` rather than the client's own timeout.
 */
export const DEFAULT_CALL_TIMEOUT_MS = 50_000;
const MAX_CALL_TIMEOUT_MS = 24 * 3600 * 1000;
/** Bytes one files_read returns unless it asks for up to MAX_READ_BYTES (a model reads a big file in slices: offset, length). */
export const DEFAULT_READ_BYTES = 64 * 1024;
export const MAX_READ_BYTES = MAX_CHUNK;
/** Longest files_write content: with JSON's worst escaping (6 bytes a character) its line stays under server.ts's MAX_LINE_BYTES. */
export const MAX_CONTENT_CHARS = 16 * 1024 * 1024;

// (the protocol's schemas, with words for the model)
const Sandbox: TString = { ...SandboxIdSchema, description: 'the sandbox id (from sandbox_create, sandbox_fork or sandbox_branch)' };
const Template: TString = { ...TemplateNameSchema, description: 'a template made with `forkling template create` (default: "default", Python with nothing imported)' };
const Count = Type.Integer({ minimum: 1, maximum: MAX_FORK_N, description: 'how many sandboxes' });
const Lifetime = Type.Integer({ minimum: 1, maximum: MAX_TIMEOUT_MS, description: 'ms until the sandbox is killed (default: the server\'s, `--default-timeout-ms`)' });
const CallTimeout = Type.Integer({ minimum: 1, maximum: MAX_CALL_TIMEOUT_MS, description: `ms before the call is stopped (default ${DEFAULT_CALL_TIMEOUT_MS})` });

export interface ToolContext {
  manager: SandboxManager;
  /** Aborted when the client cancels the call (notifications/cancelled). */
  signal: AbortSignal;
}

/** Hints for clients (MCP ToolAnnotations): whether a tool only reads, or ends something. */
interface Annotations {
  readOnlyHint?: boolean;
  destructiveHint?: boolean;
  idempotentHint?: boolean;
  openWorldHint?: boolean;
}

interface Tool<S extends TObject> {
  description: string;
  args: S;
  annotations: Annotations;
  run(args: Static<S>, ctx: ToolContext): Promise<Record<string, unknown>>;
}

// (an argument the model misnames is an error it can mend, not one quietly dropped)
const Args = <P extends TProperties>(props: P) => Type.Object(props, { additionalProperties: false });

const tool = <S extends TObject>(t: Tool<S>) => t as unknown as Tool<TObject>;

const agentOf = (ctx: ToolContext, id: string): AgentClient => ctx.manager.sandbox(id).agent;

/** Where to cut `s` near `at` without splitting a surrogate pair (one character). */
function cutAt(s: string, at: number): number {
  const c = s.charCodeAt(at - 1);
  return c >= 0xd800 && c <= 0xdbff ? at - 1 : at;
}

/** A stream's text as kept: whole when short, else its head and tail around a note of what was cut. */
class Kept {
  private head = '';
  private tail = '';
  private cut = 0;
  private decoder: TextDecoder | null = null;
  /** Bytes of a stream, decoded as UTF-8 across chunks (text() takes what is left). */
  addBytes(b: Uint8Array): void {
    this.decoder ??= new TextDecoder();
    this.add(this.decoder.decode(b, { stream: true }));
  }
  add(s: string): void {
    const half = MAX_OUTPUT_CHARS / 2;
    if (this.head.length < half && !this.tail) {
      const take = s.slice(0, cutAt(s, half - this.head.length));
      this.head += take;
      s = s.slice(take.length);
    }
    if (!s) return;
    this.tail += s;
    if (this.tail.length > half) {
      const from = cutAt(this.tail, this.tail.length - half);
      this.cut += from;
      this.tail = this.tail.slice(from);
    }
  }
  text(): string {
    if (this.decoder) this.add(this.decoder.decode());
    this.decoder = null;
    return this.cut ? `${this.head}\n[... ${this.cut} characters cut ...]\n${this.tail}` : this.head + this.tail;
  }
}

/** `s` as Kept keeps it. */
function kept(s: string): string {
  const k = new Kept();
  k.add(s);
  return k.text();
}

/**
 * Sandboxes a cancelled call made anyway (the manager takes no signal): killed,
 * since the model never learns their ids; then the call ends as cancelled.
 */
async function unlessCancelled<T extends { id: string }>(made: T[], ctx: ToolContext): Promise<T[]> {
  if (!ctx.signal.aborted) return made;
  await Promise.all(made.map((s) => ctx.manager.kill(s.id).catch(() => false)));
  throw new UserError('cancelled');
}

export const TOOLS: Record<string, Tool<TObject>> = {
  sandbox_create: tool({
    description:
      'Start a new sandbox: a fresh, isolated Linux machine whose Python interpreter has the template\'s libraries already imported, ready in milliseconds. Returns its id; eval, exec and files_* act on it. Ended by sandbox_kill, its timeout, or when this server stops.',
    args: Args({ template: Type.Optional(Template), timeoutMs: Type.Optional(Lifetime) }),
    annotations: { readOnlyHint: false, destructiveHint: false, openWorldHint: false },
    run: async (a, ctx) => ({ sandbox: (await unlessCancelled([await ctx.manager.create(a.template ?? 'default', a.timeoutMs)], ctx))[0] }),
  }),
  sandbox_fork: tool({
    description: 'Start n new sandboxes at once from a template (each as sandbox_create makes one): for trying several approaches side by side.',
    args: Args({ template: Type.Optional(Template), n: Count, timeoutMs: Type.Optional(Lifetime) }),
    annotations: { readOnlyHint: false, destructiveHint: false, openWorldHint: false },
    run: async (a, ctx) => ({ sandboxes: await unlessCancelled(await ctx.manager.fork(a.template ?? 'default', a.n, a.timeoutMs), ctx) }),
  }),
  sandbox_branch: tool({
    description:
      'Copy a running sandbox n times as it is now: each copy continues from this moment with the same Python variables, imports and files, and goes its own way (tree search over a trajectory). The source goes on unchanged.',
    args: Args({ sandbox: Sandbox, n: Count, timeoutMs: Type.Optional(Lifetime) }),
    annotations: { readOnlyHint: false, destructiveHint: false, openWorldHint: false },
    run: async (a, ctx) => ({ sandboxes: await unlessCancelled(await ctx.manager.branch(a.sandbox, a.n, a.timeoutMs), ctx) }),
  }),
  sandbox_list: tool({
    description: 'The live sandboxes: ids, templates, parents (for branches), when each expires.',
    args: Args({}),
    annotations: { readOnlyHint: true, openWorldHint: false },
    run: async (_a, ctx) => ({ sandboxes: ctx.manager.list() }),
  }),
  sandbox_kill: tool({
    description: 'End a sandbox and free what it holds.',
    args: Args({ sandbox: Sandbox }),
    annotations: { readOnlyHint: false, destructiveHint: true, idempotentHint: true, openWorldHint: false },
    run: async (a, ctx) => ({ killed: await ctx.manager.kill(a.sandbox) }),
  }),
  eval: tool({
    description:
      'Run Python code in a sandbox\'s warm interpreter. Variables, imports and functions persist between calls (as in a notebook). The value of a last expression is returned (value when it is plain data, and its repr), with what was printed; an exception comes back with its traceback.',
    args: Args({
      sandbox: Sandbox,
      code: Type.String({ maxLength: MAX_CODE, description: 'Python source; a last expression is the result' }),
      timeoutMs: Type.Optional(CallTimeout),
    }),
    annotations: { readOnlyHint: false, destructiveHint: false, openWorldHint: true },
    run: async (a, ctx) => {
      const out = new Kept();
      const err = new Kept();
      const r = await agentOf(ctx, a.sandbox).request(
        'eval',
        { code: a.code, timeoutMs: a.timeoutMs ?? DEFAULT_CALL_TIMEOUT_MS },
        { signal: ctx.signal, onEvent: (ev) => (ev.ev === 'stdout' ? out : err).add(ev.data) },
      );
      // (a value is given whole or not at all: its repr, cut, says what it was)
      const whole = r.value !== undefined && JSON.stringify(r.value).length <= MAX_OUTPUT_CHARS;
      return {
        ...(whole ? { value: r.value } : {}),
        repr: kept(r.repr),
        type: r.type,
        stdout: out.text(),
        stderr: err.text(),
        ...(r.exception ? { exception: { ...r.exception, message: kept(r.exception.message), traceback: kept(r.exception.traceback) } } : {}),
        timedOut: r.timedOut,
        durationMs: r.durationMs,
      };
    },
  }),
  exec: tool({
    description: 'Run a shell command (/bin/sh -c) in a sandbox to its end; returns its exit code and output.',
    args: Args({
      sandbox: Sandbox,
      command: Type.String({ minLength: 1, maxLength: 131072, description: 'a shell command line' }),
      cwd: Type.Optional(Type.String({ minLength: 1, maxLength: 4096, description: 'working directory' })),
      timeoutMs: Type.Optional(CallTimeout),
    }),
    annotations: { readOnlyHint: false, destructiveHint: false, openWorldHint: true },
    run: async (a, ctx) => {
      // (streamed, not the whole of each stream: only what is kept stays in memory)
      const out = new Kept();
      const err = new Kept();
      const r = await agentOf(ctx, a.sandbox).request(
        'exec',
        { shell: a.command, timeoutMs: a.timeoutMs ?? DEFAULT_CALL_TIMEOUT_MS, ...(a.cwd !== undefined ? { cwd: a.cwd } : {}) },
        {
          signal: ctx.signal,
          onEvent: (ev) => {
            if (ev.ev === 'stdout' || ev.ev === 'stderr') (ev.ev === 'stdout' ? out : err).addBytes(ev.data);
          },
        },
      );
      return { exitCode: r.exitCode, signal: r.signal, stdout: out.text(), stderr: err.text(), timedOut: r.timedOut, durationMs: r.durationMs };
    },
  }),
  files_read: tool({
    description: `Read a file of a sandbox: text when it is UTF-8, else base64. ${DEFAULT_READ_BYTES} bytes a call unless length says more (up to ${MAX_READ_BYTES}): read a bigger file in slices (offset, length).`,
    args: Args({
      sandbox: Sandbox,
      path: Type.String({ minLength: 1, maxLength: 4096 }),
      offset: Type.Optional(Type.Integer({ minimum: 0 })),
      length: Type.Optional(Type.Integer({ minimum: 0, maximum: MAX_READ_BYTES })),
    }),
    annotations: { readOnlyHint: true, openWorldHint: false },
    run: async (a, ctx) => {
      const offset = a.offset ?? 0;
      const parts: Uint8Array[] = [];
      // (one request: its result says the file's size)
      const { fileSize: size } = await agentOf(ctx, a.sandbox).readFileChunks(a.path, (d) => parts.push(d), {
        offset,
        length: a.length ?? DEFAULT_READ_BYTES,
        signal: ctx.signal,
      });
      const data = Buffer.concat(parts);
      let text: string | null = null;
      try {
        // (a slice that cuts a character in two is not UTF-8: base64 then)
        text = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true }).decode(data);
      } catch {}
      const more = offset + data.length < size;
      return {
        path: a.path,
        fileSize: size,
        offset,
        bytes: data.length,
        ...(text !== null ? { encoding: 'utf8', content: text } : { encoding: 'base64', content: data.toString('base64') }),
        ...(more ? { more: `${size - offset - data.length} bytes more: read again from offset ${offset + data.length}` } : {}),
      };
    },
  }),
  files_write: tool({
    description: 'Write a file in a sandbox (its parent directories are made), replacing it or appending to it.',
    args: Args({
      sandbox: Sandbox,
      path: Type.String({ minLength: 1, maxLength: 4096 }),
      content: Type.String({ maxLength: MAX_CONTENT_CHARS, description: 'the bytes (a bigger file: several calls, append: true)' }),
      encoding: Type.Optional(Type.Union([Type.Literal('utf8'), Type.Literal('base64')], { description: 'of content (default utf8)' })),
      append: Type.Optional(Type.Boolean()),
    }),
    annotations: { readOnlyHint: false, destructiveHint: true, openWorldHint: false },
    run: async (a, ctx) => {
      const data = a.encoding === 'base64' ? base64(a.content) : new TextEncoder().encode(a.content);
      const r = await agentOf(ctx, a.sandbox).writeFile(a.path, data, { mkdirs: true, signal: ctx.signal, ...(a.append ? { append: true } : {}) });
      return { path: a.path, size: r.size };
    },
  }),
};

function base64(s: string): Uint8Array {
  if (!/^[A-Za-z0-9+/]*={0,2}$/.test(s) || s.length % 4 !== 0) {
    throw new UserError('content is not base64', 'give standard base64 (A-Z a-z 0-9 + /, padded with =), or encoding "utf8" for text');
  }
  return Buffer.from(s, 'base64');
}

/** Checks of each tool's arguments: null, or what is wrong, naming the field. */
export const toolArgChecks = new Map(Object.entries(TOOLS).map(([name, t]) => [name, compileCheck(name, t.args)]));
