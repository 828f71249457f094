// Bearer-token authentication. Tokens come from a file (one a line, '#'
// comments); the server keeps only their SHA-256 and compares the hash of a
// presented token with every one of them with crypto.timingSafeEqual, so the
// time taken says nothing about how much of a token matched.
//
// Where a client may put its token:
//   Authorization: Bearer <token>                     (REST, Node WebSocket clients)
//   Sec-WebSocket-Protocol: forkling.v1, forkling.bearer.<token>   (browsers)
//   ?token=<token> in the URL                          (browsers; ends up in logs, prefer the subprotocol)
import { createHash, timingSafeEqual } from 'node:crypto';
import { readFile, stat } from 'node:fs/promises';
import type { IncomingMessage } from 'node:http';
import { WS_TOKEN_PREFIX } from '../../protocol/server-ops.ts';
import { UserError } from '../errors.ts';

const MIN_TOKEN = 16;

function sha256(s: string): Buffer {
  return createHash('sha256').update(s, 'utf8').digest();
}

export class TokenAuth {
  private readonly hashes: Buffer[];

  constructor(tokens: string[]) {
    if (tokens.length === 0) throw new Error('TokenAuth needs at least one token');
    this.hashes = tokens.map(sha256);
  }

  /** Reads tokens from a file; refuses an empty file, short tokens, and a file others may read. */
  static async fromFile(path: string): Promise<TokenAuth> {
    let text: string;
    try {
      text = await readFile(path, 'utf8');
    } catch (e) {
      throw new UserError(
        `cannot read the token file ${path}: ${(e as NodeJS.ErrnoException).code ?? String(e)}`,
        `create it, e.g. \`head -c 32 /dev/urandom | base64 | tr -d '/+=' > ${path} && chmod 600 ${path}\``,
      );
    }
    const st = await stat(path);
    if ((st.mode & 0o077) !== 0) {
      throw new UserError(`the token file ${path} can be read or written by its group or other users`, `chmod 600 ${path}`);
    }
    const tokens = text
      .split('\n')
      .map((l) => l.trim())
      .filter((l) => l !== '' && !l.startsWith('#'));
    if (tokens.length === 0) throw new UserError(`the token file ${path} holds no token`, 'put one token per line');
    for (const t of tokens) {
      // (a token travels as a WebSocket subprotocol, where / and = are not allowed, and in a
      // URL query, where + reads as a space)
      if (t.length < MIN_TOKEN || !/^[A-Za-z0-9._~-]+$/.test(t)) {
        throw new UserError(
          `a token in ${path} is shorter than ${MIN_TOKEN} characters or has characters other than A-Z a-z 0-9 . _ ~ -`,
          `use a random token, e.g. \`head -c 32 /dev/urandom | base64 | tr -d '/+=' > ${path}\``,
        );
      }
    }
    return new TokenAuth(tokens);
  }

  /** True when the token is one of ours; takes the same time whichever it is, or if none. */
  check(presented: string | null): boolean {
    if (presented === null) return false;
    const h = sha256(presented);
    let ok = false;
    for (const want of this.hashes) ok = timingSafeEqual(h, want) || ok;
    return ok;
  }
}

/** The token a request presents (header, WebSocket subprotocol or query), or null. */
export function presentedToken(req: IncomingMessage, url: URL): string | null {
  const auth = req.headers.authorization;
  if (auth) {
    const m = /^Bearer\s+(\S+)\s*$/i.exec(auth);
    return m ? (m[1] as string) : null;
  }
  const protos = req.headers['sec-websocket-protocol'];
  if (protos) {
    for (const p of protos.split(',')) {
      const s = p.trim();
      if (s.startsWith(WS_TOKEN_PREFIX)) return s.slice(WS_TOKEN_PREFIX.length);
    }
  }
  return url.searchParams.get('token');
}

/**
 * Without a token (a server on loopback only), any web page the user opens
 * could drive the server: a WebSocket or a fetch from the page reaches
 * 127.0.0.1, and a DNS-rebinding page does so under its own host name. So a
 * server without a token refuses requests a browser sent for a page (they
 * carry Origin) and requests for a host name that is not a loopback one.
 * Returns why a request is refused, or null. With a token, the token decides.
 */
export function refusedWithoutToken(req: IncomingMessage): string | null {
  if (req.headers.origin !== undefined) {
    return `a request from a web page (Origin ${JSON.stringify(req.headers.origin.slice(0, 100))}) needs a token: start the server with --token-file`;
  }
  const host = (req.headers.host ?? '').toLowerCase().replace(/:\d+$/, '');
  if (!['localhost', '127.0.0.1', '[::1]', '::1'].includes(host) && !/^127\.\d+\.\d+\.\d+$/.test(host)) {
    return `the Host ${JSON.stringify(host.slice(0, 100))} is not a loopback name, which a server without a token only answers (DNS rebinding); use 127.0.0.1 or localhost, or start the server with --token-file`;
  }
  return null;
}
