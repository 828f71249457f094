// The WebSocket API of `forkling serve` at the frame level: auth at upgrade,
// hello, routing to agents, interleaved streams, bad input of every kind,
// the in-flight cap, a client that drops mid-stream, 200 concurrent sessions.
import * as assert from 'uvu/assert';
import { suite } from 'uvu';
import { MAX_FRAME } from '../../protocol/schema.ts';
import { type Frame, RawClient, type Served, serve } from './server-harness.ts';
import { loud } from '../loud-hook.ts';

const TOKEN = 'test-token-0123456789abcdef';
const test = suite('server-ws');
let srv: Served;
let sandbox: string;

test.before(loud("the suite's set-up (test.before)", async () => {
  srv = await serve({ token: TOKEN, maxInFlight: 32 });
  const c = await RawClient.open(srv.url, { token: TOKEN });
  const r = await c.request('sandbox.create', { timeoutMs: 120_000 });
  assert.is(r.t, 'res', JSON.stringify(r));
  sandbox = (r.sandbox as { id: string }).id;
  c.close();
}));

test.after(async () => {
  const code = await srv.stop();
  assert.is(code, 0, srv.log.join(''));
});

test('upgrade without a token or with a wrong one is refused with 401', async () => {
  for (const attempt of [{}, { token: 'wrong-token-0123456789' }, { token: `${TOKEN}x`, via: 'protocol' as const }]) {
    try {
      await RawClient.open(srv.url, { ...attempt, hello: false });
      assert.unreachable('upgrade accepted');
    } catch (e) {
      assert.match((e as Error).message, 'HTTP 401');
    }
  }
  const res = await fetch(`${srv.url}/v1/sandboxes`);
  assert.is(res.status, 401);
  assert.is(((await res.json()) as { error: { code: string } }).error.code, 'unauthorized');
});

test('the token is accepted from the header, the subprotocol and the query', async () => {
  for (const via of ['header', 'protocol', 'query'] as const) {
    const c = await RawClient.open(srv.url, { token: TOKEN, via });
    assert.is(c.ws.protocol, 'forkling.v1');
    const r = await c.request('ping');
    assert.is(r.t, 'res');
    c.close();
  }
});

test('hello first; then server ops and routed agent ops', async () => {
  const c = await RawClient.open(srv.url, { token: TOKEN, hello: false });
  const early = await c.request('sandbox.list');
  assert.equal([early.t, early.code], ['err', 'hello_required']);
  const bad = await c.request('hello', { versions: [99] });
  assert.equal([bad.t, bad.code], ['err', 'unsupported_version']);
  const h = await c.request('hello', { versions: [1] });
  assert.is(h.t, 'res');
  assert.is(h.version, 1);
  assert.ok((h.routedOps as string[]).includes('eval'));
  const events: Frame[] = [];
  const r = await c.request('eval', { sandbox, code: 'print("a")\n6*7' }, events);
  assert.is(r.t, 'res', JSON.stringify(r));
  assert.is(r.value, 42);
  assert.equal(
    events.map((e) => [e.ev, e.data]),
    [['stdout', 'a\n']],
  );
  const info = await c.request('info', { sandbox });
  assert.is(info.sandboxId, sandbox);
  c.close();
});

test('bad input gets error frames and the connection goes on', async () => {
  const c = await RawClient.open(srv.url, { token: TOKEN });
  const expect = async (code: string, send: () => void, id: number | null = null) => {
    send();
    const f = await c.next();
    assert.is(f.t, 'err', JSON.stringify(f));
    assert.is(f.code, code, JSON.stringify(f));
    assert.is(f.id, id);
    assert.type(f.message, 'string');
    return f;
  };
  await expect('bad_frame', () => c.sendRaw(new Uint8Array([0xc1, 0xff, 0x00])));
  await expect('bad_frame', () => c.sendRaw('{"t":"req"}'));
  await expect('bad_frame', () => c.send({ hello: 'world' } as Frame));
  await expect('bad_frame', () => c.sendRaw(new Uint8Array([0x93, 1, 2, 3]))); // an array, not a map
  await expect('bad_request', () => c.send({ t: 'req', id: -1, op: 'ping' }));
  const f = await expect('bad_request', () => c.send({ t: 'req', id: 7, op: 'eval', sandbox, code: 5 }), 7);
  assert.match(f.message as string, '/code');
  await expect('bad_request', () => c.send({ t: 'req', id: 8, op: 'sandbox.fork', template: 'default', n: 0 }), 8);
  await expect('bad_request', () => c.send({ t: 'req', id: 9, op: 'eval', code: '1' }), 9); // no sandbox
  await expect('unknown_op', () => c.send({ t: 'req', id: 10, op: 'format_disk' }), 10);
  await expect('unknown_op', () => c.send({ t: 'req', id: 11, op: 'restore', sandbox }), 11); // host-only op
  await expect('not_found', () => c.send({ t: 'req', id: 12, op: 'eval', sandbox: 'no-such-sandbox', code: '1' }), 12);
  await expect('bad_request', () => c.send({ t: 'req', id: 13, op: 'eval', sandbox: '../etc', code: '1' }), 13);
  await expect('unknown_request', () => c.send({ t: 'ev', id: 999, ev: 'data', data: new Uint8Array(1) }), 999);
  await expect('bad_frame', () => c.send({ t: 'res', id: 1 }), 1);
  // an agent error passes through with its code
  await expect('not_found', () => c.send({ t: 'req', id: 14, op: 'files.read', sandbox, path: '/no/such/file' }), 14);
  // oversized: above MAX_FRAME but below the WebSocket hard cap -> error frame, session survives
  await expect('frame_too_large', () => c.sendRaw(new Uint8Array(MAX_FRAME + 1)));
  const ok = await c.request('eval', { sandbox, code: '1+1' });
  assert.is(ok.value, 2);
  // above the WebSocket hard cap (2 x MAX_FRAME) the message is not buffered: that socket closes with 1009
  const huge = await RawClient.open(srv.url, { token: TOKEN });
  huge.sendRaw(new Uint8Array(2 * MAX_FRAME + 1));
  assert.is((await huge.closed).code, 1009);
  const still = await c.request('eval', { sandbox, code: '2+2' });
  assert.is(still.value, 4);
  c.close();
});

test('fuzz: 1000 random frames never produce an internal error and the session goes on', async () => {
  const c = await RawClient.open(srv.url, { token: TOKEN });
  let seed = 12345;
  const rnd = (n: number) => {
    seed = (seed * 1103515245 + 12345) & 0x7fffffff;
    return seed % n;
  };
  const pick = <T>(xs: T[]): T => xs[rnd(xs.length)] as T;
  const values = (): unknown =>
    pick<unknown>([null, true, -1, 0, 2 ** 33, 1.5, '', 'x'.repeat(rnd(300)), new Uint8Array(rnd(64)), [1, 'a'], { a: 1 }, sandbox, '../x']);
  const ops = ['eval', 'exec', 'files.read', 'files.write', 'proc.wait', 'sandbox.kill', 'sandbox.fork', 'sandbox.setTimeout', 'hello', 'nope', 'restore'];
  for (let i = 0; i < 1000; i++) {
    const f: Frame = {};
    if (rnd(10)) f.t = pick<unknown>(['req', 'req', 'req', 'ev', 'cancel', 'res', 'err', 7]);
    if (rnd(10)) f.id = rnd(5) ? 10_000 + i : values();
    if (rnd(10)) f.op = rnd(5) ? pick(ops) : values();
    if (rnd(2)) f.sandbox = rnd(3) ? sandbox : values();
    for (const k of ['code', 'path', 'argv', 'shell', 'n', 'timeoutMs', 'template', 'data', 'ev', 'procId']) {
      if (!rnd(4)) f[k] = values();
    }
    if (f.op === 'sandbox.kill' || f.op === 'sandbox.setTimeout') f.sandbox = 'fuzz-target-does-not-exist';
    if (f.op === 'sandbox.fork') f.n = 1 + rnd(300);
    c.send(f);
  }
  c.send({ t: 'req', id: 99_999, op: 'eval', sandbox, code: '"after fuzz"' });
  const codes = new Map<string, number>();
  for (;;) {
    const f = await c.next(30_000);
    if (f.t === 'err') codes.set(f.code as string, (codes.get(f.code as string) ?? 0) + 1);
    if (f.id === 99_999 && f.t !== 'ev') {
      assert.is(f.value, 'after fuzz', JSON.stringify(f));
      break;
    }
  }
  assert.not.ok(codes.has('internal'), JSON.stringify([...codes]));
  assert.ok((codes.get('bad_request') ?? 0) > 100, JSON.stringify([...codes]));
  // sandboxes forked by the fuzz (a valid fork can happen) are cleaned up
  const list = await c.request('sandbox.list');
  for (const s of list.sandboxes as { id: string }[]) if (s.id !== sandbox) await c.request('sandbox.kill', { sandbox: s.id });
  c.close();
});

test('duplicate ids while open are refused; ids are reusable after', async () => {
  const c = await RawClient.open(srv.url, { token: TOKEN });
  c.send({ t: 'req', id: 500, op: 'eval', sandbox, code: 'import time; time.sleep(0.3); 1' });
  c.send({ t: 'req', id: 500, op: 'ping' });
  const dup = await c.next();
  assert.equal([dup.t, dup.code, dup.id], ['err', 'duplicate_id', 500]);
  const res = await c.next();
  assert.equal([res.t, res.id, res.value], ['res', 500, 1]);
  c.send({ t: 'req', id: 500, op: 'ping' });
  assert.is((await c.next()).t, 'res');
  c.close();
});

test('frames sent without waiting: a ping right behind hello is answered; an id cancelled is free again at once', async () => {
  const c = await RawClient.open(srv.url, { token: TOKEN, hello: false });
  c.send({ t: 'req', id: 1, op: 'hello', versions: [1] });
  c.send({ t: 'req', id: 2, op: 'ping' });
  const answers = [await c.next(), await c.next()];
  assert.equal(
    answers.map((f) => [f.t, f.id]),
    [
      ['res', 1],
      ['res', 2],
    ],
  );
  // a routed request cancelled, its id reused in the very next frame
  c.send({ t: 'req', id: 7, op: 'eval', sandbox, code: 'import time; time.sleep(5); 1' });
  c.send({ t: 'cancel', id: 7 });
  c.send({ t: 'req', id: 7, op: 'eval', sandbox, code: '6 * 7' });
  const cancelled = await c.next();
  assert.equal([cancelled.t, cancelled.id, cancelled.code], ['err', 7, 'cancelled']);
  const next = await c.next();
  assert.equal([next.t, next.id, next.value], ['res', 7, 42], JSON.stringify(next));
  c.close();
});

test('a flood beyond the in-flight cap gets too_many_requests; the rest are answered', async () => {
  const c = await RawClient.open(srv.url, { token: TOKEN });
  const n = 100; // the server runs with --max-in-flight 32
  for (let i = 0; i < n; i++) c.send({ t: 'req', id: 1000 + i, op: 'eval', sandbox, code: 'import time; time.sleep(0.002); 1' });
  let ok = 0;
  let limited = 0;
  for (let i = 0; i < n; i++) {
    const f = await c.next();
    if (f.t === 'res') ok++;
    else if (f.code === 'too_many_requests') limited++;
    else assert.unreachable(JSON.stringify(f));
  }
  assert.is(ok + limited, n);
  assert.ok(ok >= 32, `answered ${ok}`);
  assert.ok(limited > 0, 'nothing was limited');
  const after = await c.request('eval', { sandbox, code: '3' });
  assert.is(after.value, 3);
  c.close();
});

test('streams of several requests interleave by request id; many sockets share a sandbox', async () => {
  const a = await RawClient.open(srv.url, { token: TOKEN });
  const b = await RawClient.open(srv.url, { token: TOKEN });
  a.send({ t: 'req', id: 1, op: 'exec', sandbox, shell: 'for i in 1 2 3; do echo out$i; sleep 0.05; done' });
  a.send({ t: 'req', id: 2, op: 'eval', sandbox, code: 'for i in range(3): print("ev", i)' });
  const rb = await b.request('eval', { sandbox, code: '"from b"' });
  assert.is(rb.value, 'from b');
  const byId = new Map<number, Frame[]>();
  let finals = 0;
  while (finals < 2) {
    const f = await a.next();
    const list = byId.get(f.id as number) ?? [];
    list.push(f);
    byId.set(f.id as number, list);
    if (f.t !== 'ev') finals++;
  }
  const out1 = (byId.get(1) ?? [])
    .filter((f) => f.ev === 'stdout')
    .map((f) => Buffer.from(f.data as Uint8Array).toString())
    .join('');
  assert.is(out1, 'out1\nout2\nout3\n');
  assert.is((byId.get(1) ?? []).at(-1)?.exitCode, 0);
  const out2 = (byId.get(2) ?? []).filter((f) => f.ev === 'stdout').map((f) => f.data).join('');
  assert.is(out2, 'ev 0\nev 1\nev 2\n');
  a.close();
  b.close();
});

test('client events stream stdin into exec', async () => {
  const c = await RawClient.open(srv.url, { token: TOKEN });
  c.send({ t: 'req', id: 1, op: 'exec', sandbox, argv: ['wc', '-c'], stdinStream: true });
  for (let i = 0; i < 4; i++) c.send({ t: 'ev', id: 1, ev: 'data', data: new Uint8Array(1000) });
  c.send({ t: 'ev', id: 1, ev: 'end' });
  let out = '';
  for (;;) {
    const f = await c.next();
    if (f.ev === 'stdout') out += Buffer.from(f.data as Uint8Array).toString();
    if (f.t === 'res') break;
    assert.ok(f.t === 'ev', JSON.stringify(f));
  }
  assert.is(out.trim(), '4000');
  c.close();
});

test('a client that disconnects mid-stream: the server and the sandbox go on', async () => {
  const c = await RawClient.open(srv.url, { token: TOKEN });
  c.send({ t: 'req', id: 1, op: 'exec', sandbox, shell: 'while true; do echo tick; sleep 0.01; done' });
  c.send({ t: 'req', id: 2, op: 'eval', sandbox, code: 'import time\nfor i in range(100):\n  print(i); time.sleep(0.01)' });
  let ticks = 0;
  while (ticks < 5) if ((await c.next()).ev === 'stdout') ticks++;
  c.ws.terminate(); // no close handshake: as if the network dropped
  const d = await RawClient.open(srv.url, { token: TOKEN });
  // the dropped client's eval was cancelled (interrupted), so the agent takes new evals at once
  const r = await d.request('eval', { sandbox, code: '"still here"' });
  assert.is(r.value, 'still here');
  // and its foreground command was killed: the `tick` loop ends (reaped within moments)
  const until = Date.now() + 5000;
  for (;;) {
    const ps = await d.request('proc.list', { sandbox });
    const running = (ps.procs as { running: boolean; argv: string[] }[]).filter((p) => p.running);
    if (running.length === 0) break;
    if (Date.now() > until) assert.unreachable(`still running: ${JSON.stringify(running)}`);
    await new Promise((r) => setTimeout(r, 20));
  }
  d.close();
});

test('a cancelled sandbox.fork, or one whose client went away, leaves no sandbox behind', async () => {
  const created = async () => {
    const text = await (await fetch(`${srv.url}/metrics`, { headers: { authorization: `Bearer ${TOKEN}` } })).text();
    return [...text.matchAll(/^forkling_sandboxes_created_total\{[^}]*\} (\d+)$/gm)].reduce((a, m) => a + Number(m[1]), 0);
  };
  const c = await RawClient.open(srv.url, { token: TOKEN });
  const before = ((await c.request('sandbox.list', {})).sandboxes as unknown[]).length;
  const createdBefore = await created();
  // (5: more than the server's spare forks, so that each fork waits for new ones: a fork of
  // spares alone can be answered before the cancel that follows it arrives)
  c.send({ t: 'req', id: 900, op: 'sandbox.fork', template: 'default', n: 5 });
  c.send({ t: 'cancel', id: 900 });
  const answer = await c.next();
  assert.equal([answer.id, answer.t, answer.code], [900, 'err', 'cancelled']);
  const d = await RawClient.open(srv.url, { token: TOKEN });
  d.send({ t: 'req', id: 901, op: 'sandbox.fork', template: 'default', n: 5 });
  // ops that make nothing are only answered cancelled: what they name lives on
  d.send({ t: 'req', id: 902, op: 'sandbox.list' });
  d.send({ t: 'cancel', id: 902 });
  d.ws.terminate();
  // both forks finish making their sandboxes (10 made), which then go
  const until = Date.now() + 20_000;
  for (;;) {
    const now = ((await c.request('sandbox.list', {})).sandboxes as unknown[]).length;
    if (now === before && (await created()) >= createdBefore + 10) break;
    if (Date.now() > until) assert.unreachable(`${now - before} sandboxes left behind`);
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.is(((await c.request('eval', { sandbox, code: '1 + 1' })).value as number), 2, 'the sandbox the suite uses lives');
  c.close();
});

test('200 concurrent WebSocket sessions, each doing evals', async () => {
  const N = 200;
  const EVALS = 10;
  const opener = await RawClient.open(srv.url, { token: TOKEN });
  const fork = await opener.request('sandbox.fork', { template: 'default', n: 4, timeoutMs: 120_000 });
  assert.is(fork.t, 'res', JSON.stringify(fork));
  const ids = (fork.sandboxes as { id: string }[]).map((s) => s.id);
  const clients = await Promise.all(Array.from({ length: N }, () => RawClient.open(srv.url, { token: TOKEN })));
  const results = await Promise.all(
    clients.map(async (c, i) => {
      const sb = ids[i % ids.length];
      let sum = 0;
      for (let k = 0; k < EVALS; k++) {
        const r = await c.request('eval', { sandbox: sb, code: `${i} * 1000 + ${k}` });
        if (r.t !== 'res') throw new Error(JSON.stringify(r));
        sum += (r.value as number) - i * 1000;
      }
      return sum;
    }),
  );
  assert.equal(results, Array(N).fill((EVALS * (EVALS - 1)) / 2));
  for (const c of clients) c.close();
  for (const id of ids) assert.equal((await opener.request('sandbox.kill', { sandbox: id })).killed, true);
  opener.close();
});

test.run();
