// One client WebSocket on /v1/ws. Each binary message is one msgpack frame of
// protocol/. The session answers `hello` and the server operations itself and
// routes agent operations (those with `sandbox: <id>`) to that sandbox's agent,
// mapping the client's request ids to the agent's; stream events come back on
// this socket, interleaved by the client's request ids. Nothing a client sends
// ends the session except a WebSocket-level violation (the socket is then gone
// anyway): a bad frame gets an error frame and the session reads the next one.
import type { WebSocket } from 'ws';
import { decodeFrame, encodeFrame } from '../../protocol/codec.ts';
import { MAX_FRAME, PROTOCOL_VERSION } from '../../protocol/schema.ts';
import { ROUTED_OPS, SERVER_OPS } from '../../protocol/server-ops.ts';
import type { AgentCall } from './bridge.ts';
import type { Code } from './errors.ts';
import type { ServerContext } from './context.ts';
import {
  argsOf,
  checkCancelFrame,
  checkEventFrame,
  checkRequestFrame,
  checkSandboxId,
  clientEventArgs,
  clientStreamOps,
  routedArgs,
  serverArgs,
} from './validate.ts';
import type { Outlet } from './unsent.ts';

const ROUTED = new Set<string>(ROUTED_OPS);
/** Server ops that make sandboxes (what they make is killed if no client is left to learn of it). */
const SPAWNING_OPS = new Set(['sandbox.create', 'sandbox.boot', 'sandbox.fork', 'sandbox.branch']);
/**
 * Client events (stdin, file data) the agents' connections have not taken yet:
 * past PAUSE_AT the session reads no more of its client (flow control for a
 * large upload), below RESUME_AT it reads on. If no agent takes anything for
 * STALL_MS meanwhile (an agent that stopped reading), the requests waiting are
 * ended and the session reads on (it must: a cancel would wait behind them).
 */
const PAUSE_AT = 16 * 1024 * 1024;
const RESUME_AT = 4 * 1024 * 1024;
const STALL_MS = 5000;

interface Open {
  op: string;
  t0: number;
  /** Set for routed requests once the agent request is open. */
  call: AgentCall | null;
  /** Bytes of client events the agent's connection has not taken yet. */
  backlog?: number;
}

export class WsSession {
  private hello = false;
  private readonly open = new Map<number, Open>();
  private closed = false;
  private alive = true;
  /** Bytes of client events no agent connection has taken yet, and the flow control on them. */
  private backlog = 0;
  private paused = false;
  private stallTimer: ReturnType<typeof setTimeout> | undefined;
  /** Bumped when a stall forgets what was waiting (sends still pending then count no more). */
  private backlogGen = 0;
  /** What this session holds unsent to its client, in the server's budget. */
  private readonly outlet: Outlet;

  constructor(
    private readonly ws: WebSocket,
    private readonly ctx: ServerContext,
  ) {
    this.outlet = ctx.unsent.open(
      () => ws.bufferedAmount,
      (why) => this.cut(why),
    );
    ws.on('message', (data, isBinary) => this.onMessage(data as Buffer | Buffer[] | ArrayBuffer, isBinary));
    ws.on('close', () => this.onClose());
    ws.on('error', () => {}); // 'close' follows; a broken socket is not the server's problem
    ws.on('pong', () => {
      this.alive = true;
    });
  }

  /** Requests of this client still open. */
  get inFlight(): number {
    return this.open.size;
  }

  /** Ends the session (server shutdown). */
  close(code: number, reason: string): void {
    this.ws.close(code, reason);
  }

  private onMessage(data: Buffer | Buffer[] | ArrayBuffer, isBinary: boolean): void {
    if (!isBinary) {
      this.error(null, 'bad_frame', 'send frames as binary WebSocket messages holding msgpack');
      return;
    }
    const bytes = Array.isArray(data) ? Buffer.concat(data) : data instanceof ArrayBuffer ? new Uint8Array(data) : data;
    if (bytes.length > MAX_FRAME) {
      this.error(null, 'frame_too_large', `frame of ${bytes.length} bytes, the limit is ${MAX_FRAME}`);
      return;
    }
    let frame: unknown;
    try {
      frame = decodeFrame(bytes);
    } catch (e) {
      this.error(null, 'bad_frame', `not one msgpack value: ${(e as Error).message}`);
      return;
    }
    if (typeof frame !== 'object' || frame === null || Array.isArray(frame) || frame instanceof Uint8Array) {
      this.error(null, 'bad_frame', 'a frame is a msgpack map with a field t');
      return;
    }
    const f = frame as Record<string, unknown>;
    const id = typeof f.id === 'number' && Number.isInteger(f.id) && f.id >= 0 && f.id <= 0xffffffff ? f.id : null;
    try {
      switch (f.t) {
        case 'req':
          this.onRequest(f, id);
          return;
        case 'ev':
          this.onClientEvent(f, id);
          return;
        case 'cancel':
          this.onCancel(f, id);
          return;
        default:
          this.error(id, 'bad_frame', `unknown frame kind t=${JSON.stringify(f.t)}; clients send req, ev, cancel`);
          return;
      }
    } catch (e) {
      // A ServiceError (e.g. unknown sandbox) or a bug: the client hears about it, the session goes on.
      const se = this.ctx.toServiceError(e);
      this.error(id, se.code, se.message);
    }
  }

  private onRequest(f: Record<string, unknown>, id: number | null): void {
    const bad = checkRequestFrame(f);
    if (bad || id === null) {
      this.error(id, 'bad_request', bad ?? 'id: not a valid request id');
      return;
    }
    const op = f.op as string;
    if (this.open.has(id)) {
      this.error(id, 'duplicate_id', `request id ${id} is still open`);
      return;
    }
    if (!this.hello && op !== 'hello') {
      this.error(id, 'hello_required', 'send hello first');
      return;
    }
    if (this.open.size >= this.ctx.maxInFlight) {
      this.error(
        id,
        'too_many_requests',
        `this connection already has ${this.open.size} open requests (limit ${this.ctx.maxInFlight}); wait for some to finish`,
      );
      return;
    }
    if (this.ctx.manager.isDraining) {
      this.error(id, 'shutting_down', 'the server is shutting down');
      return;
    }
    const routed = ROUTED.has(op) && (f.sandbox !== undefined || !(op in SERVER_OPS));
    if (routed) {
      this.routed(id, op, f);
      return;
    }
    const check = serverArgs.get(op);
    if (!check) {
      this.error(id, 'unknown_op', `unknown operation ${JSON.stringify(op)}`);
      return;
    }
    const args = argsOf(f);
    if (f.sandbox !== undefined) args.sandbox = f.sandbox;
    const invalid = check(args);
    if (invalid) {
      this.error(id, 'bad_request', invalid);
      return;
    }
    const entry: Open = { op, t0: performance.now(), call: null };
    this.open.set(id, entry);
    // A hello the server will accept counts at once: the frames behind it in the same read
    // (a client that does not wait for the answer) are not refused for want of it.
    if (op === 'hello' && Array.isArray(args.versions) && args.versions.includes(PROTOCOL_VERSION)) this.hello = true;
    this.ctx.serverOp(op, args).then(
      (res) => {
        // Cancelled, or the client went away, while its sandboxes were being made: no one
        // would ever learn their ids, so they go now instead of at their timeouts.
        if (this.open.get(id) !== entry) {
          if (SPAWNING_OPS.has(op)) this.killUnclaimed(res);
        } else this.finish(id, entry, { t: 'res', id, ...res });
      },
      (e) => this.finishError(id, entry, e),
    );
  }

  private killUnclaimed(res: Record<string, unknown>): void {
    const made = [...((res.sandboxes as { id: string }[] | undefined) ?? []), ...(res.sandbox ? [res.sandbox as { id: string }] : [])];
    for (const sb of made) void this.ctx.manager.kill(sb.id).catch(() => {});
  }

  private routed(id: number, op: string, f: Record<string, unknown>): void {
    const badId = f.sandbox === undefined ? `${op}: sandbox: required to route the request` : checkSandboxId(f.sandbox);
    if (badId) {
      this.error(id, 'bad_request', badId);
      return;
    }
    const args = argsOf(f);
    const invalid = routedArgs.get(op)?.(args);
    if (invalid) {
      this.error(id, 'bad_request', invalid);
      return;
    }
    const sb = this.ctx.manager.sandbox(f.sandbox as string);
    const entry: Open = { op, t0: performance.now(), call: null };
    this.open.set(id, entry);
    const call = this.ctx.callAgent(sb, op, args, (ev) => {
      if (this.open.get(id) === entry) this.send({ t: 'ev', id, ...ev });
    });
    entry.call = call;
    call.done.then(
      (res) => this.finish(id, entry, { t: 'res', id, ...res }),
      (e) => this.finishError(id, entry, e),
    );
  }

  private onClientEvent(f: Record<string, unknown>, id: number | null): void {
    const bad = checkEventFrame(f);
    if (bad || id === null) {
      this.error(id, 'bad_request', bad ?? 'id: not a valid request id');
      return;
    }
    const entry = this.open.get(id);
    if (!entry?.call || !clientStreamOps.has(entry.op)) {
      this.error(id, 'unknown_request', `request ${id} is not open or takes no client events`);
      return;
    }
    const ev = f.ev as string;
    const check = clientEventArgs.get(ev);
    if (!check) {
      this.error(id, 'bad_request', `unknown client event ${JSON.stringify(ev)} (data, end)`);
      return;
    }
    const fields = argsOf(f);
    delete fields.ev;
    const invalid = check(fields);
    if (invalid) {
      this.error(id, 'bad_request', invalid);
      return;
    }
    const bytes = fields.data instanceof Uint8Array ? fields.data.length : 0;
    entry.backlog = (entry.backlog ?? 0) + bytes;
    this.backlog += bytes;
    const gen = this.backlogGen;
    void entry.call.send(ev, fields).then(() => {
      if (gen !== this.backlogGen) return; // (a stall ended the requests waiting and forgot their bytes)
      entry.backlog = (entry.backlog ?? 0) - bytes;
      this.backlog -= bytes;
      this.flow(true);
    });
    this.flow(false);
  }

  /** Pauses or resumes reading the client by the backlog; `progress`: an agent took some. */
  private flow(progress: boolean): void {
    if (this.closed) return;
    if (!this.paused && this.backlog > PAUSE_AT) {
      this.paused = true;
      this.ws.pause();
    } else if (this.paused && this.backlog <= RESUME_AT) {
      this.paused = false;
      this.alive = true; // (its pong may still wait in what was not read)
      this.ws.resume();
    }
    if (!this.paused) {
      clearTimeout(this.stallTimer);
      this.stallTimer = undefined;
    } else if (progress || !this.stallTimer) {
      clearTimeout(this.stallTimer);
      this.stallTimer = setTimeout(() => this.stalled(), STALL_MS);
    }
  }

  /** No agent took anything for STALL_MS: the requests still waiting end; the client is read again. */
  private stalled(): void {
    this.stallTimer = undefined;
    for (const [id, entry] of this.open) {
      if (!entry.backlog) continue;
      this.open.delete(id);
      entry.call?.cancel();
      this.error(id, 'resource_exhausted', `${entry.op}: the sandbox took none of this stream for ${STALL_MS / 1000} s (${entry.backlog} bytes waiting)`);
    }
    // (what requests that already ended left waiting is forgotten too: the client is read again)
    this.backlog = 0;
    this.backlogGen++;
    this.flow(false);
  }

  private onCancel(f: Record<string, unknown>, id: number | null): void {
    const bad = checkCancelFrame(f);
    if (bad || id === null) {
      this.error(id, 'bad_request', bad ?? 'id: not a valid request id');
      return;
    }
    // A cancel for a request that already finished is not an error: the two crossed.
    const entry = this.open.get(id);
    if (!entry) return;
    // The client forgets the id at once (it may reuse it in its next frame): so does the session.
    // A routed request is cancelled at its agent; a server op (sandbox.fork, ...) runs on (what it
    // makes is killed when done). Their late answers find no entry and are dropped.
    entry.call?.cancel();
    this.open.delete(id);
    this.error(id, 'cancelled', `${entry.op} cancelled`);
  }

  private finish(id: number, entry: Open, frame: Record<string, unknown>): void {
    if (this.open.get(id) !== entry) return;
    this.open.delete(id);
    this.ctx.metrics.requestLatency.observe({ op: entry.op, transport: 'ws' }, (performance.now() - entry.t0) / 1000);
    this.send(frame);
  }

  private finishError(id: number, entry: Open, e: unknown): void {
    if (this.open.get(id) !== entry) return;
    this.open.delete(id);
    const se = this.ctx.toServiceError(e);
    this.error(id, se.code, se.message);
  }

  private error(id: number | null, code: Code, message: string): void {
    this.ctx.metrics.errors.inc({ code, transport: 'ws' });
    this.send({ t: 'err', id, code, message });
  }

  private send(frame: Record<string, unknown>): void {
    // (ws counts what is sent after a close began in bufferedAmount without keeping it)
    if (this.closed || this.ws.readyState !== this.ws.OPEN) return;
    let bytes: Uint8Array;
    try {
      bytes = encodeFrame(frame);
    } catch (e) {
      // A value from a sandbox that cannot be encoded (too deep): that request ends with
      // `internal`, the session goes on (this ran in promise callbacks: a throw here was fatal).
      this.ctx.log(`ws: a ${String(frame.t)} frame for request ${String(frame.id)} could not be encoded: ${(e as Error).message}`);
      if (frame.t === 'err' || typeof frame.id !== 'number') return;
      const entry = this.open.get(frame.id);
      if (entry) {
        this.open.delete(frame.id);
        entry.call?.cancel();
      } else if (frame.t !== 'res') return; // (an event of a request that already ended)
      bytes = encodeFrame({ t: 'err', id: frame.id, code: 'internal', message: 'the answer could not be encoded (logged by the server)' });
    }
    this.ws.send(bytes, { binary: true });
    this.outlet.wrote(bytes.length);
  }

  /**
   * The client reads slower than its sandboxes stream (the server's budget of
   * unsent bytes, unsent.ts): rather than hold more, end the session and cancel
   * its requests. The close frame waits behind what is unsent, so the socket
   * goes 1 s later whatever the client does.
   */
  private cut(why: string): void {
    this.ctx.log(`ws: closing a session: ${why} (client too slow)`);
    this.cancelAll();
    this.ws.close(1008, 'client too slow: too much unsent');
    setTimeout(() => this.ws.terminate(), 1000).unref();
  }

  /** Heartbeat: true when the client answered the previous ping (else it is dropped). */
  heartbeat(): boolean {
    // (while the session does not read its client, on purpose, no pong can arrive: the stall
    // rule bounds that time instead)
    if (!this.alive && !this.paused) {
      this.ws.terminate();
      return false;
    }
    this.alive = false;
    this.ws.ping();
    return true;
  }

  private onClose(): void {
    this.outlet.close();
    this.cancelAll();
  }

  /**
   * The client is gone (or going): its agent requests are cancelled so the
   * agents free what they hold; its sandboxes live on until their timeouts
   * (those it was still waiting for go when made: killUnclaimed).
   */
  private cancelAll(): void {
    this.closed = true;
    clearTimeout(this.stallTimer);
    for (const entry of this.open.values()) entry.call?.cancel();
    this.open.clear();
  }
}
