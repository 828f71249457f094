// Parts of the server on their own: listen parsing and the loopback rule,
// token auth, the CLI's refusals, Prometheus rendering, the sandbox manager's
// limits and timeouts (with real agents from the test helper engine).
import { chmodSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import * as assert from 'uvu/assert';
import { suite } from 'uvu';
import { serveCommand } from '../../host/cli/serve.ts';
import { UserError } from '../../host/errors.ts';
import { TokenAuth } from '../../host/server/auth.ts';
import { ServiceError } from '../../host/server/errors.ts';
import { isLoopback, parseListen } from '../../host/server/listen.ts';
import { SandboxManager } from '../../host/server/manager.ts';
import { Counter, Histogram, Registry } from '../../host/server/metrics.ts';
import { buildOpenApi } from '../../host/server/openapi.ts';
import { ServerMetrics } from '../../host/server/telemetry.ts';
import { ROUTED_OPS } from '../../protocol/server-ops.ts';
import { AgentProcessEngine } from './server-agent-engine.ts';

const test = suite('server-units');
const dir = mkdtempSync(join(tmpdir(), 'forkling-units-'));

async function rejects(p: Promise<unknown>, cls: new (...a: never[]) => Error, text?: string): Promise<Error> {
  try {
    await p;
  } catch (e) {
    assert.instance(e, cls, String(e));
    if (text) assert.match((e as Error).message, text);
    return e as Error;
  }
  throw new Error('expected a rejection');
}

test('--listen parsing', () => {
  assert.equal(parseListen('127.0.0.1:4780'), { host: '127.0.0.1', port: 4780 });
  assert.equal(parseListen('[::1]:0'), { host: '::1', port: 0 });
  assert.equal(parseListen('localhost:80'), { host: 'localhost', port: 80 });
  for (const bad of ['', '4780', ':4780', '127.0.0.1:65536', '127.0.0.1:x', '[nope]:1', '::1:80']) {
    assert.throws(() => parseListen(bad), (e: unknown) => e instanceof UserError, bad);
  }
});

test('loopback rule', () => {
  for (const h of ['127.0.0.1', '127.1.2.3', '::1', 'localhost', '::ffff:127.0.0.1']) assert.ok(isLoopback(h), h);
  for (const h of ['0.0.0.0', '::', '10.0.0.1', '192.168.1.1', 'example.org', '128.0.0.1']) assert.not.ok(isLoopback(h), h);
});

test('without a token: requests a browser sent for a page, or for a host name that is not loopback, are refused', async () => {
  const { refusedWithoutToken } = await import('../../host/server/auth.ts');
  const req = (headers: Record<string, string>) => ({ headers }) as unknown as import('node:http').IncomingMessage;
  for (const host of ['127.0.0.1:4780', 'localhost:4780', '[::1]:4780', '127.0.0.1', 'LOCALHOST']) {
    assert.is(refusedWithoutToken(req({ host })), null, host);
  }
  assert.match(String(refusedWithoutToken(req({ host: '127.0.0.1:4780', origin: 'https://evil.example' }))), 'needs a token');
  assert.match(String(refusedWithoutToken(req({ host: 'rebound.evil.example:4780' }))), 'not a loopback name');
  assert.match(String(refusedWithoutToken(req({}))), 'not a loopback name');
});

test('token auth: file rules and checks', async () => {
  const f = join(dir, 'tokens');
  writeFileSync(f, '# comment\n\nfirst-token-0123456789\nsecond-token-0123456789\n', { mode: 0o600 });
  const auth = await TokenAuth.fromFile(f);
  assert.ok(auth.check('first-token-0123456789'));
  assert.ok(auth.check('second-token-0123456789'));
  for (const bad of [null, '', 'first-token-012345678', 'first-token-0123456789 ', 'FIRST-TOKEN-0123456789']) {
    assert.not.ok(auth.check(bad), String(bad));
  }
  for (const mode of [0o644, 0o640, 0o620]) {
    chmodSync(f, mode);
    await rejects(TokenAuth.fromFile(f), UserError, 'group or other users');
  }
  const short = join(dir, 'short');
  writeFileSync(short, 'abc\n', { mode: 0o600 });
  await rejects(TokenAuth.fromFile(short), UserError, 'shorter');
  const slash = join(dir, 'slash');
  writeFileSync(slash, 'abcdefghijklmnop/qrstuvwxyz0123456789=\n', { mode: 0o600 });
  await rejects(TokenAuth.fromFile(slash), UserError, 'characters other than'); // (no subprotocol can carry it)
  const empty = join(dir, 'empty');
  writeFileSync(empty, '# nothing\n', { mode: 0o600 });
  await rejects(TokenAuth.fromFile(empty), UserError, 'no token');
  await rejects(TokenAuth.fromFile(join(dir, 'missing')), UserError, 'cannot read');
});

test('forkling serve refuses bad setups before starting anything', async () => {
  await rejects(serveCommand(['--listen', '0.0.0.0:0']), UserError, 'without a token');
  await rejects(serveCommand(['--listen', '[::]:0']), UserError, 'without a token');
  await rejects(serveCommand(['--tls-cert', 'x.pem']), UserError, 'go together');
  await rejects(serveCommand(['--max-sandboxes', '0']), UserError, 'max-sandboxes');
  await rejects(serveCommand(['--listen', 'nonsense']), UserError, 'invalid --listen');
  await rejects(serveCommand(['--bogus']), UserError);
  await rejects(serveCommand(['--default-timeout-ms', '10', '--max-timeout-ms', '5']), UserError, 'above');
  await rejects(serveCommand(['--default-timeout-ms', '900000000', '--max-timeout-ms', '1000000000']), UserError, '7 days');
});

test('Prometheus rendering', () => {
  const r = new Registry();
  const c = r.add(new Counter('x_total', 'X.'));
  c.inc({ a: 'q"\\\n' });
  c.inc({ a: 'q"\\\n' }, 2);
  const h = r.add(new Histogram('lat_seconds', 'L.', [0.1, 1]));
  h.observe({ op: 'eval' }, 0.05);
  h.observe({ op: 'eval' }, 0.5);
  h.observe({ op: 'eval' }, 5);
  const text = r.render();
  assert.match(text, 'x_total{a="q\\"\\\\\\n"} 3');
  assert.match(text, 'lat_seconds_bucket{op="eval",le="0.1"} 1\n');
  assert.match(text, 'lat_seconds_bucket{op="eval",le="1"} 2\n');
  assert.match(text, 'lat_seconds_bucket{op="eval",le="+Inf"} 3\n');
  assert.match(text, 'lat_seconds_sum{op="eval"} 5.55\n');
  assert.match(text, 'lat_seconds_count{op="eval"} 3\n');
});

test('OpenAPI document: every routed op, no TypeBox-only types left', () => {
  const doc = buildOpenApi();
  const paths = doc.paths as Record<string, unknown>;
  for (const op of ROUTED_OPS) assert.ok(paths[`/v1/sandboxes/{id}/${op}`], op);
  const text = JSON.stringify(doc);
  assert.not.match(text, '"Uint8Array"');
  assert.not.match(text, 'maxByteLength');
});

test('manager: ids, max sandboxes, kill, ended reasons, timeouts (real agents)', async () => {
  const engine = new AgentProcessEngine();
  const metrics = new ServerMetrics();
  const m = new SandboxManager({ engine, metrics, maxSandboxes: 3, defaultTimeoutMs: 60_000, memorySampleMs: 0 });
  try {
    const [a, b] = await m.fork('default', 2);
    assert.ok(a && b && a.id !== b.id);
    const e = await rejects(m.fork('default', 2), ServiceError, 'at most 3');
    assert.is((e as ServiceError).code, 'unavailable');
    assert.is((e as ServiceError).status, 503);
    assert.is(engine.started, 2, 'the refused fork must not reach the engine');
    await rejects(m.create('default', 0), ServiceError, 'timeoutMs');
    await rejects(m.create('no-such'), ServiceError, 'not found');
    assert.is(await m.kill(a!.id), true);
    assert.is(await m.kill(a!.id), false);
    const ended = await rejects(Promise.resolve().then(() => m.sandbox(a!.id)), ServiceError, 'killed');
    assert.is((ended as ServiceError).code, 'sandbox_ended');
    await rejects(m.kill('never-was'), ServiceError, 'no sandbox');

    // a timeout kills; setTimeout re-arms it from now
    const t0 = Date.now();
    const c = await m.create('default', 300);
    const ends = new Promise<string>((r) => m.onEnd((id, why) => id === c.id && r(why)));
    await new Promise((r) => setTimeout(r, 150));
    m.setTimeout(c.id, 400); // now due ~550 ms after creation instead of 300
    assert.is(await ends, 'timeout');
    assert.ok(Date.now() - t0 >= 500, `ended after ${Date.now() - t0} ms`);
    assert.is(metrics.ended.get({ reason: 'timeout' }), 1);

    // a sandbox that dies on its own is noticed
    const d = await m.create('default');
    const died = new Promise<string>((r) => m.onEnd((id, why) => id === d.id && r(why)));
    await m.sandbox(d.id).agent.shutdown();
    assert.match(await died, 'poweroff');
    assert.is(m.size, 1);
  } finally {
    await m.close();
  }
  assert.is(m.size, 0);
  await rejects(m.create('default'), ServiceError, 'shutting down');
});

test('manager: concurrent requests cannot pass --max-sandboxes together (each counts before it waits)', async () => {
  for (const minFreeMiB of [0, 1]) {
    const engine = new AgentProcessEngine();
    const m = new SandboxManager({ engine, metrics: new ServerMetrics(), maxSandboxes: 2, minFreeMiB, memorySampleMs: 0 });
    try {
      const got = await Promise.allSettled(Array.from({ length: 5 }, () => m.fork('default', 2)));
      assert.is(got.filter((r) => r.status === 'fulfilled').length, 1, `minFreeMiB ${minFreeMiB}`);
      assert.is(m.size, 2);
      assert.is(engine.started, 2, 'refused forks must not reach the engine');
    } finally {
      await m.close();
    }
  }
});

test('manager: memory limit refuses new sandboxes with a clear error', async () => {
  const engine = new AgentProcessEngine();
  const m = new SandboxManager({ engine, maxMemoryMiB: 1, memorySampleMs: 20 });
  try {
    await m.create('default');
    const until = Date.now() + 5000;
    while (m.privateKiB === 0 && Date.now() < until) await new Promise((r) => setTimeout(r, 20));
    assert.ok(m.privateKiB > 1024, `sampled ${m.privateKiB} KiB`);
    await rejects(m.create('default'), ServiceError, 'private memory');
  } finally {
    await m.close();
  }
});

test.run();
