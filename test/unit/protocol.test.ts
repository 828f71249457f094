// The wire protocol without an agent: codec, stream framing, validation,
// golden vectors, the generated schema copies, and AgentClient against a fake
// (hostile) agent.
import { readFileSync } from 'node:fs';
import { Duplex } from 'node:stream';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { AgentClient, AgentError, answeredWithin, helloAndRestore } from '../../host/agent/client.ts';
import {
  decodeFrame,
  MAX_NESTING,
  encodeFrame,
  encodePrefixed,
  FrameReader,
  fromHex,
  lengthPrefix,
  toHex,
} from '../../protocol/codec.ts';
import { AGENT_PATH, agentWithSchema, SCHEMA_JSON_PATH, schemaJson } from '../../protocol/gen.ts';
import { ERROR_CODES, MAX_CHUNK, MAX_FRAME, OPS, type OpName } from '../../protocol/schema.ts';
import { checkClientEvent, checkEvent, checkResult, validateFrame } from '../../protocol/validate.ts';

interface Vector {
  name: string;
  from: 'client' | 'agent';
  op?: OpName;
  hex: string;
  frame: unknown;
}
const vectors = JSON.parse(readFileSync(new URL('../../protocol/vectors/frames.json', import.meta.url), 'utf8')) as {
  frames: Vector[];
  invalid: { name: string; hex: string; code: string; field: string | null }[];
};

function fromJson(v: unknown): unknown {
  if (Array.isArray(v)) return v.map(fromJson);
  if (v && typeof v === 'object') {
    const o = v as Record<string, unknown>;
    if (Object.keys(o).length === 1 && typeof o['$bin'] === 'string') return fromHex(o['$bin']);
    return Object.fromEntries(Object.entries(o).map(([k, x]) => [k, fromJson(x)]));
  }
  return v;
}

/** Deep equality that treats Buffer and Uint8Array alike. */
function plain(v: unknown): unknown {
  if (v instanceof Uint8Array) return { $bin: toHex(v) };
  if (Array.isArray(v)) return v.map(plain);
  if (v && typeof v === 'object') return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, plain(x)]));
  return v;
}

// ------------------------------------------------------------------ codec

test('codec: round trip of frames with bytes, strings, nulls, nested maps', () => {
  const f = { t: 'res', id: 7, data: new Uint8Array([0, 255, 3]), s: 'héllo', n: null, m: { a: [1, -2, 1.5] } };
  assert.equal(plain(decodeFrame(encodeFrame(f))), plain(f));
});

test('codec: undefined fields are left out; wide integers stay integers', () => {
  const bytes = encodeFrame({ a: undefined, b: 2 ** 40, c: -(2 ** 40) });
  const back = decodeFrame(bytes) as Record<string, unknown>;
  assert.equal(Object.keys(back), ['b', 'c']);
  assert.is(back['b'], 2 ** 40);
  assert.is(back['c'], -(2 ** 40));
  assert.ok(toHex(bytes).includes('d30000010000000000'), 'int64, not float64');
});

test('codec: malformed payloads throw', () => {
  assert.throws(() => decodeFrame(fromHex('c1')));
  assert.throws(() => decodeFrame(fromHex('81a161')), 'truncated map');
  assert.throws(() => decodeFrame(fromHex('0101')), 'two values');
  // msgpackr's own object-id and back-reference extensions (0x69, 0x70): a map {v: [<itself>]}
  // would decode to a value that contains itself (encoding it again recursed until the server died)
  assert.throws(() => decodeFrame(fromHex('81a176d66900000001' + '91d67000000001')), /Structured clone/);
  // nesting: MAX_NESTING levels of maps and arrays decode, one more does not (such a value
  // would not encode again: passing on a sandbox's answer failed)
  const nest = (levels: number) => {
    const b = new Uint8Array(levels + 1).fill(0x91);
    b[levels] = 0;
    return b;
  };
  assert.ok(Array.isArray(decodeFrame(nest(MAX_NESTING))));
  assert.throws(() => decodeFrame(nest(MAX_NESTING + 1)), /nested deeper than 128/);
  assert.throws(() => decodeFrame(nest(100_000)));
});

test('codec: a frame of many tiny maps is refused before anything is built; one at the limits decodes', () => {
  const withArray = (n: number, item: number) => {
    // {t: 'x', a: [n items]}, the items each one byte (0x80: an empty map; 0xc0: nil)
    const head = encodeFrame({ t: 'x', a: [] });
    const out = new Uint8Array(head.length - 1 + 5 + n);
    out.set(head.subarray(0, head.length - 1));
    out[head.length - 1] = 0xdd;
    new DataView(out.buffer).setUint32(head.length, n);
    out.fill(item, head.length + 4);
    return out;
  };
  const t0 = performance.now();
  assert.throws(() => decodeFrame(withArray(16 << 20, 0x80)), /more than 262144 maps and arrays/);
  assert.throws(() => decodeFrame(withArray(8 << 20, 0xc0)), /more than 2097152 values/);
  assert.ok(performance.now() - t0 < 2000, 'refused without decoding');
  assert.is((decodeFrame(withArray(200_000, 0x80)) as { a: unknown[] }).a.length, 200_000);
  // an array that announces more values than there are bytes
  const lying = new Uint8Array([0x81, 0xa1, 0x74, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0]);
  assert.throws(() => decodeFrame(lying), /announces/);
});

test('FrameReader: frames split at every byte boundary and several per chunk', () => {
  const frames = [{ t: 'ev', id: 1, ev: 'x' }, { t: 'res', id: 2, big: new Uint8Array(70000).fill(7) }, { t: 'cancel', id: 3 }];
  const stream = new Uint8Array(frames.reduce((n, f) => n + encodePrefixed(f).length, 0));
  let off = 0;
  for (const f of frames) {
    const e = encodePrefixed(f);
    stream.set(e, off);
    off += e.length;
  }
  for (const step of [1, 3, 4096, stream.length]) {
    const got: unknown[] = [];
    const r = new FrameReader({ payload: (p) => got.push(decodeFrame(p)), oversize: () => assert.unreachable() });
    for (let i = 0; i < stream.length; i += step) r.push(stream.subarray(i, i + step));
    assert.equal(plain(got), plain(frames), `step ${step}`);
    assert.is(r.pending, 0);
  }
});

test('FrameReader: an oversized frame is reported and skipped, the next frame still parses', () => {
  const got: unknown[] = [];
  const sizes: number[] = [];
  const r = new FrameReader({ payload: (p) => got.push(decodeFrame(p)), oversize: (n) => sizes.push(n) }, 100);
  r.push(lengthPrefix(300));
  r.push(new Uint8Array(150));
  r.push(new Uint8Array(150));
  r.push(encodePrefixed({ t: 'ev', id: 1, ev: 'after' }));
  assert.equal(sizes, [300]);
  assert.equal(got, [{ t: 'ev', id: 1, ev: 'after' }]);
});

// ------------------------------------------------------------------ validation

test('validation: errors name the field', () => {
  const v = validateFrame({ t: 'req', id: 1, op: 'exec', argv: ['ls', 5] }, ['req']);
  assert.is(v.ok, false);
  if (!v.ok) {
    assert.is(v.error.code, 'bad_request');
    assert.ok(v.error.message.startsWith('field /argv/1:'), v.error.message);
    assert.is(v.error.id, 1);
  }
  const w = validateFrame({ t: 'req', id: 2, op: 'files.write', path: '/x', data: new Uint8Array(MAX_CHUNK + 1) }, ['req']);
  assert.ok(!w.ok && w.error.message.includes('/data'));
  assert.is(checkClientEvent({ ev: 'data', data: 'str' })?.startsWith('field /data'), true);
  assert.is(checkClientEvent({ ev: 'end' }), null);
  assert.ok(checkEvent('exec', { ev: 'chunk', data: new Uint8Array(1) })?.includes('unexpected event'));
});

test('validation: frame kinds are limited per direction', () => {
  const v = validateFrame({ t: 'res', id: 1 }, ['req', 'ev', 'cancel']);
  assert.ok(!v.ok && v.error.code === 'bad_frame');
  assert.ok(validateFrame({ t: 'err', id: null, code: 'x', message: 'y' }, ['res', 'ev', 'err']).ok);
});

test('schema: every op has args, result and events; error codes are unique', () => {
  for (const [name, def] of Object.entries(OPS)) {
    assert.ok(def.args && def.result && def.events, name);
  }
  assert.is(new Set(ERROR_CODES).size, ERROR_CODES.length);
  assert.is(MAX_FRAME, 16 * 1024 * 1024);
});

test('schema: protocol/schema.json and the copy in the agent are up to date (npx tsx protocol/gen.ts)', () => {
  assert.is(readFileSync(SCHEMA_JSON_PATH, 'utf8'), schemaJson());
  const src = readFileSync(AGENT_PATH, 'utf8');
  assert.ok(agentWithSchema(src) === src, 'guest-agent/forkling_agent.py has a stale schema');
});

// ------------------------------------------------------------------ golden vectors

test('vectors: each frame decodes to its meaning and encodes to the same bytes', () => {
  assert.ok(vectors.frames.length > 10);
  for (const v of vectors.frames) {
    const meaning = fromJson(v.frame);
    assert.equal(plain(decodeFrame(fromHex(v.hex))), plain(meaning), v.name);
    assert.is(toHex(encodeFrame(meaning as object)), v.hex, v.name);
  }
});

test('vectors: frames are valid for their direction, agent results and events for their op', () => {
  for (const v of vectors.frames) {
    const f = decodeFrame(fromHex(v.hex)) as Record<string, unknown>;
    const r = validateFrame(f, v.from === 'client' ? ['req', 'ev', 'cancel'] : ['res', 'ev', 'err']);
    assert.ok(r.ok, `${v.name}: ${r.ok ? '' : r.error.message}`);
    if (v.from === 'client' && f['t'] === 'ev') assert.is(checkClientEvent(f), null, v.name);
    if (v.from === 'agent' && v.op) {
      const { t, id: _id, ...rest } = f;
      const bad = t === 'res' ? checkResult(v.op, rest) : t === 'ev' ? checkEvent(v.op, rest) : null;
      assert.is(bad, null, `${v.name}: ${bad}`);
    }
  }
});

test('vectors: invalid frames get the expected code and a message naming the field', () => {
  for (const v of vectors.invalid) {
    let code: string;
    let message = '';
    try {
      const r = validateFrame(decodeFrame(fromHex(v.hex)), ['req', 'ev', 'cancel']);
      if (r.ok) {
        const f = r.frame as Record<string, unknown>;
        const bad = f['t'] === 'ev' ? checkClientEvent(f) : null;
        assert.ok(bad, `${v.name}: accepted`);
        code = 'bad_request';
        message = bad!;
      } else {
        code = r.error.code;
        message = r.error.message;
      }
    } catch {
      code = 'bad_frame';
    }
    assert.is(code, v.code, `${v.name}: ${message}`);
    if (v.field) assert.ok(message.includes(`field ${v.field}`), `${v.name}: ${message}`);
  }
});

// ------------------------------------------------------------------ client against a fake agent

/** A fake agent: records the frames the client sends; `reply` pushes frames back. */
function fakeAgent() {
  const sent: Record<string, unknown>[] = [];
  const reader = new FrameReader({ payload: (p) => sent.push(decodeFrame(p) as Record<string, unknown>), oversize: () => {} });
  const stream = new Duplex({
    read() {},
    write(chunk: Uint8Array, _enc, cb) {
      reader.push(chunk);
      cb();
    },
  });
  const strays: Record<string, unknown>[] = [];
  const client = new AgentClient(stream, { onStrayFrame: (f) => strays.push(f) });
  const reply = (f: object) => stream.push(encodePrefixed(f));
  const tick = () => new Promise((r) => setImmediate(r));
  return { sent, client, reply, stream, strays, tick };
}

test('client: requests are matched by id, events arrive in order before the result', async () => {
  const a = fakeAgent();
  const events: string[] = [];
  const p1 = a.client.eval('1', { onStdout: (s) => events.push(s) });
  const p2 = a.client.ping();
  await a.tick();
  assert.equal(
    a.sent.map((f) => [f['id'], f['op']]),
    [
      [1, 'eval'],
      [2, 'ping'],
    ],
  );
  a.reply({ t: 'res', id: 2, time: 5 });
  a.reply({ t: 'ev', id: 1, ev: 'stdout', data: 'a' });
  a.reply({ t: 'ev', id: 1, ev: 'stdout', data: 'b' });
  a.reply({ t: 'res', id: 1, repr: '1', type: 'int', value: 1, timedOut: false, durationMs: 0.1 });
  assert.equal(await p2, { time: 5 });
  const r = await p1;
  assert.is(r.stdout, 'ab');
  assert.equal(events, ['a', 'b']);
});

test('client: err frames reject with code and details; hostile responses are refused', async () => {
  const a = fakeAgent();
  const p = a.client.stat('/nope');
  const q = a.client.ping();
  const ev = a.client.eval('x');
  await a.tick();
  a.reply({ t: 'err', id: 1, code: 'not_found', message: '/nope: missing', errno: 'ENOENT' });
  a.reply({ t: 'res', id: 2, time: 'not a number' });
  a.reply({ t: 'ev', id: 3, ev: 'stdout', data: 42 });
  const e1 = (await p.catch((e) => e)) as AgentError;
  assert.instance(e1, AgentError);
  assert.is(e1.code, 'not_found');
  assert.is(e1.fields['errno'], 'ENOENT');
  const e2 = (await q.catch((e) => e)) as AgentError;
  assert.is(e2.code, 'bad_response');
  assert.ok(e2.message.includes('/time'), e2.message);
  const e3 = (await ev.catch((e) => e)) as AgentError;
  assert.is(e3.code, 'bad_response');
  await a.tick();
  assert.ok(a.sent.some((f) => f['t'] === 'cancel' && f['id'] === 3), 'a refused stream is cancelled at the agent');
  a.reply({ t: 'res', id: 99, x: 1 });
  a.reply({ t: 'err', id: 3, code: 'cancelled', message: 'late answer to a request we cancelled: expected, not stray' });
  a.reply({ t: 'err', id: null, code: 'bad_frame', message: 'm' });
  await a.tick();
  assert.equal(
    a.strays.map((f) => f['code'] ?? 'late'),
    ['late', 'bad_frame'],
  );
  // What is not msgpack: which request it answered is unknown (it would wait forever), so the
  // connection ends and what is pending fails.
  const waiting = a.client.ping().catch((e) => e);
  a.stream.push(lengthPrefix(3));
  a.stream.push(fromHex('c1c1c1'));
  await a.tick();
  assert.is(a.strays.at(-1)?.['code'], 'bad_frame');
  const e4 = (await waiting) as AgentError;
  assert.is(e4.code, 'bad_response');
  assert.match(e4.message, /undecodable frame from the agent/);
  assert.is(((await a.client.ping().catch((e) => e)) as AgentError).code, 'bad_response', 'closed for good');
});

test('client: timeout and abort cancel at the agent; close rejects what is pending', async () => {
  const a = fakeAgent();
  const t = a.client.request('ping', {}, { timeoutMs: 20 }).catch((e) => e);
  const ac = new AbortController();
  const b = a.client.eval('while True: pass', { signal: ac.signal }).catch((e) => e);
  const c = a.client.info().catch((x) => x);
  ac.abort();
  assert.is(((await t) as AgentError).code, 'timeout');
  assert.is(((await b) as AgentError).code, 'cancelled');
  await a.tick();
  assert.equal(
    a.sent.filter((f) => f['t'] === 'cancel').map((f) => f['id']),
    [2, 1],
  );
  a.stream.push(null); // the agent goes away
  const e = (await c) as AgentError;
  assert.is(e.code, 'closed');
  assert.is(((await a.client.ping().catch((x) => x)) as AgentError).code, 'closed');
  assert.ok(a.client.isClosed);
});

const HELLO = { agent: 'forkling-agent', version: 1, pid: 1, python: '3.11', limits: { maxFrame: MAX_FRAME, maxChunk: MAX_CHUNK }, ops: ['hello'] };
const RESTORED = { entropy: { added: true, bytes: 64 }, reseeded: [], clock: { set: false }, hostname: { set: true }, sandboxId: "c1", durationUs: 5 };

test("client: a new child's restore goes out behind its hello, before any answer; a child that names itself wrongly is refused", async () => {
  const a = fakeAgent();
  const done = helloAndRestore(a.client, { sandboxId: 'c1', hostname: 'c1' }, 'c1');
  await a.tick();
  assert.equal(a.sent.map((f) => f['op']), ['hello', 'restore']);
  a.reply({ t: 'res', id: 1, ...HELLO, sandboxId: 'c1' });
  a.reply({ t: 'res', id: 2, ...RESTORED });
  await done;
  const b = fakeAgent();
  const wrong = helloAndRestore(b.client, { sandboxId: 'c1' }, 'c1').then(
    () => new Error('accepted'),
    (e: Error) => e,
  );
  await b.tick();
  b.reply({ t: 'res', id: 1, ...HELLO, sandboxId: 'other' });
  assert.match((await wrong).message, /says it is "other", not c1/);
});

test('client: first answers not given within their limit close the connection with a clear reason', async () => {
  const a = fakeAgent();
  const t0 = performance.now();
  const e = (await answeredWithin(a.client, 30, 'the agent of child c1', (c) => c.hello()).catch((x) => x)) as AgentError;
  assert.ok(performance.now() - t0 >= 25);
  assert.is(e.code, 'closed');
  assert.is(e.message, 'the agent of child c1 did not answer within 30 ms');
  assert.ok(a.client.isClosed);
  const b = fakeAgent(); // answered in time: the connection stays open
  const ok = answeredWithin(b.client, 5000, 'the agent', (c) => c.hello());
  await b.tick();
  b.reply({ t: 'res', id: 1, ...HELLO, sandboxId: null });
  assert.is((await ok).pid, 1);
  assert.not.ok(b.client.isClosed);
});

test('client: a request that cannot be encoded fails at once and is not left pending', async () => {
  const a = fakeAgent();
  const cyclic: Record<string, unknown> = {};
  cyclic.self = cyclic;
  const e = (await a.client.request('eval', { code: '1', extra: cyclic } as never).catch((x) => x)) as AgentError;
  assert.is(e.code, 'bad_request');
  assert.is(a.client.inFlight, 0);
});

test('client: files over one chunk are streamed as data events, then end', async () => {
  const a = fakeAgent();
  const data = new Uint8Array(MAX_CHUNK * 2 + 10).fill(1);
  const p = a.client.writeFile('/f', data);
  for (let i = 0; i < 20 && !a.sent.some((f) => f['ev'] === 'end'); i++) await a.tick();
  const kinds = a.sent.map((f) => (f['t'] === 'req' ? `req:${f['stream']}` : `${f['ev']}:${(f['data'] as Uint8Array | undefined)?.length ?? ''}`));
  assert.equal(kinds, ['req:true', `data:${MAX_CHUNK}`, `data:${MAX_CHUNK}`, 'data:10', 'end:']);
  a.reply({ t: 'res', id: 1, size: data.length });
  assert.equal(await p, { size: data.length });
});

test.run();
