// Errors meant for people: what went wrong and how to fix it. The CLI prints
// `message` (and `hint`) without a stack trace and exits with `exitCode`.
export class UserError extends Error {
  constructor(
    message: string,
    readonly hint?: string,
    readonly exitCode = 2,
  ) {
    super(message);
    this.name = 'UserError';
  }
}

const NAME_RE = /^[A-Za-z0-9._-]{1,64}$/;

/** Checks a user-chosen name (image, template); rejects path tricks like '..'. */
export function checkName(kind: string, name: string): string {
  if (!NAME_RE.test(name) || name === '.' || name === '..') {
    throw new UserError(
      `invalid ${kind} name ${JSON.stringify(name)}`,
      'use 1-64 characters from A-Z a-z 0-9 . _ - (not "." or "..")',
    );
  }
  return name;
}
