// The KVM engine loads a template once and keeps it while its files stay the
// same (host/engine/kvm/template.ts templateIdentity): a template made again
// under the same name, or a file of it changed in place (cut short, say), is
// other files, so the next fork loads and checks it again. No KVM needed:
// the identity is the files' own.
import { mkdirSync, mkdtempSync, renameSync, rmSync, truncateSync, utimesSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { INFO_FILE, MEMORY_FILE, STATE_FILE, templateDir, templateIdentity } from '../../host/engine/kvm/template.ts';

const home = mkdtempSync(join(tmpdir(), 'forkling-identity-'));
const savedHome = process.env.FORKLING_HOME;
process.env.FORKLING_HOME = home;
const NAME = 'ident';

function make(dir: string, memory: number): void {
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, INFO_FILE), '{}');
  writeFileSync(join(dir, STATE_FILE), 'state');
  writeFileSync(join(dir, MEMORY_FILE), Buffer.alloc(memory));
}

test.after(() => {
  rmSync(home, { recursive: true, force: true });
  if (savedHome === undefined) delete process.env.FORKLING_HOME;
  else process.env.FORKLING_HOME = savedHome;
});

test('a template is the same files until one is replaced or changed in place', () => {
  make(templateDir(NAME), 8192);
  const first = templateIdentity(NAME);
  assert.is(templateIdentity(NAME), first, 'unchanged: the same');
  truncateSync(join(templateDir(NAME), MEMORY_FILE), 4096);
  const cut = templateIdentity(NAME);
  assert.is.not(cut, first, 'its memory file cut short');
  // The same size and bytes again, written later: another mtime.
  writeFileSync(join(templateDir(NAME), STATE_FILE), 'state');
  utimesSync(join(templateDir(NAME), STATE_FILE), new Date(), new Date(Date.now() + 5000));
  assert.is.not(templateIdentity(NAME), cut, 'its state file written again');
  const before = templateIdentity(NAME);
  // Made again under the same name: a new directory renamed into place, as the store does.
  const staged = `${templateDir(NAME)}.new`;
  make(staged, 4096);
  rmSync(templateDir(NAME), { recursive: true });
  renameSync(staged, templateDir(NAME));
  assert.is.not(templateIdentity(NAME), before, 'made again');
  rmSync(templateDir(NAME), { recursive: true });
  assert.throws(() => templateIdentity(NAME), /ENOENT/);
});

test.run();
