// Run by process-lifetime.test.ts: an engine with a zygote, two forks, a
// branch and a cold-booted sandbox, then it prints their pids and the engine's directories, and waits
// to be killed. With FORKLING_TEST_MODE=end: a cold-booted sandbox, killed;
// the engine closed; then it prints "ended" and leaves Node to exit by itself.
import { ProcessEngine } from '../../host/engine/process/engine.ts';

const engine = new ProcessEngine({ warn: () => {} });
if (process.env.FORKLING_TEST_MODE === 'end') {
  const box = await engine.boot({ image: 'default' });
  await box.kill(); // (with no zygote, nothing else holds the event loop meanwhile)
  await engine.close();
  console.log('ended');
} else {
  await engine.createTemplate({ name: process.env.FORKLING_TEST_TEMPLATE!, image: 'default' });
  const kids = await engine.fork(process.env.FORKLING_TEST_TEMPLATE!, 2);
  const [b] = await engine.branch(kids[0]!, 1);
  // A cold-booted sandbox whose code defeats its agent's lifeline watch (the thread's os._exit does nothing).
  const cold = await engine.boot({ image: 'default' });
  const patched = await cold.agent.eval('import os\nos._exit = lambda *a: None\n1');
  if (patched.value !== 1) throw new Error(`patching the cold sandbox failed: ${patched.repr}`);
  const pids = [engine.zygotePid(process.env.FORKLING_TEST_TEMPLATE!)!, ...[...kids, b!, cold].map((s) => (s as unknown as { hostPid: number }).hostPid)];
  const cgroups = [...kids, b!].flatMap((s) => (s as unknown as { cgroup: { dirs: string[] } | null }).cgroup?.dirs ?? []);
  console.log(JSON.stringify({ pids, cgroups }));
  setInterval(() => {}, 1 << 30);
}
