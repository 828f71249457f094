// The seam between the server and a sandbox's agent: one agent request opened
// on behalf of a client request. The WebSocket sessions and the REST handlers
// only use this; agent-bridge.ts implements it on the AgentClient.
import type { Sandbox } from '../engine/engine.ts';

export interface AgentCall {
  /** The response fields (without t/id), or a rejection with {code, message}. */
  readonly done: Promise<Record<string, unknown>>;
  /**
   * Sends a client event (`data` / `end`) on this request; resolves when the
   * agent's connection takes more (the caller reads no more of its client until
   * then: back-pressure), or when the request ended.
   */
  send(ev: string, fields: Record<string, unknown>): Promise<void>;
  /** Asks the agent to stop this request; `done` then settles (cancelled or finished). */
  cancel(): void;
}

/** Opens `op` with `args` on the sandbox's agent; `onEvent` gets each stream event as `{ev, ...fields}`. */
export type CallAgent = (
  sb: Sandbox,
  op: string,
  args: Record<string, unknown>,
  onEvent: (ev: Record<string, unknown>) => void,
) => AgentCall;
