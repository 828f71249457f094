// Errors the server answers with: a protocol error code, a message for people,
// and the HTTP status the REST API uses for it. Anything thrown that is not a
// ServiceError is reported as `internal` (and logged), never as a crash.
import type { ErrorCode } from '../../protocol/schema.ts';
import type { ServerErrorCode } from '../../protocol/server-ops.ts';

export type Code = ErrorCode | ServerErrorCode;

const STATUS: Partial<Record<Code, number>> = {
  bad_frame: 400,
  frame_too_large: 413,
  bad_request: 400,
  unknown_op: 400,
  hello_required: 400,
  unsupported_version: 400,
  duplicate_id: 400,
  unknown_request: 400,
  cancelled: 499,
  not_found: 404,
  sandbox_ended: 410,
  already_exists: 409,
  permission_denied: 403,
  not_a_directory: 400,
  is_a_directory: 400,
  not_empty: 409,
  no_such_process: 404,
  unauthorized: 401,
  too_many_requests: 429,
  unavailable: 503,
  resource_exhausted: 503,
  shutting_down: 503,
  io_error: 500,
  internal: 500,
};

export class ServiceError extends Error {
  constructor(
    readonly code: Code,
    message: string,
    /** HTTP status where the code's usual one does not fit (e.g. 405). */
    private readonly statusOverride?: number,
  ) {
    super(message);
    this.name = 'ServiceError';
  }
  get status(): number {
    return this.statusOverride ?? STATUS[this.code] ?? 500;
  }
}

export function httpStatus(code: string): number {
  return STATUS[code as Code] ?? 500;
}
