// Eval round trips through `forkling serve` over WebSocket: median and p99 of
// `eval 1+1` on one session, then evals per second with 1, 10 and 100
// concurrent sessions (each session a WebSocket of its own, looping evals).
// Starts its own server: the real CLI with the process engine where it
// exists, else (said in the output) in-process over plain agent processes.
//   npx tsx bench/server-eval.ts [N=3000] [seconds per concurrency level=3]
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startLocalAgent } from '../host/agent/spawn.ts';
import { Sandbox } from '../host/index.ts';
import { RawClient, serve } from '../test/unit/server-harness.ts';

const N = Number(process.argv[2] ?? 3000);
const SECONDS = Number(process.argv[3] ?? 3);
const TOKEN = 'bench-token-0123456789abcdef';

const srv = await serve({ token: TOKEN, maxSandboxes: 32 });
const q = (xs: number[], p: number) => xs[Math.min(xs.length - 1, Math.floor(p * xs.length))] as number;
try {
  console.log(`server: ${srv.mode === 'cli' ? 'forkling serve (CLI) with the process engine' : 'in-process server over plain agent processes (no process engine yet)'}`);
  const c = await RawClient.open(srv.url, { token: TOKEN });
  const created = await c.request('sandbox.fork', { template: 'default', n: 4, timeoutMs: 600_000 });
  if (created.t !== 'res') throw new Error(JSON.stringify(created));
  const ids = (created.sandboxes as { id: string }[]).map((s) => s.id);
  const first = ids[0] as string;

  // 1. round trip, one session, sequential
  for (let i = 0; i < 300; i++) await c.request('eval', { sandbox: first, code: '1+1' });
  const times: number[] = [];
  for (let i = 0; i < N; i++) {
    const t0 = process.hrtime.bigint();
    const r = await c.request('eval', { sandbox: first, code: '1+1' });
    times.push(Number(process.hrtime.bigint() - t0) / 1e6);
    if (r.value !== 2) throw new Error(JSON.stringify(r));
  }
  times.sort((a, b) => a - b);
  console.log(
    `eval 1+1 round trip through the server over WebSocket (raw frames), N=${N}: median ${q(times, 0.5).toFixed(3)} ms, p99 ${q(times, 0.99).toFixed(3)} ms, min ${(times[0] as number).toFixed(3)} ms`,
  );

  // the same through the SDK (Sandbox.eval: encode, shared connection, result mapping)
  const sb = await Sandbox.connect(first, { url: srv.url, token: TOKEN });
  for (let i = 0; i < 300; i++) await sb.eval('1+1');
  const sdkTimes: number[] = [];
  for (let i = 0; i < N; i++) {
    const t0 = process.hrtime.bigint();
    await sb.eval('1+1');
    sdkTimes.push(Number(process.hrtime.bigint() - t0) / 1e6);
  }
  sdkTimes.sort((a, b) => a - b);
  console.log(
    `eval 1+1 round trip through the SDK (Sandbox.eval), N=${N}: median ${q(sdkTimes, 0.5).toFixed(3)} ms, p99 ${q(sdkTimes, 0.99).toFixed(3)} ms`,
  );
  Sandbox.disconnectAll();

  // for comparison: the same eval straight to an agent over its Unix socket (no server)
  const dir = mkdtempSync(join(tmpdir(), 'forkling-bench-'));
  const local = await startLocalAgent({ socketPath: join(dir, 'agent.sock') });
  const direct = await local.connect();
  for (let i = 0; i < 300; i++) await direct.eval('1+1');
  const dt: number[] = [];
  for (let i = 0; i < N; i++) {
    const t0 = process.hrtime.bigint();
    await direct.eval('1+1');
    dt.push(Number(process.hrtime.bigint() - t0) / 1e6);
  }
  dt.sort((a, b) => a - b);
  console.log(`(for comparison, straight to an agent over a Unix socket: median ${q(dt, 0.5).toFixed(3)} ms, p99 ${q(dt, 0.99).toFixed(3)} ms)`);
  direct.close();
  await local.stop();
  rmSync(dir, { recursive: true, force: true });

  // 2. throughput with concurrent sessions, spread over the sandboxes
  for (const sessions of [1, 10, 100]) {
    const clients = await Promise.all(Array.from({ length: sessions }, () => RawClient.open(srv.url, { token: TOKEN })));
    const used = Math.min(sessions, ids.length);
    const deadline = performance.now() + SECONDS * 1000;
    const lat: number[] = [];
    const counts = await Promise.all(
      clients.map(async (cl, i) => {
        const sandbox = ids[i % used] as string;
        let n = 0;
        while (performance.now() < deadline) {
          const t0 = performance.now();
          const r = await cl.request('eval', { sandbox, code: '1+1' });
          lat.push(performance.now() - t0);
          if (r.t !== 'res') throw new Error(JSON.stringify(r));
          n++;
        }
        return n;
      }),
    );
    const total = counts.reduce((a, b) => a + b, 0);
    lat.sort((a, b) => a - b);
    console.log(
      `${String(sessions).padStart(3)} concurrent sessions over ${used} sandbox(es): ${Math.round(total / SECONDS)} evals/s (latency median ${q(lat, 0.5).toFixed(2)} ms, p99 ${q(lat, 0.99).toFixed(2)} ms)`,
    );
    for (const cl of clients) cl.close();
  }
  for (const id of ids) await c.request('sandbox.kill', { sandbox: id });
  c.close();
} finally {
  await srv.stop();
}
