// The addon's way to a sandbox's agent socket (sandboxAgentSocket) and the
// check of who listens on it (sandboxPeerPid), tried on this process's own
// root and on helper processes.
import { spawn } from 'node:child_process';
import { closeSync, mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { connect, createServer, type Server, type Socket } from 'node:net';
import { release, tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { sandboxAddon } from '../../host/engine/process/native.ts';
import { ProcessRef } from '../../host/engine/process/process-ref.ts';

const dir = mkdtempSync(join(tmpdir(), 'forkling-agent-socket-'));
const rel = (p: string) => p.slice(1); // (relative to our root, /)
const fdOf = (s: Socket) => (s as unknown as { _handle: { fd: number } })._handle.fd;
const connected = (path: string) =>
  new Promise<Socket>((resolve, reject) => {
    const s = connect(path);
    s.once('connect', () => resolve(s));
    s.once('error', reject);
  });

let server: Server;
const sockPath = join(dir, 'agent.sock');

test.before(async () => {
  server = createServer((s) => s.on('error', () => {}));
  await new Promise<void>((r) => server.listen(sockPath, r));
});

test.after(() => {
  server.close();
  rmSync(dir, { recursive: true, force: true });
});

test('a socket below a process root: an fd to connect through; the listener is that process', async () => {
  const a = sandboxAddon();
  const fd = a.sandboxAgentSocket(process.pid, rel(sockPath));
  try {
    const s = await connected(`/proc/self/fd/${fd}`);
    assert.is(a.sandboxPeerPid(fdOf(s)), process.pid);
    s.destroy();
  } finally {
    closeSync(fd);
  }
});

test('refused: a link in its place, a link on the way, a file, nothing there, a process that is gone', () => {
  const a = sandboxAddon();
  const code = (r: string, pid = process.pid) => {
    try {
      closeSync(a.sandboxAgentSocket(pid, r));
      return 'ok';
    } catch (e) {
      return (e as NodeJS.ErrnoException).code;
    }
  };
  symlinkSync(sockPath, join(dir, 'link.sock'));
  assert.is(code(rel(join(dir, 'link.sock'))), 'ENOTSOCK'); // (O_PATH opens the link itself)
  mkdirSync(join(dir, 'real'));
  symlinkSync(dir, join(dir, 'real', 'up'));
  assert.is(code(rel(join(dir, 'real', 'up', 'agent.sock'))), 'ELOOP');
  writeFileSync(join(dir, 'file'), 'x');
  assert.is(code(rel(join(dir, 'file'))), 'ENOTSOCK');
  assert.is(code(rel(join(dir, 'none.sock'))), 'ENOENT');
  assert.is(code(rel(sockPath), 0x3ffffff), 'ESRCH');
  assert.throws(() => a.sandboxAgentSocket(process.pid, sockPath), /relative/);
});

test('the listener is another process: its pid; one that listened and is gone: -1, though its listener lives on (where the kernel has SO_PEERPIDFD)', async () => {
  const a = sandboxAddon();
  const path = join(dir, 'other.sock');
  // python listens, forks a copy that keeps the listener (and accepts), prints the copy's pid and exits
  const py = `import os, socket, time
s = socket.socket(socket.AF_UNIX)
s.bind(${JSON.stringify(path)})
s.listen()
pid = os.fork()
if pid:
    print(pid, flush=True)
    os._exit(0)
kept = []
while True:
    kept.append(s.accept())`;
  const child = spawn('python3', ['-c', py], { stdio: ['ignore', 'pipe', 'inherit'] });
  const copy = Number(await new Promise<string>((r) => child.stdout.once('data', (d) => r(String(d).trim()))));
  await new Promise((r) => child.once('exit', r));
  const s = await connected(path);
  try {
    const peer = a.sandboxPeerPid(fdOf(s));
    const [major, minor] = release().split('.').map(Number) as [number, number];
    if (major > 6 || (major === 6 && minor >= 5)) assert.is(peer, -1, 'the process that listened is gone: no one');
    else assert.is(peer, child.pid, '(SO_PEERCRED: the pid that listened, as a number)');
    assert.is.not(peer, copy, 'never the copy that accepts');
  } finally {
    s.destroy();
    process.kill(copy, 'SIGKILL');
  }
});


test('a process held by a pidfd: signalled while it lives, its exit seen; after, signals reach nothing (never a later process of that number)', async () => {
  const addon = sandboxAddon();
  const child = spawn('sleep', ['100'], { stdio: 'ignore' });
  await new Promise((r) => child.once('spawn', r));
  const ref = new ProcessRef(child.pid!);
  assert.ok(ref.alive);
  assert.ok(ref.signal('SIGCONT'), 'sent while it lives');
  let exited = false;
  void ref.exited.then(() => {
    exited = true;
  });
  assert.not.ok(exited);
  assert.ok(ref.signal('SIGKILL'));
  await ref.exited;
  await new Promise((r) => (child.exitCode !== null || child.signalCode !== null ? r(null) : child.once('exit', r))); // reaped by Node
  assert.not.ok(ref.alive);
  assert.is(ref.signal('SIGKILL'), false, 'gone: nothing to signal, no error');
  ref.release();
  assert.is(ref.signal('SIGKILL'), false, 'released');
  assert.throws(() => addon.sandboxPidfd(2 ** 22 + 7), (e: NodeJS.ErrnoException) => e.code === 'ESRCH' || e.code === 'EINVAL');
});

test.run();
