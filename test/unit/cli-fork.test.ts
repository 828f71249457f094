// `forkling fork` with the process engine: the report's fields (--json) and
// its table, and a bad option's one clear error.
import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, rmSync, symlinkSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { ensureImage } from '../../host/images.ts';
import { storePath } from '../../host/store.ts';
import { loud } from '../loud-hook.ts';

const env = { ...process.env, FORKLING_ENGINE: 'process' };
const cli = (...args: string[]) => spawnSync(process.execPath, ['bin/forkling.mjs', 'fork', ...args], { encoding: 'utf8', env, timeout: 120_000 });

// The image first, without the CLI's time limit (a fresh store builds it: a minute or more).
test.before(loud("the suite's set-up (test.before)", () => ensureImage('default')));

test('fork --json: the template is loaded apart from the fork; every child answers; memory while alive', () => {
  const r = cli('default', '-n', '2', '--eval', 'print("hi")\n6 * 7', '--json');
  assert.is(r.status, 0, r.stderr);
  const rep = JSON.parse(r.stdout);
  assert.is(rep.engine, 'process');
  assert.is(rep.template, 'default');
  assert.is(rep.n, 2);
  assert.type(rep.template_created, 'boolean');
  for (const k of ['template_load_ms', 'total_ms', 'ready_ms', 'child_p50_ms', 'child_p99_ms']) {
    assert.ok(typeof rep.timings[k] === 'number' && rep.timings[k] > 0, `${k}: ${rep.timings[k]}`);
  }
  assert.ok(rep.timings.ready_ms <= rep.timings.total_ms);
  assert.ok(rep.memory.per_child_kib > 0);
  assert.is(rep.children.length, 2);
  for (const c of rep.children) assert.equal([c.ok, c.value, c.stdout, c.error], [true, 42, 'hi\n', null]);
  assert.is(new Set(rep.children.map((c: { id: string }) => c.id)).size, 2);
});

test('fork (table): says what loading the template did; a failing eval fails the command', () => {
  const r = cli('default', '-n', '1', '--eval', '1 / 0');
  assert.is(r.status, 1);
  assert.match(r.stdout, /template loaded in [\d.]+ ms \(once per process, before the fork: its zygote started, warm-up run\)/);
  assert.match(r.stdout, /ZeroDivisionError/);
});

test('fork, first use: says that it creates the template default (a silent wait looks like a hang)', () => {
  // A store of its own with the images of ours (built above): no template default there yet.
  const home = mkdtempSync(join(tmpdir(), 'forkling-first-use-'));
  try {
    symlinkSync(storePath('images'), join(home, 'images'));
    const r = spawnSync(process.execPath, ['bin/forkling.mjs', 'fork', '-n', '1', '--eval', '6 * 7', '--json'], {
      encoding: 'utf8',
      env: { ...env, FORKLING_HOME: home },
      timeout: 120_000,
    });
    assert.is(r.status, 0, r.stderr);
    assert.match(r.stderr, /^forkling: creating template default \(first use: image default, no warm-up\)$/m);
    assert.not.match(r.stderr, /building image/, 'the image was there: nothing to build');
    const first = JSON.parse(r.stdout);
    assert.is(first.children[0].value, 42);
    assert.is(first.template_created, true, 'its load time counts the creation: the report says so');
    // Made once: the next use says nothing of it.
    const again = spawnSync(process.execPath, ['bin/forkling.mjs', 'fork', '-n', '1', '--eval', '1'], { encoding: 'utf8', env: { ...env, FORKLING_HOME: home }, timeout: 120_000 });
    assert.is(again.status, 0, again.stderr);
    assert.not.match(again.stderr, /creating template/);
    assert.match(again.stdout, /template loaded in [\d.]+ ms \(once per process, before the fork: its zygote started, warm-up run\)/);
  } finally {
    rmSync(home, { recursive: true, force: true });
  }
});

test('fork: -n out of range is one clear error', () => {
  const r = cli('default', '-n', '0');
  assert.is(r.status, 2);
  assert.match(r.stderr, /-n|n must/);
});

const nsDepth = (pid: number | 'self'): string[] =>
  /^NSpid:\s+(.*)$/m.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))?.[1]?.trim().split(/\s+/) ?? [];
/**
 * Host pids of the forks under process `pid`: PID 1 of a pid namespace nested in another (the zygote's), so two
 * levels below ours; counted from our own level because the tests may themselves run in a pid namespace.
 */
function forksUnder(pid: number): number[] {
  const depth = nsDepth('self').length + 2;
  const out: number[] = [];
  const walk = (p: number): void => {
    let tasks: string[] = [];
    try {
      tasks = readdirSync(`/proc/${p}/task`);
    } catch {} // (gone meanwhile)
    for (const t of tasks) {
      let kids: number[] = [];
      try {
        kids = readFileSync(`/proc/${p}/task/${t}/children`, 'utf8').split(' ').filter(Boolean).map(Number);
      } catch {}
      for (const k of kids) {
        let ns: string[] = [];
        try {
          ns = nsDepth(k);
        } catch {} // (gone meanwhile)
        // (not a zombie: a fork that ended, e.g. the template's rehearsal, until its parent reaps it)
        if (ns.length === depth && ns[ns.length - 1] === '1' && running(k)) out.push(k);
        walk(k);
      }
    }
  };
  walk(pid);
  return out;
}
const running = (pid: number) => {
  try {
    return !/^State:\s+Z/m.test(readFileSync(`/proc/${pid}/status`, 'utf8'));
  } catch {
    return false;
  }
};

test('fork --keep: the children run until Ctrl-C, then the command ends them and exits 0', async () => {
  const p = spawn(process.execPath, ['bin/forkling.mjs', 'fork', 'default', '-n', '2', '--eval', '1', '--json', '--keep'], { env, stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '';
  let err = '';
  p.stdout.on('data', (d) => (out += d));
  // (a signal's name where it was one: CI once saw it killed by the Ctrl-C, sent before fork.ts set its handlers, which then came after the line)
  const exited = new Promise<number | string | null>((resolve) => p.on('exit', (code, signal) => resolve(code ?? signal)));
  try {
    await new Promise<void>((resolve, reject) => {
      const t = setTimeout(() => reject(new Error(`no "children running" line within 120 s: ${err}`)), 120_000);
      p.stderr.on('data', (d) => {
        err += d;
        if (/2 children running; Ctrl-C ends them/.test(err)) {
          clearTimeout(t);
          resolve();
        }
      });
      void exited.then((code) => reject(new Error(`fork --keep exited (${code}) before Ctrl-C: ${err}`)));
    });
    assert.is(JSON.parse(out).children.length, 2);
    const forks = forksUnder(p.pid!);
    const seen = () =>
      forks
        .map((k) => {
          try {
            return `${k} [${nsDepth(k).join(' ')}] ${readFileSync(`/proc/${k}/cmdline`, 'utf8').replace(/\0/g, ' ').slice(0, 100)}`;
          } catch {
            return `${k} (gone)`;
          }
        })
        .join('; ');
    assert.is(forks.length, 2, `both children run while the command waits; found: ${seen()}`);
    p.kill('SIGINT');
    assert.is(await exited, 0, err);
    assert.equal(forks.filter(running), [], 'the children ended with the command');
  } finally {
    p.kill('SIGKILL');
  }
});

test.run();
