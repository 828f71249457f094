// The TypeScript SDK against a real `forkling serve`: every call, typed
// errors, timeouts, reconnecting to a live sandbox, one shared connection.
import { readFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import * as assert from 'uvu/assert';
import { suite } from 'uvu';
import {
  AuthError,
  ConnectionError,
  InvalidArgumentError,
  NotFoundError,
  Sandbox,
  SandboxError,
  TimeoutError,
} from '../../host/index.ts';
import type { WebSocketLike } from '../../host/sdk/connection.ts';
import { decodeFrame, encodeFrame } from '../../protocol/codec.ts';
import { MAX_FRAME } from '../../protocol/schema.ts';
import { type Served, serve } from './server-harness.ts';
import { loud } from '../loud-hook.ts';

const TOKEN = 'sdk-test-token-0123456789';
const test = suite('sdk');
let srv: Served;
let opts: { url: string; token: string };
let sb: Sandbox;

test.before(loud("the suite's set-up (test.before)", async () => {
  srv = await serve({ token: TOKEN });
  opts = { url: srv.url, token: TOKEN };
  sb = await Sandbox.create({ ...opts, template: 'default', timeoutMs: 120_000 });
}));

test.after(async () => {
  Sandbox.disconnectAll();
  assert.is(await srv.stop(), 0, srv.log.join(''));
});

async function expectError<E extends Error>(cls: new (...a: never[]) => E, p: Promise<unknown>): Promise<E> {
  try {
    await p;
  } catch (e) {
    assert.instance(e, cls, `${(e as Error).name}: ${(e as Error).message}`);
    return e as E;
  }
  throw new Error(`expected ${cls.name}, got success`);
}

test('the client path imports no node: modules and not ws (browser-safe)', () => {
  const seen = new Set<string>();
  const walk = (file: string) => {
    if (seen.has(file)) return;
    seen.add(file);
    const src = readFileSync(file, 'utf8');
    for (const m of src.matchAll(/^\s*(?:import|export)[^'"]*from\s+'([^']+)'/gm)) {
      const spec = m[1] as string;
      assert.not.ok(spec.startsWith('node:'), `${file} imports ${spec}`);
      assert.is.not(spec, 'ws', `${file} imports ws`);
      if (spec.startsWith('.')) walk(resolve(dirname(file), spec));
    }
  };
  walk(join(import.meta.dirname, '..', '..', 'host', 'sdk', 'browser.ts'));
  assert.ok(seen.size >= 4);
});

test('create, getInfo, list, setTimeout', async () => {
  const info = await sb.getInfo();
  assert.is(info.id, sb.id);
  assert.is(info.template, 'default');
  assert.is(info.timeoutMs, 120_000);
  const list = await Sandbox.list(opts);
  assert.ok(list.some((s) => s.id === sb.id));
  await sb.setTimeout(200_000);
  const after = await sb.getInfo();
  assert.is(after.timeoutMs, 200_000);
  assert.ok(after.expiresAt >= info.expiresAt + 70_000);
  await expectError(InvalidArgumentError, sb.setTimeout(0));
});

test('eval: value, text, output callbacks, exception with traceback, contexts', async () => {
  const out: string[] = [];
  const err: string[] = [];
  const r = await sb.eval('import sys\nx = 21\nprint("hello")\nprint("warn", file=sys.stderr)\nx * 2', {
    onStdout: (t) => out.push(t),
    onStderr: (t) => err.push(t),
  });
  assert.is(r.value, 42);
  assert.is(r.text, '42');
  assert.is(r.stdout, 'hello\n');
  assert.is(r.stderr, 'warn\n');
  assert.is(out.join(''), 'hello\n');
  assert.is(err.join(''), 'warn\n');
  assert.is(r.error, undefined);
  const e = await sb.eval('def f():\n  raise ValueError("bad thing")\nf()');
  assert.instance(e.error, SandboxError);
  assert.is(e.error?.type, 'ValueError');
  assert.is(e.error?.value, 'bad thing');
  assert.match(e.error?.traceback ?? '', 'in f');
  assert.is((await sb.eval('x')).value, 21);
  const other = await sb.eval('x', { context: 'fresh' });
  assert.is(other.error?.type, 'NameError');
  const obj = await sb.eval('{"a": [1, 2.5, None, True], "b": b"\\x00\\x01"}');
  assert.equal(obj.value, { a: [1, 2.5, null, true], b: new Uint8Array([0, 1]) });
});

test("a callback of the caller's that throws fails that call, not the process; the sandbox goes on", async () => {
  // (thrown inside the WebSocket's message handler, it was an uncaught exception: the process died)
  const boom = new Error('my onStdout broke');
  const got = await sb.eval('print("hello")\n1', { onStdout: () => { throw boom; } }).catch((e: unknown) => e);
  assert.is(got, boom);
  assert.is((await sb.eval('2 + 2')).value, 4);
  // what cannot be sent fails at once and leaves nothing pending
  const cyclic: Record<string, unknown> = {};
  cyclic.self = cyclic;
  const bad = await sb.commands.run('true', { envs: cyclic as never }).catch((e: unknown) => e);
  assert.instance(bad, Error);
  assert.is((await sb.eval('3')).value, 3);
});

test("a large upload goes through the server at the agent's pace (flow control, not a limit)", async () => {
  // 200 MiB: past the 16 MiB a session lets wait before it stops reading its client (and past any fixed cap)
  const w = await sb.files.write('/tmp/forkling-big-upload', new Uint8Array(200 << 20).fill(7));
  assert.is(w.size, 200 << 20);
  assert.is((await sb.eval('import os\nos.path.getsize("/tmp/forkling-big-upload")')).value, 200 << 20);
  await sb.files.remove('/tmp/forkling-big-upload');
});

test('eval timeout throws TimeoutError and the interpreter stays usable', async () => {
  await expectError(TimeoutError, sb.eval('import time\nwhile True: time.sleep(0.01)', { timeoutMs: 200 }));
  assert.is((await sb.eval('1 + 1')).value, 2);
});

test('commands.run: exit code, output, envs, cwd, stdin, timeout', async () => {
  const r = await sb.commands.run('echo out; echo err >&2; exit 3');
  assert.equal([r.exitCode, r.stdout, r.stderr], [3, 'out\n', 'err\n']);
  const env = await sb.commands.run('echo "$FOO" && pwd', { envs: { FOO: 'bar' }, cwd: '/tmp' });
  assert.is(env.stdout, 'bar\n/tmp\n');
  const cat = await sb.commands.run(['cat'], { stdin: 'piped in' });
  assert.is(cat.stdout, 'piped in');
  const big = 'y'.repeat(3 * 1024 * 1024);
  const wc = await sb.commands.run(['wc', '-c'], { stdin: big });
  assert.is(wc.stdout.trim(), String(big.length));
  const chunks: string[] = [];
  await sb.commands.run('for i in 1 2 3; do echo $i; done', { onStdout: (t) => chunks.push(t) });
  assert.is(chunks.join(''), '1\n2\n3\n');
  await expectError(TimeoutError, sb.commands.run('sleep 5', { timeoutMs: 200 }));
  await expectError(NotFoundError, sb.commands.run(['/no/such/binary']));
});

test('commands.run in the background: handle with wait, sendStdin, kill', async () => {
  const got: string[] = [];
  const h = await sb.commands.run(['cat'], { background: true, onStdout: (t) => got.push(t) });
  assert.type(h.pid, 'number');
  await h.sendStdin('line 1\n');
  await h.sendStdin(new TextEncoder().encode('line 2\n'));
  await h.closeStdin();
  const r = await h.wait();
  assert.is(r.exitCode, 0);
  assert.is(r.stdout, 'line 1\nline 2\n');
  assert.is(got.join(''), 'line 1\nline 2\n');
  const sleeper = await sb.commands.run('sleep 30', { background: true });
  const listed = await sb.commands.list();
  assert.ok(listed.some((p) => p.procId === sleeper.procId && p.running === true));
  assert.is(await sleeper.kill(), true);
  const k = await sleeper.wait();
  assert.is(k.signal, 'SIGKILL');
});

test('files: write/read text, bytes, stream; list, exists, getInfo, makeDir, rename, remove', async () => {
  const dir = `/tmp/forkling-sdk-${sb.id}`;
  assert.is(await sb.files.makeDir(`${dir}/sub`), true);
  assert.is(await sb.files.makeDir(`${dir}/sub`), false);
  const w = await sb.files.write(`${dir}/a.txt`, 'héllo');
  assert.is(w.size, 6);
  assert.is(await sb.files.read(`${dir}/a.txt`), 'héllo');
  const bytes = new Uint8Array(2.5 * 1024 * 1024).map((_, i) => (i * 7) & 255);
  assert.is((await sb.files.write(`${dir}/big.bin`, bytes)).size, bytes.length);
  const back = await sb.files.read(`${dir}/big.bin`, { format: 'bytes' });
  assert.is(back.length, bytes.length);
  assert.ok(back.every((v, i) => v === bytes[i]));
  const stream = await sb.files.read(`${dir}/big.bin`, { format: 'stream' });
  let n = 0;
  let chunks = 0;
  for await (const c of stream as unknown as AsyncIterable<Uint8Array>) {
    n += c.length;
    chunks++;
  }
  assert.is(n, bytes.length);
  assert.ok(chunks >= 3, `chunks ${chunks}`);
  const src = new ReadableStream<Uint8Array>({
    start(c) {
      c.enqueue(new TextEncoder().encode('from '));
      c.enqueue(new TextEncoder().encode('a stream'));
      c.close();
    },
  });
  await sb.files.write(`${dir}/s.txt`, src);
  assert.is(await sb.files.read(`${dir}/s.txt`), 'from a stream');
  const names = (await sb.files.list(dir)).map((e) => `${e.name}:${e.type}`).sort();
  assert.equal(names, ['a.txt:file', 'big.bin:file', 's.txt:file', 'sub:dir']);
  assert.is(await sb.files.exists(`${dir}/a.txt`), true);
  assert.is(await sb.files.exists(`${dir}/nope`), false);
  const info = await sb.files.getInfo(`${dir}/big.bin`);
  assert.equal([info.name, info.type, info.size], ['big.bin', 'file', bytes.length]);
  await sb.files.rename(`${dir}/a.txt`, `${dir}/sub/b.txt`);
  assert.is(await sb.files.read(`${dir}/sub/b.txt`), 'héllo');
  await expectError(NotFoundError, sb.files.read(`${dir}/a.txt`));
  await expectError(NotFoundError, sb.files.read(`${dir}/a.txt`, { format: 'stream' }));
  await sb.files.remove(dir);
  assert.is(await sb.files.exists(dir), false);
});

test('one shared connection per url and token', async () => {
  const again = await Sandbox.connect(sb.id, opts);
  assert.is((await again.eval('x')).value, 21);
  const metrics = await (await fetch(`${srv.url}/metrics`, { headers: { authorization: `Bearer ${TOKEN}` } })).text();
  assert.match(metrics, /^forkling_ws_connections 1$/m);
});

test('a token no WebSocket can carry (/ or =) fails with a ConnectionError that says why, not a SyntaxError', async () => {
  const err = await Sandbox.list({ url: srv.url, token: 'abcdefghijklmnop/qrstuvwxyz=' }).catch((e: Error) => e);
  assert.instance(err, ConnectionError);
  assert.match((err as Error).message, /a token may hold only/);
});

test('a request over the frame limit fails at once with InvalidArgumentError; the connection goes on', async () => {
  const t0 = performance.now();
  const err = await sb.eval(`#${'x'.repeat(20 << 20)}`).catch((e: Error) => e);
  assert.instance(err, InvalidArgumentError);
  assert.match((err as Error).message, /over the server's limit/);
  assert.ok(performance.now() - t0 < 10_000);
  assert.is((await sb.eval('1 + 1')).value, 2);
});

test('an error frame without id (the server could not read which request) fails the open requests instead of leaving them waiting', async () => {
  // a fake server: answers hello, then answers every later request with an err frame without id
  const fake = (): WebSocketLike => {
    const ws: WebSocketLike = {
      binaryType: '',
      readyState: 1,
      send(data: Uint8Array) {
        const f = decodeFrame(data) as { id: number; op: string };
        const reply = f.op === 'hello' ? { t: 'res', id: f.id, version: 1, limits: { maxFrame: MAX_FRAME } } : { t: 'err', id: null, code: 'bad_frame', message: 'not one msgpack value' };
        setImmediate(() => ws.onmessage?.({ data: encodeFrame(reply) }));
      },
      close() {},
      onopen: null,
      onmessage: null,
      onclose: null,
      onerror: null,
    };
    setImmediate(() => ws.onopen?.({}));
    return ws;
  };
  const err = await Promise.race([
    Sandbox.list({ url: 'http://fake.invalid:1', token: 'fake-token-0123456789', webSocket: fake }).then(
      () => new Error('answered'),
      (e: Error) => e,
    ),
    new Promise<null>((r) => setTimeout(() => r(null), 5000)),
  ]);
  assert.ok(err, 'the request did not wait for ever');
  assert.match(err!.message, /could not read a request of ours/);
});

test('reconnect to a live sandbox from a new connection', async () => {
  await sb.eval('kept = "state survives the client"');
  Sandbox.disconnectAll();
  const re = await Sandbox.connect(sb.id, opts);
  assert.is((await re.eval('kept')).value, 'state survives the client');
  // the old object reconnects too (lazily, on its next call), on the same shared connection
  assert.is((await sb.eval('kept')).value, 'state survives the client');
  const metrics = async () => (await (await fetch(`${srv.url}/metrics`, { headers: { authorization: `Bearer ${TOKEN}` } })).text()).match(/^forkling_ws_connections (\d+)$/m)?.[1];
  assert.is(await metrics(), '1', 'one connection for both objects');
  Sandbox.disconnectAll(); // closes that one too
  let left = await metrics();
  for (const t0 = Date.now(); left !== '0' && Date.now() - t0 < 5000; left = await metrics()) await new Promise((r) => setTimeout(r, 20));
  assert.is(left, '0', 'no connection left open');
});

test('a background command outlives a dropped connection; wait() still gives its exit', async () => {
  const h = await sb.commands.run('echo begun; sleep 0.4; echo done; exit 5', { background: true });
  Sandbox.disconnectAll(); // the exec stream is lost with the connection
  const r = await h.wait();
  assert.is(r.exitCode, 5);
  assert.match(r.stdout, 'done');
  const again = await sb.commands.connect(h.procId);
  assert.is((await again.wait()).exitCode, 5);
  await expectError(NotFoundError, sb.commands.connect('p-none'));
});

test('fork and branch return usable sandboxes; the source goes on', async () => {
  const kids = await Sandbox.fork('default', 3, { ...opts, timeoutMs: 60_000 });
  assert.is(kids.length, 3);
  assert.is(new Set(kids.map((k) => k.id)).size, 3);
  const vals = await Promise.all(kids.map((k, i) => k.eval(`${i} + 100`)));
  assert.equal(
    vals.map((v) => v.value),
    [100, 101, 102],
  );
  await kids[0]?.eval('branch_me = 7');
  const branches = (await kids[0]?.branch(2)) ?? [];
  assert.is(branches.length, 2);
  for (const b of branches) {
    const info = await b.getInfo();
    assert.is(info.parent, kids[0]?.id);
    const v = await b.eval('1 + 1');
    assert.is(v.value, 2);
    if (srv.mode === 'cli') assert.is((await b.eval('branch_me')).value, 7); // the process engine carries state over
  }
  assert.is((await kids[0]?.eval('branch_me'))?.value, 7);
  // branches first: with the process engine a branch lives in its source's pid namespace and ends with it
  for (const k of [...branches, ...kids]) assert.is(await k.kill(), true);
  assert.is(await kids[0]?.kill(), false);
  await expectError(NotFoundError, kids[0]?.eval('1') as Promise<unknown>);
});

test('boot: a sandbox cold-booted from an image, without a template', async () => {
  const b = await Sandbox.boot({ ...opts, image: 'default', timeoutMs: 60_000 });
  const info = await b.getInfo();
  assert.is(info.template, null);
  assert.is((await b.eval('"booted"')).value, 'booted');
  assert.is(await b.kill(), true);
  await expectError(NotFoundError, Sandbox.boot({ ...opts, image: 'no-such-image' }));
});

test('a sandbox is killed when its timeout passes; a dropped client does not kill it', async () => {
  const t0 = Date.now();
  const short = await Sandbox.create({ ...opts, timeoutMs: 600 });
  const id = short.id;
  Sandbox.disconnectAll(); // the client goes away; the sandbox stays until its timeout
  const again = await Sandbox.connect(id, opts);
  assert.is((await again.eval('"alive"')).value, 'alive');
  while (await again.isRunning()) {
    if (Date.now() - t0 > 10_000) assert.unreachable('not killed within 10 s of a 600 ms timeout');
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.ok(Date.now() - t0 >= 550, `killed after ${Date.now() - t0} ms`);
  const e = await expectError(NotFoundError, again.eval('1'));
  assert.is(e.code, 'sandbox_ended');
  assert.match(e.message, 'timeout');
});

test('typed errors: unknown sandbox, wrong token, unreachable server', async () => {
  await expectError(NotFoundError, Sandbox.connect('no-such-sandbox', opts));
  await expectError(AuthError, Sandbox.create({ url: srv.url, token: 'wrong-token-0123456789' }));
  await expectError(AuthError, Sandbox.list({ url: srv.url, token: '' }));
  await expectError(ConnectionError, Sandbox.list({ url: 'http://127.0.0.1:1', token: TOKEN }));
  await expectError(InvalidArgumentError, Sandbox.create({ ...opts, template: '../etc' }));
  await expectError(NotFoundError, Sandbox.create({ ...opts, template: 'no-such-template' }));
});

test('kill', async () => {
  assert.is(await sb.kill(), true);
  assert.is(await sb.kill(), false);
  assert.is(await sb.isRunning(), false);
});

test.run();
