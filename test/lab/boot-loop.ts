// A diagnostic for the lab's early triple fault (issue 5): boots the default
// image many times, a few at once, with the whole console (early printk
// included), and prints each outcome; a failed boot shows its last console
// lines, i.e. how far the guest got. Run it inside the lab:
//
//   FORKLING_LAB_COMMAND='node --import tsx test/lab/boot-loop.ts --n 12' npx tsx test/lab/run.ts
//
// Options: --n boots (12), --parallel at once (2), --quiet (no early printk,
// the normal cmdline: checks whether the console changes the odds).
// Exits 0 when every boot reached a ready agent.
import { parseArgs } from 'node:util';
import { KvmEngine } from '../../host/engine/kvm/engine.ts';

const { values } = parseArgs({
  options: { n: { type: 'string', default: '12' }, parallel: { type: 'string', default: '2' }, quiet: { type: 'boolean', default: false } },
});
const n = Number(values.n);
const parallel = Number(values.parallel);
if (!Number.isInteger(n) || n < 1 || !Number.isInteger(parallel) || parallel < 1) throw new Error('--n and --parallel must be whole numbers >= 1');

const engine = new KvmEngine();
const t0 = performance.now();
const secs = () => ((performance.now() - t0) / 1000).toFixed(1);
let next = 0;
let ok = 0;
const failures: string[] = [];

async function worker(): Promise<void> {
  while (next < n) {
    const i = next++;
    const lines: string[] = [];
    const started = performance.now();
    try {
      const sb = await engine.boot({
        image: 'default',
        readyTimeoutMs: 600_000,
        ...(values.quiet ? {} : { verbose: true, kernelArgs: ['earlyprintk=serial,ttyS0,115200'] }),
        onConsole: (l) => lines.push(l),
      });
      ok++;
      console.log(`[${secs()}s] boot ${i}: ready in ${((performance.now() - started) / 1000).toFixed(1)} s (${lines.length} console lines)`);
      await sb.kill();
    } catch (e) {
      const first = (e as Error).message.split('\n')[0];
      failures.push(`boot ${i}: ${first}`);
      console.log(`[${secs()}s] boot ${i}: FAILED after ${((performance.now() - started) / 1000).toFixed(1)} s: ${first}`);
      console.log(`  ${lines.length} console lines; the last 15:`);
      for (const l of lines.slice(-15)) console.log(`  | ${l}`);
    }
  }
}

await Promise.all(Array.from({ length: parallel }, worker));
await engine.close();
console.log(`boot loop: ${ok} of ${n} boots ready${failures.length ? `; failed: ${failures.join('; ')}` : ''}`);
process.exit(failures.length ? 1 : 0);
