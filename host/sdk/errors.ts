// Typed errors of the SDK. Every error the server or the agent answers with
// becomes one of these (by its protocol code); `code` keeps the exact code.

export class ForklingError extends Error {
  constructor(
    message: string,
    readonly code: string = 'error',
  ) {
    super(message);
    this.name = 'ForklingError';
  }
}

/** The operation ran out of time (eval or command timeout, or a client-side deadline). */
export class TimeoutError extends ForklingError {
  constructor(message: string, code = 'timeout') {
    super(message, code);
    this.name = 'TimeoutError';
  }
}

/** No such sandbox, file or process (or the sandbox has ended: code `sandbox_ended`). */
export class NotFoundError extends ForklingError {
  constructor(message: string, code = 'not_found') {
    super(message, code);
    this.name = 'NotFoundError';
  }
}

/** Missing or wrong token. */
export class AuthError extends ForklingError {
  constructor(message: string, code = 'unauthorized') {
    super(message, code);
    this.name = 'AuthError';
  }
}

/** The request was refused as invalid (the message names the field). */
export class InvalidArgumentError extends ForklingError {
  constructor(message: string, code = 'bad_request') {
    super(message, code);
    this.name = 'InvalidArgumentError';
  }
}

/** A limit was reached: max sandboxes, memory, open requests per connection. */
export class LimitError extends ForklingError {
  constructor(message: string, code: string) {
    super(message, code);
    this.name = 'LimitError';
  }
}

/** The connection to the server failed or dropped; the sandboxes live on. */
export class ConnectionError extends ForklingError {
  constructor(message: string) {
    super(message, 'connection');
    this.name = 'ConnectionError';
  }
}

/** An exception raised by code in the sandbox, with its Python traceback. */
export class SandboxError extends ForklingError {
  constructor(
    /** The exception type, e.g. `ZeroDivisionError`. */
    readonly type: string,
    /** Its message (str(exception)). */
    readonly value: string,
    readonly traceback: string,
  ) {
    super(value ? `${type}: ${value}` : type, 'sandbox_error');
    this.name = 'SandboxError';
  }
}

/** The error class for a protocol error code. */
export function errorFromCode(code: string, message: string): ForklingError {
  switch (code) {
    case 'not_found':
    case 'sandbox_ended':
    case 'no_such_process':
      return new NotFoundError(message, code);
    case 'unauthorized':
      return new AuthError(message, code);
    case 'bad_request':
    case 'bad_frame':
    case 'unknown_op':
    case 'frame_too_large':
      return new InvalidArgumentError(message, code);
    case 'too_many_requests':
    case 'unavailable':
    case 'resource_exhausted':
      return new LimitError(message, code);
    case 'timeout':
      return new TimeoutError(message, code);
    default:
      return new ForklingError(message, code);
  }
}
