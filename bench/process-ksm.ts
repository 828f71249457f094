// What KSM does to a fork's private memory: N children of a numpy template
// forked with the engine's `ksm` option, then the host's KSM turned on for a
// few seconds at a brisk scan rate, Private_* of each child read as it merges,
// then the host's KSM settings put back as they were. Needs root and Linux >=
// 6.4. Changes a host-wide setting while it runs: it refuses when any other
// process has mergeable memory (a QEMU, for one), which ksmd would scan too.
//   npx tsx bench/process-ksm.ts [N=10] [seconds=10]
import { readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { ProcessEngine } from '../host/engine/process/engine.ts';
import { loadImage } from '../host/images.ts';
import { storePath } from '../host/store.ts';

const N = Number(process.argv[2] ?? 10);
const SECONDS = Number(process.argv[3] ?? 10);
const K = '/sys/kernel/mm/ksm/';
const get = (f: string) => readFileSync(K + f, 'utf8').trim();
const privateKiB = (pid: number) => [...readFileSync(`/proc/${pid}/smaps_rollup`, 'utf8').matchAll(/^Private_\w+:\s+(\d+)/gm)].reduce((a, m) => a + Number(m[1]), 0);
const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
/** Processes whose memory ksmd would scan. */
const mergeable = () =>
  readdirSync('/proc')
    .filter((d) => /^\d+$/.test(d))
    .filter((d) => {
      try {
        return /^ksm_mergeable: yes/m.test(readFileSync(`/proc/${d}/ksm_stat`, 'utf8'));
      } catch {
        return false;
      }
    })
    .map(Number);

/** A process and all its descendants. */
const family = (pid: number): number[] => {
  let kids: number[] = [];
  try {
    kids = readdirSync(`/proc/${pid}/task`).flatMap((t) =>
      readFileSync(`/proc/${pid}/task/${t}/children`, 'utf8').split(' ').filter(Boolean).map(Number),
    );
  } catch {}
  return [pid, ...kids.flatMap(family)];
};

const rootfs = loadImage('numpy').rootfs;
const engine = new ProcessEngine({ rootfsOf: async () => rootfs, ksm: true, warn: () => {} });
const T = `bench-ksm-${process.pid}`;
const saved = { run: get('run'), pages_to_scan: get('pages_to_scan'), sleep_millisecs: get('sleep_millisecs') };
let changed = false;
try {
  await engine.createTemplate({ name: T, image: 'numpy', warmup: 'import numpy' });
  await Promise.all((await engine.fork(T, 1)).map((k) => k.kill()));
  const kids = await engine.fork(T, N);
  const pids = kids.map((k) => (k as unknown as { hostPid: number }).hostPid);
  await Promise.all(kids.map((k) => k.agent.eval('1+1')));
  const ours = new Set([...pids, ...family(engine.zygotePid(T)!)]); // the zygote, its fork server, the forks
  const others = mergeable().filter((p) => !ours.has(p));
  if (others.length) throw new Error(`processes ${others.join(' ')} have mergeable memory: not turning the host's KSM on`);
  console.log(`N=${N}, after the first eval: private median ${median(pids.map(privateKiB))} KiB (KSM run=${saved.run})`);
  changed = true;
  writeFileSync(`${K}pages_to_scan`, '2000');
  writeFileSync(`${K}sleep_millisecs`, '10');
  writeFileSync(`${K}run`, '1');
  const t0 = Date.now();
  while (Date.now() - t0 < SECONDS * 1000) {
    await new Promise((r) => setTimeout(r, 2000));
    console.log(`  ${((Date.now() - t0) / 1000).toFixed(0)} s with KSM on (full scans ${get('full_scans')}): private median ${median(pids.map(privateKiB))} KiB`);
  }
  await Promise.all(kids.map((k) => k.agent.eval('1+1')));
  console.log(`after one more eval each (copy-on-write breaks merged pages again): private median ${median(pids.map(privateKiB))} KiB`);
} finally {
  if (changed) {
    writeFileSync(`${K}run`, saved.run);
    writeFileSync(`${K}pages_to_scan`, saved.pages_to_scan);
    writeFileSync(`${K}sleep_millisecs`, saved.sleep_millisecs);
    console.log(`host KSM settings put back: run=${get('run')} pages_to_scan=${get('pages_to_scan')} sleep_millisecs=${get('sleep_millisecs')}`);
  }
  await engine.close();
  rmSync(storePath('process-templates', `${T}.json`), { force: true });
}
