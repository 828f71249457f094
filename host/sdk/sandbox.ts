// The SDK's Sandbox: one sandbox on a `forkling serve`, driven over the shared
// WebSocket of its url+token. Browser-safe.
import { concat } from '../../protocol/codec.ts';
import { MAX_CHUNK } from '../../protocol/schema.ts';
import type { SandboxInfo } from '../../protocol/server-ops.ts';
import { Connection, type ConnectionOptions, type OpenRequest } from './connection.ts';
import { ConnectionError, ForklingError, NotFoundError, SandboxError, TimeoutError } from './errors.ts';

export type { SandboxInfo };

export interface SandboxOptions extends ConnectionOptions {
  /** Template to start from (default "default"). */
  template?: string;
  /** Kill the sandbox this long after creation unless extended (server default: 5 minutes). */
  timeoutMs?: number;
}

export interface EvalOptions {
  /** Named namespace; a new name starts empty, "default" persists. */
  context?: string;
  timeoutMs?: number;
  onStdout?: (text: string) => void;
  onStderr?: (text: string) => void;
}

export interface EvalResult {
  /** The last expression's value where msgpack can carry it, else undefined. */
  value: unknown;
  /** repr() of the value. */
  text: string;
  /** Python type name of the value. */
  type: string;
  stdout: string;
  stderr: string;
  /** The exception the code raised, with its traceback. */
  error: SandboxError | undefined;
  durationMs: number;
}

export interface CommandOptions {
  envs?: Record<string, string>;
  cwd?: string;
  /** Bytes or text for the command's stdin (foreground), or the first stdin of a background command. */
  stdin?: string | Uint8Array;
  timeoutMs?: number;
  background?: boolean;
  onStdout?: (text: string) => void;
  onStderr?: (text: string) => void;
}

export interface CommandResult {
  exitCode: number | null;
  /** Signal name when the command was killed by one. */
  signal: string | null;
  stdout: string;
  stderr: string;
  procId: string;
  pid: number;
  durationMs: number;
}

export interface EntryInfo {
  name: string;
  path: string;
  type: 'file' | 'dir' | 'symlink' | 'other';
  size: number;
  mode: number;
  /** Modification time, Unix epoch seconds. */
  mtime: number;
}

type Fields = Record<string, unknown>;

const encoder = new TextEncoder();

function toBytes(data: string | Uint8Array | ArrayBuffer): Uint8Array {
  if (typeof data === 'string') return encoder.encode(data);
  if (data instanceof Uint8Array) return data;
  return new Uint8Array(data);
}

function joinPath(dir: string, name: string): string {
  return dir.endsWith('/') ? `${dir}${name}` : `${dir}/${name}`;
}

/** Decodes a byte stream's chunks as UTF-8 without splitting characters. */
class TextSink {
  private readonly dec = new TextDecoder();
  text = '';
  constructor(private readonly cb?: (t: string) => void) {}
  push(data: unknown): void {
    if (!(data instanceof Uint8Array)) return;
    const t = this.dec.decode(data, { stream: true });
    this.add(t);
  }
  end(): void {
    this.add(this.dec.decode());
  }
  private add(t: string): void {
    if (!t) return;
    this.text += t;
    this.cb?.(t);
  }
}

export class Sandbox {
  readonly commands: Commands;
  readonly files: Files;

  private constructor(
    private readonly conn: Connection,
    private infoCache: SandboxInfo,
    private readonly opts: ConnectionOptions,
  ) {
    this.commands = new Commands(this);
    this.files = new Files(this);
  }

  get id(): string {
    return this.infoCache.id;
  }

  /** Starts a sandbox from a template. */
  static async create(opts: SandboxOptions = {}): Promise<Sandbox> {
    const conn = Connection.get(opts);
    const res = await conn.request('sandbox.create', { template: opts.template, timeoutMs: opts.timeoutMs });
    return new Sandbox(conn, res.sandbox as SandboxInfo, opts);
  }

  /**
   * Cold-boots a sandbox from an image, without a template (slower than
   * create/fork; what an engine without templates offers).
   */
  static async boot(
    opts: ConnectionOptions & { image?: string; memoryMiB?: number; vcpus?: number; timeoutMs?: number } = {},
  ): Promise<Sandbox> {
    const conn = Connection.get(opts);
    const res = await conn.request('sandbox.boot', {
      image: opts.image,
      memoryMiB: opts.memoryMiB,
      vcpus: opts.vcpus,
      timeoutMs: opts.timeoutMs,
    });
    return new Sandbox(conn, res.sandbox as SandboxInfo, opts);
  }

  /** Attaches to a running sandbox by id (from any client, any time before its timeout). */
  static async connect(id: string, opts: ConnectionOptions = {}): Promise<Sandbox> {
    const conn = Connection.get(opts);
    const res = await conn.request('sandbox.connect', { sandbox: id });
    return new Sandbox(conn, res.sandbox as SandboxInfo, opts);
  }

  /** n new sandboxes from a template. */
  static async fork(template: string, n: number, opts: Omit<SandboxOptions, 'template'> = {}): Promise<Sandbox[]> {
    const conn = Connection.get(opts);
    const res = await conn.request('sandbox.fork', { template, n, timeoutMs: opts.timeoutMs });
    return (res.sandboxes as SandboxInfo[]).map((i) => new Sandbox(conn, i, opts));
  }

  /** Every sandbox on the server. */
  static async list(opts: ConnectionOptions = {}): Promise<SandboxInfo[]> {
    const res = await Connection.get(opts).request('sandbox.list', {});
    return res.sandboxes as SandboxInfo[];
  }

  /** Closes the shared connections of this process (the sandboxes live on until their timeouts). */
  static disconnectAll(): void {
    Connection.closeAll();
  }

  /** n children that continue from this sandbox's live state; this one goes on. */
  async branch(n: number, opts: { timeoutMs?: number } = {}): Promise<Sandbox[]> {
    const res = await this.conn.request('sandbox.branch', { sandbox: this.id, n, timeoutMs: opts.timeoutMs });
    return (res.sandboxes as SandboxInfo[]).map((i) => new Sandbox(this.conn, i, this.opts));
  }

  /** Kills the sandbox; false when it had already ended. */
  async kill(): Promise<boolean> {
    const res = await this.conn.request('sandbox.kill', { sandbox: this.id });
    return res.killed as boolean;
  }

  /** Sets the timeout to `ms` from now (extends or shortens it). */
  async setTimeout(ms: number): Promise<void> {
    const res = await this.conn.request('sandbox.setTimeout', { sandbox: this.id, timeoutMs: ms });
    this.infoCache = res.sandbox as SandboxInfo;
  }

  async getInfo(): Promise<SandboxInfo> {
    const res = await this.conn.request('sandbox.connect', { sandbox: this.id });
    this.infoCache = res.sandbox as SandboxInfo;
    return this.infoCache;
  }

  /** True while the server has the sandbox. */
  async isRunning(): Promise<boolean> {
    try {
      await this.getInfo();
      return true;
    } catch (e) {
      if (e instanceof ForklingError && (e.code === 'not_found' || e.code === 'sandbox_ended')) return false;
      throw e;
    }
  }

  /**
   * Runs Python in the sandbox's warm interpreter (statements; the last
   * expression is the value, like a notebook cell). An exception in the code
   * is returned as `error`; a timeout throws TimeoutError.
   */
  async eval(code: string, opts: EvalOptions = {}): Promise<EvalResult> {
    let stdout = '';
    let stderr = '';
    const res = await this.call('eval', { code, context: opts.context, timeoutMs: opts.timeoutMs }, (ev) => {
      const text = typeof ev.data === 'string' ? ev.data : '';
      if (ev.ev === 'stdout') {
        stdout += text;
        opts.onStdout?.(text);
      } else if (ev.ev === 'stderr') {
        stderr += text;
        opts.onStderr?.(text);
      }
    });
    const exc = res.exception as { type: string; message: string; traceback: string } | undefined;
    if (res.timedOut) {
      throw new TimeoutError(`eval timed out after ${opts.timeoutMs ?? '?'} ms (the code was interrupted)`);
    }
    return {
      value: res.value,
      text: String(res.repr ?? ''),
      type: String(res.type ?? ''),
      stdout,
      stderr,
      error: exc ? new SandboxError(exc.type, exc.message, exc.traceback) : undefined,
      durationMs: Number(res.durationMs ?? 0),
    };
  }

  /** Sends one agent operation to this sandbox (for operations the SDK does not wrap). */
  call(op: string, fields: Fields = {}, onEvent?: (ev: Fields) => void): Promise<Fields> {
    return this.conn.request(op, { ...fields, sandbox: this.id }, onEvent);
  }

  /** Opens an agent operation whose stream the caller feeds or cancels. */
  openCall(op: string, fields: Fields, onEvent?: (ev: Fields) => void): Promise<OpenRequest> {
    return this.conn.open(op, { ...fields, sandbox: this.id }, onEvent);
  }

  /** Resolves when the connection has sent all but a few MiB (a stream's pace). */
  drained(): Promise<void> {
    return this.conn.drained();
  }
}

/** A background command: wait for it, kill it, feed its stdin. */
export class CommandHandle {
  constructor(
    private readonly sb: Sandbox,
    readonly procId: string,
    readonly pid: number,
    private readonly result: Promise<CommandResult>,
  ) {
    result.catch(() => {}); // observed through wait()
  }

  /**
   * Resolves when the command exits. When the stream of its output was lost
   * (this client's connection dropped), waits through proc.wait instead; the
   * output is then the tail the sandbox kept.
   */
  async wait(): Promise<CommandResult> {
    try {
      return await this.result;
    } catch (e) {
      if (!(e instanceof ConnectionError) && !(e instanceof ForklingError && e.code === 'cancelled')) throw e;
      return waitByProcId(this.sb, this.procId);
    }
  }

  async kill(): Promise<boolean> {
    const res = await this.sb.call('proc.kill', { procId: this.procId });
    return res.done as boolean;
  }

  async sendStdin(data: string | Uint8Array): Promise<void> {
    const bytes = toBytes(data);
    for (let off = 0; off < bytes.length || off === 0; off += MAX_CHUNK) {
      await this.sb.call('proc.write', { procId: this.procId, data: bytes.subarray(off, off + MAX_CHUNK) });
      if (bytes.length === 0) break;
    }
  }

  async closeStdin(): Promise<void> {
    await this.sb.call('proc.closeStdin', { procId: this.procId });
  }
}

const decoder = new TextDecoder();

async function waitByProcId(sb: Sandbox, procId: string): Promise<CommandResult> {
  const t0 = Date.now();
  const r = await sb.call('proc.wait', { procId });
  return {
    exitCode: (r.exitCode as number | null) ?? null,
    signal: (r.signal as string | null) ?? null,
    stdout: decoder.decode(r.stdoutTail as Uint8Array),
    stderr: decoder.decode(r.stderrTail as Uint8Array),
    procId,
    pid: Number(r.pid),
    durationMs: Date.now() - t0,
  };
}

export class Commands {
  constructor(private readonly sb: Sandbox) {}

  /**
   * Runs a command: a string goes through /bin/sh -c, an array is the argv.
   * Resolves with exit code and output (a non-zero exit is not an error);
   * with `background: true` resolves with a CommandHandle once it started.
   */
  run(cmd: string | string[], opts: CommandOptions & { background: true }): Promise<CommandHandle>;
  run(cmd: string | string[], opts?: CommandOptions & { background?: false }): Promise<CommandResult>;
  async run(cmd: string | string[], opts: CommandOptions = {}): Promise<CommandResult | CommandHandle> {
    const out = new TextSink(opts.onStdout);
    const err = new TextSink(opts.onStderr);
    let started: (v: { procId: string; pid: number }) => void = () => {};
    const startedP = new Promise<{ procId: string; pid: number }>((r) => {
      started = r;
    });
    const fields: Fields = {
      ...(Array.isArray(cmd) ? { argv: cmd } : { shell: cmd }),
      env: opts.envs,
      cwd: opts.cwd,
      timeoutMs: opts.timeoutMs,
      background: opts.background || undefined,
    };
    const stdin = opts.stdin === undefined ? undefined : toBytes(opts.stdin);
    // A background command keeps its stdin open for sendStdin(); a foreground one gets its bytes and EOF.
    if (opts.background) fields.stdinStream = true;
    else if (stdin && stdin.length <= MAX_CHUNK) fields.stdin = stdin;
    else if (stdin) fields.stdinStream = true;
    const req = await this.sb.openCall('exec', fields, (ev) => {
      if (ev.ev === 'stdout') out.push(ev.data);
      else if (ev.ev === 'stderr') err.push(ev.data);
      else if (ev.ev === 'started') started({ procId: String(ev.procId), pid: Number(ev.pid) });
    });
    if (fields.stdinStream && stdin) {
      for (let off = 0; off < stdin.length; off += MAX_CHUNK) req.send('data', { data: stdin.subarray(off, off + MAX_CHUNK) });
      if (!opts.background) req.send('end');
    }
    const result = req.done.then((res): CommandResult => {
      out.end();
      err.end();
      if (res.timedOut) throw new TimeoutError(`command timed out after ${opts.timeoutMs} ms (killed)`);
      return {
        exitCode: (res.exitCode as number | null) ?? null,
        signal: (res.signal as string | null) ?? null,
        stdout: out.text,
        stderr: err.text,
        procId: String(res.procId),
        pid: Number(res.pid),
        durationMs: Number(res.durationMs ?? 0),
      };
    });
    if (!opts.background) return result;
    const s = await Promise.race([startedP, result.then(() => null)]);
    if (s === null) {
      const r = await result; // exited before we heard it started: still a handle
      return new CommandHandle(this.sb, r.procId, r.pid, result);
    }
    return new CommandHandle(this.sb, s.procId, s.pid, result);
  }

  /**
   * A handle for a process started earlier (e.g. by another client, or before
   * a reconnect); its wait() gives the exit status and the kept output tail.
   */
  async connect(procId: string): Promise<CommandHandle> {
    const procs = (await this.sb.call('proc.list')).procs as { procId: string; pid: number }[];
    const p = procs.find((x) => x.procId === procId);
    if (!p) throw new NotFoundError(`no process ${procId} in sandbox ${this.sb.id}`, 'no_such_process');
    return new CommandHandle(this.sb, procId, p.pid, waitByProcId(this.sb, procId));
  }

  /** Processes started by exec in the sandbox (running and recently finished). */
  async list(): Promise<Fields[]> {
    return (await this.sb.call('proc.list')).procs as Fields[];
  }

  async kill(procId: string): Promise<boolean> {
    return (await this.sb.call('proc.kill', { procId })).done as boolean;
  }

  async sendStdin(procId: string, data: string | Uint8Array): Promise<void> {
    await this.sb.call('proc.write', { procId, data: toBytes(data) });
  }
}

export type ReadFormat = 'text' | 'bytes' | 'stream';

/** Bytes per files.read request of a streamed read. */
const STREAM_WINDOW = 4 * MAX_CHUNK;

export class Files {
  constructor(private readonly sb: Sandbox) {}

  /** A file as text (default), bytes, or a ReadableStream of chunks (for large files). */
  read(path: string, opts?: { format?: 'text' }): Promise<string>;
  read(path: string, opts: { format: 'bytes' }): Promise<Uint8Array>;
  read(path: string, opts: { format: 'stream' }): Promise<ReadableStream<Uint8Array>>;
  async read(path: string, opts: { format?: ReadFormat } = {}): Promise<string | Uint8Array | ReadableStream<Uint8Array>> {
    const format = opts.format ?? 'text';
    if (format === 'stream') return this.readStream(path);
    const parts: Uint8Array[] = [];
    await this.sb.call('files.read', { path }, (ev) => {
      if (ev.ev === 'chunk' && ev.data instanceof Uint8Array) parts.push(ev.data);
    });
    const bytes = concat(parts);
    return format === 'bytes' ? bytes : new TextDecoder().decode(bytes);
  }

  /**
   * A ReadableStream that pulls the file in windows of STREAM_WINDOW bytes
   * (files.read with offset/length), so a slow reader holds back the sandbox
   * instead of filling memory. Rejects at once when the file cannot be read.
   */
  private async readStream(path: string): Promise<ReadableStream<Uint8Array>> {
    const readWindow = async (offset: number) => {
      const parts: Uint8Array[] = [];
      const res = await this.sb.call('files.read', { path, offset, length: STREAM_WINDOW }, (ev) => {
        if (ev.ev === 'chunk' && ev.data instanceof Uint8Array) parts.push(new Uint8Array(ev.data));
      });
      return { parts, size: Number(res.size) };
    };
    let first: { parts: Uint8Array[]; size: number } | null = await readWindow(0);
    let offset = first.size;
    let done = first.size < STREAM_WINDOW;
    return new ReadableStream<Uint8Array>({
      pull: async (ctl) => {
        const w = first ?? (done ? null : await readWindow(offset));
        if (!first && w) {
          offset += w.size;
          if (w.size < STREAM_WINDOW) done = true;
        }
        first = null;
        if (w) for (const p of w.parts) ctl.enqueue(p);
        if (done || !w || w.size === 0) ctl.close();
      },
    });
  }

  /** Writes a file (parents created), any size: large data goes in chunks. */
  async write(
    path: string,
    data: string | Uint8Array | ArrayBuffer | ReadableStream<Uint8Array>,
    opts: { mode?: number; append?: boolean } = {},
  ): Promise<{ path: string; size: number }> {
    const base = { path, mode: opts.mode, append: opts.append || undefined, mkdirs: true };
    if (!(data instanceof ReadableStream)) {
      const bytes = toBytes(data);
      if (bytes.length <= MAX_CHUNK) {
        const res = await this.sb.call('files.write', { ...base, data: bytes });
        return { path, size: Number(res.size) };
      }
      const req = await this.sb.openCall('files.write', { ...base, stream: true });
      for (let off = 0; off < bytes.length; off += MAX_CHUNK) req.send('data', { data: bytes.subarray(off, off + MAX_CHUNK) });
      req.send('end');
      return { path, size: Number((await req.done).size) };
    }
    const req = await this.sb.openCall('files.write', { ...base, stream: true });
    let ended = false; // (the server may end the request before the source ends: stop reading it then)
    const markEnded = () => {
      ended = true;
    };
    req.done.then(markEnded, markEnded);
    const reader = data.getReader();
    try {
      for (;;) {
        await this.sb.drained(); // (a large stream is not read into memory faster than it is sent)
        if (ended) break;
        const { done, value } = await reader.read();
        if (done) break;
        for (let off = 0; off < value.length; off += MAX_CHUNK) req.send('data', { data: value.subarray(off, off + MAX_CHUNK) });
      }
    } catch (e) {
      req.cancel();
      throw e;
    }
    if (ended) void reader.cancel().catch(() => {});
    else req.send('end');
    return { path, size: Number((await req.done).size) };
  }

  async list(path: string): Promise<EntryInfo[]> {
    const res = await this.sb.call('files.list', { path });
    return (res.entries as Omit<EntryInfo, 'path'>[]).map((e) => ({ ...e, path: joinPath(path, e.name) }));
  }

  /** Removes a file or a directory tree. */
  async remove(path: string, opts: { recursive?: boolean } = {}): Promise<void> {
    await this.sb.call('files.remove', { path, recursive: opts.recursive ?? true });
  }

  /** Creates a directory and its parents; false when it already existed. */
  async makeDir(path: string): Promise<boolean> {
    return (await this.sb.call('files.mkdir', { path, parents: true })).created as boolean;
  }

  async rename(from: string, to: string): Promise<void> {
    await this.sb.call('files.rename', { from, to });
  }

  async exists(path: string): Promise<boolean> {
    return (await this.sb.call('files.exists', { path })).exists as boolean;
  }

  async getInfo(path: string): Promise<EntryInfo & { uid: number; gid: number }> {
    const res = await this.sb.call('files.stat', { path });
    const name = path.replace(/\/+$/, '').split('/').pop() || '/';
    return { ...(res as unknown as EntryInfo & { uid: number; gid: number }), name, path };
  }
}
