// The HTTP(S) server of `forkling serve`: REST under /v1/, /healthz, /metrics,
// and the WebSocket endpoint /v1/ws, authenticated at the upgrade (a refused
// upgrade is answered with a plain HTTP 401 and never becomes a WebSocket).
import { readFileSync } from 'node:fs';
import { createServer as createHttpServer, type IncomingMessage, type Server } from 'node:http';
import { createServer as createHttpsServer } from 'node:https';
import type { AddressInfo } from 'node:net';
import type { Duplex } from 'node:stream';
import { WebSocketServer } from 'ws';
import { MAX_FRAME } from '../../protocol/schema.ts';
import { WS_SUBPROTOCOL } from '../../protocol/server-ops.ts';
import { presentedToken, refusedWithoutToken, type TokenAuth } from './auth.ts';
import type { ServerContext } from './context.ts';
import { memAvailableBytesSync } from './meminfo.ts';
import { buildOpenApi } from './openapi.ts';
import { RestApi, requestUrl } from './rest.ts';
import { WsSession } from './ws-session.ts';

export interface ServerOptions {
  ctx: ServerContext;
  /** Null: no authentication (only allowed on loopback; the CLI enforces that). */
  auth: TokenAuth | null;
  tls?: { certFile: string; keyFile: string };
  /** How often each session is pinged; one that answered none of the previous ping is dropped (default 30 s). */
  heartbeatMs?: number;
}

/**
 * Frames above MAX_FRAME get an error frame and the session goes on; a
 * WebSocket message above this hard cap is not even buffered: ws closes the
 * socket with 1009 (message too big), which is the only way to refuse it.
 */
export const WS_HARD_CAP = 2 * MAX_FRAME;
const HEARTBEAT_MS = 30_000;

/** Error code and HTTP reason of each status an upgrade is refused with. */
const UPGRADE_REFUSALS = {
  400: ['bad_request', 'Bad Request'],
  401: ['unauthorized', 'Unauthorized'],
  403: ['permission_denied', 'Forbidden'],
  404: ['not_found', 'Not Found'],
  503: ['shutting_down', 'Service Unavailable'],
} as const;

export class ForklingServer {
  readonly http: Server;
  private readonly wss: WebSocketServer;
  private readonly sessions = new Set<WsSession>();
  private readonly rest: RestApi;
  private draining = false;
  private readonly heartbeat: NodeJS.Timeout;

  constructor(private readonly opts: ServerOptions) {
    const { ctx } = opts;
    this.rest = new RestApi(ctx, opts.auth, buildOpenApi());
    const handler = (req: IncomingMessage, res: import('node:http').ServerResponse) => this.rest.handle(req, res);
    this.http = opts.tls
      ? createHttpsServer({ cert: readFileSync(opts.tls.certFile), key: readFileSync(opts.tls.keyFile) }, handler)
      : createHttpServer(handler);
    this.http.keepAliveTimeout = 30_000;
    this.wss = new WebSocketServer({
      noServer: true,
      maxPayload: WS_HARD_CAP,
      perMessageDeflate: false,
      handleProtocols: (protocols) => (protocols.has(WS_SUBPROTOCOL) ? WS_SUBPROTOCOL : false),
    });
    this.http.on('upgrade', (req, socket, head) => this.onUpgrade(req, socket, head));
    // Half-open TCP connections (a client that vanished) are found by ping/pong.
    this.heartbeat = setInterval(() => {
      for (const s of this.sessions) if (!s.heartbeat()) this.sessions.delete(s);
    }, opts.heartbeatMs ?? HEARTBEAT_MS);
    this.heartbeat.unref();
    this.http.on('clientError', (_e, socket) => {
      if (socket.writable) socket.end('HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n');
    });

    const m = ctx.metrics;
    m.gauge('forkling_sandboxes', 'Sandboxes by state (starting: asked of the engine, not ready yet).', () => [
      [{ state: 'running' }, ctx.manager.size],
      [{ state: 'starting' }, ctx.manager.starting],
    ]);
    m.gauge('forkling_ws_connections', 'Open WebSocket sessions.', () => [[{}, this.sessions.size]]);
    m.gauge('forkling_requests_in_flight', 'Requests open right now, by transport.', () => [
      [{ transport: 'ws' }, this.wsInFlight()],
      [{ transport: 'http' }, this.rest.inFlight],
    ]);
    m.gauge('forkling_sandbox_private_memory_bytes', 'Private memory of all sandboxes (last sample).', () => [
      [{}, ctx.manager.privateKiB * 1024],
    ]);
    m.gauge('forkling_server_resident_memory_bytes', 'Resident memory of the server process.', () => [
      [{}, process.memoryUsage.rss()],
    ]);
    m.gauge('forkling_host_memory_available_bytes', 'MemAvailable of the host.', () => {
      const v = memAvailableBytesSync();
      return v === null ? [] : [[{}, v]];
    });
    m.gauge('forkling_draining', '1 while the server drains for shutdown.', () => [[{}, this.draining ? 1 : 0]]);
  }

  /** Listens; resolves with the bound address (port 0 picks a free port). */
  listen(host: string, port: number): Promise<{ host: string; port: number; url: string }> {
    return new Promise((resolve, reject) => {
      this.http.once('error', reject);
      this.http.listen(port, host, () => {
        this.http.off('error', reject);
        const a = this.http.address() as AddressInfo;
        const h = a.family === 'IPv6' ? `[${a.address}]` : a.address;
        resolve({ host: a.address, port: a.port, url: `${this.opts.tls ? 'https' : 'http'}://${h}:${a.port}` });
      });
    });
  }

  /**
   * Drain: stop taking connections and requests, give open requests up to
   * `drainMs` to finish, close every session, kill every sandbox, close the engine.
   */
  async shutdown(drainMs = 10_000): Promise<void> {
    if (this.draining) return;
    this.draining = true;
    this.rest.draining = true;
    this.opts.ctx.manager.beginDrain();
    this.http.close();
    clearInterval(this.heartbeat);
    const until = Date.now() + drainMs;
    while (this.wsInFlight() + this.rest.inFlight > 0 && Date.now() < until) {
      await new Promise((r) => setTimeout(r, 20));
    }
    for (const s of this.sessions) s.close(1001, 'server shutting down');
    this.http.closeAllConnections();
    await this.opts.ctx.manager.close();
  }

  private wsInFlight(): number {
    let n = 0;
    for (const s of this.sessions) n += s.inFlight;
    return n;
  }

  private onUpgrade(req: IncomingMessage, socket: Duplex, head: Buffer): void {
    socket.on('error', () => {});
    const refuse = (status: keyof typeof UPGRADE_REFUSALS, text: string) => {
      const [code, reason] = UPGRADE_REFUSALS[status];
      const body = JSON.stringify({ error: { code, message: text } });
      socket.end(
        `HTTP/1.1 ${status} ${reason}\r\n` +
          `Content-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n` +
          (status === 401 ? 'WWW-Authenticate: Bearer\r\n' : '') +
          `\r\n${body}`,
      );
    };
    const url = requestUrl(req);
    if (!url) {
      refuse(400, `the request target ${JSON.stringify(req.url)} is not a valid path; use /v1/ws`);
      return;
    }
    if (url.pathname !== '/v1/ws') {
      refuse(404, `no WebSocket endpoint at ${url.pathname}; use /v1/ws`);
      return;
    }
    if (this.draining) {
      refuse(503, 'the server is shutting down');
      return;
    }
    const { auth } = this.opts;
    if (auth && !auth.check(presentedToken(req, url))) {
      this.opts.ctx.metrics.authFailures.inc({ transport: 'ws' });
      refuse(
        401,
        'missing or wrong token: send Authorization: Bearer <token>, the subprotocol forkling.bearer.<token>, or ?token=<token>',
      );
      return;
    }
    const refused = auth ? null : refusedWithoutToken(req);
    if (refused) {
      refuse(403, refused);
      return;
    }
    this.wss.handleUpgrade(req, socket, head, (ws) => {
      const session = new WsSession(ws, this.opts.ctx);
      this.sessions.add(session);
      ws.on('close', () => this.sessions.delete(session));
    });
  }
}
