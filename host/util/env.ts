// Settings from the environment, checked: a value that is set but malformed is
// one clear error (what, and how to fix it), never silently the default.
import { UserError } from '../errors.ts';

/** A whole number from `min` to `max`; `def` when unset or empty. */
export function envWhole(name: string, def: number, min: number, max: number): number {
  const v = process.env[name];
  if (v === undefined || v.trim() === '') return def;
  const n = /^\s*\d+\s*$/.test(v) ? Number(v) : Number.NaN;
  if (!(n >= min && n <= max)) throw new UserError(`${name}=${v} is not a whole number from ${min} to ${max}`, `unset it or set e.g. ${name}=${def}`);
  return n;
}

/** 1 (on) or 0 (off); `def` when unset or empty. */
export function envFlag(name: string, def = false): boolean {
  const v = process.env[name];
  if (v === undefined || v.trim() === '') return def;
  if (v.trim() === '1') return true;
  if (v.trim() === '0') return false;
  throw new UserError(`${name}=${v} is neither 1 (on) nor 0 (off)`, `set ${name}=1 or ${name}=0, or unset it`);
}
