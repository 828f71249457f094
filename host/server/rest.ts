// REST API under /v1/ (JSON; streams as NDJSON), plus /healthz and /metrics.
// The same server operations as the WebSocket (context.ts) and the same agent
// operations, routed as POST /v1/sandboxes/{id}/{op}. In JSON, byte fields are
// base64 strings. Files also have a raw route: GET/PUT /v1/sandboxes/{id}/files.
import type { IncomingMessage, ServerResponse } from 'node:http';
import { Kind, type TSchema } from '@sinclair/typebox';
import { MAX_CHUNK, MAX_FRAME, OPS } from '../../protocol/schema.ts';
import { ROUTED_OPS, type RoutedOpName } from '../../protocol/server-ops.ts';
import { presentedToken, refusedWithoutToken, type TokenAuth } from './auth.ts';
import type { AgentCall } from './bridge.ts';
import type { ServerContext } from './context.ts';
import { ServiceError } from './errors.ts';
import { checkSandboxId, routedArgs, serverArgs } from './validate.ts';
import type { Outlet } from './unsent.ts';

/** How long a sandbox may take none of a raw upload (PUT .../files) before it is ended (as a WebSocket stream's). */
const UPLOAD_STALL_MS = 5000;
const ROUTED = new Set<string>(ROUTED_OPS);

/** Bytes → base64, bigints → numbers (or strings beyond 2^53): what JSON can carry. */
export function toJson(x: unknown): unknown {
  if (x instanceof Uint8Array) return Buffer.from(x.buffer, x.byteOffset, x.byteLength).toString('base64');
  if (typeof x === 'bigint') return Number.isSafeInteger(Number(x)) ? Number(x) : x.toString();
  if (Array.isArray(x)) return x.map(toJson);
  if (typeof x === 'object' && x !== null) {
    const out: Record<string, unknown> = {};
    for (const [k, v] of Object.entries(x)) out[k] = toJson(v);
    return out;
  }
  return x;
}

const BASE64 = /^[A-Za-z0-9+/]*={0,2}$/;

/** Base64 strings → bytes for the top-level byte fields of an operation's arguments. */
function bytesFromJson(schema: TSchema, args: Record<string, unknown>): string | null {
  const props = (schema as { properties?: Record<string, TSchema> }).properties ?? {};
  for (const [k, s] of Object.entries(props)) {
    if (s[Kind] !== 'Uint8Array' || args[k] === undefined) continue;
    const v = args[k];
    if (typeof v !== 'string' || v.length % 4 !== 0 || !BASE64.test(v)) return `field /${k}: expected a base64 string`;
    args[k] = new Uint8Array(Buffer.from(v, 'base64'));
  }
  return null;
}

/** The request's URL, or null when its target is no valid path (e.g. `//[`: new URL throws). */
export function requestUrl(req: IncomingMessage): URL | null {
  try {
    return new URL(req.url ?? '/', 'http://localhost');
  } catch {
    return null;
  }
}

function isObject(x: unknown): x is Record<string, unknown> {
  return typeof x === 'object' && x !== null && !Array.isArray(x);
}

export class RestApi {
  inFlight = 0;
  draining = false;

  constructor(
    private readonly ctx: ServerContext,
    private readonly auth: TokenAuth | null,
    private readonly openapi: object,
  ) {}

  handle(req: IncomingMessage, res: ServerResponse): void {
    const url = requestUrl(req);
    if (!url) {
      this.fail(res, new ServiceError('bad_request', `the request target ${JSON.stringify(req.url)} is not a valid path`));
      return;
    }
    const t0 = performance.now();
    this.inFlight++;
    let label = 'unknown';
    res.on('close', () => {
      this.inFlight--;
      this.ctx.metrics.requestLatency.observe({ op: label, transport: 'http' }, (performance.now() - t0) / 1000);
    });
    this.route(req, res, url, (l) => {
      label = l;
    }).catch((e) => this.fail(res, this.ctx.toServiceError(e)));
  }

  private async route(
    req: IncomingMessage,
    res: ServerResponse,
    url: URL,
    setLabel: (op: string) => void,
  ): Promise<void> {
    const path = url.pathname;
    const method = req.method ?? 'GET';
    if (path === '/healthz') {
      setLabel('healthz');
      return this.json(res, this.draining ? 503 : 200, {
        ok: !this.draining,
        sandboxes: this.ctx.manager.size,
        draining: this.draining,
      });
    }
    if (this.auth && !this.auth.check(presentedToken(req, url))) {
      this.ctx.metrics.authFailures.inc({ transport: 'http' });
      res.setHeader('WWW-Authenticate', 'Bearer');
      throw new ServiceError('unauthorized', 'missing or wrong token: send Authorization: Bearer <token>');
    }
    const refused = this.auth ? null : refusedWithoutToken(req);
    if (refused) throw new ServiceError('permission_denied', refused);
    if (path === '/metrics' && method === 'GET') {
      setLabel('metrics');
      res.writeHead(200, { 'Content-Type': 'text/plain; version=0.0.4; charset=utf-8' });
      res.end(this.ctx.metrics.render());
      return;
    }
    if (path === '/v1/openapi.json' && method === 'GET') {
      setLabel('openapi');
      return this.json(res, 200, this.openapi);
    }
    if (this.draining) throw new ServiceError('shutting_down', 'the server is shutting down');

    const seg = path
      .split('/')
      .slice(1)
      .map((x) => {
        try {
          return decodeURIComponent(x);
        } catch {
          throw new ServiceError('bad_request', `the path segment ${JSON.stringify(x)} is not valid percent-encoding (UTF-8 bytes as %XX)`);
        }
      });
    const allow = (methods: string[]) => {
      if (!methods.includes(method)) {
        res.setHeader('Allow', methods.join(', '));
        throw new ServiceError(
          'bad_request',
          `${method} is not allowed on ${path} (allowed: ${methods.join(', ')})`,
          405,
        );
      }
    };
    if (seg[0] !== 'v1') throw new ServiceError('not_found', `no route ${path}; the API is under /v1/`);

    if (seg[1] === 'templates' && seg.length === 4 && seg[3] === 'fork') {
      allow(['POST']);
      setLabel('sandbox.fork');
      const body = await this.body(req);
      return this.json(res, 200, await this.serverOp('sandbox.fork', { ...body, template: seg[2] }));
    }
    if (seg[1] === 'images' && seg.length === 4 && seg[3] === 'boot') {
      allow(['POST']);
      setLabel('sandbox.boot');
      const body = await this.body(req);
      return this.json(res, 201, await this.serverOp('sandbox.boot', { ...body, image: seg[2] }));
    }
    if (seg[1] !== 'sandboxes') throw new ServiceError('not_found', `no route ${path}`);
    if (seg.length === 2) {
      allow(['GET', 'POST']);
      if (method === 'GET') {
        setLabel('sandbox.list');
        return this.json(res, 200, await this.serverOp('sandbox.list', {}));
      }
      setLabel('sandbox.create');
      return this.json(res, 201, await this.serverOp('sandbox.create', await this.body(req)));
    }
    const id = seg[2] as string;
    const badId = checkSandboxId(id);
    if (badId) throw new ServiceError('bad_request', badId);
    if (seg.length === 3) {
      allow(['GET', 'DELETE']);
      const op = method === 'GET' ? 'sandbox.connect' : 'sandbox.kill';
      setLabel(op);
      return this.json(res, 200, await this.serverOp(op, { sandbox: id }));
    }
    if (seg.length !== 4) throw new ServiceError('not_found', `no route ${path}`);
    const action = seg[3] as string;
    switch (action) {
      case 'timeout':
        allow(['POST']);
        setLabel('sandbox.setTimeout');
        return this.json(res, 200, await this.serverOp('sandbox.setTimeout', { ...(await this.body(req)), sandbox: id }));
      case 'branch':
        allow(['POST']);
        setLabel('sandbox.branch');
        return this.json(res, 200, await this.serverOp('sandbox.branch', { ...(await this.body(req)), sandbox: id }));
      case 'stats':
        allow(['GET']);
        setLabel('sandbox.stats');
        return this.json(res, 200, await this.serverOp('sandbox.stats', { sandbox: id }));
      case 'files':
        allow(['GET', 'PUT']);
        setLabel(method === 'GET' ? 'files.read' : 'files.write');
        return method === 'GET' ? this.readRaw(req, res, id, url) : this.writeRaw(req, res, id, url);
    }
    if (!ROUTED.has(action)) throw new ServiceError('not_found', `no route ${path}`);
    allow(['POST']);
    setLabel(action);
    return this.routed(req, res, id, action as RoutedOpName);
  }

  private async serverOp(op: string, args: Record<string, unknown>): Promise<Record<string, unknown>> {
    const invalid = serverArgs.get(op)?.(args);
    if (invalid) throw new ServiceError('bad_request', invalid);
    return this.ctx.serverOp(op, args);
  }

  private async routed(req: IncomingMessage, res: ServerResponse, id: string, op: RoutedOpName): Promise<void> {
    const def = OPS[op];
    const args = await this.body(req);
    const badBytes = bytesFromJson(def.args, args);
    if (badBytes) throw new ServiceError('bad_request', `${op}: ${badBytes}`);
    if (args.stdinStream || args.stream) {
      throw new ServiceError('bad_request', `${op}: client streams need the WebSocket API (or PUT .../files for file data)`);
    }
    const invalid = routedArgs.get(op)?.(args);
    if (invalid) throw new ServiceError('bad_request', invalid);
    const sb = this.ctx.manager.sandbox(id);
    const hasEvents = Object.keys(def.events).length > 0;
    const ndjson = hasEvents && (req.headers.accept ?? '').includes('application/x-ndjson');
    const events: unknown[] = [];
    let eventChars = 0;
    let tooMuch: ServiceError | null = null;
    let call: AgentCall;
    if (ndjson) {
      res.writeHead(200, { 'Content-Type': 'application/x-ndjson', 'Cache-Control': 'no-store' });
      const outlet = this.unsentOf(res, () => call);
      call = this.ctx.callAgent(sb, op, args, (ev) => {
        if (res.destroyed) return;
        const line = `${JSON.stringify(toJson(ev))}\n`;
        res.write(line);
        outlet.wrote(Buffer.byteLength(line));
      });
    } else {
      // One JSON answer holds every event: at most MAX_FRAME of them (a command's output grew
      // the server's memory without bound); beyond, the request ends and says how to stream.
      call = this.ctx.callAgent(sb, op, args, (ev) => {
        if (tooMuch) return;
        const json = toJson(ev);
        eventChars += JSON.stringify(json).length;
        if (eventChars > MAX_FRAME) {
          tooMuch = new ServiceError(
            'resource_exhausted',
            `${op}: its output is over ${MAX_FRAME} bytes, more than one JSON answer holds; send Accept: application/x-ndjson to stream it`,
          );
          events.length = 0;
          call.cancel();
          return;
        }
        events.push(json);
      });
    }
    const onGone = () => call.cancel();
    res.on('close', onGone);
    try {
      const result = await call.done.catch((e: unknown) => {
        throw tooMuch ?? e;
      });
      if (tooMuch) throw tooMuch;
      if (ndjson) res.end(`${JSON.stringify({ result: toJson(result) })}\n`);
      else this.json(res, 200, hasEvents ? { ...result, events } : result);
    } catch (e) {
      const se = this.ctx.toServiceError(e);
      if (ndjson) {
        this.ctx.metrics.errors.inc({ code: se.code, transport: 'http' });
        res.end(`${JSON.stringify({ error: { code: se.code, message: se.message } })}\n`);
      } else throw se;
    } finally {
      res.off('close', onGone);
    }
  }

  /**
   * What an answer holds unsent, in the server's budget (unsent.ts) until the
   * response closes; one the budget cuts loses its connection and its request
   * (`call()`, if it still runs) is cancelled.
   */
  private unsentOf(res: ServerResponse, call: () => AgentCall | undefined): Outlet {
    const outlet = this.ctx.unsent.open(
      () => res.writableLength,
      (why) => {
        this.ctx.log(`http: cutting off an answer: ${why} (client too slow)`);
        call()?.cancel();
        res.destroy();
      },
    );
    if (res.closed) outlet.close();
    else res.once('close', () => outlet.close());
    return outlet;
  }

  private async readRaw(_req: IncomingMessage, res: ServerResponse, id: string, url: URL): Promise<void> {
    const args: Record<string, unknown> = { path: url.searchParams.get('path') ?? undefined };
    for (const k of ['offset', 'length']) {
      const v = url.searchParams.get(k);
      if (v !== null) {
        if (!/^\d+$/.test(v)) throw new ServiceError('bad_request', `query ${k}: expected a non-negative integer`);
        args[k] = Number(v);
      }
    }
    const invalid = routedArgs.get('files.read')?.(args);
    if (invalid) throw new ServiceError('bad_request', invalid.replace('files.read: /path:', 'query path:'));
    const sb = this.ctx.manager.sandbox(id);
    let call: AgentCall | undefined;
    const outlet = this.unsentOf(res, () => call);
    call = this.ctx.callAgent(sb, 'files.read', args, (ev) => {
      if (ev.ev !== 'chunk' || !(ev.data instanceof Uint8Array) || res.destroyed) return;
      if (!res.headersSent) res.writeHead(200, { 'Content-Type': 'application/octet-stream' });
      res.write(ev.data);
      outlet.wrote(ev.data.length);
    });
    const onGone = () => call.cancel();
    res.on('close', onGone);
    try {
      await call.done;
      if (!res.headersSent) res.writeHead(200, { 'Content-Type': 'application/octet-stream' });
      res.end();
    } catch (e) {
      if (!res.headersSent) throw e;
      res.destroy(); // headers are out: a cut connection is the only honest way to say the body is incomplete
    } finally {
      res.off('close', onGone);
    }
  }

  private async writeRaw(req: IncomingMessage, res: ServerResponse, id: string, url: URL): Promise<void> {
    const args: Record<string, unknown> = { path: url.searchParams.get('path') ?? undefined, stream: true, mkdirs: true };
    if (url.searchParams.get('append') === 'true' || url.searchParams.get('append') === '1') args.append = true;
    const mode = url.searchParams.get('mode');
    if (mode !== null) {
      if (!/^[0-7]{1,4}$/.test(mode)) throw new ServiceError('bad_request', 'query mode: expected octal digits, e.g. 644');
      args.mode = Number.parseInt(mode, 8);
    }
    const invalid = routedArgs.get('files.write')?.(args);
    if (invalid) throw new ServiceError('bad_request', invalid.replace('files.write: /path:', 'query path:'));
    const sb = this.ctx.manager.sandbox(id);
    const call = this.ctx.callAgent(sb, 'files.write', args, () => {});
    let failed = false;
    call.done.catch(() => {
      failed = true;
    });
    // As on a WebSocket: an agent that takes none of the upload for UPLOAD_STALL_MS ends it.
    let stalled: string | null = null;
    let stallTimer: NodeJS.Timeout | undefined;
    req.on('data', (chunk: Buffer) => {
      if (failed) return;
      let sent: Promise<void> = Promise.resolve();
      for (let off = 0; off < chunk.length; off += MAX_CHUNK) {
        sent = call.send('data', { data: new Uint8Array(chunk.subarray(off, off + MAX_CHUNK)) });
      }
      // Read no more of the body until the agent's connection takes more: an agent that
      // stops reading must not make the server hold the upload.
      req.pause();
      clearTimeout(stallTimer);
      stallTimer = setTimeout(() => {
        stalled = `files.write: the sandbox took none of this upload for ${UPLOAD_STALL_MS / 1000} s`;
        call.cancel();
      }, UPLOAD_STALL_MS);
      void sent.then(() => {
        clearTimeout(stallTimer);
        req.resume();
      });
    });
    req.on('end', () => {
      if (!failed) call.send('end', {});
    });
    req.on('aborted', () => call.cancel());
    try {
      const result = await call.done;
      this.json(res, 200, result);
    } catch (e) {
      clearTimeout(stallTimer);
      req.resume();
      if (stalled) throw new ServiceError('resource_exhausted', stalled);
      throw e;
    }
  }

  /** The JSON body as an object ({} when empty); at most MAX_FRAME bytes. */
  private async body(req: IncomingMessage): Promise<Record<string, unknown>> {
    const chunks: Buffer[] = [];
    let size = 0;
    try {
      for await (const c of req) {
        size += (c as Buffer).length;
        if (size > MAX_FRAME) {
          // Read on (up to a cap) so the client gets to see the 413 rather than a reset.
          if (size > 4 * MAX_FRAME) req.destroy();
          continue;
        }
        chunks.push(c as Buffer);
      }
    } catch (e) {
      if (size <= MAX_FRAME) throw new ServiceError('bad_request', `the request body was cut off: ${(e as Error).message}`);
    }
    if (size > MAX_FRAME) throw new ServiceError('frame_too_large', `request body above ${MAX_FRAME} bytes`);
    if (size === 0) return {};
    let v: unknown;
    try {
      v = JSON.parse(Buffer.concat(chunks).toString('utf8'));
    } catch (e) {
      throw new ServiceError('bad_request', `the body is not JSON: ${(e as Error).message}`);
    }
    if (!isObject(v)) throw new ServiceError('bad_request', 'the body must be a JSON object');
    return v;
  }

  private json(res: ServerResponse, status: number, body: unknown): void {
    const text = JSON.stringify(toJson(body));
    res.writeHead(status, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(text) });
    res.end(text);
    // (up to MAX_FRAME of events: held until the client reads it, so in the budget like a streamed one)
    if (res.writableLength > 0) this.unsentOf(res, () => undefined).wrote(Buffer.byteLength(text));
  }

  private fail(res: ServerResponse, e: ServiceError): void {
    this.ctx.metrics.errors.inc({ code: e.code, transport: 'http' });
    if (res.headersSent) {
      res.destroy();
      return;
    }
    this.json(res, e.status, { error: { code: e.code, message: e.message } });
  }
}
