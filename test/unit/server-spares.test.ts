// `forkling serve --spares N` (process engine): N forks of each template are
// kept ready, so that a new sandbox is one of them; they are refilled after.
// Seen from outside: the engine's cgroups, one per fork, named by its id.
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { engineDirsOf } from '../../host/engine/process/cgroups.ts';
import { Sandbox } from '../../host/index.ts';
import { pollUntil } from '../../host/util/poll.ts';
import { templateFiles } from '../template-files.ts';
import { serve, serverMode } from './server-harness.ts';

/** The sandbox cgroups (each a sandbox's or a zygote's, z-...) of engine process `pid`. */
const engineCgroups = (pid: number): string[] =>
  engineDirsOf(pid).flatMap((d) => readdirSync(d, { withFileTypes: true }).flatMap((e) => (e.isDirectory() ? [e.name] : [])));
/**
 * Whether the sandbox of cgroup `name` maps its template's pattern (3 template files: the
 * zygote's, its fork server's, the pattern's). The first spares are made before the pattern
 * and replaced once it is there: until then the spares waiting are not the ones handed out.
 */
const mapsPattern = (pid: number, name: string): boolean =>
  engineDirsOf(pid).some((d) => {
    try {
      return templateFiles(Number(readFileSync(join(d, name, 'cgroup.procs'), 'utf8').split('\n')[0])) === 3;
    } catch {
      return false; // (gone meanwhile)
    }
  });

test('serve --spares 2: two forks wait per template; a new sandbox is one of them, and they are refilled', async () => {
  if (serverMode() !== 'cli') return; // (the in-process server runs a helper engine without spares)
  const srv = await serve({ extraArgs: ['--spares', '2'] });
  try {
    assert.ok(await pollUntil(() => /; 2 spare forks per template/.test(srv.log.join('')), 10_000), srv.log.join('')); // (logged after `listening`)
    const pid = srv.proc!.pid!;
    const first = await Sandbox.create({ url: srv.url }); // the default template's zygote starts, then its spares
    const spares = () => engineCgroups(pid).filter((n) => !n.startsWith('z-') && n !== first.id);
    if (!(await pollUntil(() => spares().length === 2 && spares().every((n) => mapsPattern(pid, n)), 20_000))) {
      if (engineCgroups(pid).length === 0) return; // (a host without usable cgroups: nothing to see them by)
      assert.unreachable(`spares (each mapping its pattern?): ${spares().map((n) => `${n} ${mapsPattern(pid, n)}`).join(', ')}`);
    }
    const waiting = spares();
    const second = await Sandbox.create({ url: srv.url });
    assert.ok(waiting.includes(second.id), `${second.id} is one of the spares ${waiting.join(', ')}`);
    assert.is((await second.eval('6 * 7')).value, 42);
    assert.ok(await pollUntil(() => spares().filter((n) => n !== second.id).length === 2, 20_000), `refilled: ${spares().join(', ')} (second ${second.id}, waiting ${waiting.join(', ')})`);
  } finally {
    await srv.stop();
  }
});

test('serve --spares 0: none', async () => {
  if (serverMode() !== 'cli') return;
  const srv = await serve({ extraArgs: ['--spares', '0'] });
  try {
    assert.ok(await pollUntil(() => /; 0 spare forks per template/.test(srv.log.join('')), 10_000), srv.log.join(''));
    const first = await Sandbox.create({ url: srv.url });
    await new Promise((r) => setTimeout(r, 500)); // (a refill would have started by now: it follows the fork at once)
    assert.equal(
      engineCgroups(srv.proc!.pid!).filter((n) => !n.startsWith('z-') && n !== first.id),
      [],
    );
  } finally {
    await srv.stop();
  }
});

test.run();
