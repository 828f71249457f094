// `forkling mcp`: the MCP server on stdio, spoken to as a client does (JSON-RPC
// 2.0, a message a line), with real sandboxes of the process engine.
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { MAX_LINE_BYTES, MCP_VERSIONS } from '../../host/mcp/server.ts';
import { MAX_OUTPUT_CHARS } from '../../host/mcp/tools.ts';
import { McpClient as Client, type Msg, withMcp } from './mcp-client.ts';

test('initialize, ping, tools/list: versions, capabilities and each tool with its argument schema', async () => {
  await withMcp(async (c, init) => {
    assert.is(init.result.protocolVersion, '2025-06-18');
    assert.equal(init.result.capabilities, { tools: { listChanged: false } });
    assert.is(init.result.serverInfo.name, 'forkling');
    assert.match(init.result.instructions, /sandbox_create/);
    // A revision it does not know: it answers with its newest.
    assert.is((await c.request('initialize', { protocolVersion: '1999-01-01', capabilities: {} })).result.protocolVersion, MCP_VERSIONS[0]);
    assert.equal((await c.request('ping')).result, {});
    const tools = (await c.request('tools/list')).result.tools as Msg[];
    assert.equal(tools.map((t) => t.name).sort(), [
      'eval',
      'exec',
      'files_read',
      'files_write',
      'sandbox_branch',
      'sandbox_create',
      'sandbox_fork',
      'sandbox_kill',
      'sandbox_list',
    ]);
    for (const t of tools) {
      assert.is(t.inputSchema.type, 'object', t.name);
      assert.is(t.inputSchema.additionalProperties, false, t.name);
      assert.ok(t.description.length > 20, t.name);
    }
    assert.equal(tools.find((t) => t.name === 'eval')!.inputSchema.required.sort(), ['code', 'sandbox']);
  });
});

test('what is not a valid call is a JSON-RPC error; a tool\'s own failure is a result with isError', async () => {
  await withMcp(async (c) => {
    assert.is((await c.raw('{"jsonrpc": "2.0", "id": 7, ', null)).error.code, -32700);
    assert.is((await c.raw('[{"jsonrpc": "2.0", "id": 8, "method": "ping"}]', null)).error.code, -32600);
    assert.is((await c.raw('{"id": 9, "method": "ping"}', 9)).error.code, -32600);
    const unknown = await c.request('resources/list');
    assert.is(unknown.error.code, -32601);
    assert.match(unknown.error.message, 'tools/call');
    for (const name of ['rm_rf', 'toString', '__proto__', 'constructor']) {
      const noTool = await c.request('tools/call', { name, arguments: {} });
      assert.is(noTool.error?.code, -32602, JSON.stringify(noTool));
      assert.match(noTool.error.message, `no tool ${JSON.stringify(name)}`);
    }
    // Arguments: a missing, a misnamed and a mistyped one, each named for the model.
    assert.match(await c.fails('eval', { sandbox: 'x' }), /bad arguments: eval: .*code/);
    assert.match(await c.fails('sandbox_create', { timeout: 5 }), /bad arguments: sandbox_create: \/timeout/);
    assert.match(await c.fails('sandbox_fork', { n: 0 }), /bad arguments: sandbox_fork: \/n/);
    assert.match(await c.fails('sandbox_create', { template: '../etc' }), /bad arguments: sandbox_create: \/template/);
    assert.match(await c.fails('eval', { sandbox: 'nope', code: '1' }), /^not_found: no sandbox "nope"/);
    assert.match(await c.fails('sandbox_create', { template: 'no-such-template' }), /no-such-template/);
    // The server still answers.
    assert.equal((await c.request('ping')).result, {});
  });
});

test('a sandbox: Python state kept between evals, commands, files both ways, branch, kill', async () => {
  const session = await withMcp(async (c) => {
    const { sandbox } = await c.ok('sandbox_create');
    assert.is(sandbox.template, 'default');
    assert.is(sandbox.expiresAt - sandbox.createdAt, 3_600_000, 'an hour unless the model says otherwise');
    const id = sandbox.id as string;
    await c.ok('eval', { sandbox: id, code: 'x = 41' });
    const v = await c.ok('eval', { sandbox: id, code: 'print("hi")\nx + 1' });
    assert.is(v.value, 42);
    assert.is(v.repr, '42');
    assert.is(v.stdout, 'hi\n');
    const ex = await c.ok('eval', { sandbox: id, code: '1 / 0' });
    assert.is(ex.exception.type, 'ZeroDivisionError');
    assert.match(ex.exception.traceback, 'ZeroDivisionError');
    const slow = await c.ok('eval', { sandbox: id, code: 'while True: pass', timeoutMs: 300 });
    assert.is(slow.timedOut, true);

    const sh = await c.ok('exec', { sandbox: id, command: 'echo out; echo err >&2; pwd; exit 3', cwd: '/tmp' });
    assert.equal([sh.exitCode, sh.stdout, sh.stderr, sh.timedOut], [3, 'out\n/tmp\n', 'err\n', false]);

    // Files: text, bytes that are not UTF-8 (base64 both ways), slices, append.
    assert.equal(await c.ok('files_write', { sandbox: id, path: '/tmp/d/a.txt', content: 'héllo\n' }), { path: '/tmp/d/a.txt', size: 7 });
    await c.ok('files_write', { sandbox: id, path: '/tmp/d/a.txt', content: 'more\n', append: true });
    const t = await c.ok('files_read', { sandbox: id, path: '/tmp/d/a.txt' });
    assert.equal([t.encoding, t.content, t.fileSize], ['utf8', 'héllo\nmore\n', 12]);
    const bin = Buffer.from([0xff, 0x00, 0xfe, 0x41]);
    await c.ok('files_write', { sandbox: id, path: '/tmp/b.bin', content: bin.toString('base64'), encoding: 'base64' });
    const b = await c.ok('files_read', { sandbox: id, path: '/tmp/b.bin' });
    assert.equal([b.encoding, b.content], ['base64', bin.toString('base64')]);
    const part = await c.ok('files_read', { sandbox: id, path: '/tmp/d/a.txt', offset: 8, length: 2 });
    assert.equal([part.content, part.bytes], ['or', 2]);
    assert.match(part.more, 'read again from offset 10');
    assert.match(await c.fails('files_write', { sandbox: id, path: '/tmp/x', content: 'not base64!', encoding: 'base64' }), /content is not base64/);
    assert.match(await c.fails('files_read', { sandbox: id, path: '/tmp/none' }), /^not_found: /);
    const seen = await c.ok('eval', { sandbox: id, code: 'open("/tmp/d/a.txt").read()' });
    assert.is(seen.value, 'héllo\nmore\n');

    // Branch: the copies start from x = 41 and go their own ways; the source goes on.
    const { sandboxes } = await c.ok('sandbox_branch', { sandbox: id, n: 2 });
    assert.is(sandboxes.length, 2);
    const [k1, k2] = sandboxes.map((s: Msg) => s.id as string);
    assert.is(sandboxes[0].parent, id);
    await c.ok('eval', { sandbox: k1, code: 'x = "one"' });
    assert.is((await c.ok('eval', { sandbox: k2, code: 'x' })).value, 41);
    assert.is((await c.ok('eval', { sandbox: k1, code: 'x' })).value, 'one');
    assert.is((await c.ok('eval', { sandbox: id, code: 'x' })).value, 41);
    const listed = (await c.ok('sandbox_list')).sandboxes.map((s: Msg) => s.id).sort();
    assert.equal(listed, [id, k1, k2].sort());

    assert.equal(await c.ok('sandbox_kill', { sandbox: k1 }), { killed: true });
    assert.match(await c.fails('eval', { sandbox: k1, code: '1' }), /^sandbox_ended: /);
    assert.is((await c.ok('eval', { sandbox: k2, code: 'x' })).value, 41, 'its sibling lives on');
  });
  assert.match(session.stderr.join(''), /stdin closed: killing 2 sandboxes/);
});

test('long output is cut to a head and a tail; a cancelled call ends at once and the sandbox goes on', async () => {
  await withMcp(async (c) => {
    const id = (await c.ok('sandbox_create')).sandbox.id as string;
    const r = await c.ok('eval', { sandbox: id, code: 'print("A" * 300000 + "END")' });
    assert.ok(r.stdout.length < MAX_OUTPUT_CHARS + 100, `${r.stdout.length} characters`);
    assert.match(r.stdout, /^A+\n\[\.\.\. \d+ characters cut \.\.\.\]\nA+END\n$/);
    const sh = await c.ok('exec', { sandbox: id, command: 'head -c 500000 /dev/zero | tr "\\0" b' });
    assert.ok(sh.stdout.length < MAX_OUTPUT_CHARS + 100);

    const t0 = performance.now();
    const code = 'import time\nopen("/tmp/asleep", "w").close()\ntime.sleep(30)';
    // It asked for progress: told every few seconds that it runs.
    const sleep = c.start('tools/call', { name: 'eval', arguments: { sandbox: id, code }, _meta: { progressToken: 'p1' } });
    c.notify('notifications/cancelled', { requestId: 9999 }); // (no such call: nothing happens)
    const progress = await c.notification('notifications/progress');
    assert.equal([progress.params.progressToken, progress.params.progress], ['p1', 1]);
    // Cancelled while it runs (the file it made says so): it gets no answer, and the sandbox goes on at once.
    const asleep = async () => (await c.ok('exec', { sandbox: id, command: 'test -e /tmp/asleep' })).exitCode === 0;
    for (let i = 0; !(await asleep()); i++) assert.ok(i < 200, 'the eval never began');
    c.notify('notifications/cancelled', { requestId: sleep.id, reason: 'the user changed their mind' });
    const next = c.ok('eval', { sandbox: id, code: '6 * 7' });
    const first = await Promise.race([sleep.answer.then((m) => `the cancelled call was answered: ${JSON.stringify(m)}`), next.then(() => 'next')]);
    assert.is(first, 'next');
    assert.is((await next).value, 42);
    assert.ok(performance.now() - t0 < 20_000, 'it did not wait for the sleep');
  });
});

test('stdin: a line too long is skipped and answered by its id; a last line without a newline is taken', async () => {
  await withMcp(async (c) => {
    const pad = 'A'.repeat(MAX_LINE_BYTES);
    const first = await c.raw(`{"jsonrpc":"2.0","id":77,"method":"ping","params":{"pad":"${pad}"}}`, 77);
    assert.is(first.error.code, -32600);
    assert.match(first.error.message, `more than ${MAX_LINE_BYTES} bytes was skipped`);
    const last = await c.raw(`{"jsonrpc":"2.0","method":"ping","params":{"pad":"${pad}"},"id":"z"}`, 'z');
    assert.is(last.error.code, -32600);
    assert.equal((await c.request('ping')).result, {}, 'the next line is taken');
    assert.equal((await c.raw('{"jsonrpc":"2.0","id":"eof","method":"ping"}', 'eof', false)).result, {});
  });
});

test('SIGTERM with stdin still open: its sandboxes are killed and it exits 0', async () => {
  const c = new Client();
  await c.init();
  await c.ok('sandbox_create');
  c.p.kill('SIGTERM');
  assert.is(await c.exited, 0, c.stderr.join(''));
  assert.match(c.stderr.join(''), /SIGTERM: killing 1 sandboxes/);
});

test('forkling mcp --help and bad options', async () => {
  const { spawnSync } = await import('node:child_process');
  const help = spawnSync(process.execPath, ['bin/forkling.mjs', 'mcp', '--help'], { encoding: 'utf8' });
  assert.is(help.status, 0);
  assert.match(help.stdout, /--max-sandboxes/);
  const bad = spawnSync(process.execPath, ['bin/forkling.mjs', 'mcp', '--max-sandboxes', 'many'], { encoding: 'utf8' });
  assert.is(bad.status, 2);
  assert.match(bad.stderr, /--max-sandboxes must be an integer ≥ 1, got "many"/);
  assert.is(bad.stdout, '', 'nothing on the protocol stream');
});

test.run();
