#!/usr/bin/env node
// Builds the native addon with node-gyp. Checks the toolchain first so that a
// missing compiler or header gives one clear message instead of a gyp trace.
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = dirname(dirname(fileURLToPath(import.meta.url)));

function have(cmd) {
  return spawnSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' }).status === 0;
}

function fail(msg) {
  console.error(`forkling: cannot build the native addon: ${msg}`);
  process.exit(1);
}

if (process.platform !== 'linux') fail('forkling runs on Linux only (it needs KVM or Linux namespaces).');
if (!have('c++') && !have('g++')) fail('no C++ compiler found. Install it with: apt-get install g++');
if (!have('make')) fail('make not found. Install it with: apt-get install make');
if (!have('python3')) fail('python3 (needed by node-gyp) not found. Install it with: apt-get install python3');

// Node's headers: from npm's configured nodedir, or next to the running node.
const nodedir = process.env.npm_config_nodedir || dirname(dirname(process.execPath));
if (!existsSync(join(nodedir, 'include', 'node', 'node_api.h'))) {
  fail(
    `Node.js headers not found under ${nodedir}/include/node. Install them with: apt-get install libnode-dev ` +
      '(or point npm at them: npm config set nodedir <dir>)',
  );
}
if (!existsSync('/usr/include/linux/kvm.h')) fail('Linux headers (linux/kvm.h) not found. Install them with: apt-get install linux-libc-dev');
if (!existsSync(join(root, 'node_modules', 'node-addon-api'))) fail('node-addon-api is missing: run npm install first.');

const candidates = [
  process.env.npm_config_node_gyp,
  join(dirname(process.execPath), '..', 'lib', 'node_modules', 'npm', 'node_modules', 'node-gyp', 'bin', 'node-gyp.js'),
].filter(Boolean);
const gyp = candidates.find((p) => existsSync(p));
if (!gyp) fail('node-gyp not found (it ships with npm). Reinstall npm, or: npm install -g node-gyp');

// One build at a time per checkout: two node-gyp runs in one build dir break each other.
const lock = join(root, 'native', '.build.lock');
for (let waited = 0; ; waited++) {
  try {
    mkdirSync(lock);
    writeFileSync(join(lock, 'pid'), String(process.pid));
    break;
  } catch {
    let holder = 0;
    try {
      holder = Number(readFileSync(join(lock, 'pid'), 'utf8'));
      process.kill(holder, 0);
    } catch {
      if (holder || waited > 4) rmSync(lock, { recursive: true, force: true }); // holder died
      Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 500);
      continue;
    }
    if (waited === 0) console.error(`forkling: waiting for another build of the addon (pid ${holder})`);
    Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 500);
  }
}
process.on('exit', () => rmSync(lock, { recursive: true, force: true }));

const r = spawnSync(process.execPath, [gyp, 'rebuild', `--nodedir=${nodedir}`, '-j', 'max'], {
  cwd: join(root, 'native'),
  stdio: 'inherit',
});
if (r.status !== 0) fail(`node-gyp exited with status ${r.status}; the compiler output is above.`);

// The process engine's helpers in C, loaded by the zygote and its forks
// inside sandboxes (guest-agent/forkling_spawn.c: the fork loop and set-up;
// forkling_reclaim.c: the template's memory as a file, and reclaim):
// freestanding (no libc linked; -z defs fails the link should the compiler
// ever call one), so they load into any image. Written next to their
// sources, which the engine binds into every zygote; renamed into place (a
// running zygote may have one mapped). Without them forks still work (set
// up in Python; no reclaim: more memory per child): a failed build is a
// warning.
const cc = process.env.CC ? [process.env.CC] : have('cc') ? ['cc'] : ['g++', '-x', 'c'];
for (const [name, without] of [
  ['forkling_spawn', 'the process engine will set up forks in Python, with more memory per child'],
  ['forkling_reclaim', "the process engine's forks will not give back the pages they copied (more memory per child)"],
]) {
  const src = join(root, 'guest-agent', `${name}.c`);
  const so = join(root, 'guest-agent', `${name}.so`);
  const tmpSo = `${so}.${process.pid}.tmp`;
  const c = spawnSync(
    cc[0],
    [...cc.slice(1), '-std=gnu11', '-O2', '-Wall', '-Wextra', '-shared', '-fPIC', '-nostdlib', '-ffreestanding', '-fno-builtin',
      '-fno-stack-protector', '-Wl,-z,defs', '-o', tmpSo, src],
    { stdio: 'inherit' },
  );
  if (c.status === 0) {
    renameSync(tmpSo, so);
  } else {
    rmSync(tmpSo, { force: true });
    console.error(`forkling: warning: compiling ${src} failed (status ${c.status}; output above): ${without}`);
  }
}
