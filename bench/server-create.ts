// A new sandbox through `forkling serve` (process engine), the way a client of
// the server sees it: Sandbox.create, then its first eval answered; 40
// requests 60 ms apart (not back to back, as users' requests come), for each
// --spares setting given. Prints median and p90.
//   npx tsx bench/server-create.ts [spares settings, default 0,4]
import { spawn } from 'node:child_process';
import { Sandbox } from '../host/index.ts';

const settings = (process.argv[2] ?? '0,4').split(',').map(Number);
if (!settings.every((n) => Number.isInteger(n) && n >= 0)) throw new Error('give spares settings as whole numbers, e.g. 0,4');
for (const spares of settings) {
  const srv = spawn(process.execPath, ['bin/forkling.mjs', 'serve', '--listen', '127.0.0.1:0', '--engine', 'process', '--spares', String(spares)], {
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const url = await new Promise<string>((resolve, reject) => {
    srv.stdout.on('data', (d) => {
      const m = /listening (\S+)/.exec(String(d));
      if (m) resolve(m[1]!);
    });
    srv.once('exit', (c) => reject(new Error(`forkling serve exited ${c}`)));
  });
  const warm = await Sandbox.create({ url }); // the template's zygote starts here
  await warm.kill();
  const ms: number[] = [];
  for (let i = 0; i < 40; i++) {
    await new Promise((r) => setTimeout(r, 60));
    const t = performance.now();
    const sb = await Sandbox.create({ url });
    await sb.eval('1');
    ms.push(performance.now() - t);
    await sb.kill();
  }
  ms.sort((a, b) => a - b);
  console.log(`--spares ${spares}: Sandbox.create + first eval answered: median ${ms[20]!.toFixed(2)} ms, p90 ${ms[36]!.toFixed(2)} ms`);
  srv.kill('SIGTERM');
  await new Promise((r) => srv.once('exit', r));
}
process.exit(0);
