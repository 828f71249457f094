// AgentClient: the host side of the forkling wire protocol over any byte
// stream (a net.Socket on the agent's Unix socket, or a vsock bridge). Many
// requests run at once, matched by id; every frame from the agent is checked
// against the schema (the guest is not trusted); when the stream ends, every
// pending request rejects. Independent of engines.
import { connect as netConnect, type Socket } from 'node:net';
import type { Duplex } from 'node:stream';
import { concat, decodeFrame, encodeFrame, FrameReader, lengthPrefix } from '../../protocol/codec.ts';
import {
  MAX_CHUNK,
  MAX_FRAME,
  type OpArgs,
  type OpEvent,
  type OpName,
  type OpResult,
  PROTOCOL_VERSION,
} from '../../protocol/schema.ts';
import { checkEvent, checkResult, validateFrame } from '../../protocol/validate.ts';

/** An error answered by the agent (`err` frame), or a local one: closed, timeout, cancelled, bad_response. */
export class AgentError extends Error {
  constructor(
    readonly code: string,
    message: string,
    /**
     * The error frame's other fields (errno, path, ...). Not named `details`:
     * uvu's reporter takes an error's `details` for a string and, on an
     * object, aborts the whole test file without printing any failure.
     */
    readonly fields: Record<string, unknown> = {},
  ) {
    super(message);
    this.name = 'AgentError';
  }
}

export interface RequestOptions<E = unknown> {
  /** Called for each event of this request, in order, before the promise settles. */
  onEvent?: (ev: E) => void;
  /** Aborting sends `cancel` to the agent and rejects with code 'cancelled'. */
  signal?: AbortSignal;
  /** Client-side limit: on expiry the request is cancelled and rejects with code 'timeout'. */
  timeoutMs?: number;
}

export interface AgentClientOptions {
  /** Frames the client cannot tie to a request (e.g. `err` with id null for a bad frame it sent). */
  onStrayFrame?: (frame: Record<string, unknown>) => void;
}

type ArgsOf<O extends OpName> = Omit<OpArgs<O>, never>;
export type EvalResult = OpResult<'eval'> & { stdout: string; stderr: string };
export type ExecResult = OpResult<'exec'> & { stdout: Uint8Array; stderr: Uint8Array };

interface Pending {
  op: OpName;
  onEvent: ((ev: Record<string, unknown>) => void) | undefined;
  resolve: (v: Record<string, unknown>) => void;
  reject: (e: Error) => void;
  cleanup: () => void;
}

/** An open request whose caller can still send `data` / `end` events (streamed input). */
export interface OpenRequest<O extends OpName> {
  id: number;
  result: Promise<OpResult<O>>;
  /** Sends a `data` event; resolves when the stream accepted it (back-pressure). */
  send(data: Uint8Array): Promise<void>;
  end(): Promise<void>;
  cancel(): void;
}

export interface ExecOptions {
  env?: Record<string, string>;
  clearEnv?: boolean;
  cwd?: string;
  stdin?: Uint8Array | string;
  /** Agent-side limit: the process group is killed (SIGKILL) and timedOut is true. */
  timeoutMs?: number;
  onStdout?: (data: Uint8Array) => void;
  onStderr?: (data: Uint8Array) => void;
  signal?: AbortSignal;
}

export interface SpawnOptions extends ExecOptions {
  /** Keep stdin open for write()/closeStdin(). */
  stdinStream?: boolean;
  /** Survives the connection (default true). */
  background?: boolean;
}

/** A process started with spawn(): it runs on while its output streams in. */
export interface AgentProcess {
  procId: string;
  pid: number;
  /** Settles when the process exits (exit code / signal), with all output received on this connection. */
  done: Promise<ExecResult>;
  write(data: Uint8Array | string): Promise<OpResult<'proc.write'>>;
  closeStdin(): Promise<OpResult<'proc.closeStdin'>>;
  signal(sig: string | number): Promise<OpResult<'proc.signal'>>;
  kill(): Promise<OpResult<'proc.kill'>>;
}

const te = new TextEncoder();
const bytes = (d: Uint8Array | string) => (typeof d === 'string' ? te.encode(d) : d);

export class AgentClient {
  private readonly pending = new Map<number, Pending>();
  private nextId = 1;
  /** Requests this side cancelled whose final frame has not come yet: their late frames are expected. */
  private readonly cancelledIds = new Set<number>();
  private closeError: AgentError | null = null;
  private readonly reader: FrameReader;
  private readonly drainWaiters: (() => void)[] = [];
  /** Resolves once the stream is closed (for any reason). */
  readonly closed: Promise<AgentError>;
  private markClosed!: (e: AgentError) => void;

  constructor(
    private readonly stream: Duplex,
    private readonly options: AgentClientOptions = {},
  ) {
    this.closed = new Promise((r) => {
      this.markClosed = r;
    });
    this.reader = new FrameReader({
      payload: (p) => this.onPayload(p),
      oversize: (n) => this.stray({ t: 'err', id: null, code: 'frame_too_large', message: `agent sent a frame of ${n} bytes` }),
    }, MAX_FRAME);
    stream.on('data', (chunk: Uint8Array) => this.reader.push(chunk));
    stream.on('drain', () => {
      for (const w of this.drainWaiters.splice(0)) w();
    });
    stream.on('error', (e: Error) => this.streamEnded(new AgentError('closed', `connection to the agent failed: ${e.message}`)));
    stream.on('close', () => this.streamEnded(new AgentError('closed', 'connection to the agent closed')));
    stream.on('end', () => {
      this.streamEnded(new AgentError('closed', 'the agent closed the connection'));
      stream.end();
    });
  }

  get isClosed(): boolean {
    return this.closeError !== null;
  }

  /** Requests in flight. */
  get inFlight(): number {
    return this.pending.size;
  }

  private readonly idleListeners: (() => void)[] = [];
  /** Calls `fn` each time the last request in flight settles; returns what stops that. */
  onIdle(fn: () => void): () => void {
    this.idleListeners.push(fn);
    return () => {
      const i = this.idleListeners.indexOf(fn);
      if (i >= 0) this.idleListeners.splice(i, 1);
    };
  }

  private explainEnd: (() => void) | null = null;
  /**
   * Calls `fn` when the stream ends on its own, before requests in flight are
   * rejected: an owner that knows why (a VM that stopped) can close() with
   * that reason first, rather than them reading "connection closed".
   */
  onStreamEnd(fn: () => void): void {
    this.explainEnd = fn;
  }

  private streamEnded(err: AgentError): void {
    if (this.closeError) return;
    try {
      this.explainEnd?.();
    } catch {} // (the plain reason then)
    this.onClosed(err);
  }

  /** Closes the stream; pending requests reject with code 'closed' and `why` (default: closed by the client). */
  close(why = 'connection closed by the client'): void {
    this.drop(new AgentError('closed', why));
  }

  /** Rejects everything pending with `err` and drops the connection. */
  private drop(err: AgentError): void {
    this.onClosed(err);
    this.stream.destroy();
  }

  // ---------------------------------------------------------------- core

  /** Sends one request and resolves with its response fields (without t/id). */
  request<O extends OpName>(op: O, args: ArgsOf<O>, opts: RequestOptions<OpEvent<O>> = {}): Promise<OpResult<O>> {
    return this.start(op, args, opts).result;
  }

  /** Starts a request whose input the caller streams (`exec` with stdinStream, `files.write` with stream). */
  open<O extends OpName>(op: O, args: ArgsOf<O>, opts: RequestOptions<OpEvent<O>> = {}): OpenRequest<O> {
    const { id, result } = this.start(op, args, opts);
    return {
      id,
      result,
      send: (data) => this.sendFrame({ t: 'ev', id, ev: 'data', data }),
      end: () => this.sendFrame({ t: 'ev', id, ev: 'end' }),
      cancel: () => this.cancel(id, new AgentError('cancelled', `${op} cancelled`)),
    };
  }

  private allocId(): number {
    for (;;) {
      const id = this.nextId;
      this.nextId = id >= 0xffffffff ? 1 : id + 1;
      if (!this.pending.has(id)) return id;
    }
  }

  /** Requests started so far (the owner's idle work tells its own from others by it). */
  get started(): number {
    return this.startedCount;
  }
  private startedCount = 0;

  private start<O extends OpName>(op: O, args: ArgsOf<O>, opts: RequestOptions<OpEvent<O>>) {
    const id = this.allocId();
    this.startedCount++;
    const result = new Promise<OpResult<O>>((resolve, reject) => {
      if (this.closeError) {
        reject(this.closeError);
        return;
      }
      if (opts.signal?.aborted) {
        reject(new AgentError('cancelled', `${op} cancelled before it was sent`));
        return;
      }
      let timer: ReturnType<typeof setTimeout> | undefined;
      const onAbort = () => this.cancel(id, new AgentError('cancelled', `${op} cancelled`));
      const cleanup = () => {
        if (timer) clearTimeout(timer);
        opts.signal?.removeEventListener('abort', onAbort);
      };
      this.pending.set(id, {
        op,
        onEvent: opts.onEvent as Pending['onEvent'],
        resolve: resolve as Pending['resolve'],
        reject,
        cleanup,
      });
      if (opts.timeoutMs !== undefined) {
        timer = setTimeout(
          () => this.cancel(id, new AgentError('timeout', `${op} got no answer within ${opts.timeoutMs} ms`)),
          opts.timeoutMs,
        );
      }
      opts.signal?.addEventListener('abort', onAbort, { once: true });
      try {
        this.sendFrame({ ...args, t: 'req', id, op }).catch(() => {}); // a closed stream rejects via onClosed()
      } catch (e) {
        // (not encodable: it must not stay pending, which kept the VM from ever counting as idle)
        this.settle(id)?.reject(new AgentError('bad_request', `${op}: the request cannot be encoded: ${(e as Error).message}`));
      }
    });
    return { id, result };
  }

  /** Rejects a pending request locally and tells the agent to stop it. */
  private cancel(id: number, err: AgentError): void {
    const p = this.pending.get(id);
    if (!p) return;
    this.settle(id)?.reject(err);
    if (this.closeError) return;
    this.cancelledIds.add(id);
    if (this.cancelledIds.size > 4096) this.cancelledIds.delete(this.cancelledIds.values().next().value!);
    this.sendFrame({ t: 'cancel', id }).catch(() => {});
  }

  private settle(id: number): Pending | undefined {
    const p = this.pending.get(id);
    if (!p) return undefined;
    this.pending.delete(id);
    p.cleanup();
    if (this.pending.size === 0) for (const fn of [...this.idleListeners]) fn(); // (a copy: one may remove itself)
    return p;
  }

  /** Writes one frame; resolves when the stream takes more (back-pressure). */
  sendFrame(frame: Record<string, unknown>): Promise<void> {
    if (this.closeError) return Promise.reject(this.closeError);
    const payload = encodeFrame(frame);
    let ok: boolean;
    if (payload.length < 65536) {
      const buf = new Uint8Array(4 + payload.length);
      buf.set(lengthPrefix(payload.length), 0);
      buf.set(payload, 4);
      ok = this.stream.write(buf);
    } else {
      this.stream.cork();
      this.stream.write(lengthPrefix(payload.length));
      ok = this.stream.write(payload);
      this.stream.uncork();
    }
    if (ok) return Promise.resolve();
    return new Promise((resolve, reject) => {
      this.drainWaiters.push(() => (this.closeError ? reject(this.closeError) : resolve()));
    });
  }

  /** Writes raw bytes to the stream (tests of bad frames). */
  writeRaw(data: Uint8Array): void {
    this.stream.write(data);
  }

  private stray(frame: Record<string, unknown>): void {
    this.options.onStrayFrame?.(frame);
  }

  private onPayload(payload: Uint8Array): void {
    let x: unknown;
    try {
      x = decodeFrame(payload);
    } catch (e) {
      // Which request it answered is unknown, so that request would wait forever: an agent that
      // sends what is not msgpack (or uses msgpackr's back-references) is broken or hostile, and
      // the connection ends (for an engine, the sandbox with it).
      const why = `undecodable frame from the agent: ${(e as Error).message}`;
      this.stray({ t: 'err', id: null, code: 'bad_frame', message: why });
      this.drop(new AgentError('bad_response', why));
      return;
    }
    const v = validateFrame(x, ['res', 'ev', 'err']);
    if (!v.ok) {
      const p = v.error.id === null ? undefined : this.settle(v.error.id);
      const err = new AgentError('bad_response', `invalid frame from the agent: ${v.error.message}`);
      if (p) p.reject(err);
      else this.stray({ t: 'err', id: v.error.id, code: 'bad_response', message: err.message });
      return;
    }
    const f = v.frame as Record<string, unknown> & { t: string; id: number | null };
    if (f.id === null) {
      this.stray(f);
      return;
    }
    const p = this.pending.get(f.id);
    if (!p) {
      if (!this.cancelledIds.has(f.id)) this.stray(f);
      else if (f.t !== 'ev') this.cancelledIds.delete(f.id); // the last frame of a request we cancelled
      return;
    }
    if (f.t === 'ev') {
      const { t: _t, id: _id, ...ev } = f;
      const bad = checkEvent(p.op, ev);
      if (bad) {
        this.cancel(f.id, new AgentError('bad_response', `invalid ${p.op} event from the agent: ${bad}`));
        return;
      }
      try {
        p.onEvent?.(ev);
      } catch (e) {
        this.cancel(f.id, e instanceof AgentError ? e : new AgentError('cancelled', `event handler threw: ${(e as Error).message}`));
      }
      return;
    }
    this.settle(f.id);
    if (f.t === 'err') {
      const { t: _t, id: _id, code, message, ...fields } = f;
      p.reject(new AgentError(code as string, message as string, fields));
      return;
    }
    const { t: _t, id: _id, ...res } = f;
    const bad = checkResult(p.op, res);
    if (bad) p.reject(new AgentError('bad_response', `invalid ${p.op} response from the agent: ${bad}`));
    else p.resolve(res);
  }

  private onClosed(err: AgentError): void {
    if (this.closeError) return;
    this.closeError = err;
    for (const id of [...this.pending.keys()]) this.settle(id)?.reject(err);
    for (const w of this.drainWaiters.splice(0)) w();
    this.markClosed(err);
  }

  // ---------------------------------------------------------------- typed helpers

  /** Version negotiation; must be the first request on a connection. */
  hello(client = 'forkling-host'): Promise<OpResult<'hello'>> {
    return this.request('hello', { versions: [PROTOCOL_VERSION], client });
  }

  ping(): Promise<OpResult<'ping'>> {
    return this.request('ping', {});
  }

  info(opts: { modules?: boolean } = {}): Promise<OpResult<'info'>> {
    return this.request('info', opts);
  }

  /** Runs Python in the agent; output is streamed to the callbacks and collected. Exceptions come back in `exception`. */
  async eval(
    code: string,
    opts: {
      context?: string;
      timeoutMs?: number;
      onStdout?: (s: string) => void;
      onStderr?: (s: string) => void;
      signal?: AbortSignal;
    } = {},
  ): Promise<EvalResult> {
    const out: string[] = [];
    const err: string[] = [];
    const args: OpArgs<'eval'> = { code };
    if (opts.context !== undefined) args.context = opts.context;
    if (opts.timeoutMs !== undefined) args.timeoutMs = opts.timeoutMs;
    const res = await this.request('eval', args, {
      ...(opts.signal ? { signal: opts.signal } : {}),
      onEvent: (ev) => {
        if (ev.ev === 'stdout') {
          out.push(ev.data);
          opts.onStdout?.(ev.data);
        } else {
          err.push(ev.data);
          opts.onStderr?.(ev.data);
        }
      },
    });
    return { ...res, stdout: out.join(''), stderr: err.join('') };
  }

  private execArgs(cmd: string[] | string, opts: ExecOptions): OpArgs<'exec'> {
    const args: OpArgs<'exec'> = typeof cmd === 'string' ? { shell: cmd } : { argv: cmd };
    if (opts.env) args.env = opts.env;
    if (opts.clearEnv) args.clearEnv = true;
    if (opts.cwd !== undefined) args.cwd = opts.cwd;
    if (opts.timeoutMs !== undefined) args.timeoutMs = opts.timeoutMs;
    return args;
  }

  /** Runs a command (argv list, or a string for /bin/sh -c) to completion. */
  async exec(cmd: string[] | string, opts: ExecOptions = {}): Promise<ExecResult> {
    const args = this.execArgs(cmd, opts);
    const stdin = opts.stdin === undefined ? undefined : bytes(opts.stdin);
    if (stdin && stdin.length > MAX_CHUNK) args.stdinStream = true;
    else if (stdin) args.stdin = stdin;
    const out: Uint8Array[] = [];
    const err: Uint8Array[] = [];
    const req = this.open('exec', args, {
      ...(opts.signal ? { signal: opts.signal } : {}),
      onEvent: (ev) => {
        if (ev.ev === 'stdout') {
          out.push(ev.data);
          opts.onStdout?.(ev.data);
        } else if (ev.ev === 'stderr') {
          err.push(ev.data);
          opts.onStderr?.(ev.data);
        }
      },
    });
    if (args.stdinStream && stdin) {
      void this.pump(req, [stdin]).catch(() => {});
    }
    const res = await req.result;
    return { ...res, stdout: concat(out), stderr: concat(err) };
  }

  /** Starts a process and resolves once it runs; `done` settles at exit. */
  spawn(cmd: string[] | string, opts: SpawnOptions = {}): Promise<AgentProcess> {
    const args = this.execArgs(cmd, opts);
    args.background = opts.background ?? true;
    if (opts.stdinStream) args.stdinStream = true;
    if (opts.stdin !== undefined) args.stdin = bytes(opts.stdin);
    const out: Uint8Array[] = [];
    const err: Uint8Array[] = [];
    return new Promise((resolve, reject) => {
      let started = false;
      const done = this.request('exec', args, {
        ...(opts.signal ? { signal: opts.signal } : {}),
        onEvent: (ev) => {
          if (ev.ev === 'started') {
            started = true;
            const procId = ev.procId;
            const finished = done.then((res) => ({ ...res, stdout: concat(out), stderr: concat(err) }));
            finished.catch(() => {}); // a process nobody waits for must not be an unhandled rejection
            resolve({
              procId,
              pid: ev.pid,
              done: finished,
              write: (data) => this.request('proc.write', { procId, data: bytes(data) }),
              closeStdin: () => this.request('proc.closeStdin', { procId }),
              signal: (signal) => this.request('proc.signal', { procId, signal }),
              kill: () => this.request('proc.kill', { procId }),
            });
          } else if (ev.ev === 'stdout') {
            out.push(ev.data);
            opts.onStdout?.(ev.data);
          } else {
            err.push(ev.data);
            opts.onStderr?.(ev.data);
          }
        },
      });
      done.catch((e) => {
        if (!started) reject(e);
      });
    });
  }

  procList(): Promise<OpResult<'proc.list'>> {
    return this.request('proc.list', {});
  }

  procWait(procId: string, timeoutMs?: number): Promise<OpResult<'proc.wait'>> {
    return this.request('proc.wait', timeoutMs === undefined ? { procId } : { procId, timeoutMs });
  }

  procWrite(procId: string, data: Uint8Array | string): Promise<OpResult<'proc.write'>> {
    return this.request('proc.write', { procId, data: bytes(data) });
  }

  procCloseStdin(procId: string): Promise<OpResult<'proc.closeStdin'>> {
    return this.request('proc.closeStdin', { procId });
  }

  procSignal(procId: string, signal: string | number, group = true): Promise<OpResult<'proc.signal'>> {
    return this.request('proc.signal', { procId, signal, group });
  }

  procKill(procId: string): Promise<OpResult<'proc.kill'>> {
    return this.request('proc.kill', { procId });
  }

  /** Streams a file from the agent chunk by chunk; resolves with the byte count. */
  readFileChunks(
    path: string,
    onChunk: (data: Uint8Array) => void,
    opts: { offset?: number; length?: number; signal?: AbortSignal } = {},
  ): Promise<OpResult<'files.read'>> {
    const args: OpArgs<'files.read'> = { path };
    if (opts.offset !== undefined) args.offset = opts.offset;
    if (opts.length !== undefined) args.length = opts.length;
    return this.request('files.read', args, {
      ...(opts.signal ? { signal: opts.signal } : {}),
      onEvent: (ev) => onChunk(ev.data),
    });
  }

  async readFile(path: string, opts: { offset?: number; length?: number; signal?: AbortSignal } = {}): Promise<Uint8Array> {
    const parts: Uint8Array[] = [];
    await this.readFileChunks(path, (d) => parts.push(d), opts);
    return concat(parts);
  }

  /** Writes a file of any size: one request up to MAX_CHUNK, streamed chunks beyond. */
  async writeFile(
    path: string,
    data: Uint8Array | string | AsyncIterable<Uint8Array> | Iterable<Uint8Array>,
    opts: { mode?: number; append?: boolean; mkdirs?: boolean; signal?: AbortSignal } = {},
  ): Promise<OpResult<'files.write'>> {
    const args: OpArgs<'files.write'> = { path };
    if (opts.mode !== undefined) args.mode = opts.mode;
    if (opts.append) args.append = true;
    if (opts.mkdirs) args.mkdirs = true;
    const ro = opts.signal ? { signal: opts.signal } : {};
    if (typeof data === 'string' || data instanceof Uint8Array) {
      const b = bytes(data);
      if (b.length <= MAX_CHUNK) return this.request('files.write', { ...args, data: b }, ro);
      data = [b];
    }
    const req = this.open('files.write', { ...args, stream: true }, ro);
    await this.pump(req, data).catch((e) => {
      req.cancel();
      throw e;
    });
    return req.result;
  }

  /** Sends an iterable of buffers as `data` events (split to MAX_CHUNK), then `end`; stops if the request settles early. */
  private async pump<O extends OpName>(req: OpenRequest<O>, data: AsyncIterable<Uint8Array> | Iterable<Uint8Array>) {
    let settled = false;
    req.result.then(
      () => {
        settled = true;
      },
      () => {
        settled = true;
      },
    );
    for await (const piece of data) {
      for (let off = 0; off < piece.length && !settled; off += MAX_CHUNK) {
        await req.send(piece.subarray(off, off + MAX_CHUNK));
      }
      if (settled) return;
    }
    if (!settled) await req.end();
  }

  listDir(path: string): Promise<OpResult<'files.list'>> {
    return this.request('files.list', { path });
  }

  stat(path: string, follow = true): Promise<OpResult<'files.stat'>> {
    return this.request('files.stat', { path, follow });
  }

  exists(path: string): Promise<OpResult<'files.exists'>> {
    return this.request('files.exists', { path });
  }

  mkdir(path: string, opts: { parents?: boolean; mode?: number } = {}): Promise<OpResult<'files.mkdir'>> {
    return this.request('files.mkdir', { path, ...opts });
  }

  remove(path: string, opts: { recursive?: boolean; force?: boolean } = {}): Promise<OpResult<'files.remove'>> {
    return this.request('files.remove', { path, ...opts });
  }

  rename(from: string, to: string): Promise<OpResult<'files.rename'>> {
    return this.request('files.rename', { from, to });
  }

  /** Called on every new child before use: entropy, clock, hostname, sandbox id. */
  restore(args: OpArgs<'restore'>): Promise<OpResult<'restore'>> {
    return this.request('restore', args);
  }

  contextList(): Promise<OpResult<'context.list'>> {
    return this.request('context.list', {});
  }

  contextDelete(context: string): Promise<OpResult<'context.delete'>> {
    return this.request('context.delete', { context });
  }

  /** Powers the guest off (PID 1) or ends the agent process; the connection then closes. */
  shutdown(reboot = false): Promise<OpResult<'shutdown'>> {
    return this.request('shutdown', { reboot });
  }
}

/**
 * The first requests on a fresh connection, which must all be answered within
 * `ms`: the agent runs the image's and the template's code and may never
 * answer. On a miss the connection is closed (pending requests reject with
 * code 'closed' and "`what` did not answer within …"); on any failure too.
 */
export async function answeredWithin<T>(client: AgentClient, ms: number, what: string, first: (c: AgentClient) => Promise<T>): Promise<T> {
  const limit = Math.max(1, ms);
  const timer = setTimeout(() => client.close(`${what} did not answer within ${limit >= 1000 ? `${Math.round(limit / 100) / 10} s` : `${Math.round(limit)} ms`}`), limit);
  try {
    return await first(client);
  } catch (e) {
    client.close();
    throw e;
  } finally {
    clearTimeout(timer);
  }
}

/**
 * A new child's greeting: hello, with its restore (its own entropy, host name
 * and sandbox id) sent at once behind it (frames are handled in order: one
 * round trip). `expectId`: the sandbox id hello must report (a process fork
 * knows its id before the restore; a restored VM still has its template's).
 */
export async function helloAndRestore(client: AgentClient, restore: OpArgs<'restore'>, expectId?: string): Promise<void> {
  const hello = client.hello();
  const restored = client.restore(restore);
  restored.catch(() => {}); // (awaited below, unless hello failed first)
  const h = await hello;
  if (expectId !== undefined && h.sandboxId !== expectId) throw new Error(`its agent says it is ${JSON.stringify(h.sandboxId)}, not ${expectId}`);
  await restored;
}

/** Connects to an agent's Unix socket; by default also does the hello exchange. */
export async function connectUnix(
  path: string,
  opts: AgentClientOptions & {
    hello?: boolean;
    timeoutMs?: number;
    /** What to call the socket in errors (default: its path). */
    name?: string;
    /** Called once connected, before any frame: throws to refuse the peer (the socket is then closed). */
    check?: (sock: Socket) => void;
  } = {},
): Promise<AgentClient> {
  const name = opts.name ?? path;
  const sock = netConnect(path);
  sock.setNoDelay?.(true);
  await new Promise<void>((resolve, reject) => {
    const timer = opts.timeoutMs
      ? setTimeout(() => {
          sock.destroy();
          reject(new AgentError('timeout', `no connection to ${name} within ${opts.timeoutMs} ms`));
        }, opts.timeoutMs)
      : undefined;
    sock.once('connect', () => {
      if (timer) clearTimeout(timer);
      sock.removeAllListeners('error');
      resolve();
    });
    sock.once('error', (e: NodeJS.ErrnoException) => {
      if (timer) clearTimeout(timer);
      reject(new AgentError('closed', `cannot connect to the agent at ${name}: ${e.code ?? e.message}`, { errno: e.code }));
    });
  });
  try {
    opts.check?.(sock);
  } catch (e) {
    sock.destroy();
    throw e;
  }
  const client = new AgentClient(sock, opts);
  if (opts.hello !== false) {
    try {
      await client.hello();
    } catch (e) {
      client.close();
      throw e;
    }
  }
  return client;
}
