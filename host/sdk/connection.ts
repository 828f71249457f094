// One WebSocket to a `forkling serve`, shared by every Sandbox object with the
// same url and token. Requests are multiplexed by id; stream events go to the
// request's handler. Browser-safe: the web-standard WebSocket API only (the
// Node entry, host/index.ts, supplies the `ws` package where Node has none).
import { decodeFrame, encodeFrame } from '../../protocol/codec.ts';
import { MAX_FRAME, PROTOCOL_VERSION } from '../../protocol/schema.ts';
import { WS_SUBPROTOCOL, WS_TOKEN_PREFIX } from '../../protocol/server-ops.ts';
import { AuthError, ConnectionError, errorFromCode, InvalidArgumentError } from './errors.ts';

/** The part of the web-standard WebSocket the SDK uses. */
export interface WebSocketLike {
  binaryType: string;
  readonly readyState: number;
  /** Bytes queued and not yet sent (browsers' WebSocket and ws both have it). */
  readonly bufferedAmount?: number;
  send(data: Uint8Array): void;
  close(code?: number, reason?: string): void;
  onopen: ((ev: unknown) => void) | null;
  onmessage: ((ev: { data: unknown }) => void) | null;
  onclose: ((ev: { code: number; reason: string }) => void) | null;
  onerror: ((ev: unknown) => void) | null;
}
export type WebSocketFactory = (url: string, protocols: string[]) => WebSocketLike;

export interface ConnectionOptions {
  /** Server URL, e.g. http://127.0.0.1:4780 (ws:// and wss:// work too). Default: $FORKLING_URL or http://127.0.0.1:4780. */
  url?: string;
  /** Bearer token. Default: $FORKLING_TOKEN where there is a process environment. */
  token?: string;
  /** WebSocket implementation (default: globalThis.WebSocket, or `ws` through the Node entry). */
  webSocket?: WebSocketFactory;
}

interface Pending {
  resolve(res: Record<string, unknown>): void;
  reject(e: Error): void;
  onEvent?: (ev: Record<string, unknown>) => void;
}

/** An open request whose stream the caller feeds (`data`/`end`) or cancels. */
export interface OpenRequest {
  readonly id: number;
  readonly done: Promise<Record<string, unknown>>;
  send(ev: 'data' | 'end', fields?: Record<string, unknown>): void;
  cancel(): void;
}

let defaultFactory: WebSocketFactory | null = null;
/** Hook for the Node entry: keeps an idle socket from holding the process open. */
let idleHook: ((ws: WebSocketLike, idle: boolean) => void) | null = null;

/** Sets the WebSocket used when none is passed (the Node entry sets `ws` here). */
export function setDefaultWebSocket(factory: WebSocketFactory, onIdle?: (ws: WebSocketLike, idle: boolean) => void): void {
  defaultFactory = factory;
  idleHook = onIdle ?? null;
}

function env(name: string): string | undefined {
  const p = (globalThis as { process?: { env?: Record<string, string | undefined> } }).process;
  return p?.env?.[name];
}

export function resolveOptions(opts: ConnectionOptions = {}): { url: string; token: string | undefined } {
  return { url: opts.url ?? env('FORKLING_URL') ?? 'http://127.0.0.1:4780', token: opts.token ?? env('FORKLING_TOKEN') };
}

function wsUrl(url: string): string {
  const u = new URL(url);
  if (u.protocol === 'http:') u.protocol = 'ws:';
  else if (u.protocol === 'https:') u.protocol = 'wss:';
  if (u.pathname === '/' || u.pathname === '') u.pathname = '/v1/ws';
  return u.toString();
}

const pool = new Map<string, Connection>();

/** Bytes a stream upload lets wait on the connection before it reads more of its source. */
const STREAM_BUFFER = 8 * 1024 * 1024;

export class Connection {
  private ws: WebSocketLike | null = null;
  private ready: Promise<void> | null = null;
  private nextId = 1;
  private readonly pending = new Map<number, Pending>();
  private serverInfo: Record<string, unknown> | null = null;

  private constructor(
    readonly url: string,
    private readonly token: string | undefined,
    private readonly factory: WebSocketFactory | undefined,
  ) {}

  /** The shared connection for this url and token (created on first use). */
  static get(opts: ConnectionOptions = {}): Connection {
    const { url, token } = resolveOptions(opts);
    const key = `${url}\n${token ?? ''}`;
    let c = pool.get(key);
    if (!c) {
      c = new Connection(url, token, opts.webSocket);
      pool.set(key, c);
    }
    return c;
  }

  /**
   * Closes every shared connection (sandboxes live on in the server). They stay
   * the shared ones: a Sandbox object made before reconnects through its own on
   * its next call, and the next closeAll() closes that one too.
   */
  static closeAll(): void {
    for (const c of pool.values()) c.close();
  }

  /** What the server said in hello (version, limits, engine); null before the first request. */
  get server(): Record<string, unknown> | null {
    return this.serverInfo;
  }

  /** One request; resolves with the response fields, rejects with a typed error. */
  async request(
    op: string,
    fields: Record<string, unknown> = {},
    onEvent?: (ev: Record<string, unknown>) => void,
  ): Promise<Record<string, unknown>> {
    return (await this.open(op, fields, onEvent)).done;
  }

  /** Opens a request and returns at once; feed its stream with send(), stop it with cancel(). */
  async open(
    op: string,
    fields: Record<string, unknown>,
    onEvent?: (ev: Record<string, unknown>) => void,
  ): Promise<OpenRequest> {
    await this.connect();
    const ws = this.ws as WebSocketLike;
    const id = this.nextId;
    this.nextId = this.nextId >= 0xfffffffe ? 1 : this.nextId + 1;
    const bytes = encodeFrame({ ...fields, t: 'req', id, op }); // (before it is pending: what cannot be encoded throws here)
    // The server cannot tell which request an oversized frame was (it answers with no id).
    const maxFrame = ((this.serverInfo?.limits as { maxFrame?: number } | undefined)?.maxFrame ?? MAX_FRAME) as number;
    if (bytes.length > maxFrame) {
      throw new InvalidArgumentError(`${op}: the request is ${bytes.length} bytes, over the server's limit of ${maxFrame} per frame; send less at once (a file: write it as a stream)`);
    }
    const done = new Promise<Record<string, unknown>>((resolve, reject) => {
      this.pending.set(id, { resolve, reject, onEvent });
    });
    if (this.pending.size === 1) idleHook?.(ws, false);
    ws.send(bytes);
    return {
      id,
      done,
      send: (ev, f = {}) => {
        if (this.ws === ws && this.pending.has(id)) this.sendFrame(ws, { ...f, t: 'ev', id, ev });
      },
      cancel: () => {
        if (this.ws === ws && this.pending.has(id)) this.sendFrame(ws, { t: 'cancel', id });
      },
    };
  }

  /**
   * Resolves once at most `max` bytes wait to be sent on this connection (or it
   * closed): a stream upload reads its source no faster than the connection
   * sends. Browsers give no event for it, so it looks every 10 ms.
   */
  async drained(max = STREAM_BUFFER): Promise<void> {
    const ws = this.ws;
    while (ws && this.ws === ws && (ws.bufferedAmount ?? 0) > max) await new Promise((r) => setTimeout(r, 10));
  }

  close(): void {
    const ws = this.ws;
    this.ws = null;
    this.ready = null;
    if (ws) {
      ws.close(1000, 'client closed');
      this.failAll(new ConnectionError('the connection was closed by the client'));
    }
  }

  private sendFrame(ws: WebSocketLike, frame: Record<string, unknown>): void {
    ws.send(encodeFrame(frame));
  }

  private connect(): Promise<void> {
    if (this.ready) return this.ready;
    const factory =
      this.factory ??
      defaultFactory ??
      ((globalThis as { WebSocket?: new (u: string, p: string[]) => WebSocketLike }).WebSocket
        ? (u: string, p: string[]) =>
            new (globalThis as unknown as { WebSocket: new (u: string, p: string[]) => WebSocketLike }).WebSocket(u, p)
        : null);
    if (!factory) {
      return Promise.reject(
        new ConnectionError('no WebSocket implementation: pass { webSocket } or import the package entry "forkling" in Node'),
      );
    }
    const protocols = [WS_SUBPROTOCOL];
    if (this.token) protocols.push(`${WS_TOKEN_PREFIX}${this.token}`);
    let ws: WebSocketLike;
    try {
      ws = factory(wsUrl(this.url), protocols);
    } catch (e) {
      // (a WebSocket refuses a subprotocol with characters outside RFC 7230's token: a token holding / or =)
      return Promise.reject(new ConnectionError(`cannot open a WebSocket to ${this.url}: ${(e as Error).message}; a token may hold only A-Z a-z 0-9 . _ ~ -`));
    }
    ws.binaryType = 'arraybuffer';
    this.ws = ws;
    const ready = new Promise<void>((resolve, reject) => {
      let opened = false;
      ws.onopen = () => {
        opened = true;
        // hello is the first request; everything else waits for it (this.ready).
        const id = this.nextId++;
        this.pending.set(id, {
          resolve: (res) => {
            this.serverInfo = res;
            if (this.pending.size === 0) idleHook?.(ws, true);
            resolve();
          },
          reject,
        });
        this.sendFrame(ws, { t: 'req', id, op: 'hello', versions: [PROTOCOL_VERSION], client: 'forkling-sdk' });
      };
      ws.onmessage = (ev) => this.onMessage(ws, ev.data);
      ws.onerror = (ev) => {
        if (opened) return; // onclose follows and says it
        const msg = String((ev as { message?: unknown }).message ?? (ev as { error?: unknown }).error ?? '');
        // Browsers hide the HTTP status of a refused upgrade; the Node `ws` package puts it in the message.
        if (/\b401\b/.test(msg)) reject(new AuthError(`the server refused the token (${this.url})`));
        else reject(new ConnectionError(`cannot connect to ${this.url}${msg ? `: ${msg}` : ''}`));
      };
      ws.onclose = (ev) => {
        // (a socket closed by close() ends late: the requests pending then are a newer socket's)
        const current = this.ws === ws;
        if (current) {
          this.ws = null;
          this.ready = null;
        }
        const why = `the connection to ${this.url} closed (${ev.code}${ev.reason ? ` ${ev.reason}` : ''})`;
        if (!opened) reject(new ConnectionError(why));
        if (current) this.failAll(new ConnectionError(`${why}; sandboxes live on, later calls reconnect`));
      };
    });
    this.ready = ready;
    ready.catch(() => {
      if (this.ready === ready) this.ready = null;
      if (this.ws === ws) this.ws = null;
      try {
        ws.close();
      } catch {
        // not open yet
      }
    });
    return ready;
  }

  private failAll(e: ConnectionError): void {
    const all = [...this.pending.values()];
    this.pending.clear();
    for (const p of all) p.reject(e);
  }

  private onMessage(ws: WebSocketLike, data: unknown): void {
    let f: Record<string, unknown>;
    try {
      const bytes = data instanceof ArrayBuffer ? new Uint8Array(data) : (data as Uint8Array);
      f = decodeFrame(bytes) as Record<string, unknown>;
    } catch {
      return; // a server that sends garbage: nothing to tie it to
    }
    if (typeof f !== 'object' || f === null) return;
    const id = f.id as number;
    if (f.t === 'err' && (id === null || id === undefined)) {
      // A frame the server could not read far enough to know its request: whichever it was, it
      // will never be answered; every open request fails with the reason rather than one hanging.
      const e = errorFromCode(String(f.code), `the server could not read a request of ours: ${String(f.message)}`);
      const all = [...this.pending.values()];
      this.pending.clear();
      idleHook?.(ws, true);
      for (const p of all) p.reject(e);
      return;
    }
    const p = this.pending.get(id);
    if (!p) return; // e.g. an event that crossed a cancel
    switch (f.t) {
      case 'ev':
        try {
          p.onEvent?.(f);
        } catch (e) {
          // A callback of the caller's that throws (onStdout, ...) ends that request, not the
          // process: thrown inside the WebSocket's message handler it was an uncaught exception.
          this.pending.delete(id);
          if (this.pending.size === 0) idleHook?.(ws, true);
          this.sendFrame(ws, { t: 'cancel', id });
          p.reject(e instanceof Error ? e : new Error(String(e)));
        }
        return;
      case 'res': {
        this.pending.delete(id);
        if (this.pending.size === 0) idleHook?.(ws, true);
        const { t: _t, id: _id, ...res } = f;
        p.resolve(res);
        return;
      }
      case 'err': {
        this.pending.delete(id);
        if (this.pending.size === 0) idleHook?.(ws, true);
        p.reject(errorFromCode(String(f.code), String(f.message)));
        return;
      }
    }
  }
}
