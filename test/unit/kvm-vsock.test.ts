// The host side of the KVM engine's vsock connection without a VM: a stand-in
// for the device's Unix socket answers `CONNECT <port>` like the VMM does
// (refusing, answering OK, or garbage), in
// front of the real guest agent on a Unix socket; the agent must answer hello
// through the handed-over socket.
import { spawn } from 'node:child_process';
import { chmodSync, mkdirSync, mkdtempSync, rmSync, symlinkSync } from 'node:fs';
import { connect, createServer, type Server, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { AgentClient } from '../../host/agent/client.ts';
import { socketDir } from '../../host/engine/kvm/vm.ts';
import { VsockConnectError, vsockConnect } from '../../host/engine/kvm/vsock.ts';

const dir = mkdtempSync(join(tmpdir(), 'forkling-vsock-'));
const agentSock = join(dir, 'agent.sock');
const agent = spawn('/usr/bin/python3', ['guest-agent/forkling_agent.py', '--unix', agentSock], { stdio: ['ignore', 'ignore', 'inherit'] });

async function agentUp(): Promise<void> {
  for (let i = 0; i < 200; i++) {
    const ok = await new Promise<boolean>((r) => {
      const s = connect(agentSock);
      s.once('connect', () => {
        s.destroy();
        r(true);
      });
      s.once('error', () => r(false));
    });
    if (ok) return;
    await new Promise((r) => setTimeout(r, 25));
  }
  throw new Error('agent did not start');
}

/** A fake device socket: `mode` decides how CONNECT is answered. */
function device(path: string, mode: 'ok' | 'refuse' | 'garbage' | 'slam'): Promise<Server> {
  const srv = createServer((c: Socket) => {
    // slam: closed at once, before CONNECT is read (our write may then fail with EPIPE)
    if (mode === 'slam') return c.destroy();
    let line = '';
    const onData = (b: Buffer) => {
      line += b.toString('latin1');
      if (!line.includes('\n')) return;
      c.removeListener('data', onData);
      assert.is(line, 'CONNECT 1024\n');
      if (mode === 'refuse') return c.destroy();
      if (mode === 'garbage') return c.end('NOPE\n');
      const up = connect(agentSock);
      up.once('connect', () => {
        c.write('OK 1073741824\n');
        up.pipe(c);
        c.pipe(up);
      });
    };
    c.on('data', onData);
  });
  return new Promise((r) => srv.listen(path, () => r(srv)));
}

test("the VMs' socket directory is used only when it is a private directory of this user", () => {
  const base = mkdtempSync(join(tmpdir(), 'forkling-rt-'));
  const saved = process.env.XDG_RUNTIME_DIR;
  process.env.XDG_RUNTIME_DIR = base;
  try {
    const dir = join(base, `forkling-${process.getuid?.() ?? 0}`);
    assert.is(socketDir(), dir, 'made private');
    chmodSync(dir, 0o777); // as if another user had made it first, open to all
    assert.throws(() => socketDir(), /not a private directory/);
    rmSync(dir, { recursive: true });
    mkdirSync(join(base, 'elsewhere'));
    symlinkSync(join(base, 'elsewhere'), dir);
    assert.throws(() => socketDir(), /not a directory/);
  } finally {
    if (saved === undefined) delete process.env.XDG_RUNTIME_DIR;
    else process.env.XDG_RUNTIME_DIR = saved;
    rmSync(base, { recursive: true, force: true });
  }
});

test('CONNECT/OK hands over a working stream to the agent', async () => {
  await agentUp();
  const p = join(dir, 'ok.sock');
  const srv = await device(p, 'ok');
  const sock = await vsockConnect(p, 1024, 5000);
  const client = new AgentClient(sock);
  sock.resume();
  const hello = await Promise.race([
    client.hello(),
    new Promise((_, rej) => setTimeout(() => rej(new Error('no hello through the handed-over socket within 5 s')), 5000).unref()),
  ]);
  assert.ok(hello);
  assert.is((await client.eval('6 * 7')).value, 42);
  client.close();
  srv.close();
});

test('a refusal and a missing socket are retryable; a bad answer is not', async () => {
  const p = join(dir, 'refuse.sock');
  const srv = await device(p, 'refuse');
  const e1 = await vsockConnect(p, 1024, 5000).catch((e) => e);
  assert.instance(e1, VsockConnectError);
  assert.is(e1.retryable, true);
  srv.close();
  const s = join(dir, 'slam.sock');
  const srv3 = await device(s, 'slam');
  for (let i = 0; i < 20; i++) {
    const e = await vsockConnect(s, 1024, 5000).catch((e) => e);
    assert.instance(e, VsockConnectError);
    assert.is(e.retryable, true, `a connection the device closed at once is retryable (${e.message})`);
  }
  srv3.close();
  const e2 = await vsockConnect(join(dir, 'none.sock'), 1024, 5000).catch((e) => e);
  assert.instance(e2, VsockConnectError);
  const g = join(dir, 'garbage.sock');
  const srv2 = await device(g, 'garbage');
  const e3 = await vsockConnect(g, 1024, 5000).catch((e) => e);
  assert.instance(e3, VsockConnectError);
  assert.is(e3.retryable, false);
  srv2.close();
});

test.after(() => {
  agent.kill('SIGKILL');
  rmSync(dir, { recursive: true, force: true });
});

test.run();
