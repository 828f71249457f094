// Engine selection: --engine / FORKLING_ENGINE parsing, auto on a host with
// and without a usable /dev/kvm, and the one line it prints.
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { UserError } from '../../host/errors.ts';
import { kvmHostProblem } from '../../host/doctor/kvm-probe.ts';
import { kvmUsable, openEngine, parseEngineChoice, resolveEngine } from '../../host/engine/select.ts';

const NO_KVM = { ok: false, why: '/dev/kvm does not exist (no hardware virtualisation here, or the kvm module is not loaded)' };
const KVM = { ok: true, why: '/dev/kvm is usable' };

test('the option wins over FORKLING_ENGINE; auto by default', () => {
  assert.is(parseEngineChoice(undefined, {}), 'auto');
  assert.is(parseEngineChoice(undefined, { FORKLING_ENGINE: 'process' }), 'process');
  assert.is(parseEngineChoice('kvm', { FORKLING_ENGINE: 'process' }), 'kvm');
  assert.is(parseEngineChoice(' Process ', {}), 'process');
});

test('an unknown engine is one clear error naming where it came from', () => {
  for (const [opt, env, from] of [
    ['vm', {}, '--engine'],
    [undefined, { FORKLING_ENGINE: 'docker' }, 'FORKLING_ENGINE'],
  ] as const) {
    try {
      parseEngineChoice(opt, env);
      assert.unreachable('should throw');
    } catch (e) {
      assert.instance(e, UserError);
      assert.match((e as UserError).message, from);
      assert.match((e as UserError).hint ?? '', 'kvm, process or auto');
    }
  }
});

test('auto picks kvm where /dev/kvm is usable, else process, saying why', () => {
  const k = resolveEngine('auto', KVM);
  assert.is(k.name, 'kvm');
  assert.match(k.line, 'auto: /dev/kvm is usable');
  const p = resolveEngine('auto', NO_KVM);
  assert.is(p.name, 'process');
  assert.match(p.line, '/dev/kvm does not exist');
  assert.match(p.line, 'weaker than a VM');
  assert.not.match(p.line, '\n');
});

test('process always states its weaker isolation; kvm asked for but unusable is an error', () => {
  assert.match(resolveEngine('process', KVM).line, 'weaker than a VM');
  assert.throws(() => resolveEngine('kvm', NO_KVM), (e: Error) => e instanceof UserError && /--engine process/.test((e as UserError).hint ?? ''));
});

test('kvmUsable: a missing or inaccessible device is not usable; kvm_pvm is refused unless allowed', () => {
  const dir = mkdtempSync(join(tmpdir(), 'forkling-select-'));
  try {
    assert.is(kvmUsable(join(dir, 'kvm')).ok, false);
    assert.match(kvmUsable(join(dir, 'kvm')).why, 'does not exist');
    const f = join(dir, 'ro');
    writeFileSync(f, '', { mode: 0o400 });
    if (process.getuid?.() !== 0) assert.match(kvmUsable(f).why, 'not readable and writable');
    const marker = join(dir, 'kvm_pvm');
    assert.is(kvmHostProblem(marker), null);
    writeFileSync(marker, '');
    assert.match(kvmHostProblem(marker) ?? '', 'kvm_pvm');
    process.env.FORKLING_ALLOW_PVM = '1';
    assert.is(kvmHostProblem(marker), null);
  } finally {
    delete process.env.FORKLING_ALLOW_PVM;
    rmSync(dir, { recursive: true, force: true });
  }
});

test('openEngine(process) prints the line and gives a working process engine', async () => {
  const lines: string[] = [];
  const engine = await openEngine('process', { log: (l) => lines.push(l) });
  try {
    assert.is(engine.name, 'process');
    assert.is(lines.length, 1);
    assert.match(lines[0]!, /engine process \(chosen explicitly\).*weaker than a VM/);
  } finally {
    await engine.close();
  }
});

test.run();
