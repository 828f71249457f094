// The REST API of `forkling serve`, every response checked against the
// OpenAPI document the server itself serves at /v1/openapi.json (a small
// JSON Schema checker below; unknown keywords fail, so nothing is skipped).
import * as assert from 'uvu/assert';
import { suite } from 'uvu';
import { type Served, serve } from './server-harness.ts';
import { loud } from '../loud-hook.ts';

const TOKEN = 'rest-test-token-0123456789';
const test = suite('server-rest');
let srv: Served;
let doc: Json;
type Json = Record<string, unknown>;

// ---------------------------------------------------------------- a JSON Schema checker (2020-12 subset)

const IGNORED = new Set(['description', 'title', 'contentEncoding', 'format', 'default', 'examples']);

function deref(s: Json): Json {
  let cur = s;
  while (typeof cur.$ref === 'string') {
    const parts = (cur.$ref as string).replace(/^#\//, '').split('/');
    let x: unknown = doc;
    for (const p of parts) x = (x as Json)[p];
    if (!x) throw new Error(`unresolved $ref ${cur.$ref}`);
    cur = x as Json;
  }
  return cur;
}

function typeOf(v: unknown): string {
  if (v === null) return 'null';
  if (Array.isArray(v)) return 'array';
  if (typeof v === 'number') return Number.isInteger(v) ? 'integer' : 'number';
  return typeof v;
}

function validate(schema0: Json, v: unknown, at = ''): string[] {
  const s = deref(schema0);
  const errs: string[] = [];
  for (const [k, want] of Object.entries(s)) {
    switch (k) {
      case 'type': {
        const t = typeOf(v);
        const ok = want === t || (want === 'number' && t === 'integer');
        if (!ok) return [`${at || '/'}: expected ${want}, got ${t}`];
        break;
      }
      case 'properties':
        if (typeOf(v) === 'object') {
          for (const [p, ps] of Object.entries(want as Json)) {
            const pv = (v as Json)[p];
            if (pv !== undefined) errs.push(...validate(ps as Json, pv, `${at}/${p}`));
          }
        }
        break;
      case 'patternProperties':
        if (typeOf(v) === 'object') {
          for (const [re, ps] of Object.entries(want as Json)) {
            for (const [p, pv] of Object.entries(v as Json)) {
              if (new RegExp(re).test(p)) errs.push(...validate(ps as Json, pv, `${at}/${p}`));
            }
          }
        }
        break;
      case 'required':
        for (const r of want as string[]) {
          if (typeOf(v) === 'object' && (v as Json)[r] === undefined) errs.push(`${at}/${r}: required`);
        }
        break;
      case 'items':
        if (Array.isArray(v)) {
          for (const [i, x] of v.entries()) errs.push(...validate(want as Json, x, `${at}/${i}`));
        }
        break;
      case 'anyOf':
        if (!(want as Json[]).some((alt) => validate(alt, v, at).length === 0)) errs.push(`${at || '/'}: matches no anyOf branch`);
        break;
      case 'const':
        if (v !== want) errs.push(`${at}: expected ${JSON.stringify(want)}`);
        break;
      case 'enum':
        if (!(want as unknown[]).includes(v)) errs.push(`${at}: ${JSON.stringify(v)} not in enum`);
        break;
      case 'minimum':
        if (typeof v === 'number' && v < (want as number)) errs.push(`${at}: below minimum`);
        break;
      case 'maximum':
        if (typeof v === 'number' && v > (want as number)) errs.push(`${at}: above maximum`);
        break;
      case 'minLength':
        if (typeof v === 'string' && v.length < (want as number)) errs.push(`${at}: too short`);
        break;
      case 'maxLength':
        if (typeof v === 'string' && v.length > (want as number)) errs.push(`${at}: too long`);
        break;
      case 'minItems':
        if (Array.isArray(v) && v.length < (want as number)) errs.push(`${at}: too few items`);
        break;
      case 'maxItems':
        if (Array.isArray(v) && v.length > (want as number)) errs.push(`${at}: too many items`);
        break;
      case 'pattern':
        if (typeof v === 'string' && !new RegExp(want as string).test(v)) errs.push(`${at}: does not match ${want}`);
        break;
      case '$ref':
        break;
      default:
        if (!IGNORED.has(k)) throw new Error(`schema keyword ${k} not supported by the test checker`);
    }
  }
  if (s.format === 'byte' && typeof v === 'string' && !/^[A-Za-z0-9+/]*={0,2}$/.test(v)) errs.push(`${at}: not base64`);
  return errs;
}

// ---------------------------------------------------------------- requests checked against the document

interface Call {
  status: number;
  body: unknown;
  text: string;
  type: string;
}

async function call(
  method: string,
  template: string,
  params: Record<string, string> = {},
  opts: { body?: unknown; raw?: BodyInit; token?: string | null; accept?: string; query?: string } = {},
): Promise<Call> {
  let path = template;
  for (const [k, v] of Object.entries(params)) path = path.replace(`{${k}}`, encodeURIComponent(v));
  const headers: Record<string, string> = {};
  const token = opts.token === undefined ? TOKEN : opts.token;
  if (token) headers.authorization = `Bearer ${token}`;
  if (opts.accept) headers.accept = opts.accept;
  const res = await fetch(`${srv.url}${path}${opts.query ? `?${opts.query}` : ''}`, {
    method,
    headers,
    body: opts.raw ?? (opts.body === undefined ? undefined : JSON.stringify(opts.body)),
  });
  const type = (res.headers.get('content-type') ?? '').split(';')[0] as string;
  const text = await res.text();
  const body = type === 'application/json' ? JSON.parse(text) : text;
  // the response must be described by the document: path, method, status, content type, schema
  const op = ((doc.paths as Json)[template] as Json | undefined)?.[method.toLowerCase()] as Json | undefined;
  assert.ok(op, `${method} ${template} is not in the OpenAPI document`);
  const resp = (op.responses as Json)[String(res.status)] as Json | undefined;
  assert.ok(resp, `${method} ${template}: status ${res.status} is not documented (${text.slice(0, 200)})`);
  const content = (resp.content as Json | undefined)?.[type] as Json | undefined;
  assert.ok(content, `${method} ${template} ${res.status}: content type ${type} is not documented`);
  if (type === 'application/json') {
    const errs = validate(content.schema as Json, body);
    assert.equal(errs, [], `${method} ${template} ${res.status}: ${JSON.stringify(body).slice(0, 300)}`);
  } else if (type === 'application/x-ndjson') {
    for (const line of text.split('\n').filter(Boolean)) {
      const errs = validate(content.schema as Json, JSON.parse(line));
      assert.equal(errs, [], `${method} ${template} NDJSON line ${line}`);
    }
  }
  return { status: res.status, body, text, type };
}

const b64 = (s: string) => Buffer.from(s).toString('base64');
const unb64 = (s: unknown) => Buffer.from(s as string, 'base64').toString();

test.before(loud("the suite's set-up (test.before)", async () => {
  srv = await serve({ token: TOKEN });
  const res = await fetch(`${srv.url}/v1/openapi.json`, { headers: { authorization: `Bearer ${TOKEN}` } });
  doc = (await res.json()) as Json;
}));

test.after(async () => {
  assert.is(await srv.stop(), 0, srv.log.join(''));
});

test('the OpenAPI document describes every route and validates itself', async () => {
  assert.is(doc.openapi, '3.1.0');
  const r = await call('GET', '/v1/openapi.json');
  assert.is(r.status, 200);
  for (const p of ['/v1/sandboxes', '/v1/sandboxes/{id}/eval', '/v1/sandboxes/{id}/files.read', '/v1/templates/{template}/fork']) {
    assert.ok((doc.paths as Json)[p], p);
  }
  const h = await call('GET', '/healthz', {}, { token: null });
  assert.equal(h.body, { ok: true, sandboxes: 0, draining: false });
});

test('auth: no token or a wrong one is 401', async () => {
  for (const token of [null, 'wrong-token-0123456789']) {
    const r = await call('GET', '/v1/sandboxes', {}, { token });
    assert.is(r.status, 401);
    assert.is((r.body as { error: { code: string } }).error.code, 'unauthorized');
  }
});

test('sandbox lifecycle, agent operations and files over REST', async () => {
  const c = await call('POST', '/v1/sandboxes', {}, { body: { template: 'default', timeoutMs: 60_000 } });
  assert.is(c.status, 201);
  const id = (c.body as { sandbox: { id: string } }).sandbox.id;
  const p = { id };
  assert.is((await call('GET', '/v1/sandboxes/{id}', p)).status, 200);
  const list = await call('GET', '/v1/sandboxes');
  assert.ok((list.body as { sandboxes: { id: string }[] }).sandboxes.some((s) => s.id === id));

  const ev = await call('POST', '/v1/sandboxes/{id}/eval', p, { body: { code: 'print("hi")\n6*7' } });
  assert.is((ev.body as Json).value, 42);
  assert.equal((ev.body as Json).events, [{ ev: 'stdout', data: 'hi\n' }]);
  const exc = await call('POST', '/v1/sandboxes/{id}/eval', p, { body: { code: '1/0' } });
  assert.is(((exc.body as Json).exception as Json).type, 'ZeroDivisionError');

  const nd = await call('POST', '/v1/sandboxes/{id}/exec', p, {
    body: { argv: ['cat'], stdin: b64('via stdin') },
    accept: 'application/x-ndjson',
  });
  assert.is(nd.type, 'application/x-ndjson');
  const lines = nd.text.trim().split('\n').map((l) => JSON.parse(l) as Json);
  assert.is(lines[0]?.ev, 'started');
  assert.is(unb64(lines.find((l) => l.ev === 'stdout')?.data), 'via stdin');
  assert.is(((lines.at(-1) as Json).result as Json).exitCode, 0);

  await call('POST', '/v1/sandboxes/{id}/files.mkdir', p, { body: { path: '/tmp/forkling-rest/d', parents: true } });
  const w = await call('POST', '/v1/sandboxes/{id}/files.write', p, { body: { path: '/tmp/forkling-rest/a', data: b64('json write') } });
  assert.equal(w.body, { size: 10 });
  const rd = await call('POST', '/v1/sandboxes/{id}/files.read', p, { body: { path: '/tmp/forkling-rest/a' } });
  assert.is(unb64(((rd.body as Json).events as Json[])[0]?.data), 'json write');
  const put = await call('PUT', '/v1/sandboxes/{id}/files', p, {
    raw: new Uint8Array(3 * 1024 * 1024 + 1).fill(120),
    query: 'path=/tmp/forkling-rest/raw.bin&mode=600',
  });
  assert.equal(put.body, { size: 3 * 1024 * 1024 + 1 });
  const get = await call('GET', '/v1/sandboxes/{id}/files', p, { query: 'path=/tmp/forkling-rest/raw.bin' });
  assert.is(get.status, 200);
  assert.is(get.text.length, 3 * 1024 * 1024 + 1);
  assert.ok(/^x+$/.test(get.text));
  const st = await call('POST', '/v1/sandboxes/{id}/files.stat', p, { body: { path: '/tmp/forkling-rest/raw.bin' } });
  assert.equal([(st.body as Json).type, (st.body as Json).mode], ['file', 0o600]);
  await call('POST', '/v1/sandboxes/{id}/files.rename', p, { body: { from: '/tmp/forkling-rest/a', to: '/tmp/forkling-rest/b' } });
  const ls = await call('POST', '/v1/sandboxes/{id}/files.list', p, { body: { path: '/tmp/forkling-rest' } });
  assert.equal(((ls.body as Json).entries as Json[]).map((e) => e.name).sort(), ['b', 'd', 'raw.bin']);
  const ex = await call('POST', '/v1/sandboxes/{id}/files.exists', p, { body: { path: '/tmp/forkling-rest/a' } });
  assert.is((ex.body as Json).exists, false);
  const missing = await call('GET', '/v1/sandboxes/{id}/files', p, { query: 'path=/tmp/forkling-rest/a' });
  assert.is(missing.status, 404);
  await call('POST', '/v1/sandboxes/{id}/files.remove', p, { body: { path: '/tmp/forkling-rest', recursive: true } });

  // a background process: started over NDJSON, the client leaves, it runs on
  const ctl = new AbortController();
  const res = await fetch(`${srv.url}/v1/sandboxes/${id}/exec`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}`, accept: 'application/x-ndjson' },
    body: JSON.stringify({ shell: 'sleep 30', background: true }),
    signal: ctl.signal,
  });
  const reader = (res.body as ReadableStream<Uint8Array>).getReader();
  const first = JSON.parse(new TextDecoder().decode((await reader.read()).value).split('\n')[0] as string) as Json;
  assert.is(first.ev, 'started');
  ctl.abort();
  const procs = await call('POST', '/v1/sandboxes/{id}/proc.list', p, { body: {} });
  const bg = ((procs.body as Json).procs as Json[]).find((x) => x.procId === first.procId);
  assert.is(bg?.running, true);
  await call('POST', '/v1/sandboxes/{id}/proc.kill', p, { body: { procId: first.procId } });
  const waited = await call('POST', '/v1/sandboxes/{id}/proc.wait', p, { body: { procId: first.procId, timeoutMs: 5000 } });
  assert.is((waited.body as Json).signal, 'SIGKILL');

  const t = await call('POST', '/v1/sandboxes/{id}/timeout', p, { body: { timeoutMs: 90_000 } });
  assert.is(((t.body as Json).sandbox as Json).timeoutMs, 90_000);
  const br = await call('POST', '/v1/sandboxes/{id}/branch', p, { body: { n: 1 } });
  const child = ((br.body as Json).sandboxes as Json[])[0] as Json;
  assert.is(child.parent, id);
  const stats = await call('GET', '/v1/sandboxes/{id}/stats', p);
  assert.type((stats.body as Json).privateKiB, 'number');
  const boot = await call('POST', '/v1/images/{image}/boot', { image: 'default' }, { body: { timeoutMs: 30_000 } });
  assert.is(boot.status, 201);
  const booted = ((boot.body as Json).sandbox as Json).id as string;
  assert.equal((await call('DELETE', '/v1/sandboxes/{id}', { id: booted })).body, { killed: true });
  const fk = await call('POST', '/v1/templates/{template}/fork', { template: 'default' }, { body: { n: 2 } });
  const forked = ((fk.body as Json).sandboxes as Json[]).map((s) => s.id as string);
  assert.is(forked.length, 2);
  for (const k of [...forked, child.id as string, id]) {
    const d = await call('DELETE', '/v1/sandboxes/{id}', { id: k });
    assert.equal(d.body, { killed: true });
  }
  const gone = await call('GET', '/v1/sandboxes/{id}', p);
  assert.is(gone.status, 410);
  assert.is((gone.body as { error: { code: string } }).error.code, 'sandbox_ended');
});

test('bad input over REST: one clear error each, documented', async () => {
  const c = await call('POST', '/v1/sandboxes', {}, { body: { timeoutMs: 60_000 } });
  const p = { id: (c.body as { sandbox: { id: string } }).sandbox.id };
  const bad = await call('POST', '/v1/sandboxes/{id}/eval', p, { raw: '{not json' });
  assert.is(bad.status, 400);
  assert.match(JSON.stringify(bad.body), 'not JSON');
  const field = await call('POST', '/v1/sandboxes/{id}/eval', p, { body: { code: 1 } });
  assert.is(field.status, 400);
  assert.match(JSON.stringify(field.body), '/code');
  const b = await call('POST', '/v1/sandboxes/{id}/files.write', p, { body: { path: '/tmp/x', data: 'not base64!' } });
  assert.is(b.status, 400);
  const n = await call('POST', '/v1/sandboxes', {}, { body: { template: 'x', timeoutMs: -5 } });
  assert.is(n.status, 400);
  const un = await call('POST', '/v1/sandboxes/{id}/eval', { id: 'no-such-sandbox' }, { body: { code: '1' } });
  assert.is(un.status, 404);
  const big = await fetch(`${srv.url}/v1/sandboxes/${p.id}/eval`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}` },
    body: new Uint8Array(17 * 1024 * 1024).fill(32),
  });
  assert.is(big.status, 413);
  const m = await fetch(`${srv.url}/v1/sandboxes/${p.id}/eval`, { headers: { authorization: `Bearer ${TOKEN}` } });
  assert.is(m.status, 405);
  const nr = await fetch(`${srv.url}/v2/whatever`, { headers: { authorization: `Bearer ${TOKEN}` } });
  assert.is(nr.status, 404);
  // a command's output beyond what one JSON answer holds: that request ends and says how to stream it
  // (the server collected it all in memory)
  const flood = await fetch(`${srv.url}/v1/sandboxes/${p.id}/exec`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
    body: JSON.stringify({ argv: ['head', '-c', '20000000', '/dev/zero'] }),
  });
  const floodBody = (await flood.json()) as { error: { code: string; message: string } };
  assert.is(floodBody.error.code, 'resource_exhausted');
  assert.match(floodBody.error.message, 'application/x-ndjson');
  // the server goes on
  const ok = await call('POST', '/v1/sandboxes/{id}/eval', p, { body: { code: '2+2' } });
  assert.is((ok.body as Json).value, 4);
  await call('DELETE', '/v1/sandboxes/{id}', p);
});

/** One raw HTTP/1.1 request (targets fetch() would refuse to send); the status line back. */
async function rawStatus(request: string): Promise<string> {
  const { connect } = await import('node:net');
  const u = new URL(srv.url);
  return new Promise((resolve, reject) => {
    const sock = connect(Number(u.port), u.hostname, () => sock.write(request));
    let got = '';
    sock.on('data', (d) => {
      got += d;
    });
    sock.on('error', reject);
    sock.on('close', () => resolve(got.split('\r\n')[0] ?? ''));
  });
}

test('a request target that is no valid URL, or a bad %-escape in a path, is 400: the server goes on', async () => {
  // (new URL('//[', base) throws: it killed the server, before any token was checked)
  assert.match(await rawStatus('GET //[ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n'), / 400 /);
  const upgrade = 'Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n';
  assert.match(await rawStatus(`GET //[ HTTP/1.1\r\nHost: x\r\n${upgrade}\r\n`), / 400 /);
  const pct = await fetch(`${srv.url}/v1/sandboxes/%E0`, { headers: { authorization: `Bearer ${TOKEN}` } });
  assert.is(pct.status, 400);
  assert.match(await pct.text(), 'percent-encoding');
  const ok = await call('GET', '/v1/sandboxes', {});
  assert.is(ok.status, 200);
});

test('/metrics is Prometheus text with sandboxes, forks, branches, latencies, memory', async () => {
  const r = await call('GET', '/metrics');
  const t = r.text;
  for (const name of [
    'forkling_sandboxes{state="running"}',
    'forkling_forks_total',
    'forkling_branches_total 1',
    'forkling_request_duration_seconds_bucket{op="eval",transport="http",le="+Inf"}',
    'forkling_spawn_duration_seconds_count{kind="fork"}',
    'forkling_server_resident_memory_bytes',
    'forkling_sandbox_private_memory_bytes',
    'forkling_auth_failures_total{transport="http"}',
  ]) {
    assert.ok(t.includes(name), `missing ${name}`);
  }
  for (const line of t.split('\n').filter((l) => l && !l.startsWith('#'))) {
    assert.match(line, /^[a-z_]+(\{[^}]*\})? [-+0-9.eInfNa]+$/, line);
  }
});

test.run();
