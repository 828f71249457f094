#!/usr/bin/env node
// The whole test suite: type check, lint, unit tests, addon tests, KVM tests.
// Each test file runs in its own process (a native crash fails one file, not
// the run). Ends with the plain line `N passed, N failed`.
//
//   node test/run.mjs            everything
//   node test/run.mjs unit       only test/unit
//   node test/run.mjs lab        only the KVM tests, all inside the lab
//   node test/run.mjs kvm-direct run test/kvm directly (used inside the lab)
//   FORKLING_TEST_FILTER=regex   only test files whose path matches
import { spawn, spawnSync } from 'node:child_process';
import { accessSync, constants, existsSync, readFileSync, readdirSync } from 'node:fs';
import { dirname, join, relative } from 'node:path';
import { fileURLToPath } from 'node:url';
import { KVM_FILE_LIMIT_S, RECAP_TITLE } from './limits.mjs';

const root = dirname(dirname(fileURLToPath(import.meta.url)));
const CI = process.env.CI === 'true';
const filter = process.env.FORKLING_TEST_FILTER ? new RegExp(process.env.FORKLING_TEST_FILTER) : null;
const tsx = join(root, 'node_modules', '.bin', 'tsx');
let passed = 0;
let failed = 0;
const failures = [];
/** What each failing file said, printed again at the end: CI often keeps only a run's head and tail. */
const recap = [];

/** The uvu FAIL blocks of a file's output (without node_modules stack lines), else its last lines. */
function failExcerpt(out) {
  const lines = out.split('\n');
  const picked = [];
  for (let i = 0; i < lines.length; i++) {
    if (!/^\s*FAIL\s/.test(lines[i])) continue;
    for (let j = i, n = 0; j < lines.length && n < 20 && !/^\s*Total:/.test(lines[j]) && (j === i || !/^\s*FAIL\s/.test(lines[j])); j++) {
      if (/^\s+at .*node_modules/.test(lines[j]) || lines[j].trim() === '') continue;
      picked.push(lines[j]);
      n++;
    }
  }
  const chosen = picked.length ? picked : lines.filter((l) => l.trim() !== '').slice(-20);
  return chosen.slice(0, 60);
}

function section(title) {
  console.log(`\n=== ${title}`);
}

/** A part that cannot run: said on its own line; fails the run under CI. */
function skip(part, why) {
  console.log(`SKIP ${part}: ${why}${CI ? ' (counted as a failure because CI=true)' : ''}`);
  if (CI) {
    failed++;
    failures.push(`${part} (skipped)`);
  }
}

function record(name, ok) {
  if (ok) passed++;
  else {
    failed++;
    failures.push(name);
  }
}

function runCheck(name, cmd, args) {
  section(name);
  const r = spawnSync(cmd, args, { cwd: root, stdio: 'inherit' });
  console.log(`${r.status === 0 ? 'ok' : 'FAILED'}: ${name}`);
  record(name, r.status === 0);
}

function listTests(dir) {
  const abs = join(root, dir);
  let out = [];
  try {
    for (const e of readdirSync(abs, { withFileTypes: true })) {
      const p = join(abs, e.name);
      if (e.isDirectory()) out = out.concat(listTests(relative(root, p)));
      else if (e.name.endsWith('.test.ts')) out.push(relative(root, p));
    }
  } catch {}
  return out.filter((f) => !filter || filter.test(f)).sort();
}

/** V8's trap in WebAssembly code, as a node process prints it (LAB WASM TRAP below). */
const WASM_TRAP = /RuntimeError: memory access out of bounds\s+at wasm:\/\/\S+/;

/**
 * The lab kernel's reports of a user process that hit an invalid opcode at an
 * address in no file (`traps: node[628] trap invalid opcode ip:... sp:...
 * error:0`, without ` in <file>[...]`): in node, V8's generated code.
 */
function jitTraps() {
  const r = spawnSync('dmesg', [], { encoding: 'utf8' });
  return (r.stdout ?? '').split('\n').filter((l) => /traps: \S+ trap invalid opcode ip:[0-9a-f]+ sp:[0-9a-f]+ error:[0-9a-f]+\s*$/.test(l));
}

/**
 * Runs one uvu file; counts its tests from uvu's summary. Returns when it ends.
 * In the lab a file is run once more, loudly, its first results not counted:
 * - one that runs past its time (LAB HANG): QEMU's emulated nested SVM has
 *   stalled 2-vCPU guests there (an AP that never got its startup IPI, a
 *   panicking guest whose console stopped mid-trace);
 * - one whose node died of SIGILL in V8's generated code (LAB SIGILL): twice in
 *   ~20 lab runs (server-kvm.test.ts, 2026-11-30), never outside the lab; QEMU
 *   7.2's TCG runs the lab's user space too. A SIGILL in a file (our addon, node
 *   itself) is not retried;
 * - one that failed with V8's WebAssembly trap "memory access out of bounds"
 *   (LAB WASM TRAP): once in ~25 lab runs (2026-12-03) a `forkling` run died
 *   so while loading its modules, before it made any VM: the only WebAssembly
 *   in our processes is the module loader's (tsx's import lexer); the lab's
 *   TCG, as for LAB SIGILL;
 * - one whose every failing test (or set-up hook) met the lab's flakes on each
 *   of its tries (LAB FLAKES, test/kvm/lab-flake.ts): the 10-child fork of
 *   snapshot-vm.test.ts had a tiny guest triple-fault in 3 of 3 tries in one
 *   run (2026-12-05) and in none of the next.
 * A second time counts.
 */
function runFile(file, timeoutMs, attempt = 1) {
  // In the lab, which file is running: the outer runner names it if the lab freezes (test/lab/run.ts).
  const inLab = !!process.env.FORKLING_IN_LAB;
  if (inLab) console.log(`LAB-FILE ${file}`);
  const trapsBefore = inLab ? jitTraps().length : 0;
  return new Promise((resolve) => {
    const started = Date.now();
    const p = spawn(tsx, [file], {
      cwd: root,
      env: { ...process.env, FORCE_COLOR: '0', NO_COLOR: '1' },
      stdio: ['ignore', 'pipe', 'pipe'],
      detached: true,
    });
    let out = '';
    p.stdout.on('data', (d) => {
      out += d;
    });
    p.stderr.on('data', (d) => {
      out += d;
    });
    let overran = false;
    const timer = setTimeout(() => {
      overran = true;
      out += `\n[test runner] ${file} exceeded ${timeoutMs / 1000}s; killed\n`;
      try {
        process.kill(-p.pid, 'SIGKILL');
      } catch {}
    }, timeoutMs);
    p.on('close', (code, signal) => {
      clearTimeout(timer);
      // uvu's summary lines; the last ones win (a test may print e.g. /proc/meminfo).
      const last = (re) => Number([...out.matchAll(re)].at(-1)?.[1] ?? 0);
      const total = last(/^\s*Total:\s+(\d+)\s*$/gm);
      const ok = last(/^\s*Passed:\s+(\d+)\s*$/gm);
      console.log(`--- ${file} (${((Date.now() - started) / 1000).toFixed(1)}s)`);
      process.stdout.write(out.replace(/\s+$/, '') + '\n');
      const bad = total - ok + (code !== 0 && ok === total ? 1 : 0);
      // What spoiled a first run in the lab, if the lab did (see above).
      const labSpoiled = () => {
        if (overran) return `LAB HANG: ${file} exceeded ${timeoutMs / 1000}s in the lab`;
        const trap = code === 132 || signal === 'SIGILL' ? jitTraps().slice(trapsBefore).at(-1) : undefined;
        if (trap) return `LAB SIGILL: ${file}: node died of an invalid opcode in V8's generated code (${trap.trim()})`;
        const wasm = bad || total === 0 ? out.match(WASM_TRAP) : null;
        if (wasm) return `LAB WASM TRAP: ${file}: a node process hit V8's WebAssembly bounds trap (${wasm[0].replace(/\s+/g, ' ')})`;
        // (a set-up hook that failed so fails every test of the file, under one FAIL line of its own)
        const outOfTries = [...out.matchAll(/^LAB FLAKE OUT OF TRIES /gm)].length;
        const fails = [...out.matchAll(/^\s*FAIL\s/gm)].length;
        // (and only where uvu summed the file up: not a crash, a signal or a bad exit after all passed)
        const summed = total > 0 && signal === null && !(code !== 0 && ok === total);
        if (summed && bad && outOfTries && fails > 0 && fails <= outOfTries) return `LAB FLAKES: ${file}: each of its failures met the lab's flakes on every try`;
        return undefined;
      };
      const spoiled = inLab && attempt === 1 ? labSpoiled() : undefined;
      if (spoiled) {
        console.log(`${spoiled}; running it once more (its results above do not count)`);
        runFile(file, timeoutMs, 2).then(resolve);
        return;
      }
      if (total === 0) {
        console.log(`FAILED: ${file} ran no test (exit ${code})`);
        record(file, false);
        recap.push(`--- ${file} (ran no test, exit ${code})`, ...failExcerpt(out));
      } else {
        passed += ok;
        failed += bad;
        if (bad) {
          failures.push(file);
          recap.push(`--- ${file}`, ...failExcerpt(out));
        }
      }
      resolve();
    });
  });
}

async function runFiles(title, files, { parallel = 2, timeoutMs = 900_000 } = {}) {
  section(title);
  if (files.length === 0) {
    skip(title, 'no test files found');
    return;
  }
  const queue = [...files];
  await Promise.all(
    Array.from({ length: Math.min(parallel, queue.length) }, async () => {
      while (queue.length) await runFile(queue.shift(), timeoutMs);
    }),
  );
}

/** KVM good enough for Linux guests: /dev/kvm usable and not kvm_pvm (see host/doctor/kvm-probe.ts). */
function kvmUsable() {
  if (existsSync('/sys/module/kvm_pvm') && process.env.FORKLING_ALLOW_PVM !== '1') return false;
  try {
    accessSync('/dev/kvm', constants.R_OK | constants.W_OK);
    return true;
  } catch {
    return false;
  }
}

/** Runs the lab: a QEMU-emulated machine with nested KVM that runs test/kvm inside. */
async function runLab(title, labFilter) {
  section(title);
  const env = { ...process.env };
  if (labFilter) env.FORKLING_TEST_FILTER = labFilter;
  const lab = spawnSync(tsx, [join(root, 'test', 'lab', 'run.ts')], { cwd: root, stdio: ['ignore', 'inherit', 'inherit'], env });
  // The lab writes the inner suite's counts to .lab/last-summary.json.
  let summary = null;
  try {
    summary = JSON.parse(readFileSync(join(root, '.lab', 'last-summary.json'), 'utf8'));
  } catch {}
  if (!summary || summary.startedAt < startedAt) {
    console.log(`FAILED: the lab produced no result (exit ${lab.status})`);
    record('KVM lab', false);
    return;
  }
  passed += summary.passed;
  failed += summary.failed;
  failures.push(...summary.failures.map((f) => `lab: ${f}`));
  recap.push(...(summary.details ?? []).map((l) => (l.startsWith('--- ') ? `--- lab: ${l.slice(4)}` : l)));
  if (lab.status !== 0 && summary.failed === 0) record('KVM lab exit status', false);
}

/**
 * Where /dev/kvm works, the KVM tests run directly (real timings) and the lab
 * still boots once with the raw KVM test, so the lab itself stays tested for
 * hosts without KVM, and with the cgroup v2 test, for hosts with v1. Where it does not, every KVM test runs in the lab.
 */
async function runKvm({ forceLab }) {
  if (kvmUsable() && !forceLab) {
    await runFiles('KVM tests (directly: /dev/kvm is usable here)', listTests('test/kvm'), { parallel: 1, timeoutMs: KVM_FILE_LIMIT_S * 1000 });
    // (and the process engine on cgroup v2, which the lab's Linux has: process-cgroup-v2.test.ts),
    // those of the two that FORKLING_TEST_FILTER leaves in
    const smoke = listTests('test/kvm').filter((f) => /kvm-raw|process-cgroup-v2/.test(f));
    if (smoke.length) await runLab('KVM lab smoke test (software-emulated machine with nested KVM) and cgroup v2', smoke.join('|'));
    return;
  }
  await runLab('KVM lab (software-emulated machine with nested KVM): all KVM tests', process.env.FORKLING_TEST_FILTER);
}

const startedAt = Date.now();
const mode = process.argv[2] ?? 'all';

if (mode === 'all') {
  runCheck('type check (tsc --noEmit, strict)', join(root, 'node_modules', '.bin', 'tsc'), ['-p', 'tsconfig.json', '--noEmit']);
  runCheck('lint (biome)', join(root, 'node_modules', '.bin', 'biome'), ['lint', '.']);
}
if (mode === 'all' || mode === 'unit') await runFiles('unit tests', listTests('test/unit'));
if (mode === 'all' || mode === 'unit') await runFiles('addon tests', listTests('test/native'));
if (mode === 'all') await runKvm({ forceLab: false });
if (mode === 'lab') await runKvm({ forceLab: true });
if (mode === 'kvm-direct') await runFiles('KVM tests', listTests('test/kvm'), { parallel: 1, timeoutMs: KVM_FILE_LIMIT_S * 1000 });

if (recap.length) console.log(`\n${RECAP_TITLE}\n${recap.join('\n')}`);
if (failures.length) console.log(`\nfailed: ${failures.join(', ')}`);
console.log(`\n${passed} passed, ${failed} failed`);
process.exit(failed === 0 ? 0 : 1);
