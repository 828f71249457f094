// `forkling run <image> [--eval <code>] [--exec <command>] [--memory <MiB>]
// [--vcpus <n>] [--json] [--console]`: boots the image to a ready agent (it
// answered hello), runs the code or command, powers the sandbox off cleanly
// and prints the result.
import type { ExitInfo, Sandbox } from '../engine/engine.ts';
import { KvmSandbox } from '../engine/kvm/vm.ts';
import { openEngine } from '../engine/select.ts';
import { UserError } from '../errors.ts';
import { parseCommandLine } from './args.ts';

const USAGE =
  'usage: forkling run <image> [--eval <code>] [--exec <command>] [--memory <MiB>] [--vcpus <n>] [--timeout <s>] [--engine kvm|process|auto] [--json] [--console]';

const HELP = `${USAGE}

Boots <image> (\`default\` is built on first use), waits until its agent answers,
runs Python code (--eval) or a shell command (--exec), powers off and prints the
result. Without --eval/--exec it only boots and powers off (a boot check).

  --memory <MiB>   guest RAM (default 512)
  --vcpus <n>      virtual CPUs (default 1)
  --timeout <s>    limit for the boot to a ready agent (default 120 with the KVM engine, 30 with the process engine)
  --json           one JSON object: result, timings, memory
  --console        show the guest console (all kernel messages) on stderr`;

function positiveInt(name: string, v: string | undefined): number | undefined {
  if (v === undefined) return undefined;
  const n = Number(v);
  if (!Number.isInteger(n) || n <= 0) throw new UserError(`${name} must be a positive whole number, not ${JSON.stringify(v)}`, USAGE);
  return n;
}

/** Clean poweroff through the engine's own path where it has one, else kill. */
async function powerOff(sb: Sandbox): Promise<ExitInfo> {
  if (sb instanceof KvmSandbox) return sb.shutdown();
  await sb.kill();
  return sb.exited;
}

const rssKiB = () => Math.round(process.memoryUsage().rss / 1024);
const dec = new TextDecoder();

export async function runCommand(argv: string[]): Promise<number> {
  const { values, positionals } = parseCommandLine(
    {
      args: argv,
      allowPositionals: true,
      options: {
        eval: { type: 'string' },
        exec: { type: 'string' },
        memory: { type: 'string' },
        vcpus: { type: 'string' },
        timeout: { type: 'string' },
        engine: { type: 'string' },
        json: { type: 'boolean' },
        console: { type: 'boolean' },
        help: { type: 'boolean', short: 'h' },
      },
    },
    USAGE,
  );
  if (values.help) {
    console.log(HELP);
    return 0;
  }
  if (positionals.length !== 1) throw new UserError(positionals.length ? 'give exactly one image' : 'which image? (e.g. default)', USAGE);
  if (values.eval !== undefined && values.exec !== undefined) throw new UserError('--eval and --exec cannot be used together', USAGE);
  const image = positionals[0] as string;
  const memoryMiB = positiveInt('--memory', values.memory);
  const vcpus = positiveInt('--vcpus', values.vcpus);
  const timeoutS = positiveInt('--timeout', values.timeout);
  const json = values.json === true;

  const rssBefore = rssKiB();
  const engine = await openEngine(values.engine);
  let sb: Sandbox | undefined;
  try {
    sb = await engine.boot({
      image,
      ...(memoryMiB !== undefined ? { memoryMiB } : {}),
      ...(vcpus !== undefined ? { vcpus } : {}),
      ...(timeoutS !== undefined ? { readyTimeoutMs: timeoutS * 1000 } : {}),
      ...(values.console ? { onConsole: (l: string) => process.stderr.write(`[console] ${l}\n`), verbose: true } : {}),
    });
    const bootMs = sb.timings.readyAt - sb.timings.startedAt;
    if (!json) console.error(`forkling: ${image} ready in ${bootMs.toFixed(0)} ms (${sb.engine})`);

    let result: Record<string, unknown> = {};
    let code = 0;
    if (values.eval !== undefined) {
      const r = await sb.agent.eval(values.eval, json ? {} : { onStdout: (s) => process.stdout.write(s), onStderr: (s) => process.stderr.write(s) });
      result = { kind: 'eval', value: r.value, repr: r.repr, type: r.type, stdout: r.stdout, stderr: r.stderr, exception: r.exception ?? null };
      if (r.exception) {
        code = 1;
        if (!json) process.stderr.write(r.exception.traceback || `${r.exception.type}: ${r.exception.message}\n`);
      } else if (!json && r.type !== 'NoneType') {
        console.log(r.repr);
      }
    } else if (values.exec !== undefined) {
      const r = await sb.agent.exec(values.exec, json ? {} : { onStdout: (b) => process.stdout.write(b), onStderr: (b) => process.stderr.write(b) });
      result = { kind: 'exec', exitCode: r.exitCode, signal: r.signal, stdout: dec.decode(r.stdout), stderr: dec.decode(r.stderr) };
      code = r.exitCode ?? 128;
    }
    const stats = await sb.stats();
    const exit = await powerOff(sb);
    const rssAfter = rssKiB();
    if (json) {
      console.log(
        JSON.stringify({
          engine: sb.engine,
          image,
          bootMs: Math.round(bootMs),
          result,
          exit,
          memory: { sandboxPrivateKiB: stats.privateKiB, hostRssBeforeKiB: rssBefore, hostRssAfterKiB: rssAfter },
          counters: stats.counters,
        }),
      );
    }
    return code;
  } finally {
    if (sb) await sb.kill();
    await engine.close();
  }
}
