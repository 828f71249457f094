// Runtime validation from the schema (TypeBox compiled checkers). Every check
// reports the first failing field by its JSON pointer, e.g. `/argv/0`.
// Browser-safe (TypeBox's compiler only).
import type { TSchema } from '@sinclair/typebox';
import { TypeCompiler, type TypeCheck } from '@sinclair/typebox/compiler';
import {
  CancelFrame,
  ClientEvents,
  ErrorFrame,
  EventFrame,
  type Frame,
  OPS,
  type OpName,
  RequestFrame,
  ResponseFrame,
} from './schema.ts';

const cache = new WeakMap<TSchema, TypeCheck<TSchema>>();
function checker(schema: TSchema): TypeCheck<TSchema> {
  let c = cache.get(schema);
  if (!c) {
    c = TypeCompiler.Compile(schema);
    cache.set(schema, c);
  }
  return c;
}

/** A validation failure: the protocol error code and a message that names the field. */
export interface Invalid {
  code: 'bad_frame' | 'bad_request' | 'unknown_op';
  message: string;
  /** The request id when it could be read (so the error can be tied to it). */
  id: number | null;
}

/** Checks `value` against `schema`; returns null when valid, else `field /path: problem`. */
export function check(schema: TSchema, value: unknown): string | null {
  const c = checker(schema);
  if (c.Check(value)) return null;
  const e = c.Errors(value).First();
  if (!e) return 'invalid value';
  return `field ${e.path || '/'}: ${e.message}`;
}

function idOf(x: Record<string, unknown>): number | null {
  const id = x['id'];
  return typeof id === 'number' && Number.isInteger(id) && id >= 0 && id <= 0xffffffff ? id : null;
}

const ENVELOPES: Record<string, TSchema> = {
  req: RequestFrame,
  res: ResponseFrame,
  ev: EventFrame,
  err: ErrorFrame,
  cancel: CancelFrame,
};

function isMap(x: unknown): x is Record<string, unknown> {
  return typeof x === 'object' && x !== null && !Array.isArray(x) && !(x instanceof Uint8Array);
}

/**
 * Checks the envelope of any frame (and, for requests, the operation's
 * arguments). `allowed` limits the kinds accepted from this peer.
 */
export function validateFrame(x: unknown, allowed: readonly Frame['t'][]): { ok: true; frame: Frame } | { ok: false; error: Invalid } {
  if (!isMap(x)) return { ok: false, error: { code: 'bad_frame', message: 'frame is not a msgpack map', id: null } };
  const t = x['t'];
  if (typeof t !== 'string' || !allowed.includes(t as Frame['t'])) {
    return {
      ok: false,
      error: { code: 'bad_frame', message: `field /t: expected one of ${allowed.join(', ')}`, id: idOf(x) },
    };
  }
  const env = check(ENVELOPES[t]!, x);
  if (env) return { ok: false, error: { code: 'bad_request', message: env, id: idOf(x) } };
  if (t === 'req') {
    const op = x['op'] as string;
    const def = (OPS as Record<string, (typeof OPS)[OpName]>)[op];
    if (!def) return { ok: false, error: { code: 'unknown_op', message: `unknown op ${JSON.stringify(op)}`, id: idOf(x) } };
    const bad = check(def.args, x);
    if (bad) return { ok: false, error: { code: 'bad_request', message: bad, id: idOf(x) } };
  }
  return { ok: true, frame: x as Frame };
}

/** Checks the fields of a response to `op`. */
export function checkResult(op: OpName, res: unknown): string | null {
  return check(OPS[op].result, res);
}

/** Checks an event received on a request for `op` (unknown event names are an error). */
export function checkEvent(op: OpName, ev: Record<string, unknown>): string | null {
  const schema = (OPS[op].events as Record<string, TSchema>)[ev['ev'] as string];
  if (!schema) return `field /ev: unexpected event ${JSON.stringify(ev['ev'])} for ${op}`;
  return check(schema, ev);
}

/** Checks an event a client sends on an open request (`data` / `end`). */
export function checkClientEvent(ev: Record<string, unknown>): string | null {
  const schema = (ClientEvents as Record<string, TSchema>)[ev['ev'] as string];
  if (!schema) return `field /ev: expected one of ${Object.keys(ClientEvents).join(', ')}`;
  return check(schema, ev);
}
