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

/** Outlets of a budget whose unsent bytes the test sets; `cuts` lists the names cut, in order. */
function outlets(b: UnsentBudget) {
  const held: Record<string, number> = {};
  const cuts: string[] = [];
  const why: string[] = [];
  const open = (name: string) => {
    held[name] = 0;
    return b.open(
      () => held[name]!,
      (w) => {
        cuts.push(name);
        why.push(w);
      },
    );
  };
  return { held, cuts, why, open };
}

test('budget: past it, the outlets holding the most are cut, not the one that wrote; drained ones are read again first', () => {
  const b = new UnsentBudget(8 * MiB, { stallMs: 1e9, refreshMs: 0 });
  const { held, cuts, why, open } = outlets(b);
  const a = open('a');
  const o = open('o');
  held.a = 6 * MiB;
  a.wrote(6 * MiB);
  assert.equal(cuts, [], 'under the budget');
  held.o = 3 * MiB;
  o.wrote(3 * MiB); // 9 MiB: a holds the most
  assert.equal(cuts, ['a']);
  assert.match(why[0]!, /budget of 8 MiB .* 6 MiB of it for this client, the most/);
  assert.is(b.total, 3 * MiB, 'a cut outlet counts no more');
  a.wrote(1); // (a cut outlet is closed: nothing more happens to it)
  assert.equal(cuts, ['a']);
  // one that drained meanwhile (not written since) is read again before anyone is cut
  const c = open('c');
  held.c = 6 * MiB;
  c.wrote(6 * MiB); // 9 MiB by the last reads
  assert.equal(cuts, ['a', 'c'], 'c holds the most now');
  held.o = 0; // o drained meanwhile
  const d = open('d');
  held.d = 6 * MiB;
  d.wrote(6 * MiB); // 3 + 6 = 9 MiB by the last reads, 6 MiB in truth
  assert.equal(cuts, ['a', 'c'], 'nobody cut: read again, the server holds 6 MiB');
  assert.is(b.total, 6 * MiB);
  for (const x of [o, d]) x.close();
  assert.is(b.total, 0);
});

test('budget: outlets under 64 KiB (clients that keep up) are never cut; one outlet over 256 MiB is', () => {
  const b = new UnsentBudget(1 * MiB, { stallMs: 1e9, refreshMs: 0 });
  const { held, cuts, open } = outlets(b);
  const many = Array.from({ length: 20 }, (_, i) => open(`s${i}`));
  for (const [i, o] of many.entries()) {
    held[`s${i}`] = CUT_MIN - 1;
    o.wrote(CUT_MIN - 1); // 20 x 64 KiB: over the budget, nobody to cut
  }
  assert.equal(cuts, []);
  const big = open('big');
  held.big = MAX_OUTLET + 1;
  big.wrote(MAX_OUTLET + 1);
  assert.equal(cuts, ['big']);
  for (const o of many) o.close();
  assert.throws(() => new UnsentBudget(0), /positive/);
});

test('budget: an outlet of 64 KiB or more that sends nothing for the stall time is cut; one that sends is not', async () => {
  const b = new UnsentBudget(1024 * MiB, { stallMs: 150 });
  const { held, cuts, why, open } = outlets(b);
  const stuck = open('stuck');
  const moving = open('moving');
  held.stuck = MiB;
  stuck.wrote(MiB);
  held.moving = MiB; // holds as much, but what it holds keeps going out
  const feed = setInterval(() => moving.wrote(64 * 1024), 10);
  try {
    assert.ok(await pollUntil(() => cuts.length > 0, 5000));
    await new Promise((r) => setTimeout(r, 300));
  } finally {
    clearInterval(feed);
  }
  assert.equal(cuts, ['stuck']);
  assert.match(why[0]!, /no byte of the 1 MiB unsent to this client went out for 0.15 s/);
  moving.close();
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
  const cut = () => logs.slice(before).some((l) => /http: cutting off an answer: the server holds more than its budget/.test(l));
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

test('REST: an answer that ended but sits unread (streamed, or whole JSON) is cut after the stall time, under the budget too', async () => {
  const metrics = new ServerMetrics();
  const manager = new SandboxManager({ engine: socketAgentEngine(sockPath, 'stall'), metrics, memorySampleMs: 0 });
  const log: string[] = [];
  const ctx2 = createContext({ manager, metrics, maxInFlight: 16, callAgent: callAgentClient, log: (l) => log.push(l), maxUnsentBytes: 1024 * MiB, unsentStallMs: 300 });
  const srv2 = new ForklingServer({ ctx: ctx2, auth: null });
  const url2 = (await srv2.listen('127.0.0.1', 0)).url;
  try {
    const created = await fetch(`${url2}/v1/sandboxes`, { method: 'POST', body: '{}', headers: { 'content-type': 'application/json' } });
    const { sandbox } = (await created.json()) as { sandbox: { id: string } };
    const req = request(`${url2}/v1/sandboxes/${sandbox.id}/eval`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', accept: 'application/x-ndjson' },
    });
    req.on('response', (r) => r.pause());
    req.on('error', () => {});
    req.end(JSON.stringify({ code: 'flood:48' }));
    assert.ok(await pollUntil(() => log.some((l) => /http: cutting off an answer: no byte of the \d+ MiB unsent to this client went out for 0.3 s/.test(l)), 20_000), log.join(' | '));
    assert.ok(await pollUntil(() => ctx2.unsent.total === 0, 5000), `held after the cut: ${ctx2.unsent.total}`);
    req.destroy();
    // a whole JSON answer (its events collected: up to 16 MiB) left unread goes the same way
    const cutsBefore = log.filter((l) => /cutting off an answer: no byte/.test(l)).length;
    const whole = request(`${url2}/v1/sandboxes/${sandbox.id}/eval`, { method: 'POST', headers: { 'content-type': 'application/json' } });
    whole.on('response', (r) => r.pause());
    whole.on('error', () => {});
    whole.end(JSON.stringify({ code: 'flood:12' }));
    assert.ok(await pollUntil(() => log.filter((l) => /cutting off an answer: no byte/.test(l)).length > cutsBefore, 20_000), log.join(' | '));
    assert.ok(await pollUntil(() => ctx2.unsent.total === 0, 5000), `held after the cut: ${ctx2.unsent.total}`);
    whole.destroy();
  } finally {
    await srv2.shutdown(500);
  }
});

test.run();
