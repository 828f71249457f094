// What the server holds for clients that read slower than their sandboxes
// write: one cap per outlet and a budget for all of them together
// (host/server/unsent.ts). A fake engine hands out sandboxes whose "agent" is
// a socket server of this test that floods an eval's stdout on request.
import { mkdtempSync, rmSync } from 'node:fs';
import { request } from 'node:http';
import { createServer, type Server, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import WebSocket from 'ws';
import { callAgentClient } from '../../host/server/agent-bridge.ts';
import { createContext, type ServerContext } from '../../host/server/context.ts';
import { SandboxManager } from '../../host/server/manager.ts';
import { ForklingServer } from '../../host/server/server.ts';
import { ServerMetrics } from '../../host/server/telemetry.ts';
import { CUT_MIN, MAX_OUTLET, UnsentBudget } from '../../host/server/unsent.ts';
import { pollUntil } from '../../host/util/poll.ts';
import { decodeFrame, encodeFrame, FrameReader, lengthPrefix } from '../../protocol/codec.ts';
import { socketAgentEngine } from './server-agent-engine.ts';

const MiB = 2 ** 20;

test('budget: an outlet under 1 MiB is never cut; over the budget the one writing with at least 1 MiB is, unless the others drained meanwhile', () => {
  const b = new UnsentBudget(8 * MiB);
  const held = { a: 0, b: 0, small: 0 };
  const a = b.open(() => held.a);
  const o = b.open(() => held.b);
  const small = b.open(() => held.small);
  held.a = 6 * MiB;
  assert.is(a.wrote(), null, 'under the budget');
  held.small = CUT_MIN - 1;
  held.b = 3 * MiB;
  // over the budget (9 MiB + ...): the small one writes, and is left alone
  assert.is(small.wrote(), null);
  // a drained meanwhile (not written since): read again, the server is under its budget after all
  held.a = 0;
  assert.is(o.wrote(), null);
  assert.ok(b.total < 8 * MiB, `total ${b.total}`);
  held.a = 7 * MiB;
  assert.match(String(a.wrote()), /budget of 8 MiB/);
  a.close();
  assert.is(b.total, held.b + held.small, 'a closed outlet counts no more');
  assert.is(a.wrote(), null, 'nor is it cut again');
  // one outlet alone past its own cap
  const big = new UnsentBudget(4 * MAX_OUTLET).open(() => MAX_OUTLET + 1);
  assert.match(String(big.wrote()), /more than 256 MiB unsent to this client/);
  assert.throws(() => new UnsentBudget(0), /positive/);
});

// ---------------------------------------------------------------- the server

const dir = mkdtempSync(join(tmpdir(), 'forkling-unsent-'));
const sockPath = join(dir, 'agent.sock');
const LIMIT = 8 * MiB;
const CHUNK = 'x'.repeat(256 * 1024);
let agentServer: Server;
let ctx: ServerContext;
let srv: ForklingServer;
let url = '';
const logs: string[] = [];

/** The fake agent: eval `flood:<MiB>` writes that much stdout (as fast as its socket takes it), then answers. */
function fakeAgent(s: Socket): void {
  const cancelled = new Set<number>();
  const send = (f: Record<string, unknown>) => {
    const bytes = encodeFrame(f);
    s.write(lengthPrefix(bytes.length));
    return s.write(bytes);
  };
  const flood = async (id: number, mib: number) => {
    for (let i = 0; i < mib * 4; i++) {
      if (cancelled.has(id) || s.destroyed) return;
      if (!send({ t: 'ev', id, ev: 'stdout', data: CHUNK })) await new Promise((r) => s.once('drain', r));
    }
    send({ t: 'res', id, repr: '', type: '', timedOut: false, durationMs: 0, value: mib });
  };
  const r = new FrameReader({
    payload: (p) => {
      const f = decodeFrame(p) as { t: string; id: number; op: string; code?: string };
      if (f.t === 'cancel') {
        cancelled.add(f.id);
        send({ t: 'err', id: f.id, code: 'cancelled', message: 'cancelled' });
        return;
      }
      if (f.t !== 'req') return;
      const m = /^flood:(\d+)$/.exec(f.code ?? '');
      if (f.op !== 'eval' || !m) send({ t: 'err', id: f.id, code: 'unknown_op', message: 'fake' });
      else void flood(f.id, Number(m[1]));
    },
    oversize() {},
  });
  s.on('data', (c) => r.push(c));
  s.on('error', () => {});
}


/** A WebSocket session with a sandbox; `read: false` stops reading the socket once the eval is sent. */
async function floodOverWs(mib: number, read: boolean) {
  const ws = new WebSocket(`${url.replace('http', 'ws')}/v1/ws`, ['forkling.v1']);
  const answers = new Map<number, (f: Record<string, unknown>) => void>();
  let stdout = 0;
  ws.on('message', (d: Buffer) => {
    const f = decodeFrame(d) as Record<string, unknown>;
    if (f.t === 'ev' && f.ev === 'stdout') stdout += String(f.data).length;
    else answers.get(f.id as number)?.(f);
  });
  const closed = new Promise<number>((r) => ws.once('close', (code) => r(code)));
  await new Promise((r) => ws.once('open', r));
  let n = 0;
  const ask = (f: Record<string, unknown>) =>
    new Promise<Record<string, unknown>>((resolve) => {
      const id = ++n;
      answers.set(id, resolve);
      ws.send(encodeFrame({ ...f, t: 'req', id }));
    });
  assert.is((await ask({ op: 'hello', versions: [1] })).t, 'res');
  const sandbox = ((await ask({ op: 'sandbox.create' })).sandbox as { id: string }).id;
  const answer = ask({ op: 'eval', sandbox, code: `flood:${mib}` });
  const socket = (ws as unknown as { _socket: Socket })._socket;
  if (!read) socket.pause();
  return { answer, closed, stdout: () => stdout, resume: () => socket.resume(), close: () => ws.terminate() };
}

test.before(async () => {
  agentServer = createServer(fakeAgent);
  await new Promise<void>((r) => agentServer.listen(sockPath, r));
  const metrics = new ServerMetrics();
  const manager = new SandboxManager({ engine: socketAgentEngine(sockPath, 'flood'), metrics, memorySampleMs: 0 });
  ctx = createContext({ manager, metrics, maxInFlight: 16, callAgent: callAgentClient, log: (l) => logs.push(l), maxUnsentBytes: LIMIT });
  srv = new ForklingServer({ ctx, auth: null });
  url = (await srv.listen('127.0.0.1', 0)).url;
});

test.after(async () => {
  await srv.shutdown(500);
  agentServer.close();
  rmSync(dir, { recursive: true, force: true });
});

test('clients that stop reading are cut off once the server holds more than its budget for all of them; one that reads is not', async () => {
  // Two sessions that stop reading, each sent 64 MiB (under one session's own cap of 256 MiB).
  const slow = [await floodOverWs(64, false), await floodOverWs(64, false)];
  const cuts = () => logs.filter((l) => /closing a session: the server holds more than its budget of 8 MiB/.test(l)).length;
  assert.ok(await pollUntil(() => cuts() === 2, 30_000), `both cut: ${logs.join(' | ')}`);
  // their buffers go with their sockets (1 s after the close frame that waits behind them)
  assert.ok(await pollUntil(() => ctx.unsent.total < CUT_MIN, 10_000), `held after the cuts: ${ctx.unsent.total}`);
  for (const s of slow) {
    s.resume();
    assert.ok([1006, 1008].includes(await s.closed), 'the session is closed');
  }
  // A session that reads gets all of 32 MiB, four times the budget.
  const fast = await floodOverWs(32, true);
  const done = await fast.answer;
  assert.is(done.value, 32, JSON.stringify(done));
  assert.is(fast.stdout(), 32 * MiB);
  assert.is(cuts(), 2, 'it was not cut');
  fast.close();
});

test('REST: a streamed (NDJSON) answer the client stops reading is cut off past the budget; the server goes on', async () => {
  const created = await fetch(`${url}/v1/sandboxes`, { method: 'POST', body: '{}', headers: { 'content-type': 'application/json' } });
  const { sandbox } = (await created.json()) as { sandbox: { id: string } };
  const before = logs.length;
  const req = request(`${url}/v1/sandboxes/${sandbox.id}/eval`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', accept: 'application/x-ndjson' },
  });
  let res: import('node:http').IncomingMessage | undefined;
  req.on('response', (r) => {
    res = r;
    r.pause(); // a client that stops reading
  });
  req.on('error', () => {});
  req.end(JSON.stringify({ code: 'flood:64' }));
  const cut = () => logs.slice(before).some((l) => /http: cutting off a streamed answer: the server holds more than its budget/.test(l));
  assert.ok(await pollUntil(cut, 30_000), `cut: ${logs.slice(before).join(' | ')}`);
  assert.ok(await pollUntil(() => ctx.unsent.total < CUT_MIN, 10_000), `held after the cut: ${ctx.unsent.total}`);
  res?.destroy();
  // the server goes on: a small flood answers in full
  const small = await fetch(`${url}/v1/sandboxes/${sandbox.id}/eval`, {
    method: 'POST',
    body: JSON.stringify({ code: 'flood:1' }),
    headers: { 'content-type': 'application/json' },
  });
  const body = (await small.json()) as { value: number; events: unknown[] };
  assert.is(body.value, 1);
  assert.is(body.events.length, 4);
});

test.run();
