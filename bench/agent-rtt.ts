// Round trip of `eval 1+1` from the TypeScript client to the guest agent and
// back over a Unix socket (agent running as a host process). Prints median and
// p99 over N sequential calls after a warm-up.
//   npx tsx bench/agent-rtt.ts [N=2000]
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startLocalAgent } from '../host/agent/spawn.ts';

const N = Number(process.argv[2] ?? 2000);
const dir = mkdtempSync(join(tmpdir(), 'forkling-rtt-'));
const agent = await startLocalAgent({ socketPath: join(dir, 'agent.sock') });
const client = await agent.connect();
try {
  for (let i = 0; i < 200; i++) await client.eval('1+1'); // warm-up
  const times: number[] = [];
  for (let i = 0; i < N; i++) {
    const t0 = process.hrtime.bigint();
    const r = await client.eval('1+1');
    times.push(Number(process.hrtime.bigint() - t0) / 1e6);
    if (r.value !== 2) throw new Error(`eval 1+1 returned ${r.repr}`);
  }
  times.sort((a, b) => a - b);
  const q = (p: number) => times[Math.min(times.length - 1, Math.floor(p * times.length))]!;
  console.log(`agent eval 1+1 round trip over a Unix socket, N=${N}: median ${q(0.5).toFixed(3)} ms, p99 ${q(0.99).toFixed(3)} ms, min ${times[0]!.toFixed(3)} ms`);
} finally {
  client.close();
  await agent.stop();
  rmSync(dir, { recursive: true, force: true });
}
