// The process engine when forks come one request at a time, apart (as a
// server's users send them), not back to back: N children per request, every
// request 60 ms after the last ended; median and p90 of "all ready" (restore
// answered) and "all answered" (a first eval). Template `default`. Prints
// whether the host's cgroup moves are quick (favordynmods), which decides
// most of a single fork's time here, and the time the slowest move took.
//   npx tsx bench/process-fork-spaced.ts [--n 1,10] [--rounds 40]
import { cgroupMoveCheck } from '../host/doctor/checks.ts';
import { ProcessEngine } from '../host/engine/process/engine.ts';

const args = process.argv.slice(2);
const opt = (name: string, def: string) => {
  const i = args.indexOf(name);
  return i >= 0 ? (args[i + 1] ?? def) : def;
};
const NS = opt('--n', '1,10').split(',').map(Number);
const ROUNDS = Number(opt('--rounds', '40'));
if (!NS.every((n) => Number.isInteger(n) && n >= 1 && n <= 100) || !Number.isInteger(ROUNDS) || ROUNDS < 1) {
  throw new Error('--n takes counts from 1 to 100 (e.g. --n 1,10), --rounds a whole number >= 1');
}

const q = (a: number[], p: number) => [...a].sort((x, y) => x - y)[Math.min(a.length - 1, Math.floor(p * a.length))]!.toFixed(1);
const engine = new ProcessEngine();
try {
  const t = performance.now();
  await engine.prepare('default');
  console.log(`template default loaded in ${(performance.now() - t).toFixed(0)} ms; cgroup moves: ${cgroupMoveCheck().detail}`);
  console.log('    N | rounds | all ready: median, p90 ms | all answered: median, p90 ms | slowest cgroup move: median, p90 ms');
  for (const n of NS) {
    const ready: number[] = [];
    const answered: number[] = [];
    const moves: number[] = [];
    for (let i = 0; i < ROUNDS; i++) {
      await new Promise((r) => setTimeout(r, 60));
      const t0 = performance.now();
      const kids = await engine.fork('default', n);
      ready.push(performance.now() - t0);
      moves.push(engine.lastSpawn?.slowestMoveMs ?? 0);
      await Promise.all(kids.map((k) => k.agent.eval('1')));
      answered.push(performance.now() - t0);
      await Promise.all(kids.map((k) => k.kill()));
    }
    console.log(`${String(n).padStart(5)} | ${String(ROUNDS).padStart(6)} | ${q(ready, 0.5).padStart(8)}, ${q(ready, 0.9).padStart(6)} | ${q(answered, 0.5).padStart(8)}, ${q(answered, 0.9).padStart(6)} | ${q(moves, 0.5).padStart(8)}, ${q(moves, 0.9).padStart(6)}`);
  }
  const load = (await import('node:os')).loadavg().map((x) => x.toFixed(2));
  console.log(`load average: ${load.join(' ')}`);
} finally {
  await engine.close();
}
