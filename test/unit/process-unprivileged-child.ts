// Run by process-engine.test.ts as an unprivileged user: a template, a fork,
// a branch and a cold boot, without root. Prints one JSON line.
import { ProcessEngine } from '../../host/engine/process/engine.ts';

const rootfs = process.env.FORKLING_TEST_ROOTFS!;
const engine = new ProcessEngine({ rootfsOf: async () => rootfs, warn: () => {} });
try {
  await engine.createTemplate({ name: 'unpriv', image: 'default', warmup: 'import os\nW = "warm"' });
  const [a] = await engine.fork('unpriv', 1);
  const fork = (await a!.agent.eval('(W, os.getuid(), os.getpid(), open("/proc/self/uid_map").read().split())')).value;
  const [b] = await engine.branch(a!, 1);
  await a!.agent.eval('W = "changed"');
  const branch = (await b!.agent.eval('(W, os.getpid())')).value;
  const booted = await engine.boot({ image: 'default' });
  const boot = (await booted.agent.eval('import os\nos.getpid()')).value;
  console.log(JSON.stringify({ uid: process.getuid?.(), fork, branch, boot }));
} finally {
  await engine.close();
}
