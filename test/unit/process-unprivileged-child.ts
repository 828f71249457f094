// Run by process-engine.test.ts as an unprivileged user: a template, a fork,
// a branch and a cold boot, without root. Prints one JSON line.
import { ProcessEngine } from '../../host/engine/process/engine.ts';

const rootfs = process.env.FORKLING_TEST_ROOTFS!;
const engine = new ProcessEngine({ rootfsOf: async () => rootfs, warn: () => {} });
try {
  // (with an open file, a pipe and an asyncio loop: each fork gets its own, also without root)
  const warmup = 'import os, asyncio\nW = "warm"\nf = open("/tmp/log", "w+"); f.write("w"); f.flush()\npr, pw = os.pipe(); os.write(pw, b"q")\nloop = asyncio.new_event_loop()';
  await engine.createTemplate({ name: 'unpriv', image: 'default', warmup });
  const [a, a2] = await engine.fork('unpriv', 2);
  const fork = (await a!.agent.eval('(W, os.getuid(), os.getpid(), open("/proc/self/uid_map").read().split())')).value;
  await a!.agent.eval('f.write("A"); f.flush(); os.write(pw, b"A")');
  const own = (await a2!.agent.eval('(open("/tmp/log").read(), os.read(pr, 10).decode(), loop.run_until_complete(asyncio.sleep(0, result="loop")))')).value;
  // new files anywhere in the image's directories (the image's own files belong to the host's root: read-only)
  const write = (
    await a2!.agent.eval(
      'import errno\nopen("/root/note", "w").write("r"); open("/usr/local/new", "w").write("n")\ntry:\n    open("/etc/hostname", "w"); e = None\nexcept OSError as x:\n    e = errno.errorcode[x.errno]\n(open("/root/note").read(), open("/usr/local/new").read(), e)',
    )
  ).value;
  const [b] = await engine.branch(a!, 1);
  await a!.agent.eval('W = "changed"');
  const branch = (await b!.agent.eval('(W, os.getpid())')).value;
  const booted = await engine.boot({ image: 'default' });
  const boot = (await booted.agent.eval('import os\nos.getpid()')).value;
  const [b2] = await engine.branch(a2!, 1);
  const branched = (await b2!.agent.eval('open("/root/note").read() + open("/tmp/b", "w").write("b").__str__()')).value;
  const bootWrite = (await booted.agent.eval('open("/tmp/cold", "w").write("c")')).value;
  const [bb] = await engine.branch(booted, 1);
  const bootBranch = (await bb!.agent.eval('open("/tmp/cold").read() + str(open("/root/bb", "w").write("bb"))')).value;
  // No cgroup2 mount: its cgroup namespace is not the sandbox's own (without root a
  // sandbox's root owns its cgroup files; where cgroup2 lacks nsdelegate it could raise its limits)
  const mountCg =
    'import ctypes, errno, os\nos.makedirs("/tmp/cg", exist_ok=True)\nlibc = ctypes.CDLL(None, use_errno=True)\n' +
    '0 if libc.mount(b"none", b"/tmp/cg", b"cgroup2", 0, None) == 0 else errno.errorcode[ctypes.get_errno()]';
  const cgroup2 = [(await a!.agent.eval(mountCg)).value, (await booted.agent.eval(mountCg)).value, (await bb!.agent.eval(mountCg)).value];
  console.log(JSON.stringify({ uid: process.getuid?.(), fork, own, write, branch, branched, boot, bootWrite, bootBranch, cgroup2 }));
} finally {
  await engine.close();
}
