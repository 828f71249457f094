// The real guest agent, as a host process (not PID 1) on a Unix socket,
// driven through AgentClient and the real codec: every operation, stream
// order, timeouts, concurrency, memory exhaustion, bad and oversized frames,
// disconnects. The large-file round trip is 256 MiB (about 5 s here;
// FORKLING_TEST_FILE_MB=N to change it).
import { createHash, randomBytes } from 'node:crypto';
import { existsSync, mkdtempSync, readdirSync, readFileSync, readlinkSync, rmSync, writeFileSync } from 'node:fs';
import { connect } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { type AgentClient, AgentError, connectUnix } from '../../host/agent/client.ts';
import { type LocalAgent, startLocalAgent } from '../../host/agent/spawn.ts';
import { decodeFrame, encodePrefixed, FrameReader, lengthPrefix } from '../../protocol/codec.ts';
import { MAX_FRAME } from '../../protocol/schema.ts';
import { loud } from '../loud-hook.ts';

const dir = mkdtempSync(join(tmpdir(), 'forkling-agent-test-'));
const FILE_MB = Number(process.env.FORKLING_TEST_FILE_MB ?? 256);
let agent: LocalAgent;
let c: AgentClient;
const strays: Record<string, unknown>[] = [];

const ms = () => performance.now();
const sleep = (t: number) => new Promise((r) => setTimeout(r, t));
const text = (b: Uint8Array) => Buffer.from(b).toString('utf8');
async function rejects(p: Promise<unknown>, code: string): Promise<AgentError> {
  const e = await p.then(
    () => null,
    (x: unknown) => x,
  );
  assert.instance(e, AgentError, `expected AgentError ${code}`);
  assert.is((e as AgentError).code, code, (e as AgentError).message);
  return e as AgentError;
}
function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}
async function until(what: string, cond: () => boolean | Promise<boolean>, timeoutMs = 5000) {
  const end = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > end) throw new Error(`timed out waiting for: ${what}`);
    await sleep(20);
  }
}

test.before(loud("the suite's set-up (test.before)", async () => {
  agent = await startLocalAgent({
    socketPath: join(dir, 'agent.sock'),
    // RLIMIT_AS keeps the out-of-memory test small; few malloc arenas keep threads inside it
    args: ['--max-memory', String(2 * 1024 ** 3)],
    env: { ...process.env, MALLOC_ARENA_MAX: '2' },
  });
  c = await agent.connect({ onStrayFrame: (f) => strays.push(f) });
}));

test.after(async () => {
  c?.close();
  await agent?.stop();
  rmSync(dir, { recursive: true, force: true });
});

// ------------------------------------------------------------------ hello, ping, info

test('hello: version negotiation; other requests need it first', async () => {
  const raw = await connectUnix(agent.socketPath, { hello: false });
  await rejects(raw.ping(), 'hello_required');
  const e = await rejects(raw.request('hello', { versions: [7, 9] }), 'unsupported_version');
  assert.equal(e.fields['supported'], [1]);
  const h = await raw.request('hello', { versions: [1, 2] });
  assert.is(h.version, 1);
  assert.is(h.pid, agent.pid);
  assert.is(h.limits.maxFrame, MAX_FRAME);
  assert.ok(h.ops.includes('eval') && h.ops.includes('files.read'));
  assert.ok((await raw.ping()).time > 1e9);
  raw.close();
});

test('info: pid, not PID 1, memory, modules', async () => {
  const i = await c.info({ modules: true });
  assert.is(i.pid, agent.pid);
  assert.is(i.pid1, false);
  assert.ok(i.memory.rss > 1e6);
  assert.ok(i.modules!.includes('msgpack'));
  assert.is(i.moduleCount, i.modules!.length);
  assert.ok(i.uptime > 0);
  assert.ok(i.contexts.includes('default'));
});

// ------------------------------------------------------------------ eval

test('eval: statements then the last expression, persistent default namespace', async () => {
  const r = await c.eval('a = 20\nb = a + 1\nb * 2');
  assert.equal([r.value, r.repr, r.type, r.timedOut], [42, '42', 'int', false]);
  assert.is((await c.eval('a')).value, 20);
  const none = await c.eval('z = 1');
  assert.equal([none.value, none.repr], [null, 'None']);
});

test('eval: values as data where possible, repr always', async () => {
  const r = await c.eval("{'s': 'x', 'l': [1, 2.5, None, True], 'b': b'\\x00\\xff', 't': (1, 2)}");
  const v = r.value as Record<string, unknown>;
  assert.ok(v['b'] instanceof Uint8Array);
  assert.equal([...(v['b'] as Uint8Array)], [0, 255]);
  assert.equal({ ...v, b: null }, { s: 'x', l: [1, 2.5, null, true], b: null, t: [1, 2] });
  const o = await c.eval('class K:\n    def __repr__(self): return "<K>"\nK()');
  assert.is(o.value, undefined);
  assert.is(o.repr, '<K>');
  assert.is(o.type, '__main__.K');
  const big = await c.eval('2**100');
  assert.is(big.value, undefined);
  assert.is(big.repr, String(2n ** 100n));
  assert.is((await c.eval('2**62')).value, 2n ** 62n);
  assert.is((await c.eval('{1: 2}')).value, undefined, 'non-string keys: repr only');
  const long = await c.eval('"y" * (30 << 20)');
  assert.equal([long.value, long.type, long.repr.length < 300_000], [undefined, 'str', true], 'too big for a frame: clipped repr only');
});

test('eval: named contexts start empty and are separate', async () => {
  await c.eval('only_here = 5', { context: 'ctx-a' });
  assert.is((await c.eval('only_here', { context: 'ctx-a' })).value, 5);
  const e = await c.eval('only_here', { context: 'ctx-b' });
  assert.is(e.exception?.type, 'NameError');
  assert.is((await c.eval('only_here')).exception?.type, 'NameError', 'default does not see it');
  assert.ok((await c.contextList()).contexts.includes('ctx-a'));
  assert.equal(await c.contextDelete('ctx-a'), { deleted: true });
  assert.is((await c.eval('only_here', { context: 'ctx-a' })).exception?.type, 'NameError');
});

test('eval: exceptions give type, message and a traceback of the cell', async () => {
  const r = await c.eval('def f():\n    raise ValueError("bad thing")\nf()');
  assert.is(r.exception?.type, 'ValueError');
  assert.is(r.exception?.message, 'bad thing');
  assert.ok(r.exception!.traceback.includes('raise ValueError("bad thing")'), r.exception!.traceback);
  assert.not.ok(r.exception!.traceback.includes('forkling_agent.py'), 'agent frames are hidden');
  const s = await c.eval('1 +');
  assert.is(s.exception?.type, 'SyntaxError');
  const hostile = await c.eval('class E(Exception):\n    def __str__(self): raise RuntimeError("no")\n    def __repr__(self): raise RuntimeError("no")\nraise E()');
  assert.is(hostile.exception?.type, '__main__.E');
  assert.ok(hostile.exception?.message.includes('str failed'));
  const huge = await c.eval('raise ValueError("x" * (20 << 20))');
  assert.ok(huge.exception!.message.length < 300_000, 'long messages are clipped below the frame limit');
});

test('eval: stdout and stderr stream in order, while the eval runs, before the result', async () => {
  const seen: [string, string, number][] = [];
  const t0 = ms();
  const r = await c.request(
    'eval',
    { code: 'import sys, time\nprint("one")\nprint("two", file=sys.stderr)\nprint("three")\ntime.sleep(0.5)\nprint("four")\n7' },
    { onEvent: (ev) => seen.push([ev.ev, ev.data, ms() - t0]) },
  );
  const tEnd = ms() - t0;
  assert.is(r.value, 7);
  assert.is(seen.map((s) => s[1]).join(''), 'one\ntwo\nthree\nfour\n');
  assert.equal(
    seen.map((s) => s[0]),
    seen.length === 4 ? ['stdout', 'stderr', 'stdout', 'stdout'] : seen.map((s) => s[0]),
  );
  const order = seen.flatMap(([ev, d]) => d.split('\n').filter(Boolean).map((w) => `${ev}:${w}`));
  assert.equal(order, ['stdout:one', 'stderr:two', 'stdout:three', 'stdout:four']);
  assert.ok(seen[0]![2] < tEnd - 300, `first output at ${seen[0]![2]} ms, result at ${tEnd} ms: not streamed`);
});

test('eval: a timeout interrupts (KeyboardInterrupt) and the interpreter stays usable', async () => {
  const t0 = ms();
  const r = await c.eval('import time\nkept = 1\ntime.sleep(30)', { timeoutMs: 300 });
  const took = ms() - t0;
  assert.ok(r.timedOut);
  assert.is(r.exception?.type, 'KeyboardInterrupt');
  assert.ok(took < 3000, `took ${took} ms`);
  assert.is((await c.eval('kept + 1')).value, 2);
  // code that swallows the first interrupt is interrupted again
  const r2 = await c.eval('import time\nn = 0\nwhile True:\n    try:\n        time.sleep(10)\n    except KeyboardInterrupt:\n        n += 1\n        if n > 1: raise', {
    timeoutMs: 200,
  });
  assert.ok(r2.timedOut);
  assert.is((await c.eval('n')).value, 2);
});

test('eval: capture survives code that redirects sys.stdout and leaves it so', async () => {
  const r = await c.eval('import sys, io\nsys.stdout = io.StringIO()\nprint("lost")');
  assert.is(r.stdout, '');
  const after = await c.eval('print("seen")');
  assert.is(after.stdout, 'seen\n');
});

test('eval: what subprocesses, os.system and C code write to fds 1 and 2 is the eval\'s output, in order', async () => {
  const r = await c.eval(
    'import os, subprocess, sys, ctypes\nprint("a")\nos.system("echo b; echo B >&2")\nprint("c")\nsubprocess.run(["sh", "-c", "echo d"])\nprint("e")\nos.write(2, b"F\\n")\nctypes.CDLL(None).puts(b"g")\nctypes.CDLL(None).fflush(None)\n1',
  );
  assert.is(r.value, 1);
  // What subprocesses wrote comes in order with the prints around them (a write
  // to fd 1 right before a print, within 50 us, may come after it).
  assert.is(r.stdout, 'a\nb\nc\nd\ne\ng\n');
  assert.is(r.stderr, 'B\nF\n');
  // A subprocess that writes more than a pipe holds while the eval waits for it (a reader drains the pipe).
  const big = await c.eval('import subprocess\nsubprocess.run("yes 0123456789abcdef | head -c 3000000", shell=True).returncode');
  assert.is(big.value, 0);
  assert.is(big.stdout.length, 3_000_000);
  assert.is(big.stdout.slice(0, 34), '0123456789abcdef\n0123456789abcdef\n');
  // Undecodable bytes become U+FFFD; a character split across two writes stays whole.
  const bin = await c.eval('import os, time\nos.write(1, b"\\xff\\xe2\\x82")\ntime.sleep(0.05)\nos.write(1, b"\\xac\\n")\nNone');
  assert.is(bin.stdout, '\ufffd\u20ac\n');
  // The reader thread may hold a piece it took from the pipe when the eval ends: the eval waits for it.
  const outs = await Promise.all(Array.from({ length: 40 }, (_, i) => c.eval(`os.system("echo ${i}")\nNone`)));
  assert.equal(outs.map((o) => o.stdout), outs.map((_, i) => `${i}\n`));
  // A character cut off at an eval's end is that eval's (U+FFFD), not the start of the next one's output.
  assert.is((await c.eval('os.write(1, b"cut \\xe2\\x82")\nNone')).stdout, 'cut \ufffd');
  assert.is((await c.eval('print("whole")')).stdout, 'whole\n');
  // A process the eval forks (multiprocessing's workers) prints into the eval too.
  const forked = await c.eval('pid = os.fork()\nif pid == 0:\n    print("from the fork", flush=True)\n    os._exit(0)\nos.waitpid(pid, 0)[1]');
  assert.equal([forked.value, forked.stdout], [0, 'from the fork\n']);
  // Its prints go out a whole line per write (print writes text and newline apart), so the lines of
  // workers printing at once never mix; what is left without a newline goes out when it flushes.
  const mixed = await c.eval(
    'kids = []\nfor k in range(4):\n    pid = os.fork()\n    if pid == 0:\n' +
      '        for i in range(300): print("p%d-%d" % (k, i), "x" * 40)\n' +
      '        print("tail%d!" % k, end="")\n        sys.stdout.flush()\n        os._exit(0)\n    kids.append(pid)\n' +
      '[os.waitpid(p, 0)[1] for p in kids]',
  );
  assert.equal(mixed.value, [0, 0, 0, 0]);
  assert.equal(mixed.stdout.match(/tail\d!/g)?.sort(), ['tail0!', 'tail1!', 'tail2!', 'tail3!']);
  const lines = mixed.stdout.replace(/tail\d!/g, '').split('\n').filter(Boolean);
  assert.is(lines.length, 1200);
  assert.ok(lines.every((l) => /^p[0-3]-\d+ x{40}$/.test(l)), 'every worker line arrived whole');
  // A background writer faster than the agent can pass it on does not keep an eval from ending.
  const flood = await c.eval('yes = subprocess.Popen(["yes"])\ntime.sleep(0.1)\n"started"', { timeoutMs: 20_000 });
  assert.is(flood.value, 'started');
  assert.ok(flood.stdout.length > 0 && /^(y\n)*y?$/.test(flood.stdout.slice(0, 100000)), 'the flood so far is its output');
  assert.is((await c.eval('yes.kill()\nyes.wait()')).value, -9);
  // sys.stdout handed to a subprocess is fd 1 (subprocess calls fileno()): captured too.
  assert.is((await c.eval('import subprocess, sys\nsubprocess.run(["echo", "via fileno"], stdout=sys.stdout)\nNone')).stdout, 'via fileno\n');
  // The agent's own fds 1 and 2 are unchanged for the next eval, and exec is unaffected.
  assert.is((await c.eval('import os\nos.system("echo again")')).stdout, 'again\n');
  const ex = await c.exec(['sh', '-c', 'echo out; echo err >&2']);
  assert.is(text(ex.stdout), 'out\n');
});

test('eval: one print larger than the output buffer (8 MiB) after a quiet spell is sent whole', async () => {
  const r = await c.eval('import time\ntime.sleep(0.1)\nprint("y" * (9 << 20), end="")\n2');
  assert.is(r.value, 2);
  assert.is(r.stdout.length, 9 << 20);
});

test('eval: SystemExit and _thread.exit() do not end the agent', async () => {
  assert.is((await c.eval('import sys\nsys.exit(3)')).exception?.type, 'SystemExit');
  assert.is((await c.eval('import _thread\n_thread.exit()')).exception?.type, 'SystemExit');
  assert.is((await c.eval('1+1')).value, 2);
});

test('eval: memory exhaustion raises MemoryError in the eval; the agent lives on', async () => {
  // RLIMIT_AS is 2 GiB; bytes(n) is calloc'ed, so this reserves address space without touching memory
  const r = await c.eval('hog = []\nwhile True:\n    hog.append(bytes(64 << 20))');
  assert.is(r.exception?.type, 'MemoryError');
  const freed = await c.eval('del hog\nimport gc\ngc.collect()\nbig = bytes(256 << 20)\nlen(big)');
  assert.is(freed.value, 256 << 20, JSON.stringify(freed.exception));
  await c.eval('del big');
  assert.ok((await c.ping()).time > 0);
});

test('eval: cancel (abort) interrupts a running eval', async () => {
  const ac = new AbortController();
  const p = c.eval('import time\ntime.sleep(30)', { signal: ac.signal });
  await sleep(100);
  ac.abort();
  await rejects(p, 'cancelled');
  const t0 = ms();
  assert.is((await c.eval('3')).value, 3);
  assert.ok(ms() - t0 < 2000);
});

test('eval: a queued eval times out without running when another holds the interpreter', async () => {
  const long = c.eval('import time\ntime.sleep(0.8)\n"long"');
  await sleep(50);
  const t0 = ms();
  const q = await c.eval('queued_ran = True', { timeoutMs: 100 });
  assert.ok(q.timedOut);
  assert.ok(ms() - t0 < 600, 'answered at its deadline, not after the long eval');
  assert.is((await long).value, 'long');
  assert.is((await c.eval('"queued_ran" in globals()')).value, false);
});

// ------------------------------------------------------------------ exec

test('exec: argv and shell, exit codes, stdout/stderr, env, cwd, stdin', async () => {
  const r = await c.exec(['sh', '-c', 'echo out; echo err >&2; exit 3']);
  assert.equal([text(r.stdout), text(r.stderr), r.exitCode, r.signal, r.timedOut], ['out\n', 'err\n', 3, null, false]);
  const s = await c.exec('echo "$FOO" && pwd', { env: { FOO: 'bar' }, cwd: '/tmp' });
  assert.is(text(s.stdout), 'bar\n/tmp\n');
  const clean = await c.exec(['/usr/bin/env'], { clearEnv: true, env: { ONLY: '1' } });
  assert.is(text(clean.stdout), 'ONLY=1\n');
  const cat = await c.exec(['cat'], { stdin: 'piped in' });
  assert.is(text(cat.stdout), 'piped in');
  const k = await c.exec('kill -9 $$');
  assert.equal([k.exitCode, k.signal], [null, 'SIGKILL']);
});

test('exec: large stdin is streamed; output arrives complete', async () => {
  const data = randomBytes(3 * 1024 * 1024 + 17);
  const r = await c.exec(['sha256sum'], { stdin: data });
  assert.is(text(r.stdout).split(' ')[0], createHash('sha256').update(data).digest('hex'));
  const big = await c.exec(['head', '-c', String(5 * 1024 * 1024), '/dev/zero']);
  assert.is(big.stdout.length, 5 * 1024 * 1024);
});

test('exec: events in order: started, output, then the result', async () => {
  const evs: string[] = [];
  const r = await c.request('exec', { shell: 'echo a; sleep 0.1; echo b >&2; sleep 0.1; echo c' }, { onEvent: (e) => evs.push(e.ev === 'started' ? 'started' : `${e.ev}:${text(e.data).trim()}`) });
  assert.equal(evs, ['started', 'stdout:a', 'stderr:b', 'stdout:c']);
  assert.is(r.exitCode, 0);
});

test('exec: timeout kills the process group; missing command and cwd are errors', async () => {
  const t0 = ms();
  const r = await c.exec('sleep 30 & sleep 30; echo never', { timeoutMs: 300 });
  assert.ok(r.timedOut);
  assert.is(r.signal, 'SIGKILL');
  assert.ok(ms() - t0 < 3000);
  const e = await rejects(c.exec(['no-such-command-xyz']), 'not_found');
  assert.ok(e.message.includes('no-such-command-xyz'));
  await rejects(c.exec(['ls'], { cwd: '/no/such/dir' }), 'not_found');
  await rejects(c.request('exec', { argv: ['ls'], shell: 'ls' }), 'bad_request');
  await rejects(c.exec(['echo', 'a\0b']), 'bad_request');
  await rejects(c.stat('/tmp/a\0b'), 'bad_request');
});

test('processes: background spawn with stdin, list, wait, signal, kill', async () => {
  const cat = await c.spawn(['cat'], { stdinStream: true });
  assert.ok(cat.pid > 0);
  await cat.write('hello ');
  await cat.write(new Uint8Array([119, 111, 114, 108, 100]));
  const listed = (await c.procList()).procs.find((p) => p.procId === cat.procId);
  assert.ok(listed?.running && listed.background);
  assert.equal(listed!.argv, ['cat']);
  await cat.closeStdin();
  const done = await cat.done;
  assert.is(text(done.stdout), 'hello world');
  assert.is(done.exitCode, 0);
  const waited = await c.procWait(cat.procId);
  assert.equal([waited.running, waited.exitCode, text(waited.stdoutTail)], [false, 0, 'hello world']);

  const sleeper = await c.spawn(['sleep', '30']);
  const w = await c.procWait(sleeper.procId, 100);
  assert.is(w.running, true);
  const short = await c.spawn(['sleep', '0.3']);
  assert.is((await c.procWait(short.procId, 0)).running, false, 'timeoutMs 0: no limit (as for eval and exec), not a poll');
  assert.equal(await sleeper.signal('TERM'), { done: true });
  assert.is((await sleeper.done).signal, 'SIGTERM');
  const s2 = await c.spawn(['sleep', '30']);
  assert.equal(await s2.kill(), { done: true });
  assert.is((await s2.done).signal, 'SIGKILL');
  await rejects(c.procWait('p999999'), 'no_such_process');
  await rejects(c.procSignal(s2.procId, 'NOPE'), 'bad_request');
});

test('concurrency: evals run while a background command streams its output', async () => {
  const stamps: number[] = [];
  const t0 = ms();
  const proc = await c.spawn('for i in $(seq 1 12); do echo $i; sleep 0.05; done', {
    onStdout: () => stamps.push(ms() - t0),
  });
  const evalStart = ms() - t0;
  const r = await c.eval('import time\ntime.sleep(0.4)\n"slept"');
  const evalEnd = ms() - t0;
  let quick = 0;
  while (stamps.length < 12 && quick < 200) {
    assert.is((await c.eval('1+1')).value, 2);
    quick++;
  }
  assert.is(r.value, 'slept');
  const done = await proc.done;
  assert.is(text(done.stdout).split('\n').filter(Boolean).length, 12);
  const during = stamps.filter((s) => s > evalStart && s < evalEnd).length;
  assert.ok(during >= 3, `only ${during} output events arrived while the eval ran (${JSON.stringify(stamps)})`);
  assert.ok(quick > 0);
});

// ------------------------------------------------------------------ files

test('files: write, read, stat, exists, list, mkdir -p, rename, remove', async () => {
  const d = join(dir, 'files');
  assert.equal(await c.mkdir(join(d, 'a/b/c')), { created: true });
  assert.equal(await c.mkdir(join(d, 'a/b/c')), { created: false });
  await rejects(c.mkdir(join(d, 'a'), { parents: false }), 'already_exists');
  assert.equal(await c.writeFile(join(d, 'a/x.txt'), 'hello', { mode: 0o600 }), { size: 5 });
  assert.equal(await c.writeFile(join(d, 'a/x.txt'), ' more', { append: true }), { size: 5 });
  assert.is(text(await c.readFile(join(d, 'a/x.txt'))), 'hello more');
  assert.is(text(await c.readFile(join(d, 'a/x.txt'), { offset: 6, length: 2 })), 'mo');
  const st = await c.stat(join(d, 'a/x.txt'));
  assert.equal([st.type, st.size, st.mode], ['file', 10, 0o600]);
  assert.equal(await c.exists(join(d, 'a/x.txt')), { exists: true, type: 'file' });
  assert.equal(await c.exists(join(d, 'nope')), { exists: false, type: null });
  await c.writeFile(join(d, 'deep/er/y.bin'), new Uint8Array([1, 2]), { mkdirs: true });
  const ls = await c.listDir(join(d, 'a'));
  assert.equal(
    ls.entries.map((e) => [e.name, e.type]),
    [
      ['b', 'dir'],
      ['x.txt', 'file'],
    ],
  );
  assert.equal(await c.rename(join(d, 'a/x.txt'), join(d, 'a/y.txt')), { done: true });
  assert.ok(existsSync(join(d, 'a/y.txt')));
  await rejects(c.remove(join(d, 'a')), 'not_empty');
  assert.equal(await c.remove(join(d, 'a'), { recursive: true }), { removed: true });
  assert.equal(await c.remove(join(d, 'a'), { force: true }), { removed: false });
  const nf = await rejects(c.readFile(join(d, 'missing')), 'not_found');
  assert.is(nf.fields['errno'], 'ENOENT');
  await rejects(c.readFile(d), 'is_a_directory');
  await rejects(c.listDir(join(d, 'deep/er/y.bin')), 'not_a_directory');
  await rejects(c.stat(join(d, 'missing')), 'not_found');
  // files whose size says nothing: a character device (with a length), a /proc file
  assert.is((await c.readFile('/dev/urandom', { length: 100 })).length, 100);
  assert.ok(text(await c.readFile('/proc/self/status')).includes(`Pid:\t${agent.pid}`));
});

test(`files: a ${FILE_MB} MiB file round-trips with the same sha256`, async () => {
  const size = FILE_MB * 1024 * 1024 + 123;
  const block = randomBytes(1024 * 1024);
  const want = createHash('sha256');
  async function* gen() {
    let left = size;
    let i = 0;
    while (left > 0) {
      const n = Math.min(left, block.length);
      const chunk = Buffer.from(block.subarray(0, n));
      chunk.writeUInt32LE(i++, 0); // every MiB differs
      want.update(chunk);
      left -= n;
      yield chunk;
    }
  }
  const path = join(dir, 'big.bin');
  const t0 = ms();
  assert.equal(await c.writeFile(path, gen()), { size });
  const t1 = ms();
  const digest = want.digest('hex');
  const got = createHash('sha256');
  const res = await c.readFileChunks(path, (d) => got.update(d));
  const t2 = ms();
  assert.equal(res, { size, fileSize: size });
  assert.is(got.digest('hex'), digest);
  assert.is(createHash('sha256').update(readFileSync(path)).digest('hex'), digest, 'on disk too');
  console.log(`  ${FILE_MB} MiB: write ${(t1 - t0).toFixed(0)} ms, read ${(t2 - t1).toFixed(0)} ms`);
  rmSync(path);
});

// ------------------------------------------------------------------ restore, shutdown

test('restore: sandbox id, hostname and clock refused off PID 1, random reseeded, idempotent and fast', async () => {
  const before = await c.eval('import random\nrandom.random()');
  await c.eval('import random\nrandom.seed(1)');
  const a1 = (await c.eval('random.random()')).value;
  await c.eval('random.seed(1)');
  const r = await c.restore({ entropy: randomBytes(32), sandboxId: 'sb-test', hostname: 'child-1', time: Date.now() / 1000 });
  assert.is(r.sandboxId, 'sb-test');
  assert.ok(r.reseeded.includes('random'));
  assert.is(r.entropy.added, false);
  assert.ok(r.entropy.reason?.includes('--system-ops'));
  assert.is(r.clock.set, false);
  assert.is(r.hostname.set, false);
  const a2 = (await c.eval('random.random()')).value;
  assert.is.not(a1, a2, 'the generator was reseeded');
  assert.ok(before.value !== undefined);
  const again = await c.restore({ entropy: randomBytes(32), sandboxId: 'sb-test' });
  assert.is(again.sandboxId, 'sb-test');
  assert.ok(Number.isFinite(again.durationUs) && again.durationUs >= 0, `durationUs: ${again.durationUs}`); // (a figure: CI's load moves it)
  assert.is((await c.info()).sandboxId, 'sb-test');
  assert.is((await c.hello()).sandboxId, 'sb-test');
});

test('restore: with --system-ops entropy it adds entropy to the kernel pool (root) or says why not', async () => {
  const a = await startLocalAgent({ socketPath: join(dir, 'sys.sock'), args: ['--system-ops', 'entropy'] });
  try {
    const cl = await a.connect();
    const r = await cl.restore({ entropy: randomBytes(64) });
    if (process.getuid?.() === 0) assert.equal(r.entropy, { added: true, bytes: 64 });
    else assert.ok(!r.entropy.added && r.entropy.reason?.includes('RNDADDENTROPY'));
    cl.close();
  } finally {
    await a.stop();
  }
});

// ------------------------------------------------------------------ hostile and broken clients

/** A raw connection: write any bytes, read decoded frames. */
async function rawConn() {
  const sock = connect(agent.socketPath);
  await new Promise((r) => sock.once('connect', r));
  const frames: Record<string, unknown>[] = [];
  const r = new FrameReader({ payload: (p) => frames.push(decodeFrame(p) as Record<string, unknown>), oversize: () => {} });
  sock.on('data', (d) => r.push(d));
  const next = async (n: number) => {
    await until(`${n} frames`, () => frames.length >= n);
    return frames;
  };
  sock.write(encodePrefixed({ t: 'req', id: 1, op: 'hello', versions: [1] }));
  await next(1);
  return { sock, frames, next };
}

test('bad frames: each gets an err frame naming the problem; the connection survives', async () => {
  const { sock, frames, next } = await rawConn();
  sock.write(Buffer.concat([lengthPrefix(3), Buffer.from([0xc1, 0xc1, 0xc1])]));
  sock.write(encodePrefixed([1, 2, 3] as unknown as object));
  sock.write(encodePrefixed({ t: 'req', id: 5, op: 'exec', argv: [1] }));
  sock.write(encodePrefixed({ t: 'req', id: 6, op: 'teleport' }));
  sock.write(encodePrefixed({ t: 'ev', id: 77, ev: 'data', data: new Uint8Array(1) }));
  sock.write(lengthPrefix(0));
  sock.write(encodePrefixed({ t: 'req', id: 8, op: 'ping' }));
  await next(8);
  const got = frames.slice(1).map((f) => [f['t'], f['id'], f['code'] ?? null]);
  assert.equal(got, [
    ['err', null, 'bad_frame'],
    ['err', null, 'bad_frame'],
    ['err', 5, 'bad_request'],
    ['err', 6, 'unknown_op'],
    ['err', 77, 'unknown_request'],
    ['err', null, 'bad_frame'],
    ['res', 8, null],
  ]);
  assert.ok(String(frames[3]!['message']).includes('field /argv/0'), String(frames[3]!['message']));
  sock.destroy();
});

test('bad frames: a duplicate id of an open request is refused', async () => {
  const { sock, frames, next } = await rawConn();
  sock.write(encodePrefixed({ t: 'req', id: 9, op: 'eval', code: 'import time\ntime.sleep(0.3)' }));
  sock.write(encodePrefixed({ t: 'req', id: 9, op: 'ping' }));
  await next(3);
  assert.equal(
    frames.slice(1).map((f) => [f['t'], f['code'] ?? null]),
    [
      ['err', 'duplicate_id'],
      ['res', null],
    ],
  );
  sock.destroy();
});

test('oversized frames are skipped with frame_too_large; a frame cut short by a disconnect is harmless', async () => {
  const { sock, frames, next } = await rawConn();
  sock.write(lengthPrefix(MAX_FRAME + 1));
  sock.write(Buffer.alloc(MAX_FRAME + 1));
  sock.write(encodePrefixed({ t: 'req', id: 2, op: 'ping' }));
  await next(3);
  assert.equal([frames[1]!['code'], frames[1]!['length'], frames[2]!['t']], ['frame_too_large', MAX_FRAME + 1, 'res']);
  sock.write(lengthPrefix(1000));
  sock.write(Buffer.alloc(10));
  sock.destroy();
  assert.ok((await c.ping()).time > 0);
});

/** Paths the agent process holds open (from /proc: it runs on this host). */
function agentOpenFiles(): string[] {
  const fdDir = `/proc/${agent.pid}/fd`;
  const out: string[] = [];
  for (const fd of readdirSync(fdDir)) {
    try {
      out.push(readlinkSync(join(fdDir, fd)));
    } catch {}
  }
  return out;
}

test('disconnect mid-stream: foreground process killed, eval interrupted, file streams closed; background lives', async () => {
  const cl = await agent.connect();
  let pid = 0;
  const p = cl.request('exec', { shell: 'while true; do echo y; sleep 0.01; done' }, {
    onEvent: (e) => {
      if (e.ev === 'started') pid = e.pid;
    },
  });
  p.catch(() => {});
  await until('process started', () => pid > 0);
  const bg = await cl.spawn(['sleep', '30']);
  const ev = cl.eval('import time\ntime.sleep(30)');
  ev.catch(() => {});
  const mid = join(dir, 'mid.bin');
  writeFileSync(mid, Buffer.alloc(32 * 1024 * 1024));
  const rd = cl.readFileChunks(mid, () => {});
  rd.catch(() => {});
  const partial = join(dir, 'partial.bin');
  const wr = cl.writeFile(
    partial,
    (async function* () {
      yield new Uint8Array(1024);
      await new Promise(() => {}); // the client stalls mid-stream, then disconnects
    })(),
  );
  wr.catch(() => {});
  await until('both files open in the agent', () => agentOpenFiles().filter((f) => f === mid || f === partial).length === 2);
  cl.close();
  await until('foreground process killed', () => !alive(pid));
  await until('file streams closed', () => !agentOpenFiles().some((f) => f === mid || f === partial));
  const t0 = ms();
  assert.is((await c.eval('5')).value, 5);
  assert.ok(ms() - t0 < 2500, 'the abandoned eval was interrupted');
  assert.ok(alive(bg.pid), 'a background process outlives its connection');
  const w = await c.procWait(bg.procId, 50);
  assert.is(w.running, true);
  await c.procKill(bg.procId);
  assert.is((await c.procWait(bg.procId)).signal, 'SIGKILL');
  await until('connection gone', async () => (await c.info()).connections === 1);
});

test('many concurrent connections', async () => {
  const clients = await Promise.all(Array.from({ length: 40 }, () => agent.connect()));
  const results = await Promise.all(
    clients.map(async (cl, i) => {
      const [e, x] = await Promise.all([cl.eval(`${i} * 2`), cl.exec(['echo', String(i)])]);
      return [e.value, text(x.stdout)];
    }),
  );
  results.forEach(([v, out], i) => {
    assert.is(v, i * 2);
    assert.is(out, `${i}\n`);
  });
  for (const cl of clients) cl.close();
  await until('connections closed', async () => (await c.info()).connections === 1);
});

test('onIdle: called each time the last request in flight settles', async () => {
  const cl = await agent.connect();
  let idle = 0;
  cl.onIdle(() => idle++);
  await Promise.all([cl.eval('1'), cl.eval('2'), cl.exec(['true'])]);
  assert.is(idle, 1, 'once for the three together');
  await cl.eval('3');
  assert.is(idle, 2);
  assert.instance(await cl.readFile(join(dir, 'no-such-file')).catch((e: unknown) => e), AgentError);
  assert.is(idle, 3, 'a failed request settles too');
  cl.close();
});

test('the stream closing rejects pending requests; shutdown ends the (non-PID-1) agent', async () => {
  const a = await startLocalAgent({ socketPath: join(dir, 'short.sock') });
  const cl = await a.connect();
  const pending = cl.eval('import time\ntime.sleep(30)');
  await sleep(50);
  a.process.kill('SIGKILL');
  await rejects(pending, 'closed');
  await rejects(cl.ping(), 'closed');
  const b = await startLocalAgent({ socketPath: join(dir, 'short2.sock') });
  const cb = await b.connect();
  assert.equal(await cb.shutdown(), { done: true });
  assert.is(await b.exited, 0);
  await cb.closed;
});

test('onStreamEnd: an owner that knows why the stream ended closes with that reason before pending requests are rejected', async () => {
  const a = await startLocalAgent({ socketPath: join(dir, 'explained.sock') });
  const cl = await a.connect();
  let calls = 0;
  cl.onStreamEnd(() => {
    calls++;
    cl.close('the VM x stopped (error: guest RAM lost)');
  });
  // (a request the agent holds: its answer never comes)
  let running = false;
  const pending = cl.request(
    'eval',
    { code: 'print("running")\nimport time\ntime.sleep(30)' },
    {
      onEvent: () => {
        running = true;
      },
    },
  );
  await until('the eval runs', () => running);
  a.process.kill('SIGKILL');
  const e = await rejects(pending, 'closed');
  assert.is(e.message, 'the VM x stopped (error: guest RAM lost)');
  assert.is(calls, 1, 'called once, though the stream both ended and closed');
  // A close by the owner itself is no stream end: the hook is not called.
  const b = await startLocalAgent({ socketPath: join(dir, 'explained2.sock') });
  const cb = await b.connect();
  let called = false;
  cb.onStreamEnd(() => {
    called = true;
  });
  cb.close();
  await cb.closed;
  assert.not.ok(called);
  await b.stop();
});

test('no stray frames reached the main client', () => {
  assert.equal(strays, []);
});

test.run();
