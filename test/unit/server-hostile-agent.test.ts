// The server against a hostile agent (what a sandbox's agent answers is
// untrusted input): answers the server cannot pass on end that request with
// an error, and the server and the session go on. A fake engine hands out
// one sandbox whose "agent" is a socket server of this test.
import { mkdtempSync, rmSync } from 'node:fs';
import { createServer, type Server, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import WebSocket from 'ws';
import type { Engine } from '../../host/engine/engine.ts';
import { callAgentClient } from '../../host/server/agent-bridge.ts';
import type { CallAgent } from '../../host/server/bridge.ts';
import { createContext } from '../../host/server/context.ts';
import { SandboxManager } from '../../host/server/manager.ts';
import { ForklingServer } from '../../host/server/server.ts';
import { ServerMetrics } from '../../host/server/telemetry.ts';
import { decodeFrame, encodeFrame, FrameReader, lengthPrefix, MAX_NESTING } from '../../protocol/codec.ts';
import { socketAgentEngine } from './server-agent-engine.ts';

const dir = mkdtempSync(join(tmpdir(), 'forkling-hostile-agent-'));
const sockPath = join(dir, 'agent.sock');

/** An eval answer whose value is `valueBytes` (raw msgpack), else well formed. */
function evalAnswer(id: number, valueBytes: Uint8Array): Uint8Array {
  const base = encodeFrame({ t: 'res', id, repr: '', type: '', timedOut: false, durationMs: 0, value: 0 });
  // the map's last value is `value: 0` (one byte, 0x00): replaced by the raw bytes
  const out = new Uint8Array(base.length - 1 + valueBytes.length);
  out.set(base.subarray(0, base.length - 1));
  out.set(valueBytes, base.length - 1);
  return out;
}

const nested = (depth: number) => {
  const b = new Uint8Array(depth + 1).fill(0x91); // [[[...0...]]]
  b[depth] = 0;
  return b;
};

/** What the fake agent answers to eval code: a raw value, or a normal number. */
function valueFor(code: string): Uint8Array {
  if (code === 'cyclic') return Uint8Array.from([0xd6, 0x69, 0, 0, 0, 1, 0x91, 0xd6, 0x70, 0, 0, 0, 1]); // msgpackr's id + back-reference
  if (code === 'deep') return nested(MAX_NESTING + 1); // (deeper would decode here but not encode again)
  if (code === 'bomb') {
    // 15 Mi empty maps of one byte each: 10 s and 2 GiB to decode, were it decoded
    const n = 15 << 20;
    const b = new Uint8Array(5 + n).fill(0x80);
    b[0] = 0xdd;
    new DataView(b.buffer).setUint32(1, n);
    return b;
  }
  return Uint8Array.of(Number(code)); // (a small number: msgpack's positive fixint is the byte itself)
}

let agentServer: Server;
let server: { srv: ForklingServer; url: string };
let url = '';
const logs: string[] = [];

async function startServer(engine: Engine, callAgent: CallAgent, heartbeatMs?: number): Promise<{ srv: ForklingServer; url: string }> {
  const metrics = new ServerMetrics();
  const manager = new SandboxManager({ engine, metrics, memorySampleMs: 0 });
  const ctx = createContext({ manager, metrics, maxInFlight: 16, callAgent, log: (l) => logs.push(l) });
  const srv = new ForklingServer({ ctx, auth: null, ...(heartbeatMs !== undefined ? { heartbeatMs } : {}) });
  return { srv, url: (await srv.listen('127.0.0.1', 0)).url };
}

/** A WebSocket session that has said hello: ask() sends a request and resolves with its answer. */
async function session(serverUrl: string) {
  const ws = new WebSocket(`${serverUrl.replace('http', 'ws')}/v1/ws`, ['forkling.v1']);
  const waiters = new Map<number, (f: Record<string, unknown>) => void>();
  ws.on('message', (d: Buffer) => {
    const f = decodeFrame(d) as Record<string, unknown>;
    waiters.get(f.id as number)?.(f);
  });
  await new Promise((r) => ws.once('open', r));
  let n = 0;
  const ask = (f: Record<string, unknown>) =>
    new Promise<Record<string, unknown>>((resolve) => {
      const id = ++n;
      waiters.set(id, resolve);
      ws.send(encodeFrame({ ...f, t: 'req', id }));
    });
  assert.is((await ask({ op: 'hello', versions: [1] })).t, 'res');
  /** Sends a frame as it is (client events of the last request: id = lastId()). */
  const send = (f: Record<string, unknown>) => ws.send(encodeFrame(f));
  return { ask, send, lastId: () => n, close: () => ws.close() };
}

/** A new sandbox's id, from sandbox.create's answer. */
async function created(ask: (f: Record<string, unknown>) => Promise<Record<string, unknown>>): Promise<string> {
  const res = await ask({ op: 'sandbox.create' });
  assert.is(res.t, 'res', JSON.stringify(res));
  return (res.sandbox as { id: string }).id;
}


test.before(async () => {
  agentServer = createServer((s: Socket) => {
    const r = new FrameReader({
      payload: (p) => {
        const f = decodeFrame(p) as { t: string; id: number; op: string; code?: string };
        if (f.t !== 'req') return;
        if (f.op === 'files.write') {
          s.pause(); // an agent that stops reading: what is streamed to it waits in the server
          return;
        }
        const bytes =
          f.op !== 'eval'
            ? encodeFrame({ t: 'err', id: f.id, code: 'unknown_op', message: 'fake' })
            : f.code === 'claim'
              ? encodeFrame({ t: 'err', id: f.id, code: 'unauthorized', message: 'an agent claiming a server code' })
              : evalAnswer(f.id, valueFor(f.code ?? '0'));
        s.write(lengthPrefix(bytes.length));
        s.write(bytes);
      },
      oversize() {},
    });
    s.on('data', (c) => r.push(c));
    s.on('error', () => {});
  });
  await new Promise<void>((r) => agentServer.listen(sockPath, r));
  server = await startServer(socketAgentEngine(sockPath, 'hostile'), callAgentClient);
  url = server.url;
});

test.after(async () => {
  await server.srv.shutdown(500);
  agentServer.close();
  rmSync(dir, { recursive: true, force: true });
});

test('an agent that answers what the host does not decode (nested too deep, a value that contains itself, millions of maps) ends its connection; the server and the session go on', async () => {
  const { ask, close } = await session(url);
  assert.is((await ask({ op: 'sandbox.create' })).t, 'res');
  for (const [code, sandbox] of [
    ['deep', 'hostile1'],
    ['cyclic', 'hostile2'],
    ['bomb', 'hostile3'],
  ] as const) {
    assert.is((await ask({ op: 'sandbox.create' })).t, 'res');
    assert.is((await ask({ op: 'eval', sandbox, code: '7' })).value, 7);
    const t0 = performance.now();
    const bad = await ask({ op: 'eval', sandbox, code });
    assert.ok(performance.now() - t0 < 3000, `${code}: refused without decoding it`);
    assert.is(bad.t, 'err', JSON.stringify(bad).slice(0, 200));
    assert.match(String(bad.message), /undecodable frame from the agent/);
    const after = await ask({ op: 'eval', sandbox, code: '7' });
    assert.is(after.t, 'err', `${code}: the connection to that agent is closed`);
  }
  // An agent may not answer with one of the server's own codes (a REST 401, the SDK's AuthError).
  assert.is((await ask({ op: 'sandbox.create' })).t, 'res');
  const claim = await ask({ op: 'eval', sandbox: 'hostile4', code: 'claim' });
  assert.is(claim.code, 'internal', JSON.stringify(claim));
  // The server and the session go on.
  assert.is((await ask({ op: 'sandbox.create' })).t, 'res');
  assert.is((await ask({ op: 'eval', sandbox: 'hostile5', code: '8' })).value, 8);
  close();
});

test('a stream into an agent that stops reading: the server stops reading the client, then ends that request (5 s without progress); the session goes on', async () => {
  const { ask, send, lastId, close } = await session(url);
  const sandbox = await created(ask);
  const answer = ask({ op: 'files.write', sandbox, path: '/tmp/big', stream: true });
  const chunk = new Uint8Array(1 << 20);
  for (let i = 0; i < 80; i++) send({ t: 'ev', id: lastId(), ev: 'data', data: chunk });
  const got = await answer;
  assert.is(got.t, 'err');
  assert.is(got.code, 'resource_exhausted', JSON.stringify(got));
  assert.is((await ask({ op: 'ping' })).t, 'res', 'the session goes on');
  close();
});

test('a raw upload (PUT .../files) into an agent that stops reading is ended after 5 s without progress, saying so', async () => {
  const { ask, close } = await session(url);
  const sandbox = await created(ask);
  close();
  let sentMiB = 0;
  const body = new ReadableStream<Uint8Array>({
    pull(c) {
      if (sentMiB++ >= 200) c.close();
      else c.enqueue(new Uint8Array(1 << 20));
    },
  });
  const t0 = performance.now();
  const r = await fetch(`${url}/v1/sandboxes/${sandbox}/files?path=/tmp/big`, { method: 'PUT', body, duplex: 'half' } as RequestInit);
  assert.is(r.status, 503);
  const j = (await r.json()) as { error: { code: string; message: string } };
  assert.is(j.error.code, 'resource_exhausted');
  assert.match(j.error.message, /took none of this upload for 5 s/);
  assert.ok(performance.now() - t0 < 60_000, 'ended long before any request timeout');
  assert.ok(sentMiB < 200, `the server stopped reading (${sentMiB} MiB taken from the client)`);
});

test('an SDK stream upload into an agent that stops reading: the SDK stops reading its source too', async () => {
  const { Sandbox } = await import('../../host/index.ts');
  const sb = await Sandbox.create({ template: 'default', url });
  let pulled = 0;
  const CHUNKS = 96;
  const source = new ReadableStream<Uint8Array>(
    {
      pull(c) {
        if (pulled++ === CHUNKS) c.close();
        else c.enqueue(new Uint8Array(1 << 20).fill(5));
      },
    },
    { highWaterMark: 0 },
  );
  const err = await sb.files.write('/tmp/x', source).catch((e: Error) => e);
  assert.instance(err, Error);
  assert.match((err as Error).message, /took none of this stream/);
  // the server stopped reading at 16 MiB waiting; the SDK let 8 MiB wait on its side (plus the
  // sockets' buffers): without that it read the whole source into memory (96 MiB here)
  assert.ok(pulled < 64, `the SDK read ${pulled} MiB of a 96 MiB source`);
});

test('a session paused by its upload (the agent stopped reading) is not dropped by the heartbeat meanwhile; the stall rule ends the upload, the session goes on', async () => {
  // Pinged every second: while the server reads nothing of the client, no pong can arrive (before
  // the fix the session was dropped at the second ping, and the upload failed with a closed socket).
  const fast = await startServer(socketAgentEngine(sockPath, 'hostile-heartbeat'), callAgentClient, 1000);
  const { Sandbox } = await import('../../host/index.ts');
  try {
    const sb = await Sandbox.create({ template: 'default', url: fast.url });
    let pulled = 0;
    const source = new ReadableStream<Uint8Array>(
      {
        pull(c) {
          if (pulled++ === 48) c.close();
          else c.enqueue(new Uint8Array(1 << 20).fill(7));
        },
      },
      { highWaterMark: 0 },
    );
    const err = await sb.files.write('/tmp/x', source).catch((e: Error) => e);
    assert.instance(err, Error);
    assert.match((err as Error).message, /took none of this stream/);
    // (that agent reads nothing more: another sandbox, over the same connection)
    const other = await Sandbox.create({ template: 'default', url: fast.url });
    assert.is((await other.eval('6')).value, 6, 'the session answers again');
  } finally {
    await fast.srv.shutdown(500);
  }
});

test('an answer the server cannot encode ends that request with internal; the session goes on', async () => {
  // (a decoded agent answer always encodes again: MAX_NESTING; this checks the guard behind it)
  const calls = new Map<string, number>();
  const callAgent: CallAgent = (_sb, _op, args) => {
    const code = String(args.code);
    calls.set(code, (calls.get(code) ?? 0) + 1);
    const value = code === 'huge' ? 10n ** 30n : Number(code); // no msgpack integer holds 10^30
    return { done: Promise.resolve({ repr: '', type: '', timedOut: false, durationMs: 0, value }), async send() {}, cancel() {} };
  };
  const second = await startServer(socketAgentEngine(sockPath, 'hostile'), callAgent);
  try {
    const { ask, close } = await session(second.url);
    const sandbox = await created(ask);
    const bad = await ask({ op: 'eval', sandbox, code: 'huge' });
    assert.is(bad.t, 'err');
    assert.is(bad.code, 'internal');
    assert.ok(logs.some((l) => /could not be encoded/.test(l)), logs.join('\n'));
    assert.is((await ask({ op: 'eval', sandbox, code: '9' })).value, 9);
    close();
  } finally {
    await second.srv.shutdown(500);
  }
});

test('a server without a token refuses what a web page sends (REST and WebSocket), and a host name that is not loopback', async () => {
  const { request } = await import('node:http');
  const status = (headers: Record<string, string>) =>
    new Promise<number>((resolve, reject) => {
      const r = request(`${url}/v1/sandboxes`, { headers }, (res) => {
        res.resume();
        resolve(res.statusCode ?? 0);
      });
      r.on('error', reject);
      r.end();
    });
  assert.is(await status({}), 200);
  assert.is(await status({ origin: 'https://evil.example' }), 403);
  assert.is(await status({ host: 'rebound.evil.example' }), 403);
  const ws = new WebSocket(`${url.replace('http', 'ws')}/v1/ws`, ['forkling.v1'], { origin: 'https://evil.example' });
  const code = await new Promise<number>((resolve) => {
    ws.on('unexpected-response', (_req, res) => resolve(res.statusCode ?? 0));
    ws.on('open', () => resolve(101));
    ws.on('error', () => {});
  });
  assert.is(code, 403);
});

test.run();
