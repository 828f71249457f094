// What an agent client sees of `forkling mcp` (the MCP server on stdio): from
// its start until initialize is answered, each sandbox_create until answered
// (the first one also starts the template: with the process engine its
// zygote), and eval `1+1` round trips through tools/call; then N sandboxes
// from one sandbox_fork. Times are until the client read the answer.
//   npx tsx bench/mcp.ts [--engine process|kvm] [evals=500] [creates=20] [forkN=10]
import { McpClient } from '../test/unit/mcp-client.ts';

const args = process.argv.slice(2);
const engineAt = args.indexOf('--engine');
const engine = engineAt >= 0 ? (args.splice(engineAt, 2)[1] as string) : 'process';
const [EVALS = 500, CREATES = 20, FORK_N = 10] = args.map(Number);

const q = (xs: number[], p: number) => [...xs].sort((a, b) => a - b)[Math.min(xs.length - 1, Math.floor(p * xs.length))] as number;
const ms = (t0: number) => performance.now() - t0;
const f = (x: number) => x.toFixed(2);

const t0 = performance.now();
const c = new McpClient(['--engine', engine, '--max-sandboxes', String(CREATES + FORK_N + 4)]);
try {
  await c.init();
  console.log(`engine ${engine}: forkling mcp started and answered initialize in ${ms(t0).toFixed(0)} ms`);

  const creates: number[] = [];
  const ids: string[] = [];
  for (let i = 0; i < CREATES; i++) {
    const t = performance.now();
    ids.push((await c.ok('sandbox_create')).sandbox.id);
    creates.push(ms(t));
  }
  console.log(`sandbox_create: the first ${f(creates[0] as number)} ms (starts the template); the next ${CREATES - 1}: median ${f(q(creates.slice(1), 0.5))} ms, max ${f(Math.max(...creates.slice(1)))} ms`);

  const id = ids[0] as string;
  const first = performance.now();
  await c.ok('eval', { sandbox: ids[CREATES - 1], code: '1+1' });
  console.log(`first eval in a new sandbox: ${f(ms(first))} ms`);
  for (let i = 0; i < 50; i++) await c.ok('eval', { sandbox: id, code: '1+1' });
  const evals: number[] = [];
  for (let i = 0; i < EVALS; i++) {
    const t = performance.now();
    const r = await c.ok('eval', { sandbox: id, code: '1+1' });
    evals.push(ms(t));
    if (r.value !== 2) throw new Error(JSON.stringify(r));
  }
  console.log(`eval 1+1 through tools/call, N=${EVALS}: median ${f(q(evals, 0.5))} ms, p99 ${f(q(evals, 0.99))} ms`);

  const tf = performance.now();
  const forked = (await c.ok('sandbox_fork', { n: FORK_N })).sandboxes as { id: string }[];
  const forkMs = ms(tf);
  await Promise.all(forked.map((s) => c.ok('eval', { sandbox: s.id, code: '1+1' })));
  console.log(`sandbox_fork n=${FORK_N}: answered in ${f(forkMs)} ms; every child's first eval answered ${f(ms(tf))} ms after the call`);
} finally {
  const code = await c.end();
  if (code !== 0) console.error(`forkling mcp exited ${code}: ${c.stderr.join('')}`);
}
