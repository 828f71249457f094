// What the WebSocket sessions and the REST handlers share: the manager, the
// metrics, the limits, and the server operations themselves (one
// implementation behind both transports).
import { packageVersion } from '../version.ts';
import { ERROR_CODES, MAX_CHUNK, MAX_FRAME, PROTOCOL_VERSION } from '../../protocol/schema.ts';
import { ROUTED_OPS, SERVER_ERROR_CODES, SERVER_OPS, type ServerOpArgs } from '../../protocol/server-ops.ts';
import type { CallAgent } from './bridge.ts';
import { type Code, ServiceError } from './errors.ts';
import type { SandboxManager } from './manager.ts';
import type { ServerMetrics } from './telemetry.ts';
import { UnsentBudget } from './unsent.ts';

export interface ServerContext {
  readonly manager: SandboxManager;
  readonly metrics: ServerMetrics;
  readonly maxInFlight: number;
  readonly serverName: string;
  /** Bytes held for clients that have not read them yet, over all sessions and responses. */
  readonly unsent: UnsentBudget;
  log(line: string): void;
  serverOp(op: string, args: Record<string, unknown>): Promise<Record<string, unknown>>;
  callAgent: CallAgent;
  toServiceError(e: unknown): ServiceError;
}

const KNOWN_CODES = new Set<string>([...ERROR_CODES, ...SERVER_ERROR_CODES]);


export function createContext(opts: {
  manager: SandboxManager;
  metrics: ServerMetrics;
  maxInFlight: number;
  callAgent: CallAgent;
  log: (line: string) => void;
  /** The server's budget of bytes unsent to clients (default 1 GiB). */
  maxUnsentBytes?: number;
  /** How long an outlet may send nothing before it is cut (default 60 s; unsent.ts). */
  unsentStallMs?: number;
}): ServerContext {
  const { manager, maxInFlight, log } = opts;
  const serverName = `forkling/${packageVersion()}`;

  async function serverOp(op: string, args: Record<string, unknown>): Promise<Record<string, unknown>> {
    switch (op) {
      case 'hello': {
        const a = args as ServerOpArgs<'hello'>;
        if (!a.versions.includes(PROTOCOL_VERSION)) {
          throw new ServiceError(
            'unsupported_version',
            `this server speaks protocol version ${PROTOCOL_VERSION}, the client offered ${a.versions.join(', ')}`,
          );
        }
        return {
          version: PROTOCOL_VERSION,
          server: serverName,
          engine: manager.engine.name,
          limits: { maxFrame: MAX_FRAME, maxChunk: MAX_CHUNK, maxInFlight },
          ops: Object.keys(SERVER_OPS),
          routedOps: [...ROUTED_OPS],
        };
      }
      case 'ping':
        return { time: Date.now() / 1000 };
      case 'sandbox.create': {
        const a = args as ServerOpArgs<'sandbox.create'>;
        return { sandbox: await manager.create(a.template ?? 'default', a.timeoutMs) };
      }
      case 'sandbox.boot': {
        const a = args as ServerOpArgs<'sandbox.boot'>;
        return { sandbox: await manager.boot(a.image ?? 'default', a) };
      }
      case 'sandbox.fork': {
        const a = args as ServerOpArgs<'sandbox.fork'>;
        return { sandboxes: await manager.fork(a.template, a.n, a.timeoutMs) };
      }
      case 'sandbox.branch': {
        const a = args as ServerOpArgs<'sandbox.branch'>;
        return { sandboxes: await manager.branch(a.sandbox, a.n, a.timeoutMs) };
      }
      case 'sandbox.list':
        return { sandboxes: manager.list() };
      case 'sandbox.connect':
        return { sandbox: manager.get((args as ServerOpArgs<'sandbox.connect'>).sandbox) };
      case 'sandbox.kill':
        return { killed: await manager.kill((args as ServerOpArgs<'sandbox.kill'>).sandbox) };
      case 'sandbox.setTimeout': {
        const a = args as ServerOpArgs<'sandbox.setTimeout'>;
        return { sandbox: manager.setTimeout(a.sandbox, a.timeoutMs) };
      }
      case 'sandbox.stats':
        return await manager.stats((args as ServerOpArgs<'sandbox.stats'>).sandbox);
      default:
        throw new ServiceError('unknown_op', `unknown operation ${JSON.stringify(op)}`);
    }
  }

  function toServiceError(e: unknown): ServiceError {
    if (e instanceof ServiceError) return e;
    const maybe = e as { code?: unknown; message?: unknown } | null;
    if (maybe && typeof maybe.code === 'string' && KNOWN_CODES.has(maybe.code) && typeof maybe.message === 'string') {
      return new ServiceError(maybe.code as Code, maybe.message);
    }
    log(`internal error: ${e instanceof Error ? (e.stack ?? e.message) : String(e)}`);
    return new ServiceError('internal', 'internal server error (logged by the server)');
  }

  return {
    manager,
    metrics: opts.metrics,
    maxInFlight,
    serverName,
    unsent: new UnsentBudget(opts.maxUnsentBytes, { ...(opts.unsentStallMs !== undefined ? { stallMs: opts.unsentStallMs } : {}) }),
    log,
    serverOp,
    callAgent: opts.callAgent,
    toServiceError,
  };
}
