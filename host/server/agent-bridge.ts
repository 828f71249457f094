// CallAgent on the AgentClient: a client's request becomes one agent request
// on the sandbox's own connection (the AgentClient allocates the agent-side
// id; the caller keeps the client-side one). Agent errors keep their code;
// a dropped agent connection means the sandbox is gone.
import { ERROR_CODES, type OpName } from '../../protocol/schema.ts';
import { AgentError } from '../agent/client.ts';
import type { AgentCall, CallAgent } from './bridge.ts';
import { ServiceError } from './errors.ts';

function mapError(e: unknown): unknown {
  if (!(e instanceof AgentError)) return e;
  switch (e.code) {
    case 'closed':
      return new ServiceError('sandbox_ended', `the sandbox's agent is gone (${e.message})`);
    case 'bad_response':
      // The guest is not trusted: a malformed answer is its fault, reported as such.
      return new ServiceError('internal', `the sandbox's agent answered with an invalid frame: ${e.message}`);
    case 'timeout':
      return new ServiceError('internal', e.message);
    default:
      // An agent's own error code (not_found, bad_request, cancelled, ...) is passed through; one
      // of the server's (unauthorized, too_many_requests, ...) an agent may not claim.
      if ((ERROR_CODES as readonly string[]).includes(e.code)) return e;
      return new ServiceError('internal', `the sandbox's agent answered with the error code ${JSON.stringify(e.code.slice(0, 64))}, which is not an agent's`);
  }
}

export const callAgentClient: CallAgent = (sb, op, args, onEvent): AgentCall => {
  const req = sb.agent.open(op as OpName, args as never, { onEvent: onEvent as never });
  return {
    done: (req.result as Promise<Record<string, unknown>>).catch((e: unknown) => {
      throw mapError(e);
    }),
    send(ev, fields) {
      const p = ev === 'data' ? req.send(fields.data as Uint8Array) : req.end();
      return p.catch(() => {}); // a closed agent connection rejects `done` as well
    },
    cancel() {
      req.cancel();
    },
  };
};
