// The floor under the process engine's memory per child: what CPython itself
// costs per forked child, without forkling (bench/python-floor.py, run with
// the image's python3 in a cold-booted sandbox of the image `numpy`). A
// child that takes one request in a thread and evaluates it cannot cost
// less than the last row, whatever the agent around it does. Two more rows
// measure the process engine's reclaim on it (guest-agent/forkling_reclaim.so,
// built by npm run build:native): the parent's memory made a file's, and a
// child giving back its pages that equal the file's.
//   npx tsx bench/python-floor.ts [--n 10]
import { existsSync, readFileSync } from 'node:fs';
import { ProcessEngine } from '../host/engine/process/engine.ts';
import { buildImage, imageExists, loadImage } from '../host/images.ts';

const args = process.argv.slice(2);
const nArg = args.indexOf('--n');
const N = nArg >= 0 ? Number(args[nArg + 1]) : 10;
if (!Number.isInteger(N) || N < 2 || N > 200) throw new Error('--n takes a count from 2 to 200 (children forked at a time)');
if (!imageExists('numpy')) {
  console.error('building image numpy (default + python3-numpy) once...');
  await buildImage({ name: 'numpy', extras: ['python3-numpy'], ifMissing: true });
}
const rootfs = loadImage('numpy').rootfs;
const reclaimSo = new URL('../guest-agent/forkling_reclaim.so', import.meta.url).pathname;
if (!existsSync(reclaimSo)) console.error(`${reclaimSo} is not built (npm run build:native): its rows are left out`);
const engine = new ProcessEngine({ rootfsOf: async () => rootfs });
try {
  const box = await engine.boot({ image: 'numpy' });
  await box.agent.writeFile('/tmp/python-floor.py', readFileSync(new URL('./python-floor.py', import.meta.url)));
  const argv = ['python3', '/tmp/python-floor.py', String(N)];
  if (existsSync(reclaimSo)) {
    await box.agent.writeFile('/tmp/forkling_reclaim.so', readFileSync(reclaimSo));
    argv.push('/tmp/forkling_reclaim.so');
  }
  const r = await box.agent.exec(argv, { timeoutMs: 120_000 });
  if (r.exitCode !== 0) throw new Error(`python-floor.py failed (${r.exitCode}): ${new TextDecoder().decode(r.stderr)}`);
  const out = JSON.parse(new TextDecoder().decode(r.stdout)) as {
    python: string;
    n: number;
    rows: { what: string; median_kib: number; max_kib: number; given_back_kib?: number }[];
    remap: { ms: number; file_kib: number; parent_private_kib: [number, number] } | null;
  };
  console.log(`CPython ${out.python}, numpy imported, gc frozen; ${out.n} children forked at a time with libc fork(); private KiB per child while all live:`);
  for (const row of out.rows) {
    const back = row.given_back_kib !== undefined ? ` (gave back ${row.given_back_kib} KiB)` : '';
    console.log(`${String(row.median_kib).padStart(6)} (max ${String(row.max_kib).padStart(5)})  ${row.what}${back}`);
  }
  if (out.remap) {
    const [before, after] = out.remap.parent_private_kib;
    console.log(`parent's memory made a file's in ${out.remap.ms} ms: ${out.remap.file_kib} KiB written to it; parent private ${before} -> ${after} KiB`);
  }
  await box.kill();
} finally {
  await engine.close();
}
