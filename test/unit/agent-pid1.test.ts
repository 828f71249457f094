// The agent as PID 1, for real, in new PID, mount, UTS and network namespaces
// (unshare; needs root): mounts, hostname, lo up, orphan reaping, restore of
// hostname and entropy, and shutdown. The clock is left alone (it is not
// namespaced: setting it would set the host's).
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { hostname } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import type { AgentClient } from '../../host/agent/client.ts';
import { type LocalAgent, startLocalAgent } from '../../host/agent/spawn.ts';
import { loud } from '../loud-hook.ts';

// not under /tmp or /run: the agent mounts fresh tmpfs there in its namespace
const dir = mkdtempSync('/var/tmp/forkling-pid1-');
let agent: LocalAgent;
let c: AgentClient;
const text = (b: Uint8Array) => Buffer.from(b).toString('utf8');

test.before(loud("the suite's set-up (test.before)", async () => {
  if (process.getuid?.() !== 0) throw new Error('agent-pid1.test.ts needs root (unshare of PID/mount/UTS/net namespaces)');
  agent = await startLocalAgent({
    socketPath: join(dir, 'agent.sock'),
    wrapper: ['unshare', '--pid', '--fork', '--kill-child', '--mount', '--propagation', 'private', '--uts', '--net'],
    args: ['--system-ops', 'hostname,entropy'],
  });
  c = await agent.connect();
}));

test.after(async () => {
  c?.close();
  await agent?.stop();
  rmSync(dir, { recursive: true, force: true });
});

test('runs as PID 1', async () => {
  assert.is((await c.hello()).pid, 1);
  assert.is((await c.info()).pid1, true);
});

test('mounts /proc, /sys, /dev, /dev/pts, /dev/shm, /tmp, /run', async () => {
  const mounts = text((await c.exec(['cat', '/proc/mounts'])).stdout)
    .split('\n')
    .map((l) => l.split(' ')[1]);
  for (const m of ['/proc', '/sys', '/dev', '/dev/pts', '/dev/shm', '/tmp', '/run']) assert.ok(mounts.includes(m), `${m} not mounted`);
  // its own /proc: it sees its namespace only
  const ps = await c.eval("import os\nsorted(int(p) for p in os.listdir('/proc') if p.isdigit())[0]");
  assert.is(ps.value, 1);
});

test('brings up lo: a TCP connection to 127.0.0.1 works in the new network namespace', async () => {
  const r = await c.eval(
    "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\nx = socket.create_connection(s.getsockname(), timeout=2)\nx.close(); s.close()\n'connected'",
  );
  assert.is(r.value, 'connected', JSON.stringify(r.exception));
});

test('reaps orphans, and leaves the exit status of children that code waits for', async () => {
  const r = await c.exec(['sh', '-c', 'sleep 0.3 & echo $!']);
  const orphan = Number(text(r.stdout).trim());
  assert.ok(orphan > 1);
  const gone = await c.eval(
    `import os, time\nend = time.time() + 5\nwhile os.path.exists('/proc/${orphan}') and time.time() < end:\n    time.sleep(0.05)\nnot os.path.exists('/proc/${orphan}')`,
  );
  assert.is(gone.value, true, 'the orphan was not reaped');
  const rc = await c.eval("import subprocess, time\np = subprocess.Popen(['sh', '-c', 'sleep 1.2; exit 7'])\np.wait()");
  assert.is(rc.value, 7, 'a child waited for by eval code keeps its exit status');
});

test('an idle agent, asleep with no tick, still reaps an orphan that exits meanwhile (its pidfd wakes the reaper)', async () => {
  const r = await c.exec(['sh', '-c', 'sleep 0.5 & echo $!']);
  const orphan = Number(text(r.stdout).trim());
  assert.ok(orphan > 1);
  // No request meanwhile: one would wake the reaper by itself. Seen twice 0.5 s apart, then reaped.
  await new Promise((res) => setTimeout(res, 2500));
  const gone = await c.eval(`not __import__('os').path.exists('/proc/${orphan}')`);
  assert.is(gone.value, true, 'the orphan that exited while the agent idled is still there');
});

test('restore sets the hostname (in its UTS namespace) and adds entropy', async () => {
  const hostBefore = hostname();
  const r = await c.restore({ hostname: 'child-7', entropy: randomBytes(32), sandboxId: 'sb-7' });
  assert.equal(r.hostname, { set: true });
  assert.equal(r.entropy, { added: true, bytes: 32 });
  assert.is(r.clock.set, false);
  const again = await c.restore({ hostname: 'child-7', entropy: randomBytes(32), sandboxId: 'sb-7' });
  // (the agent reports how long it took: a figure, not asserted here, since CI's load moves it)
  assert.ok(Number.isFinite(again.durationUs) && again.durationUs >= 0, `durationUs: ${again.durationUs}`);
  assert.is(text((await c.exec(['hostname'])).stdout).trim(), 'child-7');
  assert.is((await c.info()).hostname, 'child-7');
  assert.is(hostname(), hostBefore, 'the host kept its name');
});

test('quiet, when it says so, gives the free pages of the C heap back to the kernel (the garbage of what ran is not kept)', async () => {
  const rss = async () => (await c.eval("int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])")).value as number;
  // ~20 MiB freed below a live object: free() alone keeps it (only a heap's top is trimmed).
  await c.eval('_junk = [bytes(1000) for _ in range(20000)]\n_pin = bytes(1000)\ndel _junk');
  const before = await rss();
  let quiet = false;
  for (let i = 0; i < 250 && !quiet; i++) {
    quiet = (await c.request('quiet', {})).quiet === true;
    if (!quiet) await new Promise((res) => setTimeout(res, 20));
  }
  assert.ok(quiet, 'never quiet');
  const after = await rss();
  await c.eval('del _pin');
  assert.ok(after < before - 10_000, `VmRSS ${before} KiB before quiet, ${after} KiB after`);
});

test('quiet: true while nothing but the agent would run; else it names the thread, process or alarm', async () => {
  const quiet = () => c.request('quiet', {});
  type Quiet = Awaited<ReturnType<typeof quiet>>;
  /** Asks until `ok` holds for the answer, or 5 s passed; returns the last answer. */
  const askUntil = async (ok: (r: Quiet) => boolean) => {
    let r = await quiet();
    for (let i = 0; i < 250 && !ok(r); i++) {
      await new Promise((res) => setTimeout(res, 20));
      r = await quiet();
    }
    return r;
  };
  /** Until the answer is `want` (a zombie of an earlier test is reaped within ~1 s). */
  const until = (want: boolean) => askUntil((r) => r.quiet === want);
  /**
   * Until the busy reason matches `re`. Under load what was just started may for a while look
   * like something else: a new thread still running on its way to its wait, a process not yet
   * renamed by its exec (Popen returns once exec closed its error pipe, which the kernel does
   * before it renames the process).
   */
  const busyUntil = (re: RegExp) => askUntil((r) => re.test(r.busy ?? ''));
  // An eval with a limit, done: the agent's watchdog then waits with no timeout (a template's
  // warm-up has a limit: its children would otherwise not be quiet until that deadline).
  assert.is((await c.eval('6 * 7', { timeoutMs: 600_000 })).value, 42);
  let r = await until(true);
  assert.is(r.quiet, true, `not quiet at rest: ${r.busy}`);
  assert.is(r.busy, null);
  // A thread that waits with a timeout would run by itself; one that waits with none (an idle pool worker) would not.
  await c.eval('import threading\n_ev = threading.Event()\n_t = threading.Thread(target=_ev.wait, args=(60,), daemon=True)\n_t.start()');
  const timedWait = /^thread \d+ \(.*\) waits in futex with a timeout$/;
  r = await busyUntil(timedWait);
  assert.is(r.quiet, false);
  assert.match(r.busy ?? '', timedWait, `busy: ${r.busy}`);
  await c.eval('_ev.set(); _t.join()\n_ev = threading.Event()\n_t = threading.Thread(target=_ev.wait, daemon=True)\n_t.start()');
  r = await until(true);
  assert.is(r.quiet, true, `a thread that waits with no timeout: ${r.busy}`);
  await c.eval('_ev.set(); _t.join()');
  // A thread that spins is busy (it is looked at again for a few ms only: a thread on its way to a wait is not).
  // (asked until it says so: under load a look may find it blocked on the GIL's mutex, a wait with no timeout)
  await c.eval('_spin = True\ndef _spinner():\n    while _spin: pass\n_t = threading.Thread(target=_spinner, daemon=True)\n_t.start()');
  r = await busyUntil(/^thread \d+ \(.*\) (runs|waits in futex with a timeout)$/);
  await c.eval('_spin = False; _t.join()');
  assert.is(r.quiet, false);
  assert.match(r.busy ?? '', /^thread \d+ \(.*\) (runs|waits in futex with a timeout)$/, `busy: ${r.busy}`);
  assert.is((await until(true)).quiet, true);
  // A process besides the agent.
  const p = await c.spawn(['sleep', '60']);
  const sleeping = new RegExp(`^process ${p.pid} \\(sleep\\) runs$`);
  r = await busyUntil(sleeping);
  assert.is(r.quiet, false);
  assert.match(r.busy ?? '', sleeping, `busy: ${r.busy}`);
  await p.kill();
  await p.done;
  assert.is((await until(true)).quiet, true, 'the process was killed and reaped');
  // An alarm (SIGALRM would end the agent: set and cleared in one eval).
  const a = await c.eval("import signal\nsignal.alarm(60)\n_r = __import__('__main__').quiet_check()\nsignal.alarm(0)\n_r");
  assert.is(a.value, 'an alarm (signal.alarm or setitimer) is set');
  assert.is((await until(true)).quiet, true);
});

test('shutdown: PID 1 stops everything and powers off (ends the namespace)', async () => {
  const sleeper = await c.spawn(['sleep', '60']);
  assert.ok(sleeper.pid > 1);
  assert.equal(await c.shutdown(), { done: true });
  const code = await Promise.race([agent.exited, new Promise((r) => setTimeout(() => r('still running'), 8000))]);
  assert.is.not(code, 'still running');
  await c.closed;
});

test.run();
