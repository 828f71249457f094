// Compiled TypeBox checks for everything a client sends the server: the frame
// envelopes, the server operations and the agent operations it routes. The
// message of a failure names the field, e.g. "eval: /timeoutMs: Expected integer".
import type { TSchema } from '@sinclair/typebox';
import { type TypeCheck, TypeCompiler } from '@sinclair/typebox/compiler';
import { CancelFrame, ClientEvents, EventFrame, OPS, RequestFrame } from '../../protocol/schema.ts';
import { ROUTED_OPS, SERVER_OPS, SandboxIdSchema } from '../../protocol/server-ops.ts';

export type Check = (value: unknown) => string | null;

/** A compiled check of `schema`: null, or the first thing wrong, naming `what` and the field. */
export function compileCheck(what: string, schema: TSchema): Check {
  const c: TypeCheck<TSchema> = TypeCompiler.Compile(schema);
  return (value) => {
    if (c.Check(value)) return null;
    const e = c.Errors(value).First();
    if (!e) return `${what}: invalid`;
    return `${what}: ${e.path || '(frame)'}: ${e.message}`;
  };
}

export const checkRequestFrame = compileCheck('request frame', RequestFrame);
export const checkEventFrame = compileCheck('event frame', EventFrame);
export const checkCancelFrame = compileCheck('cancel frame', CancelFrame);
export const checkSandboxId = compileCheck('sandbox', SandboxIdSchema);

export const serverArgs = new Map<string, Check>(
  Object.entries(SERVER_OPS).map(([name, def]) => [name, compileCheck(name, def.args)]),
);
export const routedArgs = new Map<string, Check>(
  ROUTED_OPS.map((name) => [name, compileCheck(name, OPS[name].args)]),
);
export const clientEventArgs = new Map<string, Check>(
  Object.entries(ClientEvents).map(([name, schema]) => [name, compileCheck(`event ${name}`, schema)]),
);

/** Ops whose requests take client events (streamed stdin, file data). */
export const clientStreamOps = new Set<string>(ROUTED_OPS.filter((n) => OPS[n].clientStream));

const ENVELOPE = new Set(['t', 'id', 'op', 'sandbox']);

/** The operation's own fields of a request frame (without t, id, op, sandbox). */
export function argsOf(frame: Record<string, unknown>): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const k in frame) if (!ENVELOPE.has(k)) out[k] = frame[k];
  return out;
}
