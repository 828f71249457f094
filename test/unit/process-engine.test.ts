// The process engine for real (no lab, no KVM): a warm zygote from the
// `default` image, forks and branches, and what isolates them. Needs root or
// unprivileged user namespaces; the first run builds the `default` image
// (about a minute, cached in the store).
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { chownSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from 'node:fs';
import { availableParallelism } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import type { AgentClient } from '../../host/agent/client.ts';
import type { Sandbox } from '../../host/engine/engine.ts';
import { connectAgent } from '../../host/engine/process/agent-socket.ts';
import { ProcessEngine, zygoteCpus } from '../../host/engine/process/engine.ts';
import { ensureImage } from '../../host/images.ts';
import { storePath } from '../../host/store.ts';
import { pollUntil } from '../../host/util/poll.ts';
import { loud } from '../loud-hook.ts';
import { templateFiles } from '../template-files.ts';
import { comesToSleep, sleptFor } from '../wakeups.ts';

const root = dirname(dirname(dirname(fileURLToPath(import.meta.url))));

const TEMPLATE = `test-process-${randomBytes(3).toString('hex')}`;
let engine: ProcessEngine;
const warnings: string[] = [];

async function val(agent: AgentClient, code: string): Promise<unknown> {
  const r = await agent.eval(code);
  if (r.exception) throw new Error(`eval failed: ${r.exception.traceback || r.exception.message}`);
  return r.value;
}

/** Running (a zombie waiting for its parent, the zygote, to reap it does not count). */
const alive = (pid: number) => {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2, stat.lastIndexOf(')') + 3) !== 'Z';
  } catch {
    return false;
  }
};
const hostPid = (s: Sandbox) => (s as unknown as { hostPid: number }).hostPid;
/** Whether a process is PID 1 of a pid namespace of its own (a sandbox; not the fork server). */
const pidOneOwnNs = (pid: number) => {
  try {
    return /^NSpid:\s+(.*)$/m.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))?.[1]?.trim().split(/\s+/).pop() === '1';
  } catch {
    return false;
  }
};
/** Host pids of a process's children ([] once it is gone). */
const childrenOf = (pid: number): number[] => {
  try {
    return readdirSync(`/proc/${pid}/task`).flatMap((t) => readFileSync(`/proc/${pid}/task/${t}/children`, 'utf8').split(' ').filter(Boolean).map(Number));
  } catch {
    return [];
  }
};

/** Runs `fn` with a template of its own (the `default` image, warmed up with `warmup`); kills what it put in `kids` and forgets the template after (its zygote ends with the engine). */
async function withTemplate(suffix: string, warmup: string[], fn: (name: string, kids: Sandbox[]) => Promise<void>): Promise<void> {
  const name = `${TEMPLATE}-${suffix}`;
  await engine.createTemplate({ name, image: 'default', warmup: warmup.join('\n') });
  const kids: Sandbox[] = [];
  try {
    await fn(name, kids);
  } finally {
    await Promise.all(kids.map((k) => k.kill()));
    rmSync(storePath('process-templates', `${name}.json`), { force: true });
  }
}
const meminfo = (key: string) => Number(new RegExp(`^${key}:\\s+(\\d+)`, 'm').exec(readFileSync('/proc/meminfo', 'utf8'))![1]);
const memAvailableKiB = () => meminfo('MemAvailable');

test.before(loud("the suite's set-up (test.before)", async () => {
  engine = new ProcessEngine({ warn: (l) => warnings.push(l), pidsPerSandbox: 64 });
  await engine.createTemplate({
    name: TEMPLATE,
    image: 'default',
    memoryMiB: 256,
    warmup:
      'import os, random, uuid, socket\nWARM = {"answer": 42, "pid": os.getpid()}\nTEMPLATE_RANDOM = random.random()\n' +
      'open("/tmp/warm-file", "w").write("from the warm-up")',
  });
}));

test.after(async () => {
  await engine?.close();
  rmSync(storePath('process-templates', `${TEMPLATE}.json`), { force: true });
});

test('prepare freezes the template and starts its fork server before any fork, once; a missing template is named', async () => {
  const z = (engine as unknown as { zygotes: Map<string, { pid: number }> }).zygotes.get(TEMPLATE)!;
  assert.equal(childrenOf(z.pid), [], 'no fork server before the first fork');
  await engine.prepare(TEMPLATE);
  const server = childrenOf(z.pid);
  assert.is(server.length, 1, `the fork server; the zygote said: ${engine.zygoteConsole(TEMPLATE).slice(-12).join(' | ')}`);
  await engine.prepare(TEMPLATE);
  assert.equal(childrenOf(z.pid), server, 'prepared once');
  // the host's kernel: the agent loads no modules there (the seccomp filter would refuse each, a line apiece)
  assert.equal(engine.zygoteConsole(TEMPLATE).filter((l) => l.includes('finit_module')), [], "no module loads tried on the host's kernel");
  try {
    await engine.prepare(`${TEMPLATE}-missing`);
    assert.unreachable('a missing template is refused');
  } catch (e) {
    assert.match((e as Error).message, /does not exist/);
  }
});

test("an engine closed while a template's zygote starts (a first prepare or fork) takes that zygote with it", async () => {
  const before = new Set(childrenOf(process.pid));
  const e = new ProcessEngine({ warn: (l) => warnings.push(l) });
  const prepared = e.prepare(TEMPLATE).then(
    () => null,
    (err: Error) => err,
  );
  await e.close();
  await prepared;
  const left = childrenOf(process.pid).filter((k) => !before.has(k));
  assert.equal(left, [], `started and left: ${left.map((k) => readFileSync(`/proc/${k}/cmdline`, 'utf8').replace(/\0/g, ' ')).join('; ')}`);
});

test('a child inherits the warm-up state and is PID 1 of its own namespaces', async () => {
  const [c] = await engine.fork(TEMPLATE, 1);
  const v = (await val(c!.agent, '(WARM["answer"], os.getpid(), socket.gethostname(), os.environ.get("FORKLING_PROCESS_ROLE"), open("/tmp/warm-file").read())')) as unknown[];
  assert.equal(v, [42, 1, c!.id, 'sandbox', 'from the warm-up']);
  assert.ok(c!.timings.readyAt >= c!.timings.startedAt);
  // forked and set up by guest-agent/forkling_spawn.c (fewer pages copied), not by the Python fallback
  assert.is(await val(c!.agent, 'import sys; sys.modules["forkling_zygote"].STATE["setup"]'), 'c');
  await c!.kill();
});

test("a child's service threads: streamed eval output, an eval timeout, a second connection, orphans reaped", async () => {
  const [c] = await engine.fork(TEMPLATE, 1);
  try {
    // output streams while the eval runs (the flusher thread starts at the first print)
    let firstOutputAt = 0;
    const r = await c!.agent.eval('import time\nprint("from the child")\ntime.sleep(1)\n7', {
      onStdout: () => {
        firstOutputAt ||= performance.now();
      },
    });
    assert.is(r.stdout, 'from the child\n');
    assert.is(r.value, 7);
    assert.ok(firstOutputAt > 0 && performance.now() - firstOutputAt > 500, 'the output came before the eval ended');
    // a timeout interrupts a busy eval (the watchdog thread starts at the first eval with one)
    const t = await Promise.race([
      c!.agent.eval('while True: time.sleep(0.01)', { timeoutMs: 300 }),
      new Promise<null>((res) => setTimeout(() => res(null), 10000)),
    ]);
    assert.ok(t?.timedOut, 'the eval timed out');
    assert.is(await val(c!.agent, '1 + 1'), 2);
    // a second client connects to the child's socket (the service thread accepts)
    const second = await connectAgent(hostPid(c!));
    try {
      assert.is(await val(second, 'WARM["answer"]'), 42);
    } finally {
      second.close();
    }
    // an orphan ends as a zombie child of the agent (PID 1), which reaps it
    const reaped = await val(
      c!.agent,
      'import subprocess\norphan = int(subprocess.run(["sh", "-c", "sleep 0.2 & echo $!"], capture_output=True, text=True).stdout)\n' +
        'for _ in range(100):\n    if not os.path.exists("/proc/%d" % orphan): break\n    time.sleep(0.05)\nnot os.path.exists("/proc/%d" % orphan)',
    );
    assert.is(reaped, true);
  } finally {
    await c!.kill();
  }
});

test("what a sandbox's subprocesses write to fds 1 and 2 is its own eval's output: forks, siblings and branches", async () => {
  const [a, b] = await engine.fork(TEMPLATE, 2);
  try {
    assert.is((await a!.agent.eval('import os, subprocess, time\nos.system("echo a-out; echo a-err >&2")')).stdout, 'a-out\n');
    // b's output while a's eval runs is b's; a's is a's
    const slow = a!.agent.eval('time.sleep(0.5)\nos.system("echo a-late")\nNone');
    const rb = await b!.agent.eval('import subprocess\nsubprocess.run(["sh", "-c", "echo b-out"])\nNone');
    assert.is(rb.stdout, 'b-out\n');
    assert.is((await slow).stdout, 'a-late\n');
    // multiprocessing's fork workers print into the eval too (through the child's own pipes)
    const mp = await a!.agent.eval('import multiprocessing\nwith multiprocessing.get_context("fork").Pool(2) as pool:\n    pool.map(print, ["w1", "w2", "w3"])');
    assert.equal(mp.stdout.split('\n').filter(Boolean).sort(), ['w1', 'w2', 'w3']);
    // a branch has pipes of its own (it is a copy of a, whose fds 1 and 2 were a's pipes)
    const [br] = await engine.branch(a!, 1);
    try {
      const during = a!.agent.eval('time.sleep(0.5)\nprint("a-end")');
      assert.is((await br!.agent.eval('os.system("echo br-out")\nNone')).stdout, 'br-out\n');
      assert.is((await during).stdout, 'a-end\n');
    } finally {
      await br!.kill();
    }
  } finally {
    await Promise.all([a!.kill(), b!.kill()]);
  }
});

test('10 children in parallel each answer their own eval', async () => {
  const kids = await engine.fork(TEMPLATE, 10);
  assert.is(new Set(kids.map((k) => k.id)).size, 10);
  const answers = await Promise.all(kids.map((k, i) => val(k.agent, `WARM["answer"] * 1000 + ${i}`)));
  assert.equal(answers, kids.map((_, i) => 42000 + i));
  await Promise.all(kids.map((k) => k.kill()));
});

test('a fork of 30 (sent to the zygote as several requests) gives 30 distinct children in order', async () => {
  const kids = await engine.fork(TEMPLATE, 30);
  assert.is(kids.length, 30);
  assert.is(new Set(kids.map((k) => k.id)).size, 30);
  assert.is(new Set(kids.map(hostPid)).size, 30);
  const hosts = await Promise.all(kids.map((k) => val(k.agent, 'socket.gethostname()')));
  assert.equal(hosts, kids.map((k) => k.id));
  await Promise.all(kids.map((k) => k.kill()));
});

test('a fork request that hits the pids limit part-way: the forked children answer, the rest fail, nothing leaks', async () => {
  const z = (engine as unknown as { zygotes: Map<string, { client: AgentClient; pid: number }> }).zygotes.get(TEMPLATE)!;
  // 40 children at 2 tasks each (the agent, its service thread), all in the zygote's cgroup (pids.max 64): some forks get EAGAIN.
  const ids = Array.from({ length: 40 }, (_, i) => `pl${i}-${randomBytes(3).toString('hex')}`);
  const res = await z.client.request('fork', { children: ids.map((id) => ({ id, hostname: id })) });
  const ok = res.children.filter((c) => c.ok);
  const bad = res.children.filter((c) => !c.ok);
  assert.ok(ok.length > 0 && bad.length > 0, `forked ${ok.length}, failed ${bad.length}`);
  for (const b of bad) assert.match(b.error ?? '', /Resource temporarily unavailable|not forked|can't start new thread/);
  // every child reported forked is alive (listening); kill them
  const nsToHost = new Map<number, number>();
  // the zygote's forks are the children of its fork server (its one child that is not PID 1 of a namespace of its own)
  for (const k of childrenOf(z.pid).flatMap((s) => [s, ...childrenOf(s)])) {
    if (!alive(k)) continue; // earlier tests' killed sandboxes, waiting for the fork server to reap them
    const ns = /^NSpid:\s+(.*)$/m.exec(readFileSync(`/proc/${k}/status`, 'utf8'))![1]!.trim().split(/\s+/).map(Number);
    if (ns[ns.length - 1] === 1) nsToHost.set(ns[ns.length - 2]!, k);
  }
  for (const c of ok) {
    const p = nsToHost.get(c.pid!);
    assert.ok(p !== undefined && alive(p), `child ${c.id} (pid ${c.pid} in the zygote) is alive`);
    process.kill(p!, 'SIGKILL');
  }
  // the zygote's only live forks are those: no half-made child was left behind
  assert.is(nsToHost.size, ok.length);
  // (zombies hold their pids until the fork server reaps them: wait for that before forking again)
  for (const deadline = Date.now() + 10000; [...nsToHost.values()].some((p) => existsSync(`/proc/${p}`)); ) {
    assert.ok(Date.now() < deadline, 'the fork server reaps the killed children');
    await new Promise((r) => setTimeout(r, 50));
  }
  // and the template still forks
  const [c] = await engine.fork(TEMPLATE, 1);
  assert.is(await val(c!.agent, 'WARM["answer"]'), 42);
  await c!.kill();
});

test('randomness differs in every child and from the template', async () => {
  const kids = await engine.fork(TEMPLATE, 4);
  const code = '(os.urandom(16).hex(), str(uuid.uuid4()), random.random(), TEMPLATE_RANDOM)';
  const rs = (await Promise.all(kids.map((k) => val(k.agent, code)))) as [string, string, number, number][];
  for (const i of [0, 1, 2]) assert.is(new Set(rs.map((r) => r[i])).size, kids.length, `field ${i} repeats across children`);
  const templateRandom = rs[0]![3];
  for (const r of rs) {
    assert.is(r[3], templateRandom); // the template's own value is inherited...
    assert.is.not(r[2], templateRandom); // ...but the generator was reseeded
  }
  await Promise.all(kids.map((k) => k.kill()));
});

test('files written in one child are absent in its siblings', async () => {
  const [a, b] = await engine.fork(TEMPLATE, 2);
  await val(a!.agent, 'open("/tmp/mine", "w").write("a"); open("/root/note", "w").write("a"); 1');
  assert.equal(await val(b!.agent, '(os.path.exists("/tmp/mine"), os.path.exists("/root/note"))'), [false, false]);
  assert.equal(await val(a!.agent, 'open("/tmp/mine").read()'), 'a');
  // and the zygote's base did not change: a new child sees nothing either
  const [c] = await engine.fork(TEMPLATE, 1);
  assert.equal(await val(c!.agent, 'os.path.exists("/tmp/mine")'), false);
  await Promise.all([a, b, c].map((k) => k!.kill()));
});

test("open files and shared memory are each child's own: those of the warm-up (fork) and of a live source (BRANCH)", async () => {
  // A fork shares its parent's open file descriptions and MAP_SHARED pages: a child must get its
  // own, or it writes the template's files (which every sibling reads) or its source's.
  await withTemplate('files', [
    'import os, mmap, tempfile',
    'f = open("/tmp/log", "w+"); f.write("warm"); f.flush(); os.set_inheritable(f.fileno(), True)',
    'open("/tmp/ro", "w").write("read-only"); r = open("/tmp/ro"); r.read(4)',
    't = tempfile.TemporaryFile(); t.write(b"unnamed"); t.flush()',
    'm = mmap.mmap(-1, 4096); m[:4] = b"anon"',
    'fm = open("/tmp/mapped", "w+b"); fm.write(bytes(4096)); fm.flush(); mm = mmap.mmap(fm.fileno(), 4096); mm[:4] = b"file"',
    's = open("/dev/shm/seg", "w+"); s.write("shm"); s.flush()',
    // write-only and unlinked; and an unnamed file mapped shared (the mapping and the fd must stay one file)
    'wo = open("/tmp/gone", "w"); wo.write("x"); wo.flush(); os.unlink("/tmp/gone")',
    'u = tempfile.TemporaryFile(); u.truncate(4096); um = mmap.mmap(u.fileno(), 4096); um[:2] = b"u0"',
    'def gone(): return open("/proc/self/fd/%d" % wo.fileno()).read()',
  ], async (name, kids) => {
    const see = '(f.tell(), (f.seek(0), f.read())[1], open("/tmp/log").read(), (t.seek(0), t.read())[1], bytes(m[:6]), bytes(mm[:6]), open("/tmp/mapped", "rb").read(6), (s.seek(0), s.read())[1], open("/dev/shm/seg").read())';
    const warm = [4, 'warm', 'warm', 'unnamed', 'anon\0\0', 'file\0\0', 'file\0\0', 'shm', 'shm'];
    const [a, b] = await engine.fork(name, 2);
    kids.push(a!, b!);
    const fresh = await val(b!.agent, '(f.tell(), r.tell(), r.readable(), r.writable(), os.get_inheritable(f.fileno()), os.get_inheritable(r.fileno()))');
    assert.equal(fresh, [4, 4, true, false, true, false], 'offsets, access modes and close-on-exec as the warm-up left them');
    await val(a!.agent, 'f.write("+a"); f.flush(); t.write(b"+a"); t.flush(); m[4:6] = b"+a"; mm[4:6] = b"+a"; s.write("+a"); s.flush(); 1');
    const bytesOf = (v: unknown) => (v instanceof Uint8Array ? Buffer.from(v).toString('latin1') : v);
    const seen = async (k: Sandbox) => ((await val(k.agent, see)) as unknown[]).map(bytesOf);
    assert.equal(await seen(a!), [6, 'warm+a', 'warm+a', 'unnamed+a', 'anon+a', 'file+a', 'file+a', 'shm+a', 'shm+a']);
    assert.equal(await seen(b!), warm, 'a sibling sees none of it');
    await val(a!.agent, 'wo.write("A"); wo.flush(); um[:2] = b"uA"; 1');
    assert.equal(await val(a!.agent, '(gone(), (u.seek(0), u.read(2))[1])').then((v) => (v as unknown[]).map(bytesOf)), ['xA', 'uA'], "the child's own copies, its mapping on its copy of the file");
    assert.equal(await val(b!.agent, '(gone(), (u.seek(0), u.read(2))[1], bytes(um[:2]))').then((v) => (v as unknown[]).map(bytesOf)), ['x', 'u0', 'u0']);
    const [c] = await engine.fork(name, 1);
    kids.push(c!);
    assert.equal(await seen(c!), warm, 'nor does the template');
    // BRANCH: files the source opened after its fork, and those it inherited
    await val(a!.agent, 'g = open("/tmp/src", "w+"); g.write("src"); g.flush(); 1');
    const [br] = await engine.branch(a!, 1);
    kids.push(br!);
    await val(br!.agent, 'g.write("+br"); g.flush(); f.write("+br"); f.flush(); m[:2] = b"BR"; mm[:2] = b"BR"; 1');
    assert.equal(await val(a!.agent, '(open("/tmp/src").read(), open("/tmp/log").read(), bytes(m[:6]), bytes(mm[:6]))').then((v) => (v as unknown[]).map(bytesOf)), [
      'src',
      'warm+a',
      'anon+a',
      'file+a',
    ]);
    assert.equal(await val(br!.agent, '(open("/tmp/src").read(), open("/tmp/log").read(), bytes(m[:6]), bytes(mm[:6]), open("/tmp/mapped", "rb").read(6))').then((v) => (v as unknown[]).map(bytesOf)), [
      'src+br',
      'warm+a+br',
      'BRon+a',
      'BRle+a',
      'BRle+a',
    ]);
  });
});

test("pipes, socket pairs, eventfds, asyncio's epoll and a template's subprocess are each child's own", async () => {
  await withTemplate('fds', [
    'import asyncio, os, socket, subprocess',
    'loop = asyncio.new_event_loop()',
    'pr, pw = os.pipe(); os.write(pw, b"queued")',
    'ev = os.eventfd(3)',
    'sa, sb = socket.socketpair(); sa.sendall(b"pair")',
    'cat = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)',
    'def registered(): return open("/proc/self/fdinfo/%d" % loop._selector.fileno()).read().count("tfd:")',
    'out = os.dup(1)  # another fd of the eval output pipe (fd 1 while an eval runs): each child\'s own',
  ], async (name, kids) => {
    const [a, b] = await engine.fork(name, 2);
    kids.push(a!, b!);
    const before = await val(b!.agent, 'registered()');
    // A: writes into every one of them, and registers one more fd with its loop
    const wrote = await a!.agent.eval(
      [
        'os.write(pw, b"+a"); os.eventfd_write(ev, 10); sb.sendall(b"+a")',
        'x, y = socket.socketpair(); loop.add_reader(x.fileno(), lambda: None)',
        'try:\n    cat.stdin.write(b"from a\\n"); cat.stdin.flush(); piped = "written"\nexcept BrokenPipeError:\n    piped = "EPIPE"',
        '(registered(), piped, os.write(out, b"to its output\\n"))',
      ].join('\n'),
    );
    assert.equal(wrote.value, [Number(before) + 1, 'EPIPE', 14], "the template's cat is not in the child: its stdin refuses writes");
    assert.is(wrote.stdout, 'to its output\n', "the warm-up's dup of fd 1 writes the child's eval output");
    // B sees what the warm-up left, none of A's
    const seen = await val(
      b!.agent,
      [
        'os.set_blocking(pr, False); os.set_blocking(ev, False); sa.setblocking(False)',
        'def take(f):\n    try:\n        return f()\n    except BlockingIOError:\n        return None',
        '(take(lambda: os.read(pr, 100)), take(lambda: os.eventfd_read(ev)), sb.recv(100), take(lambda: sa.recv(100)), registered(), cat.stdout.read())',
      ].join('\n'),
    );
    assert.equal(seen, [Buffer.from('queued'), 3, Buffer.from('pair'), null, before, Buffer.alloc(0)]);
    // and the loop still runs in a child
    assert.is(await val(b!.agent, 'loop.run_until_complete(asyncio.sleep(0.01, result=7))'), 7);
    // BRANCH: the source's pipe and its queued bytes, copied; the branch's writes stay its own
    await val(a!.agent, 'qr, qw = os.pipe(); os.write(qw, b"src"); 1');
    const [br] = await engine.branch(a!, 1);
    kids.push(br!);
    await val(br!.agent, 'os.write(qw, b"+br"); 1');
    assert.equal(await val(br!.agent, 'os.read(qr, 100)'), Buffer.from('src+br'));
    // the source's dup of its fd 1 is the branch's own output in the branch, while the source runs an eval
    const during = a!.agent.eval('import time\ntime.sleep(0.3)\nos.write(out, b"a\\n")\nNone');
    assert.is((await br!.agent.eval('os.write(out, b"br\\n")\nNone')).stdout, 'br\n');
    assert.is((await during).stdout, 'a\n');
    assert.equal(await val(a!.agent, 'os.read(qr, 100)'), Buffer.from('src'));
  });
});

test('a fork server that dies in the middle of a request leaves no child behind; children already handed out live on', async () => {
  // The warm-up's at-fork handler stops the fork server once it has five children, in the
  // middle of the second request (its third), while the host still waits for its answer.
  // (Counted live, not forked: the template's pattern child, made and gone before prepare()
  // returns, was a fork too, if its zygote could make one.)
  await withTemplate('dies', [
    'import os, time',
    'def after():',
    '    if os.environ.get("FORKLING_PROCESS_ROLE") == "sandbox" and "FORKLING_SANDBOX_ID" not in os.environ:  # the fork server',
    '        if len(open("/proc/self/task/%d/children" % os.getpid()).read().split()) == 5:',
    '            time.sleep(120)',
    'os.register_at_fork(after_in_parent=after)',
  ], async (name, kids) => {
    await engine.prepare(name);
    const zygote = engine.zygotePid(name)!;
    const family = (pid: number): number[] => childrenOf(pid).flatMap((k) => (alive(k) ? [k, ...family(k)] : []));
    const first = childrenOf(zygote).find((p) => !pidOneOwnNs(p))!;
    assert.ok(await pollUntil(() => childrenOf(first).length === 0, 5000), 'the pattern child gone and reaped');
    kids.push(...(await engine.fork(name, 2))); // the server's first two forks
    // forks listening: PID 1 of a pid namespace of their own, with a socket in their own root
    // (not the zygote's socket, still seen there by a fork that has not pivoted into its own root yet)
    const sockAt = (p: number) => {
      try {
        const st = statSync(`/proc/${p}/root/run/forkling/agent.sock`);
        return `${st.dev}:${st.ino}`;
      } catch {
        return null;
      }
    };
    const zygoteSock = sockAt(zygote);
    const sockets = () => family(zygote).filter((p) => pidOneOwnNs(p) && ![null, zygoteSock].includes(sockAt(p))).length;
    const pending = engine.fork(name, 3).then(
      () => null,
      (e: Error) => e.message,
    );
    // all three forked and listening, their server stuck: it dies now
    await pollUntil(() => sockets() >= 5, 20000);
    assert.is(sockets(), 5, 'the request\'s three children listen');
    const server = childrenOf(zygote).find((p) => !pidOneOwnNs(p));
    assert.ok(server, 'the fork server');
    process.kill(server!, 'SIGKILL');
    assert.match((await pending) ?? '', /fork server/, 'the request fails, saying why');
    // its children die with the server; the two handed out (now the zygote's: it is init of the
    // server's pid namespace) live on
    const handedOut = new Set(kids.flatMap((k) => [hostPid(k), ...family(hostPid(k))]));
    const left = () => family(zygote).filter((p) => !handedOut.has(p));
    await pollUntil(() => left().length === 0, 5000);
    assert.equal(left(), [], 'no other process is left under the zygote');
    for (const k of kids) assert.is(await val(k.agent, '6 * 7'), 42, 'children the host had taken live on');
    // the next request gets a new server
    const [c] = await engine.fork(name, 1);
    kids.push(c!);
    assert.is(await val(c!.agent, '1 + 1'), 2);
  });
});

test('a fork server that died while idle (killed for memory, say) is replaced at the next request, which succeeds', async () => {
  const zygote = engine.zygotePid(TEMPLATE)!;
  const [a] = await engine.fork(TEMPLATE, 1);
  const server = childrenOf(zygote).find((p) => alive(p) && !pidOneOwnNs(p));
  assert.ok(server, 'the fork server');
  process.kill(server!, 'SIGKILL');
  await pollUntil(() => !alive(server!), 5000);
  // (without the zygote's check, this request went to the dead server's socket and failed)
  const [b] = await engine.fork(TEMPLATE, 1);
  assert.is(await val(b!.agent, 'WARM["answer"]'), 42);
  assert.is(await val(a!.agent, '6 * 7'), 42, 'a child handed out before lives on');
  const next = childrenOf(zygote).find((p) => alive(p) && !pidOneOwnNs(p));
  assert.ok(next !== undefined && next !== server, 'a new fork server');
  await a!.kill();
  await b!.kill();
});

test('a fork the host never connects to (it gave up on the request) exits by itself; a claimed one lives on', async () => {
  const short = new ProcessEngine({ warn: () => {}, pidsPerSandbox: 64, unclaimedForkS: 2 });
  const name = `${TEMPLATE}-unclaimed`;
  try {
    await short.createTemplate({ name, image: 'default' });
    await short.prepare(name); // (its pattern child made and gone: not one of the forks counted below)
    const [claimed] = await short.fork(name, 1);
    // The zygote asked directly, as the engine does, which then never connects.
    const zygote = (short as unknown as { zygotes: Map<string, { client: AgentClient }> }).zygotes.get(name)!;
    const res = (await zygote.client.request('fork', { children: [{ id: 'unclaimed1', hostname: 'unclaimed1' }] })) as {
      children: { ok: boolean; pid?: number }[];
    };
    assert.ok(res.children[0]?.ok, JSON.stringify(res));
    const family = (pid: number): number[] => childrenOf(pid).flatMap((k) => [k, ...family(k)]);
    const zpid = short.zygotePid(name)!;
    const claimedPid = hostPid(claimed!);
    const unclaimed = () => family(zpid).filter((p) => alive(p) && pidOneOwnNs(p) && p !== claimedPid);
    assert.is(unclaimed().length, 1, 'the unclaimed fork runs');
    const t0 = Date.now();
    assert.ok(await pollUntil(() => unclaimed().length === 0, 15000), 'the unclaimed fork exited');
    assert.ok(Date.now() - t0 >= 500, 'not at once: it waited for its host');
    // (made before the unclaimed one: past its own unclaimed time too)
    assert.is(await val(claimed!.agent, '6 * 7'), 42, 'the fork the host connected to lives on');
    await claimed!.kill();
    assert.throws(() => new ProcessEngine({ unclaimedForkS: 0 }), /unclaimedForkS: 0 is not a number of seconds/);
  } finally {
    await short.close();
    rmSync(storePath('process-templates', `${name}.json`), { force: true });
  }
});

test("an idle fork gives back its copies of the template's bytes (reclaim); what it holds stays as it was; the template file is sealed", async () => {
  const warm = ['import threading', 'BIG = [str(i) * 20 for i in range(200000)]', 'TOTAL = sum(len(x) for x in BIG)'];
  await withTemplate('reclaim', warm, async (name, kids) => {
    await engine.prepare(name); // (its pattern made: forks from here on map it where they match it)
    kids.push(...(await engine.fork(name, 2)));
    const [a, b] = kids as [Sandbox, Sandbox];
    // touch (and leave as they were) many of the template's objects; state of its own; a thread
    await val(a.agent, 'n = sum(len(x) for x in BIG)\nMINE = {"k": list(range(1000))}\nT = threading.Thread(target=lambda: None); T.start(); T.join()\nn');
    const priv = () =>
      readFileSync(`/proc/${hostPid(a)}/smaps_rollup`, 'utf8')
        .split('\n')
        .filter((l) => l.startsWith('Private'))
        .reduce((t, l) => t + Number(l.split(/\s+/)[1]), 0);
    const busy = priv();
    // idle 2 s (four quiet ticks of its service thread), then it gives back
    assert.ok(await pollUntil(() => priv() < busy - 256, 10000, 200), `gave back (was ${busy} KiB, now ${priv()})`);
    assert.equal(await val(a.agent, '(sum(len(x) for x in BIG) == TOTAL, MINE["k"][-1], BIG[123456])'), [true, 999, '123456'.repeat(20)]);
    assert.equal(await val(b.agent, '(len(BIG), TOTAL == sum(len(x) for x in BIG), "MINE" in globals())'), [200000, true, false]);
    // Three files mapped (the zygote's, the fork server's layer, the pattern), and the fork's memory
    // maps each; one fd of each in the fork (its own: opened again after the fork).
    const files = (await val(
      a.agent,
      'import os\n' +
        'fds = [int(n) for n in os.listdir("/proc/self/fd") if os.path.exists("/proc/self/fd/" + n) and "forkling-template" in os.readlink("/proc/self/fd/" + n)]\n' +
        'inodes = {os.fstat(fd).st_ino for fd in fds}\n' +
        'mapped = {int(l.split()[4]) for l in open("/proc/self/maps") if "forkling-template" in l}\n' +
        '(len(fds), len(inodes), inodes <= mapped)',
    )) as [number, number, boolean];
    // (the zygote says on its console why a file is missing: a remap or the pattern failed)
    assert.equal(files, [3, 3, true], `the files of the template and of its pattern, each mapped; the zygote's console:\n${engine.zygoteConsole(name).join('\n')}`);
    // the fork server found pages each fork copies ahead (those the pattern child wrote: fr_prefault)
    const ahead = engine.zygoteConsole(name).map((l) => /each fork copies (\d+) KiB ahead/.exec(l)?.[1]).find((k) => k !== undefined);
    if (process.env.FORKLING_PROCESS_PREFAULT === '0') assert.equal(ahead, '0', 'copying ahead turned off');
    else assert.ok(Number(ahead) > 0, `the pages a fork copies ahead: ${ahead} KiB`);
    // each fork's fds of them are its own open files: an offset set in one is not seen in a sibling
    const tmplFds = 'import os\nfds = sorted(int(n) for n in os.listdir("/proc/self/fd") if os.path.exists("/proc/self/fd/" + n) and "forkling-template" in os.readlink("/proc/self/fd/" + n))\n';
    assert.equal(await val(a.agent, `${tmplFds}[os.lseek(fd, 4096 * (i + 1), os.SEEK_SET) for i, fd in enumerate(fds)]`), [4096, 8192, 12288]);
    assert.equal(await val(b.agent, `${tmplFds}[os.lseek(fd, 0, os.SEEK_CUR) for fd in fds]`), [0, 0, 0], 'no offset shared with a sibling');
    // the files every fork maps: an fd of each is in each fork, and each refuses what would change it for the others
    const sealed = (await val(
      a.agent,
      'import os, errno, fcntl\n' +
        'fds = sorted(int(n) for n in os.listdir("/proc/self/fd") if "forkling-template" in (os.readlink("/proc/self/fd/" + n) if os.path.exists("/proc/self/fd/" + n) else ""))\n' +
        'res = []\n' +
        'for fd in fds:\n' +
        '    out = [fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY]  # its own, read-only (no offset shared with siblings)\n' +
        '    fd = os.open("/proc/self/fd/%d" % fd, os.O_RDWR)  # (opened again for writing)\n' +
        '    for f in (lambda: os.pwrite(fd, b"x", 0), lambda: os.ftruncate(fd, 0), lambda: os.ftruncate(fd, 1 << 40)):\n' +
        '        try:\n            f(); out.append("done")\n        except OSError as e:\n            out.append(errno.errorcode[e.errno])\n' +
        '    res.append(out)\n' +
        'res',
    )) as (string | boolean)[][];
    assert.equal(sealed, [[true, 'EPERM', 'EPERM', 'EPERM'], [true, 'EPERM', 'EPERM', 'EPERM'], [true, 'EPERM', 'EPERM', 'EPERM']]);
  });
  // off: no file, nothing given back
  const off = new ProcessEngine({ warn: () => {}, pidsPerSandbox: 64, reclaim: false });
  const name = `${TEMPLATE}-noreclaim`;
  try {
    await off.createTemplate({ name, image: 'default' });
    const [c] = await off.fork(name, 1);
    assert.is(await val(c!.agent, 'import os\nany("forkling-template" in os.readlink("/proc/self/fd/" + n) for n in os.listdir("/proc/self/fd") if os.path.exists("/proc/self/fd/" + n))'), false);
    await c!.kill();
  } finally {
    await off.close();
    rmSync(storePath('process-templates', `${name}.json`), { force: true });
  }
});

test('an idle fork sleeps once it has given back its copies (no tick writes them again); a request or the exit of a child process wakes it', async () => {
  const [c] = await engine.fork(TEMPLATE, 1);
  try {
    const pid = hostPid(c!);
    assert.is(await val(c!.agent, '1 + 1'), 2);
    assert.ok(await comesToSleep(pid, 15000), 'idle, it sleeps: no thread wakes');
    // a request wakes its service thread (which then ticks through a quiet spell), not only the connection's
    assert.is(await val(c!.agent, '2 + 2'), 4);
    assert.not.ok(await sleptFor(pid, 1500), 'the request woke the service thread');
    assert.ok(await comesToSleep(pid, 15000), 'and it sleeps again');
    // an orphan (a child of PID 1 once its shell exits) that outlives a quiet spell: it sleeps
    // meanwhile, and the orphan's exit wakes it to reap it (no request comes in between)
    const orphan = await val(c!.agent, 'import subprocess\nint(subprocess.run(["sh", "-c", "sleep 11 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True).stdout)');
    assert.ok(await comesToSleep(pid, 9000), 'asleep while its child runs'); // (idle 2-5 s, then its reclaim)
    assert.ok(childrenOf(pid).length > 0, 'the orphan still runs');
    assert.ok(await pollUntil(() => childrenOf(pid).length === 0, 15000, 200), 'the orphan reaped once it exited');
    assert.ok(await comesToSleep(pid, 15000), 'and it sleeps again');
    assert.is(await val(c!.agent, `import os\nos.path.exists("/proc/${orphan}")`), false, 'the orphan was reaped');
    // a branch sleeps on a wake-up of its own (not its source's): a request to each wakes that one
    const [br] = await engine.branch(c!, 1);
    try {
      for (const s of [br!, c!]) assert.ok(await comesToSleep(hostPid(s), 15000), `${s === br ? 'the branch' : 'its source'} sleeps`);
      assert.is(await val(br!.agent, '3 + 3'), 6);
      assert.not.ok(await sleptFor(hostPid(br!), 1500), "a request woke the branch's service thread");
      assert.ok(await sleptFor(hostPid(c!), 1500), 'and not its source');
      assert.is(await val(c!.agent, '4 + 4'), 8);
      assert.not.ok(await sleptFor(hostPid(c!), 1500), "a request woke the source's");
    } finally {
      await br!.kill();
    }
  } finally {
    await c!.kill();
  }
});

test('BRANCH to depth 3: each level sees every variable above it; sources keep running', async () => {
  const [root] = await engine.fork(TEMPLATE, 1);
  // a file of the image deleted in the source (an overlay whiteout) stays deleted in its branches
  await val(root!.agent, 'L0 = "zero"; open("/tmp/l0", "w").write("0"); os.remove("/etc/debian_version"); 1');
  const [b1] = await engine.branch(root!, 1);
  await val(b1!.agent, 'L1 = "one"; open("/tmp/l1", "w").write("1"); 1');
  const [b2] = await engine.branch(b1!, 1);
  await val(b2!.agent, 'L2 = "two"; 1');
  const [b3] = await engine.branch(b2!, 1);
  assert.equal(await val(b3!.agent, '(WARM["answer"], L0, L1, L2, sorted(f for f in os.listdir("/tmp") if f.startswith("l")))'), [
    42,
    'zero',
    'one',
    'two',
    ['l0', 'l1'],
  ]);
  assert.equal(await val(b3!.agent, '(os.getpid(), socket.gethostname(), os.path.exists("/etc/debian_version"))'), [1, b3!.id, false]);
  // the sources go on, unchanged by their branches
  await val(b3!.agent, 'L0 = "changed in b3"; open("/tmp/l0", "w").write("b3"); 1');
  assert.equal(await val(root!.agent, '(L0, open("/tmp/l0").read(), "L1" in dir())'), ['zero', '0', false]);
  assert.equal(await val(b1!.agent, '(L1, "L2" in dir())'), ['one', false]);
  // two branches of one source are independent of each other
  const [x, y] = await engine.branch(root!, 2);
  await val(x!.agent, 'L0 = "x"; 1');
  assert.is(await val(y!.agent, 'L0'), 'zero');
  await Promise.all([b3, b2, b1, x, y, root].map((s) => s!.kill()));
});

test("BRANCH of a sandbox with a large writable layer: each child's copy is charged to the child's cgroup, not its source's", async () => {
  const [src] = await engine.fork(TEMPLATE, 1); // (256 MiB each: seven copies in the source's cgroup would not fit)
  const kids: Sandbox[] = [];
  try {
    const MiB = 40;
    await val(src!.agent, `open("/tmp/big", "wb").write(os.urandom(1 << 20) * ${MiB}); 1`);
    kids.push(...(await engine.branch(src!, 6)));
    for (const k of [src!, ...kids]) assert.is(await val(k.agent, 'os.path.getsize("/tmp/big")'), MiB << 20);
    const mem = (s: Sandbox) => (s as unknown as { stats(): Promise<{ counters: Record<string, number> }> }).stats().then((x) => x.counters.cgroupMemoryBytes);
    const [srcBytes, ...kidBytes] = await Promise.all([src!, ...kids].map(mem));
    if (srcBytes === undefined) {
      console.log('  (no memory cgroups here: where the copies are charged is not checked)');
      return;
    }
    assert.ok(srcBytes < (MiB + 32) * 2 ** 20, `the source's cgroup holds ${srcBytes >> 20} MiB: its branches' copies of its layer were charged to it`);
    for (const b of kidBytes) assert.ok(b! >= MiB * 2 ** 20, `a branch's cgroup holds ${b! >> 20} MiB, less than its copy of the layer`);
  } finally {
    await Promise.all([...kids, src!].map((s) => s.kill()));
  }
});

test("many live forks of a small template: what each wrote before it left the zygote's cgroup does not exhaust the zygote's limit", async () => {
  // Each fork's set-up pages stay charged to the zygote's cgroup (~1 MiB a fork): 120 of a 128 MiB
  // template went over its limit, and the kernel killed processes in it, before the engine raised it.
  const name = `${TEMPLATE}-small`;
  await engine.createTemplate({ name, image: 'default', memoryMiB: 128 });
  const kids: Sandbox[] = [];
  try {
    kids.push(...(await engine.fork(name, 120)));
    const answers = await Promise.all(kids.map((k) => val(k.agent, '6 * 7')));
    assert.ok(answers.every((a) => a === 42));
  } finally {
    await Promise.all(kids.map((k) => k.kill()));
    rmSync(storePath('process-templates', `${name}.json`), { force: true });
  }
});

test("forks of a template whose warm-up left 40 MiB in /dev/shm: each fork's copy does not exhaust the zygote's limit", async () => {
  // (a fork copies the warm-up's /dev/shm in its set-up, charged to the zygote's cgroup: 8 forks of
  // a 256 MiB template killed the zygote before its limit counted them)
  const name = `${TEMPLATE}-shm`;
  await engine.createTemplate({ name, image: 'default', memoryMiB: 256, warmup: 'open("/dev/shm/big", "wb").write(b"y" * (40 << 20))' });
  const kids: Sandbox[] = [];
  try {
    kids.push(...(await engine.fork(name, 8)));
    for (const k of kids) assert.is(await val(k.agent, 'import os\nos.path.getsize("/dev/shm/big")'), 40 << 20);
  } finally {
    await Promise.all(kids.map((k) => k.kill()));
    rmSync(storePath('process-templates', `${name}.json`), { force: true });
  }
});

/** Python for a source sandbox: branch_pid(), the pid (in its namespace) of its one branch (the only other PID 1 it sees). */
const BRANCH_PID_PY = `def branch_pid():
    for p in os.listdir('/proc'):
        if p.isdigit() and p != '1':
            status = open('/proc/%s/status' % p).read()
            if [l for l in status.splitlines() if l.startswith('NSpid:')][0].split()[-1] == '1':
                return int(p)
`;

test('a source that answers a BRANCH with the pid of its earlier branch: refused, and that branch lives on', async () => {
  const [src] = await engine.fork(TEMPLATE, 1);
  const [b1] = await engine.branch(src!, 1);
  await val(b1!.agent, 'B = "b1 state"; 1');
  // user code in the source answers the next branch request itself, naming b1 (its only other PID 1)
  await val(
    src!.agent,
    `import sys, os
${BRANCH_PID_PY}forged = branch_pid()
sys.modules['forkling_zygote']._agent_mod.OPS['branch'] = lambda agent, conn, f: {'children': [{'id': ch['id'], 'ok': True, 'pid': forged} for ch in f['children']]}
forged is not None`,
  );
  await engine.branch(src!, 1).then(
    () => assert.unreachable('the forged answer was taken'),
    (e: Error) => assert.match(e.message, /which is another sandbox's/),
  );
  assert.is(await val(b1!.agent, 'B'), 'b1 state', 'b1 was not touched');
  await Promise.all([b1, src].map((s) => s!.kill()));
});

test('a sandbox whose PID 1 exits while another process holds its connection open is ended all the same', async () => {
  // A branch's source can reach into its branch's root: the branch hands it the host's connection
  // (SCM_RIGHTS over a socket in its /tmp), then exits. No end of file reaches the host.
  const [src] = await engine.fork(TEMPLATE, 1);
  const [b] = await engine.branch(src!, 1);
  const giving = val(
    b!.agent,
    `import socket, sys
agent = sys.modules['forkling_zygote']._agent_mod.AGENT
l = socket.socket(socket.AF_UNIX); l.bind('/tmp/give.sock'); l.listen(1)
c, _ = l.accept()
socket.send_fds(c, [b'x'], [conn.sock.fileno() for conn in agent.connections])
c.recv(1); len(agent.connections)`,
  );
  const held = await val(
    src!.agent,
    `import os, socket, time
${BRANCH_PID_PY}path = '/proc/%d/root/tmp/give.sock' % branch_pid()
for _ in range(500):
    if os.path.exists(path): break
    time.sleep(0.01)
s = socket.socket(socket.AF_UNIX); s.connect(path)
_, HELD, _, _ = socket.recv_fds(s, 1, 8)
s.send(b'k'); len(HELD)`,
  );
  assert.is(held, 1, 'the source holds the branch\'s connection');
  assert.is(await giving, 1);
  const t0 = performance.now();
  void b!.agent.eval('import os; os._exit(0)').catch(() => {});
  const info = await Promise.race([b!.exited, new Promise<null>((r) => setTimeout(() => r(null), 10_000))]);
  assert.ok(info, 'the branch was ended');
  assert.is(info!.reason, 'crashed');
  assert.match(info!.message ?? '', /PID 1 exited/);
  assert.ok(performance.now() - t0 < 10_000);
  assert.is(await val(src!.agent, 'len(HELD)'), 1, 'the source still holds it, and runs');
  await src!.kill();
});

test('killing a source leaves its branches running; the last branch to go takes the source with it', async () => {
  const [src] = await engine.fork(TEMPLATE, 1);
  await val(src!.agent, 'import subprocess\nS = "state of the source"; open("/tmp/src", "w").write("src file")\nP = subprocess.Popen(["sleep", "1000"])\n1');
  const srcPid = hostPid(src!);
  const srcSleep = childrenOf(srcPid);
  assert.is(srcSleep.length, 1, 'the source has one child process: its sleep');
  const srcCg = (src as unknown as { cgroup: { dirs: string[] } | null }).cgroup?.dirs ?? [];
  const [b1] = await engine.branch(src!, 1);
  await val(b1!.agent, 'B1 = "b1"; open("/tmp/b1", "w").write("b1 file"); 1');
  const [b2] = await engine.branch(b1!, 1);
  const b1Pid = hostPid(b1!);
  await src!.pause(); // a paused (frozen) source must still lose its other processes when killed
  await src!.kill();
  assert.is((await src!.exited).reason, 'killed');
  // the source's own processes are gone (its PID 1 is held, stopped, while its branches live) ...
  assert.not.ok(alive(srcSleep[0]!), 'the source\'s sleep is killed at once');
  const srcState = readFileSync(`/proc/${srcPid}/stat`, 'utf8');
  // stopped (T), or frozen by the cgroup freezer (v1 shows D), and its cgroup frozen where there is a freezer
  assert.ok(['T', 'D'].includes(srcState[srcState.lastIndexOf(')') + 2]!), `the source PID 1 is held: ${srcState}`);
  for (const d of srcCg) {
    if (existsSync(join(d, 'freezer.state'))) assert.is(readFileSync(join(d, 'freezer.state'), 'utf8').trim(), 'FROZEN');
    if (existsSync(join(d, 'cgroup.freeze'))) assert.is(readFileSync(join(d, 'cgroup.freeze'), 'utf8').trim(), '1');
  }
  // ... and its branches answer, with their memory and files intact
  assert.equal(await val(b1!.agent, '(S, B1, open("/tmp/src").read(), open("/tmp/b1").read(), WARM["answer"])'), ['state of the source', 'b1', 'src file', 'b1 file', 42]);
  assert.equal(await val(b2!.agent, '(S, B1, os.getpid())'), ['state of the source', 'b1', 1]);
  // killing the middle one (which has a branch of its own) keeps b2 going too
  await b1!.kill();
  assert.equal(await val(b2!.agent, 'S + "!"'), 'state of the source!');
  const [b3] = await engine.branch(b2!, 1);
  assert.is(await val(b3!.agent, 'B1'), 'b1');
  await b3!.kill();
  assert.ok(alive(srcPid) && alive(b1Pid), 'the held sources stay while b2 lives');
  await b2!.kill();
  await (src as unknown as { finished: Promise<void> }).finished;
  assert.not.ok(alive(srcPid), 'the source PID 1 is gone with its last branch');
  assert.not.ok(alive(b1Pid), 'so is the middle one');
  for (const d of srcCg) assert.not.ok(existsSync(d), `cgroup ${d} removed`);
  assert.is((engine as unknown as { holding: Set<unknown> }).holding.size, 0);
});

test('close() with a killed source still held by a live branch removes both', async () => {
  const e2 = new ProcessEngine({ warn: (l) => warnings.push(l), pidsPerSandbox: 64 });
  const [src] = await e2.fork(TEMPLATE, 1);
  const [b] = await e2.branch(src!, 1);
  const pids = [hostPid(src!), hostPid(b!)];
  const cgs = [src, b].flatMap((s) => (s as unknown as { cgroup: { dirs: string[] } | null }).cgroup?.dirs ?? []);
  await src!.kill();
  assert.is(await val(b!.agent, 'WARM["answer"]'), 42);
  await e2.close();
  for (const p of pids) assert.not.ok(alive(p), `process ${p} gone after close`);
  for (const d of cgs) assert.not.ok(existsSync(d), `cgroup ${d} removed`);
});

test('KSM opt-in: forks of a ksm engine have all their memory mergeable; by default they do not', async () => {
  const mergeAny = (pid: number) => /^ksm_merge_any: (\w+)/m.exec(readFileSync(`/proc/${pid}/ksm_stat`, 'utf8'))?.[1];
  const [plain] = await engine.fork(TEMPLATE, 1);
  if (!existsSync(`/proc/${hostPid(plain!)}/ksm_stat`) || mergeAny(hostPid(plain!)) === undefined) {
    console.log('  (kernel without PR_SET_MEMORY_MERGE / ksm_stat: KSM check skipped)');
    await plain!.kill();
    return;
  }
  assert.is(mergeAny(hostPid(plain!)), 'no');
  await plain!.kill();
  const e2 = new ProcessEngine({ warn: (l) => warnings.push(l), pidsPerSandbox: 64, ksm: true });
  try {
    const [k] = await e2.fork(TEMPLATE, 1);
    assert.is(mergeAny(hostPid(k!)), 'yes');
    assert.is(mergeAny(e2.zygotePid(TEMPLATE)!), 'yes');
    assert.is(await val(k!.agent, 'WARM["answer"]'), 42);
  } finally {
    await e2.close();
  }
});

test("a fork's set-up runs with the zygote's CPU limit raised by its forks' share (at most the host's CPUs), the template's again once they are in their own cgroups", async () => {
  const z = (engine as unknown as { zygotes: Map<string, { cgroup: { dirs: string[] } | null; limits: { cpus: number } }> }).zygotes.get(TEMPLATE)!;
  const cpuFile = (z.cgroup?.dirs ?? []).flatMap((d) => ['cpu.cfs_quota_us', 'cpu.max'].map((f) => join(d, f))).find((f) => existsSync(f));
  if (!cpuFile) {
    console.log('  (no cpu cgroup here: not checked)');
    return;
  }
  const quota = () => Number(readFileSync(cpuFile, 'utf8').trim().split(' ')[0]);
  const own = quota();
  assert.is(own, Math.round(z.limits.cpus * 100000));
  const n = 12;
  const want = Math.round(zygoteCpus(z.limits.cpus, n, availableParallelism()) * 100000);
  let most = own;
  let forking = true;
  const watch = (async () => {
    while (forking) {
      most = Math.max(most, quota());
      await new Promise((r) => setTimeout(r, 1));
    }
  })();
  const kids = await engine.fork(TEMPLATE, n);
  forking = false;
  await watch;
  try {
    assert.is(most, want, `the zygote's CPU quota while its forks were set up: ${most}, not ${want}`);
    assert.is(quota(), own, "the template's own once its forks are in their own cgroups");
  } finally {
    await Promise.all(kids.map((k) => k.kill()));
  }
  // The share: the template's vCPUs for the zygote and for each fork, no more than the host has, no less than the template's.
  assert.is(zygoteCpus(1, 12, 2), 2);
  assert.is(zygoteCpus(1, 3, 16), 4);
  assert.is(zygoteCpus(2, 0, 16), 2);
  assert.is(zygoteCpus(4, 10, 2), 4);
});

test('killing children frees their memory, files, processes and cgroups', async () => {
  const [c] = await engine.fork(TEMPLATE, 1);
  const pid = hostPid(c!);
  // 64 MiB of heap, 64 MiB in its private layer (tmpfs: counted as Shmem), and a child process
  await val(
    c!.agent,
    'import subprocess\nHOLD = b"x" * (64 << 20)\nwith open("/tmp/big", "wb") as f:\n    for _ in range(64): f.write(b"y" * (1 << 20))\nP = subprocess.Popen(["sleep", "1000"])\n1',
  );
  const st = await c!.stats();
  assert.ok(st.privateKiB > 60 * 1024, `private memory while alive: ${st.privateKiB} KiB`);
  assert.ok(st.counters.processes! >= 2, 'the agent and its sleep');
  // MemAvailable is not a good witness here (freed pages may sit in per-cpu lists or be handed
  // back to a hypervisor); the kernel's own counts of anonymous and tmpfs pages are.
  const before = { anon: meminfo('AnonPages'), shmem: meminfo('Shmem') };
  const cgDirs = (c as unknown as { cgroup: { dirs: string[] } | null }).cgroup?.dirs ?? [];
  await c!.kill();
  assert.is((await c!.exited).reason, 'killed');
  assert.not.ok(alive(pid), 'the sandbox PID 1 is gone');
  for (const d of cgDirs) assert.not.ok(existsSync(d), `cgroup ${d} removed`);
  const shmemFreed = before.shmem - meminfo('Shmem');
  assert.ok(shmemFreed > 60 * 1024, `its layer went with it: Shmem fell by ${shmemFreed} KiB`);
  const anonFreed = before.anon - meminfo('AnonPages');
  assert.ok(anonFreed > 48 * 1024, `its heap went with it: AnonPages fell by ${anonFreed} KiB`);
});

test('a paused sandbox is killed at once: thawed first (a v1-frozen process holds its SIGKILL), cgroup removed', async () => {
  const [c] = await engine.fork(TEMPLATE, 1);
  const pid = hostPid(c!);
  const cgDirs = (c as unknown as { cgroup: { dirs: string[] } | null }).cgroup?.dirs ?? [];
  await c!.pause();
  const t = performance.now();
  await c!.kill();
  // (the engine waits up to 2 s for a killed PID 1 to exit before it removes the cgroup anyway)
  assert.ok(performance.now() - t < 1500, `kill took ${(performance.now() - t).toFixed(0)} ms: it waited out its exit`);
  assert.is((await c!.exited).reason, 'killed');
  assert.not.ok(alive(pid), 'the sandbox PID 1 is gone');
  for (const d of cgDirs) assert.not.ok(existsSync(d), `cgroup ${d} removed`);
});

test('isolation: no host files, no other sandbox, no network', async () => {
  const [a, b] = await engine.fork(TEMPLATE, 2);
  const marker = `/tmp/forkling-host-marker-${randomBytes(4).toString('hex')}`;
  await import('node:fs').then((fs) => fs.writeFileSync(marker, 'host'));
  try {
    const seen = (await val(
      a!.agent,
      `(os.path.exists("/work"), os.path.exists(${JSON.stringify(marker)}), os.path.exists("/var/lib/forkling"), ` +
        'sorted(os.listdir("/sys")), [n for _, n in socket.if_nameindex()])',
    )) as unknown[];
    assert.equal(seen, [false, false, false, [], ['lo']]);
  } finally {
    rmSync(marker, { force: true });
  }
  // a sibling's processes are invisible: b runs a sleep that a cannot find
  await val(b!.agent, 'import subprocess\nS = subprocess.Popen(["sleep", "77777"])\n1');
  const procs = (await val(
    a!.agent,
    '[open("/proc/" + p + "/cmdline", "rb").read().decode(errors="replace") for p in os.listdir("/proc") if p.isdigit()]',
  )) as string[];
  assert.ok(procs.every((c) => !c.includes('77777')), `a sees: ${procs.join(' | ')}`);
  assert.ok(procs.length <= 3, `a sees ${procs.length} processes`);
  // the outside network is unreachable, at once
  const net = (await val(
    a!.agent,
    'import time\nt = time.monotonic()\ntry:\n    socket.create_connection(("1.1.1.1", 80), timeout=5)\n    r = "connected"\nexcept OSError as e:\n    r = type(e).__name__\n(r, time.monotonic() - t)',
  )) as [string, number];
  assert.is.not(net[0], 'connected');
  assert.ok(net[1] < 0.5, `connect failed after ${net[1]} s`);
  // loopback works inside
  assert.is(await val(a!.agent, 's = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); c = socket.create_connection(s.getsockname()); c.close(); s.close(); "ok"'), 'ok');
  await Promise.all([a, b].map((k) => k!.kill()));
});

test('kill(0, SIGKILL) and kill(-1, SIGKILL) in a sandbox reach that sandbox only (each is a session of its own)', async () => {
  // (in Node's process group, kill(0) reached Node and every sandbox: a process group ignores pid namespaces)
  const [a, b] = await engine.fork(TEMPLATE, 2);
  const sids = (await Promise.all([a, b].map((k) => val(k!.agent, '(os.getsid(0), os.getpgid(0))')))) as [number, number][];
  assert.equal(sids, [
    [1, 1],
    [1, 1],
  ], 'each fork leads its own session and process group (pid 1 in its namespace)');
  // (its PID 1, the agent, is a namespace init: a SIGKILL from inside its namespace passes it by)
  const sleeper = 'import subprocess\nS = subprocess.Popen(["sleep", "1000"])\nimport os, signal\nos.kill(-1, signal.SIGKILL)\nos.kill(0, signal.SIGKILL)\nS.wait()';
  assert.is(await val(a!.agent, sleeper), -9, "the sandbox's own processes are killed");
  assert.is(await val(a!.agent, '1 + 1'), 2);
  assert.is(await val(b!.agent, 'WARM["answer"]'), 42, 'its sibling lives');
  const [c] = await engine.fork(TEMPLATE, 1);
  assert.is(await val(c!.agent, '1 + 1'), 2, 'the zygote and its fork server live');
  await Promise.all([b, c].map((k) => k!.kill()));
});

test("a sandbox's root is not the host's root uid: global sysctls stay out of reach", async () => {
  // (mapped onto the host's 0-65535 when forkling ran as root, it could write
  // kernel.core_pattern through its own /proc: a way out)
  const [c] = await engine.fork(TEMPLATE, 1);
  const [euid, map, write] = (await val(
    c!.agent,
    'import os\ntry:\n    open("/proc/sys/kernel/core_pattern", "w").close()\n    w = "opened for writing"\nexcept OSError as e:\n    w = type(e).__name__\n(os.geteuid(), open("/proc/self/uid_map").read().split(), w)',
  )) as [number, string[], string];
  assert.is(euid, 0, 'root inside');
  assert.is.not(Number(map[1]), 0, `host uid of its root: ${map.join(' ')}`);
  assert.is(write, 'PermissionError');
  await c!.kill();
});

test("no fd of a fork reaches the zygote's mount tree (the zygote's agent socket)", async () => {
  // (the zygote kept an O_PATH fd of its base layer; every fork inherited it, and `..` from it
  // walked the zygote's tree past the fork's own pivot_root: to the agent sockets there)
  const [a, b] = await engine.fork(TEMPLATE, 2);
  const code = `
import os, stat
own = os.stat('/run/forkling/agent.sock')
hits = []
for fd in map(int, os.listdir('/proc/self/fd')):
    try:
        if not stat.S_ISDIR(os.stat(fd).st_mode):
            continue
    except OSError:
        continue
    for up in range(1, 8):
        p = '/proc/self/fd/%d/%s' % (fd, '../' * up)
        for name in ('forkling/agent.sock', 'run/forkling/agent.sock'):
            try:
                st = os.stat(p + name)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) != (own.st_dev, own.st_ino):
                hits.append(p + name)
hits
`;
  assert.equal(await val(a!.agent, code), []);
  await Promise.all([a, b].map((k) => k!.kill()));
});

test("a warm-up's fds of /proc, /run and removed directories are closed in its forks, not shared: nothing leads to the zygote or a sibling", async () => {
  await withTemplate('procfds', [
    'import os',
    "os.mkdir('/tmp/gone'); GONE = os.open('/tmp/gone', os.O_RDONLY | os.O_DIRECTORY); os.rmdir('/tmp/gone')",
    "PROC = os.open('/proc', os.O_RDONLY | os.O_DIRECTORY)",
    "PATH = os.open('/proc/self', os.O_PATH)",
    "MEM = os.open('/proc/self/mem', os.O_RDWR)",
    "open('/run/shared', 'w').close(); RUN = os.open('/run/shared', os.O_RDWR)",
    "KEEP = os.open('/etc/hostname', os.O_RDONLY)",
    'FDS = [GONE, PROC, PATH, MEM, RUN, KEEP]',
    'KEYS = [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in FDS]',
  ], async (name, kids) => {
    kids.push(...(await engine.fork(name, 2)));
    // (a closed fd's number may be taken again since, by the agent's own pipes, sockets and
    // memory files; a file of the root layer is opened again by name: the fork's own copy)
    const code = `
import os
def state(fd, key):
    try:
        st = os.fstat(fd)
    except OSError:
        return 'closed'
    if (st.st_dev, st.st_ino) == key:
        return 'shared'
    agents = os.readlink('/proc/self/fd/%d' % fd).startswith(('pipe:', 'socket:', 'anon_inode:', '/memfd:'))
    return 'closed' if agents else 'its own'
def path(fd):
    try:
        return os.readlink('/proc/self/fd/%d' % fd)
    except OSError:
        return None
[state(fd, key) for fd, key in zip(FDS, KEYS)] + [os.read(KEEP, 100) != b'', [path(fd) for fd in FDS]]`;
    for (const k of kids) {
      const got = (await val(k.agent, code)) as unknown[];
      // (what each fd number leads to now, said when it fails: CI once saw the first one "its own")
      assert.equal(got.slice(0, 7), [...Array(5).fill('closed'), 'its own', true], `what the fds lead to: ${JSON.stringify(got[7])}`);
    }
  });
});

test('a sandbox writes nothing on the host (its /run is its own); the host connects only to the sandbox itself', async () => {
  // (/run/forkling was a host directory bound in: a sandbox could fill the host's /run)
  const [c] = await engine.fork(TEMPLATE, 1);
  await val(c!.agent, 'open("/run/forkling/planted", "wb").write(b"x" * 65536)\n1');
  const engineDir = (engine as unknown as { dir: string }).dir;
  const planted = (readdirSync(engineDir, { recursive: true }) as string[]).filter((f) => f.endsWith('planted'));
  assert.equal(planted, [], 'no file of the sandbox in the engine\'s host directory');
  // its agent socket swapped for a link (to anywhere), or a directory on the way: refused, not followed
  const refused = (why: RegExp) =>
    connectAgent(hostPid(c!)).then(
      (a) => {
        a.close();
        assert.unreachable('a link was followed');
      },
      (e: Error) => assert.match(e.message, why, e.message),
    );
  await val(c!.agent, 'os.rename("/run/forkling/agent.sock", "/run/forkling/real.sock")\nos.symlink("/run/forkling/real.sock", "/run/forkling/agent.sock")\n1');
  await refused(/ENOTSOCK/); // (the link itself, opened O_PATH: not a socket)
  await val(c!.agent, 'os.rename("/run/forkling", "/run/elsewhere")\nos.symlink("/run/elsewhere", "/run/forkling")\n1');
  await refused(/ELOOP/);
  await val(c!.agent, 'os.unlink("/run/forkling")\nos.rename("/run/elsewhere", "/run/forkling")\n1');
  // a socket there served by another process of the sandbox: refused
  await val(
    c!.agent,
    'import subprocess, sys, time\nos.unlink("/run/forkling/agent.sock")\n' +
      'P = subprocess.Popen([sys.executable, "-c", "import socket, time; s = socket.socket(socket.AF_UNIX); s.bind(\'/run/forkling/agent.sock\'); s.listen(); open(\'/run/forkling/up\', \'w\').close(); time.sleep(1000)"])\n' +
      'for _ in range(500):\n    if os.path.exists("/run/forkling/up"): break\n    time.sleep(0.01)\nos.path.exists("/run/forkling/up")',
  );
  await connectAgent(hostPid(c!)).then(
    (a) => {
      a.close();
      assert.unreachable('another process answered for the sandbox');
    },
    (e: Error) => assert.match(e.message, /served by process \d+, not by the sandbox/),
  );
  // the agent's own socket back in place: connects
  await val(c!.agent, 'P.kill(); P.wait()\nos.unlink("/run/forkling/agent.sock")\nos.rename("/run/forkling/real.sock", "/run/forkling/agent.sock")\n1');
  const again = await connectAgent(hostPid(c!));
  try {
    assert.is(await val(again, 'WARM["answer"]'), 42);
  } finally {
    again.close();
  }
  await c!.kill();
});

test("a fork writing a line without end to the zygote's console: the host keeps a cut line and goes on", async () => {
  const [c] = await engine.fork(TEMPLATE, 1);
  // 8 MiB without a newline to the console every fork shares, then a short line
  await val(c!.agent, 'import sys\nfor _ in range(128): sys.__stdout__.write("z" * 65536)\nsys.__stdout__.write("\\nafter-the-long-one\\n")\nsys.__stdout__.flush()\n1');
  assert.ok(await pollUntil(() => engine.zygoteConsole(TEMPLATE).includes('after-the-long-one'), 10_000), 'the next line arrives');
  const cut = engine.zygoteConsole(TEMPLATE).filter((l) => l.startsWith('zzz'));
  assert.ok(cut.length >= 1 && cut.every((l) => l.length < 17_000 && l.endsWith('characters]')), `cut lines: ${cut.map((l) => l.length).join(', ')}`);
  await c!.kill();
});

test('a source that answers a branch for other children than asked is refused, and goes on', async () => {
  const [src] = await engine.fork(TEMPLATE, 1);
  // the source's agent answers every branch with one made-up child, twice
  await val(
    src!.agent,
    'import sys\nA = sys.modules["__main__"] if "OPS" in dir(sys.modules["__main__"]) else next(m for m in sys.modules.values() if hasattr(m, "OPS") and "branch" in getattr(m, "OPS", {}))\nA.OPS["branch"] = lambda agent, conn, f: {"children": [{"id": "x", "ok": True, "pid": 1}] * 2}\n1',
  );
  const err = await engine.branch(src!, 1).catch((e: Error) => e);
  assert.instance(err, Error);
  assert.match((err as Error).message, /answered for 2 children, not for the 1 asked for/);
  assert.is(await val(src!.agent, 'WARM["answer"]'), 42);
  await src!.kill();
});

test('seccomp and the user namespace refuse what a sandbox never needs', async () => {
  const [c] = await engine.fork(TEMPLATE, 1);
  const code = `
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def err(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return 0 if r >= 0 else errno.errorcode[ctypes.get_errno()]
out = {
  'bpf': err(321, 0, 0, 0),
  'perf_event_open': err(298, 0, 0, -1, -1, 0),
  'keyctl': err(250, 0, 0, 0),
  'init_module': err(175, 0, 0, 0),
  'kexec_load': err(246, 0, 0, 0, 0),
  'ptrace': err(101, 16, 1, 0, 0),
  'unshare_user': err(272, 0x10000000),
  'unshare_cgroup': err(272, 0x02000000),
  'setns_net': err(308, 0, 0x40000000),
  'reboot': err(169, 0xfee1dead, 672274793, 0x4321FEDC, 0),
  'pidfd_getfd': err(438, 0, 0, 0),
  'kcmp': err(312, 1, 1, 0, 0, 0),
  'process_madvise': err(440, 0, 0, 0, 0, 0),
  'process_madvise_own_pidfd': err(440, os.pidfd_open(os.getpid()), 0, 0, 4, 0),
  'process_madvise_self': err(440, -10000, 0, 0, 4, 0),
  'process_mrelease': err(448, 0, 0),
}
out['mount_ext4'] = 0 if libc.mount(b"/dev/null", b"/mnt", b"ext4", 0, None) == 0 else errno.errorcode[ctypes.get_errno()]
os.makedirs("/tmp/cg", exist_ok=True)
out['mount_cgroup2'] = 0 if libc.mount(b"none", b"/tmp/cg", b"cgroup2", 0, None) == 0 else errno.errorcode[ctypes.get_errno()]
out
`;
  const got = (await val(c!.agent, code)) as Record<string, string | number>;
  const refused = ['bpf', 'perf_event_open', 'keyctl', 'init_module', 'kexec_load', 'ptrace', 'unshare_user', 'setns_net', 'reboot'];
  // cgroup2: a cgroup namespace the sandbox owns would let it mount one (and, where the host lacks
  // nsdelegate and the sandbox's root owns its cgroup files, raise its own limits)
  for (const k of [...refused, 'pidfd_getfd', 'kcmp', 'process_madvise', 'process_madvise_own_pidfd', 'process_mrelease', 'unshare_cgroup', 'mount_cgroup2']) {
    assert.is(got[k], 'EPERM', `${k}: ${got[k]}`);
  }
  // process_madvise on itself (PIDFD_SELF; EBADF before Linux 6.15): an idle fork's reclaim in one call
  assert.ok(got.process_madvise_self === 0 || got.process_madvise_self === 'EBADF', `process_madvise_self: ${got.process_madvise_self}`);
  assert.ok(got.mount_ext4 !== 0, 'an ext4 mount is refused');
  await c!.kill();
});

test('at its pids limit a sandbox refuses new connections and eval timeouts, and takes both again once processes end', async () => {
  const [s] = await engine.fork(TEMPLATE, 1);
  const full = await val(
    s!.agent,
    `import os, time
KIDS = []
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    KIDS.append(pid)
len(KIDS)`,
  );
  assert.ok((full as number) > 10, `forked ${full} before the limit`);
  // no thread for a new connection: that connection is closed, the service goes on
  const refused = await connectAgent(hostPid(s!)).then(
    (c) => {
      c.close();
      return 'accepted';
    },
    (e: Error) => e.message,
  );
  assert.not.equal(refused, 'accepted');
  // no thread for the eval watchdog: that eval fails; the next one tries again
  await s!.agent.eval('1', { timeoutMs: 60_000 }).catch(() => {});
  await val(s!.agent, 'import signal\nfor p in KIDS: os.kill(p, signal.SIGKILL)\nfor p in KIDS: os.waitpid(p, 0)\n1');
  const again = await connectAgent(hostPid(s!));
  assert.is(await val(again, '6 * 7'), 42, 'a new connection is served again');
  again.close();
  const spin = await Promise.race([s!.agent.eval('while True: pass', { timeoutMs: 300 }), new Promise<null>((r) => setTimeout(() => r(null), 15_000))]);
  assert.ok(spin?.timedOut, 'an eval timeout works again');
  await s!.kill();
});

test('a branch is ready once it says so, though a process it forked holds its ready pipe', async () => {
  const [src] = await engine.fork(TEMPLATE, 1);
  // (an at-fork handler of the source's code forks in every branch before its set-up ends)
  // (once per branch: the handler runs again in the process it forks, which would fork on to the pids limit)
  await val(
    src!.agent,
    "import os, time\ndef after():\n    if os.environ.get('HELD_ONCE'):\n        return\n    os.environ['HELD_ONCE'] = '1'\n    if os.fork() == 0:\n        time.sleep(60)\n        os._exit(0)\nos.register_at_fork(after_in_child=after)\n1",
  );
  const t0 = performance.now();
  const [b] = await engine.branch(src!, 1);
  assert.ok(performance.now() - t0 < 20_000, 'not held until the end of file');
  assert.is(await val(b!.agent, '1 + 1'), 2);
  await Promise.all([b, src].map((k) => k!.kill()));
});

test('a fork bomb and a memory hog in one sandbox leave the others and the host working', async () => {
  const [bomb, hog, calm] = await engine.fork(TEMPLATE, 3);
  // fork bomb: the pids cgroup (64 here) stops it; it burns at most its cpu share
  const bombRun = bomb!.agent.exec(['/bin/sh', '-c', 'f() { f | f & }; f; sleep 5'], { timeoutMs: 10000 }).catch((e: Error) => e);
  // memory hog: beyond its 256 MiB, the OOM killer acts inside its cgroup only
  const hogRun = val(hog!.agent, 'x = []\nwhile True: x.append(b"y" * (16 << 20))').catch((e: Error) => e);
  const t0 = performance.now();
  assert.is(await val(calm!.agent, 'WARM["answer"]'), 42);
  assert.ok(performance.now() - t0 < 5000, 'a calm sibling still answers');
  const hogOutcome = await hogRun;
  assert.ok(hogOutcome instanceof Error, 'the hog does not finish normally');
  const [fresh] = await engine.fork(TEMPLATE, 1);
  assert.is(await val(fresh!.agent, '1 + 1'), 2);
  assert.ok(((await bomb!.stats()).counters.processes ?? 0) <= 64, 'the bomb is capped by pids.max');
  await Promise.all([bomb, hog, calm, fresh].map((k) => k!.kill()));
  await bombRun;
  assert.ok(memAvailableKiB() > 256 * 1024, 'the host has memory left');
});

test('pause freezes a sandbox and resume thaws it; stats while alive', async () => {
  const [c] = await engine.fork(TEMPLATE, 1);
  await c!.pause();
  let answered = false;
  const pending = val(c!.agent, '"awake"').then((v) => {
    answered = true;
    return v;
  });
  await new Promise((r) => setTimeout(r, 300));
  assert.not.ok(answered, 'a paused sandbox does not answer');
  await c!.resume();
  assert.is(await pending, 'awake');
  const st = await c!.stats();
  assert.ok(st.privateKiB > 0 && st.counters.processes! >= 1);
  await c!.kill();
});

test('a cold boot from the image gives a sandbox of its own (no zygote)', async () => {
  const s = await engine.boot({ image: 'default' });
  assert.equal(await val(s.agent, 'import os, socket\n(os.getpid(), socket.gethostname(), "WARM" in dir())'), [1, s.id, false]);
  const [b] = await engine.branch(s, 1);
  await val(s.agent, 'X = 1');
  assert.equal(await val(b!.agent, '(os.getpid(), "X" in dir())'), [1, false]);
  await Promise.all([b!.kill(), s.kill()]);
});

test('a template made again: its old zygote lives while a fork of it does, and goes with the last one', async () => {
  await withTemplate('remade', ['X = 1'], async (name, kids) => {
    const [old] = await engine.fork(name, 1);
    const oldZygote = engine.zygotePid(name)!;
    await engine.createTemplate({ name, image: 'default', warmup: 'X = 2' });
    assert.is.not(engine.zygotePid(name), oldZygote, 'a new zygote');
    assert.ok(alive(oldZygote), 'the old zygote lives on: its fork runs in its pid namespace');
    assert.is(await val(old!.agent, 'X'), 1);
    const [fresh] = await engine.fork(name, 1);
    kids.push(fresh!);
    assert.is(await val(fresh!.agent, 'X'), 2);
    await old!.kill();
    assert.ok(await pollUntil(() => !alive(oldZygote), 10_000), 'the old zygote went with its last fork');
  });
});

test('a warm-up that raises, outruns its limit, swallows every interrupt or ends its agent is refused with why; no zygote is left, nothing saved', async () => {
  const name = `${TEMPLATE}-late`;
  const ours = () => childrenOf(process.pid).filter(alive);
  const before = ours();
  const cases: [string, number | undefined, RegExp][] = [
    ['1 / 0', undefined, /the warm-up of template \S+ failed: ZeroDivisionError/],
    // interrupted by the agent at the limit: says where
    ['import time\nwhile True: time.sleep(0.05)', 1000, /the warm-up of template \S+ did not finish within 1 s \(interrupted in <cell-\d+>, line 2: while True: time.sleep\(0.05\)\)$/],
    // the agent's interrupt comes again every second; the host gives up WARMUP_GRACE_MS after the limit
    ['import time\nwhile True:\n    try:\n        time.sleep(10)\n    except KeyboardInterrupt:\n        pass', 1000, /did not finish within 1 s, and went on after it was interrupted/],
    ['import os\nos._exit(3)', undefined, /the warm-up of template \S+ failed: its agent went away/],
    ['W = 1', 0, /warm-up time limit 0 is not a whole number of ms/],
  ];
  for (const [warmup, warmupTimeoutMs, want] of cases) {
    let msg = '';
    try {
      await engine.createTemplate({ name, image: 'default', warmup, ...(warmupTimeoutMs !== undefined ? { warmupTimeoutMs } : {}) });
    } catch (e) {
      msg = (e as Error).message;
      assert.is((e as Error).name, 'UserError', msg);
    }
    assert.match(msg, want);
    assert.is(engine.zygotePid(name), null);
    assert.not.ok(existsSync(storePath('process-templates', `${name}.json`)), 'nothing saved');
    const left = () => ours().filter((p) => !before.includes(p));
    assert.ok(await pollUntil(() => left().length === 0, 5000), `the zygote is gone (left: ${left()})`);
  }
});

test('a template outlives its engine: another engine forks it from its saved definition', async () => {
  const other = new ProcessEngine({ warn: () => {} });
  try {
    const [c] = await other.fork(TEMPLATE, 1);
    assert.is(await val(c!.agent, 'WARM["answer"]'), 42);
  } finally {
    await other.close();
  }
  const missing = new ProcessEngine({ warn: () => {} });
  try {
    await missing.fork('no-such-template', 1);
    assert.unreachable('should throw');
  } catch (e) {
    assert.match((e as Error).message, 'does not exist');
  } finally {
    await missing.close();
  }
});

test('spare forks: taken first, restored when made (fresh randomness each), a dead one skipped, refilled, killed at close', async () => {
  const spareEngine = new ProcessEngine({ warn: () => {}, spares: 3 });
  let pids: number[] = [];
  try {
    await spareEngine.fork(TEMPLATE, 1).then((k) => Promise.all(k.map((x) => x.kill()))); // starts the zygote
    assert.is(await spareEngine.sparesReady(TEMPLATE), 3);
    // the first spares are made at once (the first fork waits for them), before the template's pattern;
    // once it is there they are replaced by spares that map it (the zygote's file, its fork server's and
    // the pattern's): one made before it would hold ~600 KiB more while it waits
    const spareFiles = () => (spareEngine as unknown as { zygotes: Map<string, { spares: Sandbox[] }> }).zygotes.get(TEMPLATE)!.spares.map((s) => templateFiles(hostPid(s)));
    assert.ok(await pollUntil(() => spareFiles().join() === '3,3,3', 15_000), `each maps the template's pattern: ${spareFiles()}`);
    const kids = await spareEngine.fork(TEMPLATE, 5); // 3 spares + 2 fresh
    assert.is(kids.length, 5);
    const rs = (await Promise.all(kids.map((k) => val(k.agent, '(WARM["answer"], random.random(), socket.gethostname())')))) as [number, number, string][];
    assert.equal(rs.map((r) => r[0]), [42, 42, 42, 42, 42]);
    assert.is(new Set(rs.map((r) => r[1])).size, 5);
    assert.equal(rs.map((r) => r[2]), kids.map((k) => k.id));
    assert.is(await spareEngine.sparesReady(TEMPLATE), 3);
    const spares = (spareEngine as unknown as { zygotes: Map<string, { spares: Sandbox[] }> }).zygotes.get(TEMPLATE)!.spares;
    pids = [...kids, ...spares].map(hostPid);
    assert.is(pids.filter(alive).length, 8);
    // a spare whose agent died while it waited is not handed out
    const dead = spares[0]!;
    process.kill(hostPid(dead), 'SIGKILL');
    assert.ok(await pollUntil(() => !(dead as unknown as { running: boolean }).running, 10_000), 'the engine saw it die');
    const more = await spareEngine.fork(TEMPLATE, 3); // 2 spares + 1 fresh
    assert.not.ok(more.some((k) => k.id === dead.id));
    assert.equal(await Promise.all(more.map((k) => val(k.agent, 'WARM["answer"]'))), [42, 42, 42]);
    pids.push(...more.map(hostPid));
  } finally {
    await spareEngine.close();
  }
  assert.equal(pids.filter(alive), []);
});

test('after a fork the refill of spares waits until what it handed out has answered a first request, or 250 ms; a fork meanwhile starts it', async () => {
  const spareEngine = new ProcessEngine({ warn: () => {}, spares: 2 });
  const kids: Sandbox[] = [];
  try {
    await spareEngine.fork(TEMPLATE, 1).then((k) => Promise.all(k.map((x) => x.kill()))); // starts the zygote
    assert.is(await spareEngine.sparesReady(TEMPLATE), 2);
    const z = (spareEngine as unknown as { zygotes: Map<string, { spares: Sandbox[]; refillNow: (() => void) | null }> }).zygotes.get(TEMPLATE)!;
    kids.push(...(await spareEngine.fork(TEMPLATE, 1)));
    assert.ok(z.refillNow, 'the refill waits');
    assert.is(z.spares.length, 1);
    assert.is(await val(kids[0]!.agent, '1 + 1'), 2);
    assert.is(z.refillNow, null, 'it started at the first answer');
    assert.is(await spareEngine.sparesReady(TEMPLATE), 2);
    // no request: it starts by itself
    kids.push(...(await spareEngine.fork(TEMPLATE, 1)));
    assert.ok(z.refillNow, 'the refill waits');
    assert.ok(await pollUntil(() => z.refillNow === null, 5000), 'it started by itself');
    assert.is(await spareEngine.sparesReady(TEMPLATE), 2);
    // another fork while it waits: started at once, and that fork gets what it asked for
    kids.push(...(await spareEngine.fork(TEMPLATE, 1)));
    assert.ok(z.refillNow, 'the refill waits');
    const more = await spareEngine.fork(TEMPLATE, 3);
    kids.push(...more);
    assert.equal(await Promise.all(more.map((k) => val(k.agent, 'WARM["answer"]'))), [42, 42, 42]);
    assert.is(new Set(kids.map((k) => k.id)).size, kids.length);
    assert.is(await spareEngine.sparesReady(TEMPLATE), 2);
  } finally {
    await spareEngine.close();
  }
});

test("an image on overlayfs (a store in a container's root file system): forks, branches of branches and a cold boot work", async () => {
  // overlayfs stacks at most two deep: a fork's root over one overlay of the template's files and
  // the image, itself on overlayfs, was three (EINVAL), so forks failed wherever the store was.
  const dir = mkdtempSync('/tmp/forkling-ovl-');
  const merged = join(dir, 'rootfs');
  for (const d of ['upper', 'work', 'rootfs']) mkdirSync(join(dir, d));
  const lower = (await ensureImage('default')).rootfs;
  const m = spawnSync('mount', ['-t', 'overlay', 'overlay', '-o', `lowerdir=${lower},upperdir=${dir}/upper,workdir=${dir}/work`, merged], { encoding: 'utf8' });
  assert.is(m.status, 0, `mount the overlay: ${m.stderr}`);
  const e = new ProcessEngine({ rootfsOf: async () => merged, warn: () => {} });
  const name = `${TEMPLATE}-ovl`;
  try {
    await e.createTemplate({ name, image: 'default', warmup: 'W = "warm"' });
    const [a] = await e.fork(name, 1);
    assert.is(await val(a!.agent, 'W'), 'warm');
    const [b] = await e.branch(a!, 1);
    await val(b!.agent, 'X = 1\nopen("/tmp/b", "w").write("b")');
    const [c] = await e.branch(b!, 1);
    assert.equal(await val(c!.agent, '(W, X, open("/tmp/b").read())'), ['warm', 1, 'b']);
    const booted = await e.boot({ image: 'default' });
    await val(booted.agent, 'open("/tmp/cold", "w").write("c")');
    const [bb] = await e.branch(booted, 1);
    assert.is(await val(bb!.agent, 'open("/tmp/cold").read()'), 'c');
  } finally {
    await e.close();
    rmSync(storePath('process-templates', `${name}.json`), { force: true });
    spawnSync('umount', ['-l', merged]);
    rmSync(dir, { recursive: true, force: true });
  }
});

test('works unprivileged too (uid 65534, user namespaces)', async () => {
  const home = mkdtempSync('/tmp/forkling-unpriv-');
  chownSync(home, 65534, 65534);
  try {
    const rootfs = (await ensureImage('default')).rootfs;
    const child = spawnSync(join(root, 'node_modules', '.bin', 'tsx'), [join(root, 'test', 'unit', 'process-unprivileged-child.ts')], {
      cwd: root,
      uid: 65534,
      gid: 65534,
      env: { ...process.env, HOME: home, FORKLING_HOME: home, FORKLING_RUNTIME_DIR: join(home, 'run'), FORKLING_TEST_ROOTFS: rootfs },
      encoding: 'utf8',
      timeout: 60000,
    });
    assert.is(child.status, 0, `exit ${child.status}: ${child.stderr}`);
    const out = JSON.parse(child.stdout.trim().split('\n').pop()!);
    assert.equal(out, {
      uid: 65534,
      fork: ['warm', 0, 1, ['0', '0', '1']],
      own: ['w', 'q', 'loop'],
      write: ['r', 'n', 'EACCES'],
      branch: ['warm', 1],
      branched: 'r1',
      boot: 1,
      bootWrite: 1,
      bootBranch: 'c2',
      cgroup2: ['EPERM', 'EPERM', 'EPERM'],
    });
  } finally {
    rmSync(home, { recursive: true, force: true });
  }
});

test('the selection line states the weaker isolation', () => {
  assert.match(engine.isolation, /weaker than a VM/);
});

test.run();
