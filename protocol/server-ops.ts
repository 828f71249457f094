// Server-level operations of `forkling serve` (WebSocket /v1/ws and REST /v1/).
// Same frames and the same TypeBox style as protocol/schema.ts; this module
// only adds what the server itself answers (sandbox lifecycle) and the list of
// agent operations it routes to a sandbox when the request carries `sandbox`.
// PROTOCOL.md, section "Server operations", is the prose of this module.
//
// Browser-safe: imports only TypeBox and the agent schema.
import { type Static, type TSchema, Type } from '@sinclair/typebox';
import { MAX_CHUNK, MAX_FRAME, type OpName } from './schema.ts';

/** Most sandboxes one fork/branch request may ask for. */
export const MAX_FORK_N = 256;
/** Longest sandbox timeout the protocol accepts (a server may set a lower cap). */
export const MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000;
/** Default requests one client connection may have open at once (the server says its value in hello). */
export const DEFAULT_MAX_IN_FLIGHT = 256;

export const SandboxIdSchema = Type.String({ minLength: 1, maxLength: 128, pattern: '^[A-Za-z0-9._-]+$' });
export const TemplateNameSchema = Type.String({ minLength: 1, maxLength: 64, pattern: '^[A-Za-z0-9._-]+$' });
const TimeoutMs = Type.Integer({ minimum: 1, maximum: MAX_TIMEOUT_MS });
const Count = Type.Integer({ minimum: 1, maximum: MAX_FORK_N });

export const SandboxInfoSchema = Type.Object({
  id: Type.String(),
  /** Template it was forked from (branches inherit their source's). */
  template: Type.Union([Type.String(), Type.Null()]),
  /** The sandbox it was branched from, or null. */
  parent: Type.Union([Type.String(), Type.Null()]),
  engine: Type.String(),
  state: Type.Union([Type.Literal('running'), Type.Literal('paused')]),
  /** Unix epoch milliseconds. */
  createdAt: Type.Number(),
  /** When the server kills it unless the timeout is extended (epoch ms). */
  expiresAt: Type.Number(),
  timeoutMs: Type.Integer(),
});
export type SandboxInfo = Static<typeof SandboxInfoSchema>;

const One = Type.Object({ sandbox: SandboxInfoSchema });
const Many = Type.Object({ sandboxes: Type.Array(SandboxInfoSchema) });

interface ServerOpDef {
  args: TSchema;
  result: TSchema;
}
const sop = <A extends TSchema, R extends TSchema>(args: A, result: R) => ({ args, result }) satisfies ServerOpDef;

export const SERVER_OPS = {
  hello: sop(
    Type.Object({
      versions: Type.Array(Type.Integer({ minimum: 1, maximum: 65535 }), { minItems: 1, maxItems: 16 }),
      client: Type.Optional(Type.String({ maxLength: 256 })),
    }),
    Type.Object({
      version: Type.Integer(),
      server: Type.String(),
      engine: Type.String(),
      limits: Type.Object({ maxFrame: Type.Integer(), maxChunk: Type.Integer(), maxInFlight: Type.Integer() }),
      /** Server operations, then the agent operations it routes. */
      ops: Type.Array(Type.String()),
      routedOps: Type.Array(Type.String()),
    }),
  ),
  ping: sop(Type.Object({}), Type.Object({ time: Type.Number() })),
  'sandbox.create': sop(
    Type.Object({ template: Type.Optional(TemplateNameSchema), timeoutMs: Type.Optional(TimeoutMs) }),
    One,
  ),
  /** A cold boot of an image (no template): slower than a fork; what engines without templates offer. */
  'sandbox.boot': sop(
    Type.Object({
      image: Type.Optional(TemplateNameSchema),
      memoryMiB: Type.Optional(Type.Integer({ minimum: 64, maximum: 1024 * 1024 })),
      vcpus: Type.Optional(Type.Integer({ minimum: 1, maximum: 64 })),
      timeoutMs: Type.Optional(TimeoutMs),
    }),
    One,
  ),
  'sandbox.fork': sop(
    Type.Object({ template: TemplateNameSchema, n: Count, timeoutMs: Type.Optional(TimeoutMs) }),
    Many,
  ),
  'sandbox.branch': sop(
    Type.Object({ sandbox: SandboxIdSchema, n: Count, timeoutMs: Type.Optional(TimeoutMs) }),
    Many,
  ),
  'sandbox.list': sop(Type.Object({}), Many),
  'sandbox.connect': sop(Type.Object({ sandbox: SandboxIdSchema }), One),
  'sandbox.kill': sop(Type.Object({ sandbox: SandboxIdSchema }), Type.Object({ killed: Type.Boolean() })),
  'sandbox.setTimeout': sop(Type.Object({ sandbox: SandboxIdSchema, timeoutMs: TimeoutMs }), One),
  'sandbox.stats': sop(
    Type.Object({ sandbox: SandboxIdSchema }),
    Type.Object({ privateKiB: Type.Integer(), counters: Type.Record(Type.String(), Type.Number()) }),
  ),
} as const;

export type ServerOpName = keyof typeof SERVER_OPS;
export type ServerOpArgs<O extends ServerOpName> = Static<(typeof SERVER_OPS)[O]['args']>;
export type ServerOpResult<O extends ServerOpName> = Static<(typeof SERVER_OPS)[O]['result']>;

/**
 * Agent operations a client may send through the server, with `sandbox: <id>`
 * added to the request. `hello`, `restore` and `shutdown` stay between the host
 * and its agents (the server says hello itself; `sandbox.kill` ends a sandbox).
 */
export const ROUTED_OPS = [
  'ping',
  'info',
  'eval',
  'context.list',
  'context.delete',
  'exec',
  'proc.list',
  'proc.wait',
  'proc.write',
  'proc.closeStdin',
  'proc.signal',
  'proc.kill',
  'files.read',
  'files.write',
  'files.list',
  'files.stat',
  'files.exists',
  'files.mkdir',
  'files.remove',
  'files.rename',
] as const satisfies readonly OpName[];
export type RoutedOpName = (typeof ROUTED_OPS)[number];

/**
 * Error codes the server adds to the agent's (protocol/schema.ts ERROR_CODES).
 * `unauthorized`: missing or wrong bearer token (HTTP 401; on WebSocket the
 * upgrade itself is refused). `too_many_requests`: the connection already has
 * its maximum of open requests. `sandbox_ended`: the sandbox existed but has
 * ended (timeout, kill, crash); the message says why. `unavailable`: the
 * server cannot take more sandboxes now (max sandboxes, memory).
 */
export const SERVER_ERROR_CODES = ['unauthorized', 'too_many_requests', 'sandbox_ended', 'unavailable'] as const;
export type ServerErrorCode = (typeof SERVER_ERROR_CODES)[number];

export const SERVER_LIMITS = { maxFrame: MAX_FRAME, maxChunk: MAX_CHUNK };

/** WebSocket subprotocol the server selects; a second offered subprotocol `forkling.bearer.<token>` carries the token from browsers. */
export const WS_SUBPROTOCOL = 'forkling.v1';
export const WS_TOKEN_PREFIX = 'forkling.bearer.';
