// The process engine, side by side in one run: N = 1, 10, 100 children forked
// from a warm zygote (warm-up: `import numpy`) against a cold start of the same
// sandbox without a zygote (new namespaces, python3 start, the same warm-up from
// scratch). "Ready" = every child has answered its first eval. Private memory
// per child = Private_* of smaps_rollup of its processes while alive, after
// that first answer, and again once they have been idle 8 s (given back, then asleep). Builds the image `numpy` (default + python3-numpy) once.
//   npx tsx bench/process-fork.ts [--image NAME] [--no-cold] [--no-spares] [--no-reclaim] [--no-prefault] [--ksm] [--n 1,10,100]
import { closeSync, openSync, readdirSync, readFileSync, readSync, rmSync } from 'node:fs';
import type { Sandbox } from '../host/engine/engine.ts';
import { cgroupMoveCheck } from '../host/doctor/checks.ts';
import { ProcessEngine } from '../host/engine/process/engine.ts';
import { buildImage, imageExists, loadImage } from '../host/images.ts';
import { storePath } from '../host/store.ts';

const args = process.argv.slice(2);
const imageArg = args.indexOf('--image');
const IMAGE = imageArg >= 0 ? args[imageArg + 1]! : 'numpy';
const COLD = !args.includes('--no-cold');
const KSM = args.includes('--ksm');
const SPARES = !args.includes('--no-spares');
const RECLAIM = !args.includes('--no-reclaim');
const PREFAULT = !args.includes('--no-prefault');
const WARMUP = 'import numpy';
/** How long children are left idle before their memory is read again: an idle fork gives back its
 * copies of the template's bytes once idle 2-5 s (four quiet ticks of its service thread, 0.5-1.25 s each), then
 * sleeps; a fork of 100 under load may take a few seconds more: read at 8 s, the state an idle fork stays in. */
const IDLE_MS = 8000;
const nArg = args.indexOf('--n');
const NS = nArg >= 0 ? args[nArg + 1]!.split(',').map(Number) : [1, 10, 100];
if (!NS.every((n) => Number.isInteger(n) && n >= 1 && n <= 1024)) throw new Error('--n takes a comma-separated list of counts from 1 to 1024, e.g. --n 10,100');

if (!imageExists(IMAGE)) {
  if (IMAGE !== 'numpy') throw new Error(`image ${IMAGE} does not exist`);
  console.error('building image numpy (default + python3-numpy) once...');
  await buildImage({ name: 'numpy', extras: ['python3-numpy'], ifMissing: true });
}
const rootfs = loadImage(IMAGE).rootfs;
const engine = new ProcessEngine({ rootfsOf: async () => rootfs, ksm: KSM, reclaim: RECLAIM, prefault: PREFAULT });
const TEMPLATE = `bench-fork-${process.pid}`;

/** CPU time of a process's live threads, in ms (schedstat: nanosecond run time). */
function cpuMs(pid: number): number {
  let ns = 0;
  try {
    for (const t of readdirSync(`/proc/${pid}/task`)) {
      try {
        ns += Number(readFileSync(`/proc/${pid}/task/${t}/schedstat`, 'utf8').split(' ')[0]);
      } catch {}
    }
  } catch {}
  return ns / 1e6;
}

/** Page faults of a process so far, its exited threads' too (/proc/<pid>/stat minflt + majflt): unlike
 * CPU time, the same from run to run on a noisy machine, and most of a child's CPU here. */
function faults(pid: number): number {
  try {
    const f = readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1]!.split(' ');
    return Number(f[7]) + Number(f[9]);
  } catch {
    return Number.NaN;
  }
}

/** The zygote and its fork server (its children that are not PID 1 of a pid namespace of their own). */
function zygoteAndServer(zpid: number): number[] {
  const out = [zpid];
  try {
    for (const t of readdirSync(`/proc/${zpid}/task`)) {
      for (const k of readFileSync(`/proc/${zpid}/task/${t}/children`, 'utf8').split(' ').filter(Boolean)) {
        const ns = /^NSpid:\s+(.*)$/m.exec(readFileSync(`/proc/${k}/status`, 'utf8'))?.[1]?.trim().split(/\s+/);
        if (ns && ns[ns.length - 1] !== '1') out.push(Number(k));
      }
    }
  } catch {}
  return out;
}

/**
 * Of a child's private pages (present, mapped by it alone), how many KiB are
 * byte for byte unlike the zygote's (and its fork server's) page at the same address and unlike a
 * sibling's: what it would still hold alone where KSM shares identical pages
 * (option `ksm`). Reads /proc/<pid>/pagemap and mem: needs root; null otherwise.
 */
function uniqueKiB(child: number, others: number[]): number | null {
  const PAGE = 4096;
  let pm: number;
  const mems: number[] = [];
  try {
    pm = openSync(`/proc/${child}/pagemap`, 'r');
    mems.push(openSync(`/proc/${child}/mem`, 'r'));
    for (const o of others) mems.push(openSync(`/proc/${o}/mem`, 'r'));
  } catch {
    return null;
  }
  const page = (fd: number, addr: number, buf: Buffer) => {
    try {
      return readSync(fd, buf, 0, PAGE, addr) === PAGE;
    } catch {
      return false;
    }
  };
  const mine = Buffer.alloc(PAGE);
  const theirs = Buffer.alloc(PAGE);
  let unique = 0;
  try {
    for (const line of readFileSync(`/proc/${child}/maps`, 'utf8').split('\n')) {
      const f = line.split(/\s+/);
      if (!f[1]?.includes('w') || f[5]?.startsWith('[v')) continue;
      const [a, b] = f[0]!.split('-').map((x) => Number.parseInt(x, 16)) as [number, number];
      const entries = Buffer.alloc(((b - a) / PAGE) * 8);
      readSync(pm, entries, 0, entries.length, (a / PAGE) * 8);
      for (let i = 0; i < (b - a) / PAGE; i++) {
        const e = entries.readBigUInt64LE(i * 8);
        if (!(e >> 63n) || !((e >> 56n) & 1n)) continue; // not present, or not exclusively ours
        const addr = a + i * PAGE;
        if (!page(mems[0]!, addr, mine)) continue;
        if (!mems.slice(1).some((fd) => page(fd, addr, theirs) && theirs.equals(mine))) unique++;
      }
    }
  } finally {
    closeSync(pm);
    for (const fd of mems) closeSync(fd);
  }
  return (unique * PAGE) / 1024;
}

const median = (xs: number[]) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)] ?? Number.NaN;
};

async function firstAnswers(kids: Sandbox[], t0: number): Promise<number> {
  await Promise.all(
    kids.map(async (k) => {
      const r = await k.agent.eval('1 + 1');
      if (r.value !== 2) throw new Error(`child ${k.id}: eval 1+1 gave ${r.repr}`);
    }),
  );
  return performance.now() - t0;
}

interface Row {
  n: number;
  forkMs: number;
  split: string;
  forkPrivKiB: number;
  forkPrivMaxKiB: number;
  /** The same once the children have been idle IDLE_MS (an idle fork gives back its copies of the template's bytes). */
  idlePrivKiB: number;
  idlePrivMaxKiB: number;
  /** Median KiB no other process of the template has byte for byte (see uniqueKiB). */
  uniqueKiB: number | null;
  coldMs?: number;
  coldPrivKiB?: number;
}

try {
  const tt = performance.now();
  await engine.createTemplate({ name: TEMPLATE, image: IMAGE, warmup: WARMUP });
  console.log(`template (zygote start + ${WARMUP}): ${(performance.now() - tt).toFixed(0)} ms; engine: ${engine.isolation}`);
  if (engine.cgroups.warning) console.log(`cgroups: ${engine.cgroups.warning}`);
  // What the first fork would do: the template's files frozen, its fork server started, its pattern made.
  const tp = performance.now();
  await engine.prepare(TEMPLATE);
  const pattern = engine.zygoteConsole(TEMPLATE).find((l) => /pattern for forks/.test(l)) ?? 'no pattern (see the zygote console)';
  console.log(`prepared (the first fork's work): ${(performance.now() - tp).toFixed(0)} ms; ${pattern.replace(/^forkling-agent: /, '')}`);

  const rows: Row[] = [];
  const zpid = engine.zygotePid(TEMPLATE)!;
  for (const n of NS) {
    const zpids = zygoteAndServer(zpid);
    const z0 = zpids.reduce((a, p) => a + cpuMs(p), 0);
    const h0 = process.cpuUsage();
    const t0 = performance.now();
    const kids = await engine.fork(TEMPLATE, n);
    const forkMs = await firstAnswers(kids, t0);
    const hu = process.cpuUsage(h0);
    const hostCpu = (hu.user + hu.system) / 1000;
    const zygoteCpu = zpids.reduce((a, p) => a + cpuMs(p), 0) - z0;
    const childCpu = kids.reduce((a, k) => a + cpuMs((k as unknown as { hostPid: number }).hostPid), 0);
    const cpu = `CPU per child: in the child ${(childCpu / n).toFixed(2)}, zygote and its fork server ${(zygoteCpu / n).toFixed(2)}, host process ${(hostCpu / n).toFixed(2)} (ms; kernel work done for a child counts in it)`;
    const childFaults = median(kids.map((k) => faults((k as unknown as { hostPid: number }).hostPid)));
    const ls = engine.lastSpawn!;
    const split = `cgroups ${ls.cgroupsMs.toFixed(1)}, zygote reply ${ls.replyMs.toFixed(1)}, restored ${ls.readyMs.toFixed(1)}, child set-up median ${ls.childSetupMsMedian.toFixed(1)}, slowest move into a cgroup ${ls.slowestMoveMs.toFixed(1)}`;
    const priv = await Promise.all(kids.map(async (k) => (await k.stats()).privateKiB));
    await new Promise((r) => setTimeout(r, IDLE_MS)); // (the state measured: idle this long)
    const idle = await Promise.all(kids.map(async (k) => (await k.stats()).privateKiB));
    // What giving those pages back cost (an idle fork's reclaim; its other idle work is well under 1 ms).
    const idleCpu = kids.reduce((a, k) => a + cpuMs((k as unknown as { hostPid: number }).hostPid), 0) - childCpu;
    const maps = median(kids.map((k) => { try { return readFileSync(`/proc/${(k as unknown as { hostPid: number }).hostPid}/maps`, 'utf8').split('\n').length - 1; } catch { return Number.NaN; } }));
    const kidPids = kids.map((k) => (k as unknown as { hostPid: number }).hostPid);
    const uniq = kidPids.slice(0, 5).map((p, i) => uniqueKiB(p, [...zpids, kidPids[(i + 1) % kidPids.length]!].filter((x) => x !== p)));
    await Promise.all(kids.map((k) => k.kill()));
    const u = uniq.every((x) => x !== null) ? median(uniq as number[]) : null;
    // (each mapping costs the kernel ~0.2-0.3 KiB: a vm_area_struct of 192 bytes, and anon_vma_chain entries of 64)
    const kernel = `mappings per child, idle, median: ${maps} (kernel memory, ~0.25 KiB each)`;
    rows.push({ n, forkMs, split: `${split}\n      | ${cpu}\n      | CPU per child while idle ${IDLE_MS / 1000} s after the first answers (giving its copied pages back; forks that did so before the last answered count above): ${(idleCpu / n).toFixed(2)} ms\n      | page faults per child until its first answer, median: ${childFaults}\n      | ${kernel}`, forkPrivKiB: median(priv), forkPrivMaxKiB: Math.max(...priv),
      idlePrivKiB: median(idle), idlePrivMaxKiB: Math.max(...idle), uniqueKiB: u });
  }
  // The same with 100 spare forks kept ready per template (set up and listening in advance;
  // restored at hand-out): what a caller waits for when the pool is full.
  const spareRows: { n: number; ms: number }[] = [];
  if (SPARES) {
    const pooled = new ProcessEngine({ rootfsOf: async () => rootfs, spares: 100, warn: () => {} });
    try {
      await pooled.fork(TEMPLATE, 1).then((k) => Promise.all(k.map((x) => x.kill())));
      for (const n of NS) {
        await pooled.sparesReady(TEMPLATE);
        const t0 = performance.now();
        const kids = await pooled.fork(TEMPLATE, n);
        spareRows.push({ n, ms: await firstAnswers(kids, t0) });
        await Promise.all(kids.map((k) => k.kill()));
      }
    } finally {
      await pooled.close();
    }
  }
  if (COLD) {
    for (const row of rows) {
      const t0 = performance.now();
      const boxes = await Promise.all(
        Array.from({ length: row.n }, async () => {
          const s = await engine.boot({ image: IMAGE, readyTimeoutMs: 300000 });
          const r = await s.agent.eval(WARMUP);
          if (r.exception) throw new Error(`cold warm-up failed: ${r.exception.message}`);
          return s;
        }),
      );
      row.coldMs = await firstAnswers(boxes, t0);
      row.coldPrivKiB = median(await Promise.all(boxes.map(async (b) => (await b.stats()).privateKiB)));
      await Promise.all(boxes.map((b) => b.kill()));
    }
  }
  console.log(`\n    N | fork: all ready ms | private KiB/child (median, max) | idle ${IDLE_MS / 1000} s later | cold: all ready ms | cold private KiB | cold/fork`);
  for (const r of rows) {
    console.log(
      `${String(r.n).padStart(5)} | ${r.forkMs.toFixed(1).padStart(18)} | ${`${r.forkPrivKiB}, ${r.forkPrivMaxKiB}`.padStart(31)} | ` +
        `${`${r.idlePrivKiB}, ${r.idlePrivMaxKiB}`.padStart(16)} | ` +
        `${r.coldMs === undefined ? '-'.padStart(18) : r.coldMs.toFixed(1).padStart(18)} | ${String(r.coldPrivKiB ?? '-').padStart(16)} | ` +
        `${r.coldMs === undefined ? '-' : `${(r.coldMs / r.forkMs).toFixed(1)}x`}`,
    );
  }
  console.log('\nprivate KiB per child unlike the zygote\'s, its fork server\'s and a sibling\'s page (what KSM could not share; option ksm, host KSM running):');
  for (const r of rows) console.log(`${String(r.n).padStart(5)} | ${r.uniqueKiB ?? 'not measured (needs root)'}`);
  const ksmNow = (() => {
    try {
      return readFileSync('/sys/kernel/mm/ksm/run', 'utf8').trim();
    } catch {
      return 'absent';
    }
  })();
  console.log(`KSM: ${KSM ? 'asked for' : 'not asked for (--ksm)'}, host /sys/kernel/mm/ksm/run = ${ksmNow}`);
  // (Seen on Linux 6.18: once favordynmods had been on, moves stayed quick after it was turned off again.)
  console.log(`cgroup moves: ${cgroupMoveCheck().detail}`);
  if (SPARES) console.log('\nwith 100 spare forks waiting per template (option spares; each spare holds a child\'s memory):');
  for (const r of spareRows) {
    const cold = rows.find((x) => x.n === r.n)?.coldMs;
    console.log(`${String(r.n).padStart(5)} | all answered in ${r.ms.toFixed(1)} ms${cold === undefined ? '' : ` (cold/spares ${(cold / r.ms).toFixed(1)}x)`}`);
  }
  console.log('\nwhere the fork time went (ms from the fork call; for N > 25, the last of its requests to the zygote to finish):');
  for (const r of rows) console.log(`${String(r.n).padStart(5)} | ${r.split}`);
  console.log(`\nload average while measuring: ${(await import('node:os')).loadavg().map((x) => x.toFixed(2)).join(' ')} on ${(await import('node:os')).cpus().length} cores`);
  console.log('\ngoals: 100 children ready within 150 ms; under 512 KiB private per idle child; at least 50x faster than cold with numpy');
} finally {
  await engine.close();
  rmSync(storePath('process-templates', `${TEMPLATE}.json`), { force: true });
}
