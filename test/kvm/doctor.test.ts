// Where KVM works (in the lab, or a host with /dev/kvm): `forkling doctor
// --engine kvm` says so, with the API version and every needed capability.
import { spawnSync } from 'node:child_process';
import { test } from 'uvu';
import * as assert from 'uvu/assert';

test('doctor --engine kvm: /dev/kvm usable, API 12 with every needed capability', () => {
  const r = spawnSync(process.execPath, ['bin/forkling.mjs', 'doctor', '--json', '--engine', 'kvm'], { encoding: 'utf8' });
  const rep = JSON.parse(r.stdout) as { ok: boolean; engine: string; checks: { name: string; status: string; detail: string }[] };
  const check = (n: string) => rep.checks.find((c) => c.name === n);
  assert.is(check('/dev/kvm')?.status, 'pass', JSON.stringify(check('/dev/kvm')));
  assert.is(check('KVM API')?.status, 'pass', JSON.stringify(check('KVM API')));
  assert.match(check('KVM API')?.detail ?? '', 'version 12');
  assert.is(rep.engine, 'kvm');
  assert.is(rep.ok, true, r.stdout);
  assert.is(r.status, 0);
});

test.run();
