// The one schema source of the forkling wire protocol (v1). TypeScript types
// come from it (Static<>), the TypeScript side validates with it, and
// protocol/gen.ts writes it as JSON Schema into protocol/schema.json and into
// the Python agent, which validates with the same document. PROTOCOL.md is the
// prose description of the same thing; change both together.
//
// Browser-safe: imports only TypeBox.
import { type Static, type TSchema, Type } from '@sinclair/typebox';

export const PROTOCOL_VERSION = 1;
/** Largest msgpack payload of one frame, in bytes (the 4-byte prefix not counted). */
export const MAX_FRAME = 16 * 1024 * 1024;
/** Largest `data` of one chunk event (file data, process output). */
export const MAX_CHUNK = 1024 * 1024;
/** Longest eval source accepted. */
export const MAX_CODE = 4 * 1024 * 1024;

const Id = Type.Integer({ minimum: 0, maximum: 0xffffffff });
const Name = Type.String({ minLength: 1, maxLength: 256 });
const Path = Type.String({ minLength: 1, maxLength: 4096 });
const Bytes = (maxByteLength = MAX_CHUNK) => Type.Uint8Array({ maxByteLength });
const Ms = Type.Integer({ minimum: 0, maximum: 365 * 24 * 3600 * 1000 });
const Nullable = <T extends TSchema>(t: T) => Type.Union([t, Type.Null()]);

// ---------------------------------------------------------------- envelopes

export const RequestFrame = Type.Object({ t: Type.Literal('req'), id: Id, op: Type.String({ minLength: 1, maxLength: 64 }) });
export const ResponseFrame = Type.Object({ t: Type.Literal('res'), id: Id });
export const EventFrame = Type.Object({ t: Type.Literal('ev'), id: Id, ev: Type.String({ minLength: 1, maxLength: 64 }) });
export const ErrorFrame = Type.Object({
  t: Type.Literal('err'),
  id: Nullable(Id),
  code: Type.String({ minLength: 1, maxLength: 64 }),
  message: Type.String({ maxLength: 65536 }),
});
export const CancelFrame = Type.Object({ t: Type.Literal('cancel'), id: Id });

/** Events a client may send on one of its open requests (streamed stdin / file data). */
export const ClientEvents = {
  data: Type.Object({ data: Bytes() }),
  end: Type.Object({}),
};

// ---------------------------------------------------------------- shared shapes

const ExceptionInfo = Type.Object({
  type: Type.String(),
  message: Type.String(),
  traceback: Type.String(),
});
const ExitInfo = {
  procId: Type.String(),
  pid: Type.Integer(),
  exitCode: Nullable(Type.Integer()),
  signal: Nullable(Type.String()),
};
const FileType = Type.Union([
  Type.Literal('file'),
  Type.Literal('dir'),
  Type.Literal('symlink'),
  Type.Literal('other'),
]);
const StatInfo = {
  type: FileType,
  size: Type.Integer({ minimum: 0 }),
  mode: Type.Integer({ minimum: 0 }),
  mtime: Type.Number(),
};
const Done = Type.Object({ done: Type.Boolean() });
const OutputEvents = {
  stdout: Type.Object({ data: Bytes() }),
  stderr: Type.Object({ data: Bytes() }),
};
const TextOutputEvents = {
  stdout: Type.Object({ data: Type.String() }),
  stderr: Type.Object({ data: Type.String() }),
};

/** One operation: its request fields, its response fields, the events it streams. */
interface OpDef {
  args: TSchema;
  result: TSchema;
  events: Record<string, TSchema>;
  /** The client may send `data`/`end` events on this request. */
  clientStream?: boolean;
}

const op = <A extends TSchema, R extends TSchema, E extends Record<string, TSchema> = Record<never, TSchema>>(
  args: A,
  result: R,
  events?: E,
  clientStream = false,
) => ({ args, result, events: (events ?? {}) as E, clientStream }) satisfies OpDef;

// Process engine only (guest-agent/forkling_zygote.py): fork() of the warm
// agent. `fork` is answered by a zygote, `branch` by a running sandbox; each
// child is ready (listening on its own socket) when its entry has ok: true.
// No children: a zygote freezes its template and starts its fork server (the
// engine's prepare), a sandbox does nothing.
const ForkArgs = Type.Object({
  children: Type.Array(
    Type.Object({ id: Type.String({ minLength: 1, maxLength: 32 }), hostname: Type.String({ minLength: 1, maxLength: 63 }) }),
    { minItems: 0, maxItems: 1024 },
  ),
});
// A branch's children are charged to the source's cgroup until the host
// moves them to their own. With hold, each child waits (for the host's signal
// once it has moved it) before it copies the source's writable layer, and the
// source tells the host each child's pid as soon as it is forked.
const BranchArgs = Type.Composite([ForkArgs, Type.Object({ hold: Type.Optional(Type.Boolean()) })]);
const BranchEvents = { forked: Type.Object({ child: Type.String(), pid: Type.Integer() }) };
const ForkResult = Type.Object({
  children: Type.Array(
    Type.Object({
      id: Type.String(),
      ok: Type.Boolean(),
      pid: Type.Optional(Type.Integer()),
      setupMs: Type.Optional(Type.Number()),
      error: Type.Optional(Type.String()),
    }),
  ),
});

// ---------------------------------------------------------------- operations

export const OPS = {
  hello: op(
    Type.Object({
      versions: Type.Array(Type.Integer({ minimum: 1, maximum: 65535 }), { minItems: 1, maxItems: 16 }),
      client: Type.Optional(Type.String({ maxLength: 256 })),
    }),
    Type.Object({
      version: Type.Integer(),
      agent: Type.String(),
      python: Type.String(),
      pid: Type.Integer(),
      sandboxId: Nullable(Type.String()),
      limits: Type.Object({ maxFrame: Type.Integer(), maxChunk: Type.Integer() }),
      ops: Type.Array(Type.String()),
    }),
  ),
  ping: op(Type.Object({}), Type.Object({ time: Type.Number() })),
  info: op(
    Type.Object({ modules: Type.Optional(Type.Boolean()) }),
    Type.Object({
      agent: Type.String(),
      version: Type.Integer(),
      python: Type.String(),
      pid: Type.Integer(),
      pid1: Type.Boolean(),
      uptime: Type.Number(),
      sandboxId: Nullable(Type.String()),
      hostname: Type.String(),
      moduleCount: Type.Integer(),
      modules: Type.Optional(Type.Array(Type.String())),
      memory: Type.Object({
        rss: Type.Integer(),
        total: Nullable(Type.Integer()),
        available: Nullable(Type.Integer()),
      }),
      contexts: Type.Array(Type.String()),
      procs: Type.Integer(),
      connections: Type.Integer(),
    }),
  ),
  // Host-only: whether anything in the sandbox would run without input (the KVM engine's doze).
  quiet: op(Type.Object({}), Type.Object({ quiet: Type.Boolean(), busy: Nullable(Type.String()) })),
  eval: op(
    Type.Object({
      code: Type.String({ maxLength: MAX_CODE }),
      context: Type.Optional(Name),
      timeoutMs: Type.Optional(Ms),
    }),
    Type.Object({
      value: Type.Optional(Type.Unknown()),
      repr: Type.String(),
      type: Type.String(),
      exception: Type.Optional(ExceptionInfo),
      timedOut: Type.Boolean(),
      durationMs: Type.Number(),
    }),
    TextOutputEvents,
  ),
  'context.list': op(Type.Object({}), Type.Object({ contexts: Type.Array(Type.String()) })),
  'context.delete': op(Type.Object({ context: Name }), Type.Object({ deleted: Type.Boolean() })),
  exec: op(
    Type.Object({
      argv: Type.Optional(Type.Array(Type.String({ maxLength: 131072 }), { minItems: 1, maxItems: 65536 })),
      shell: Type.Optional(Type.String({ maxLength: 131072 })),
      env: Type.Optional(Type.Record(Type.String(), Type.String())),
      clearEnv: Type.Optional(Type.Boolean()),
      cwd: Type.Optional(Path),
      stdin: Type.Optional(Bytes()),
      stdinStream: Type.Optional(Type.Boolean()),
      timeoutMs: Type.Optional(Ms),
      background: Type.Optional(Type.Boolean()),
    }),
    Type.Object({ ...ExitInfo, timedOut: Type.Boolean(), durationMs: Type.Number() }),
    { started: Type.Object({ procId: Type.String(), pid: Type.Integer() }), ...OutputEvents },
    true,
  ),
  'proc.list': op(
    Type.Object({}),
    Type.Object({
      procs: Type.Array(
        Type.Object({
          ...ExitInfo,
          argv: Type.Array(Type.String()),
          running: Type.Boolean(),
          background: Type.Boolean(),
          startedAt: Type.Number(),
        }),
      ),
    }),
  ),
  'proc.wait': op(
    Type.Object({ procId: Name, timeoutMs: Type.Optional(Ms) }),
    Type.Object({ ...ExitInfo, running: Type.Boolean(), stdoutTail: Bytes(), stderrTail: Bytes() }),
  ),
  'proc.write': op(Type.Object({ procId: Name, data: Bytes() }), Type.Object({ written: Type.Integer() })),
  'proc.closeStdin': op(Type.Object({ procId: Name }), Done),
  'proc.signal': op(
    Type.Object({
      procId: Name,
      signal: Type.Union([Type.String({ maxLength: 16 }), Type.Integer({ minimum: 1, maximum: 64 })]),
      group: Type.Optional(Type.Boolean()),
    }),
    Done,
  ),
  'proc.kill': op(Type.Object({ procId: Name }), Done),
  'files.read': op(
    Type.Object({
      path: Path,
      offset: Type.Optional(Type.Integer({ minimum: 0 })),
      length: Type.Optional(Type.Integer({ minimum: 0 })),
    }),
    Type.Object({ size: Type.Integer({ minimum: 0 }), fileSize: Type.Integer({ minimum: 0 }) }),
    { chunk: Type.Object({ data: Bytes() }) },
  ),
  'files.write': op(
    Type.Object({
      path: Path,
      data: Type.Optional(Bytes()),
      stream: Type.Optional(Type.Boolean()),
      append: Type.Optional(Type.Boolean()),
      mode: Type.Optional(Type.Integer({ minimum: 0, maximum: 0o7777 })),
      mkdirs: Type.Optional(Type.Boolean()),
    }),
    Type.Object({ size: Type.Integer({ minimum: 0 }) }),
    {},
    true,
  ),
  'files.list': op(
    Type.Object({ path: Path }),
    Type.Object({ entries: Type.Array(Type.Object({ name: Type.String(), ...StatInfo })) }),
  ),
  'files.stat': op(
    Type.Object({ path: Path, follow: Type.Optional(Type.Boolean()) }),
    Type.Object({ ...StatInfo, uid: Type.Integer(), gid: Type.Integer() }),
  ),
  'files.exists': op(
    Type.Object({ path: Path }),
    Type.Object({ exists: Type.Boolean(), type: Nullable(FileType) }),
  ),
  'files.mkdir': op(
    Type.Object({
      path: Path,
      parents: Type.Optional(Type.Boolean()),
      mode: Type.Optional(Type.Integer({ minimum: 0, maximum: 0o7777 })),
    }),
    Type.Object({ created: Type.Boolean() }),
  ),
  'files.remove': op(
    Type.Object({ path: Path, recursive: Type.Optional(Type.Boolean()), force: Type.Optional(Type.Boolean()) }),
    Type.Object({ removed: Type.Boolean() }),
  ),
  'files.rename': op(Type.Object({ from: Path, to: Path }), Done),
  restore: op(
    Type.Object({
      entropy: Type.Optional(Bytes(4096)),
      time: Type.Optional(Type.Number({ minimum: 0 })),
      hostname: Type.Optional(Type.String({ minLength: 1, maxLength: 64 })),
      sandboxId: Type.Optional(Type.String({ minLength: 1, maxLength: 128 })),
    }),
    Type.Object({
      entropy: Type.Object({ added: Type.Boolean(), bytes: Type.Integer(), reason: Type.Optional(Type.String()) }),
      reseeded: Type.Array(Type.String()),
      clock: Type.Object({ set: Type.Boolean(), reason: Type.Optional(Type.String()) }),
      hostname: Type.Object({ set: Type.Boolean(), reason: Type.Optional(Type.String()) }),
      sandboxId: Nullable(Type.String()),
      durationUs: Type.Number(),
    }),
  ),
  shutdown: op(Type.Object({ reboot: Type.Optional(Type.Boolean()) }), Done),
  fork: op(ForkArgs, ForkResult),
  branch: op(BranchArgs, ForkResult, BranchEvents),
} as const;

export type OpName = keyof typeof OPS;
export type OpArgs<O extends OpName> = Static<(typeof OPS)[O]['args']>;
export type OpResult<O extends OpName> = Static<(typeof OPS)[O]['result']>;
type EventsOf<O extends OpName> = (typeof OPS)[O]['events'];
/** An event of operation O as the client receives it: `{ev: name, ...fields}`. */
export type OpEvent<O extends OpName> = {
  [K in keyof EventsOf<O> & string]: { ev: K } & (EventsOf<O>[K] extends TSchema ? Static<EventsOf<O>[K]> : never);
}[keyof EventsOf<O> & string];

export const ERROR_CODES = [
  'bad_frame', // payload is not a msgpack map with a known `t`
  'frame_too_large', // length prefix above MAX_FRAME; the payload was skipped
  'bad_request', // a field failed validation; message names it
  'unknown_op',
  'hello_required',
  'unsupported_version',
  'duplicate_id',
  'unknown_request', // an event for a request that is not open (or takes no stream)
  'cancelled',
  'not_found',
  'already_exists',
  'permission_denied',
  'not_a_directory',
  'is_a_directory',
  'not_empty',
  'io_error',
  'no_such_process',
  'resource_exhausted',
  'shutting_down',
  'internal',
] as const;
export type ErrorCode = (typeof ERROR_CODES)[number];

export type RequestFrameT = Static<typeof RequestFrame> & Record<string, unknown>;
export type ResponseFrameT = Static<typeof ResponseFrame> & Record<string, unknown>;
export type EventFrameT = Static<typeof EventFrame> & Record<string, unknown>;
export type ErrorFrameT = Static<typeof ErrorFrame> & Record<string, unknown>;
export type CancelFrameT = Static<typeof CancelFrame>;
export type Frame = RequestFrameT | ResponseFrameT | EventFrameT | ErrorFrameT | CancelFrameT;

/** The JSON Schema document the Python agent validates with (written by protocol/gen.ts). */
export function schemaDocument() {
  const ops: Record<string, { args: unknown; clientStream: boolean }> = {};
  for (const [name, def] of Object.entries(OPS)) ops[name] = { args: def.args, clientStream: def.clientStream };
  return {
    version: PROTOCOL_VERSION,
    limits: { maxFrame: MAX_FRAME, maxChunk: MAX_CHUNK, maxCode: MAX_CODE },
    frames: { req: RequestFrame, ev: EventFrame, cancel: CancelFrame },
    clientEvents: ClientEvents,
    ops,
    errorCodes: ERROR_CODES,
  };
}
