// `forkling serve --tls-cert --tls-key`: HTTPS and WSS with a certificate the
// test makes (openssl), used through the SDK (with the CA passed to `ws`) and REST.
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync } from 'node:fs';
import { request } from 'node:https';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import * as assert from 'uvu/assert';
import { suite } from 'uvu';
import WebSocket from 'ws';
import { Sandbox, type WebSocketLike } from '../../host/index.ts';
import { serve } from './server-harness.ts';

const test = suite('server-tls');

test('HTTPS and WSS with a given certificate', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'forkling-tls-'));
  const certFile = join(dir, 'cert.pem');
  const keyFile = join(dir, 'key.pem');
  execFileSync('openssl', [
    'req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes', '-days', '1',
    '-subj', '/CN=127.0.0.1', '-addext', 'subjectAltName=IP:127.0.0.1',
    '-keyout', keyFile, '-out', certFile,
  ], { stdio: 'ignore' });
  const ca = readFileSync(certFile);
  const token = 'tls-test-token-0123456789';
  const srv = await serve({ token, tls: { certFile, keyFile } });
  try {
    assert.match(srv.url, /^https:\/\/127\.0\.0\.1:\d+$/);
    const sb = await Sandbox.create({
      url: srv.url,
      token,
      webSocket: (u, p) => new WebSocket(u, p, { ca }) as unknown as WebSocketLike,
    });
    assert.is((await sb.eval('"over tls"')).value, 'over tls');
    const body = await new Promise<string>((resolve, reject) => {
      const req = request(`${srv.url}/v1/sandboxes`, { ca, headers: { authorization: `Bearer ${token}` } }, (res) => {
        let t = '';
        res.on('data', (d) => {
          t += d;
        });
        res.on('end', () => resolve(t));
      });
      req.on('error', reject);
      req.end();
    });
    assert.ok((JSON.parse(body) as { sandboxes: { id: string }[] }).sandboxes.some((s) => s.id === sb.id));
    // a client that does not trust the certificate gets no connection
    await new Promise<void>((resolve) => {
      const ws = new WebSocket(`${srv.url.replace('https', 'wss')}/v1/ws`, ['forkling.v1']);
      ws.on('error', () => resolve());
      ws.on('open', () => assert.unreachable('connected without trusting the certificate'));
    });
    await sb.kill();
  } finally {
    Sandbox.disconnectAll();
    assert.is(await srv.stop(), 0);
  }
});

test.run();
