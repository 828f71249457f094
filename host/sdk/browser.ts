// The SDK for browsers (and any runtime with a global WebSocket): no Node
// imports anywhere below this module.
export { Connection, type ConnectionOptions, setDefaultWebSocket, type WebSocketFactory, type WebSocketLike } from './connection.ts';
export {
  AuthError,
  ConnectionError,
  ForklingError,
  InvalidArgumentError,
  LimitError,
  NotFoundError,
  SandboxError,
  TimeoutError,
} from './errors.ts';
export {
  CommandHandle,
  type CommandOptions,
  type CommandResult,
  Commands,
  type EntryInfo,
  type EvalOptions,
  type EvalResult,
  Files,
  Sandbox,
  type SandboxInfo,
  type SandboxOptions,
} from './sandbox.ts';
