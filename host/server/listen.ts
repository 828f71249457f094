// `--listen host:port` parsing and the loopback rule: without a token the
// server only listens where nobody else on the network can reach it.
import { isIP } from 'node:net';
import { UserError } from '../errors.ts';

export const DEFAULT_LISTEN = '127.0.0.1:4780';

export interface ListenAddress {
  host: string;
  port: number;
}

export function parseListen(s: string): ListenAddress {
  const m = /^(?:\[([0-9a-fA-F:.]+)\]|([^:[\]]*)):(\d{1,5})$/.exec(s);
  const port = m ? Number(m[3]) : Number.NaN;
  const host = m ? (m[1] ?? m[2] ?? '') : '';
  if (!m || port > 65535 || host === '' || (m[1] !== undefined && isIP(host) !== 6)) {
    throw new UserError(
      `invalid --listen ${JSON.stringify(s)}`,
      'use host:port, e.g. 127.0.0.1:4780, 0.0.0.0:4780 or [::1]:4780 (port 0 picks a free one)',
    );
  }
  return { host, port };
}

/** True for addresses only this machine can reach. */
export function isLoopback(host: string): boolean {
  if (host === 'localhost') return true;
  if (isIP(host) === 4) return host.startsWith('127.');
  if (isIP(host) === 6) {
    const h = host.toLowerCase();
    return h === '::1' || /^::ffff:127\./.test(h) || h === '0:0:0:0:0:0:0:1';
  }
  return false;
}
