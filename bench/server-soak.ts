// Soak of `forkling serve` (process engine): WORKERS concurrent clients for
// SECONDS do random work through the SDK (fork, eval, timeouts, exceptions,
// commands, background processes, file round trips, branches of branches,
// sandboxes left to their timeouts, clients that vanish mid-request), then
// waits for every sandbox to go and compares the server with its state
// before: open fds, processes and cgroups of its engine (with its spare forks:
// `serve`'s default --spares 4), RSS. Prints the
// figures; exits 1 on an unexpected answer or a leak.
//   npx tsx bench/server-soak.ts [SECONDS=120] [WORKERS=6]
import { spawn } from 'node:child_process';
import { readdirSync, readFileSync, readlinkSync } from 'node:fs';
import WebSocket from 'ws';
import { engineDirsOf } from '../host/engine/process/cgroups.ts';
import { Sandbox } from '../host/index.ts';
import { decodeFrame, encodeFrame } from '../protocol/codec.ts';

const SECONDS = Number(process.argv[2] ?? 120);
const WORKERS = Number(process.argv[3] ?? 6);
const srv = spawn('node', ['bin/forkling.mjs', 'serve', '--listen', '127.0.0.1:0', '--engine', 'process', '--max-sandboxes', '60'], { stdio: ['ignore', 'pipe', 'pipe'] });
const errLines: string[] = [];
srv.stderr.on('data', (d) => errLines.push(...String(d).split('\n').filter(Boolean)));
const url = await new Promise<string>((res, rej) => {
  srv.stdout.on('data', (d) => {
    const m = /listening (\S+)/.exec(String(d));
    if (m) res(m[1]!);
  });
  srv.on('exit', (c) => rej(new Error(`serve exited ${c}: ${errLines.join('\n')}`)));
});
const pid = srv.pid!;
const fds = () => readdirSync(`/proc/${pid}/fd`).length;
const rssKiB = () => Number(/VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))![1]);
/** Processes and cgroups of the server's engine (its pids hierarchy, forkling-p<pid>-*). */
const tree = (p: number): { procs: number; cgroups: number } => {
  let procs = 0;
  let cgroups = 0;
  const walk = (d: string) => {
    cgroups++;
    try {
      procs += readFileSync(`${d}/cgroup.procs`, 'utf8').split('\n').filter(Boolean).length;
    } catch {}
    for (const e of readdirSync(d, { withFileTypes: true })) if (e.isDirectory()) walk(`${d}/${e.name}`);
  };
  for (const d of engineDirsOf(p)) walk(d);
  return { procs, cgroups };
};
// warm: the default template
const warm = await Sandbox.create({ url });
await warm.kill();
/** Waits until the engine's processes stop changing for a second (its spare forks refilled). */
async function settled(): Promise<void> {
  let last = -1;
  for (let i = 0; i < 60; i++) {
    const now = tree(pid).procs;
    if (now === last) return;
    last = now;
    await new Promise((r) => setTimeout(r, 1000));
  }
}
await settled();
const base = { fds: fds(), rss: rssKiB(), ...tree(pid) };
console.log('baseline', base);

const counts = new Map<string, number>();
const bump = (k: string) => counts.set(k, (counts.get(k) ?? 0) + 1);
const unexpected: string[] = [];
const rnd = (n: number) => Math.floor(Math.random() * n);
const deadline = Date.now() + SECONDS * 1000;

async function abrupt(): Promise<void> {
  const ws = new WebSocket(`${url.replace('http', 'ws')}/v1/ws`, ['forkling.v1']);
  await new Promise((r, j) => {
    ws.once('open', r);
    ws.once('error', j);
  });
  let id = 0;
  const waiters = new Map<number, (f: Record<string, unknown>) => void>();
  ws.on('message', (d: Buffer) => {
    const f = decodeFrame(d) as Record<string, unknown>;
    waiters.get(f.id as number)?.(f);
  });
  const ask = (f: Record<string, unknown>) =>
    new Promise<Record<string, unknown>>((r) => {
      waiters.set(++id, r);
      ws.send(encodeFrame({ ...f, t: 'req', id }));
    });
  await ask({ op: 'hello', versions: [1] });
  const made = await ask({ op: 'sandbox.create', timeoutMs: 3000 });
  const sb = (made.sandbox as { id: string } | undefined)?.id;
  if (!sb) await new Promise((r) => setTimeout(r, 100));
  if (sb) {
    void ask({ op: 'eval', sandbox: sb, code: 'import time\nfor i in range(100):\n    print(i)\n    time.sleep(0.01)' });
    if (rnd(2)) void ask({ op: 'sandbox.fork', template: 'default', n: 2, timeoutMs: 3000 }); // cancelled by the close: made ones killed
    await new Promise((r) => setTimeout(r, rnd(200)));
  }
  ws.terminate();
  bump('abrupt');
}

async function session(): Promise<void> {
  const kind = rnd(10);
  if (kind === 0) return abrupt();
  const [s, ...rest] = await Sandbox.fork('default', 1 + rnd(3), { url, timeoutMs: 20_000 });
  for (const x of rest) void x.kill();
  if (!s) throw new Error('fork answered no sandbox');
  try {
    const r = await s.eval('x = 6 * 7\nprint("hi")\nx');
    if (r.value !== 42 || r.stdout !== 'hi\n') unexpected.push(`eval: ${JSON.stringify(r).slice(0, 200)}`);
    bump('eval');
    if (rnd(3) === 0) {
      try {
        await s.eval('while True: pass', { timeoutMs: 200 });
        unexpected.push('busy eval did not time out');
      } catch (e) {
        if ((e as Error).name !== 'TimeoutError') unexpected.push(`busy eval: ${(e as Error).name}: ${(e as Error).message}`);
        bump('timeout');
      }
    }
    if (rnd(3) === 0) {
      const bad = await s.eval('1/0');
      if (bad.error?.type !== 'ZeroDivisionError') unexpected.push(`1/0: ${JSON.stringify(bad.error)}`);
    }
    const c = await s.commands.run('echo out; echo err >&2; exit 3');
    if (c.exitCode !== 3 || c.stdout !== 'out\n' || c.stderr !== 'err\n') unexpected.push(`command: ${JSON.stringify(c)}`);
    bump('exec');
    const data = new Uint8Array(50_000 + rnd(300_000)).map((_, i) => i & 255);
    await s.files.write('/tmp/f.bin', data);
    const back = await s.files.read('/tmp/f.bin', { format: 'bytes' });
    if (back.length !== data.length || back.some((b, i) => b !== data[i])) unexpected.push('file round trip differs');
    bump('files');
    if (rnd(3) === 0) {
      const bg = await s.commands.run(['sleep', '30'], { background: true });
      await bg.kill();
      bump('bg');
    }
    if (rnd(2) === 0) {
      const kids = await s.branch(1 + rnd(2), { timeoutMs: 5000 });
      for (const k of kids) {
        const v = await k.eval('x + 1');
        if (v.value !== 43) unexpected.push(`branch: ${JSON.stringify(v).slice(0, 200)}`);
        if (rnd(2) === 0) {
          const kk = await k.branch(1, { timeoutMs: 5000 });
          await kk[0]!.eval('x');
          await kk[0]!.kill();
        }
        if (rnd(4)) await k.kill();
      }
      bump('branch');
    }
    if (rnd(5) === 0) {
      await s.setTimeout(500); // left to its timeout
      bump('timeout-left');
      return;
    }
  } finally {
    await s.kill().catch(() => {});
  }
}

async function worker(): Promise<void> {
  while (Date.now() < deadline) {
    try {
      await session();
    } catch (e) {
      const msg = `${(e as Error).name}: ${(e as Error).message}`;
      if (/max|room|unavailable/i.test(msg)) {
        bump('full');
        await new Promise((r) => setTimeout(r, 100));
      }
      else unexpected.push(msg);
    }
  }
}
await Promise.all(Array.from({ length: WORKERS }, worker));
console.log(`ops in ${SECONDS} s (sessions: eval...; full = refused at --max-sandboxes 60)`, Object.fromEntries(counts));
// everything left goes with its timeout (20 s for branches not killed)
const t0 = Date.now();
let left = await Sandbox.list({ url });
while (left.length > 0 && Date.now() - t0 < 40_000) {
  await new Promise((r) => setTimeout(r, 500));
  left = await Sandbox.list({ url });
}
await settled();
const after = { fds: fds(), rss: rssKiB(), ...tree(pid), sandboxes: left.length };
console.log('after', after);
const fdNames = readdirSync(`/proc/${pid}/fd`).map((f) => {
  try {
    return readlinkSync(`/proc/${pid}/fd/${f}`);
  } catch {
    return '?';
  }
});
const kinds = new Map<string, number>();
for (const n of fdNames) kinds.set(n.replace(/\d+/g, 'N'), (kinds.get(n.replace(/\d+/g, 'N')) ?? 0) + 1);
console.log('fds by kind', Object.fromEntries(kinds));
const cg = readFileSync(`/proc/${pid}/cgroup`, 'utf8');
console.log('serve cgroup', cg.trim().split('\n').slice(0, 2).join(' | '));
console.log('unexpected', unexpected.length, unexpected.slice(0, 20));
console.log('serve log other', errLines.filter((l) => !/timed out|^forkling serve: (engine|auto)/.test(l)).slice(-25));
srv.kill('SIGTERM');
await new Promise((r) => srv.once('exit', r));
const leaked = after.fds > base.fds || after.procs > base.procs || after.cgroups > base.cgroups || after.sandboxes > 0;
if (leaked) console.log('LEAK: the server holds more than before');
process.exit(unexpected.length > 0 || leaked ? 1 : 0);
