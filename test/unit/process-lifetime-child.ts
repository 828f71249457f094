// Run by process-lifetime.test.ts: an engine with a zygote, two forks and a
// branch, then it prints their pids and the engine's directories, and waits
// to be killed.
import { ProcessEngine } from '../../host/engine/process/engine.ts';

const engine = new ProcessEngine({ warn: () => {} });
await engine.createTemplate({ name: process.env.FORKLING_TEST_TEMPLATE!, image: 'default' });
const kids = await engine.fork(process.env.FORKLING_TEST_TEMPLATE!, 2);
const [b] = await engine.branch(kids[0]!, 1);
const pids = [engine.zygotePid(process.env.FORKLING_TEST_TEMPLATE!)!, ...[...kids, b!].map((s) => (s as unknown as { hostPid: number }).hostPid)];
const cgroups = [...kids, b!].flatMap((s) => (s as unknown as { cgroup: { dirs: string[] } | null }).cgroup?.dirs ?? []);
console.log(JSON.stringify({ pids, cgroups }));
setInterval(() => {}, 1 << 30);
