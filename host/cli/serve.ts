// `forkling serve`: the daemon agent frameworks talk to (WebSocket /v1/ws,
// REST /v1/, /healthz, /metrics). The first line on stdout, once the socket
// is bound, is exactly `listening <url>` (e.g. `listening http://127.0.0.1:4780`);
// tools and tests read the port from it. Logs go to stderr.
import { DEFAULT_MAX_IN_FLIGHT, MAX_TIMEOUT_MS } from '../../protocol/server-ops.ts';
import { defaultReclaimIdleMs, MAX_SLEEP_AFTER_MS } from '../engine/kvm/sleep-after.ts';
import { openEngine } from '../engine/select.ts';
import { UserError } from '../errors.ts';
import { callAgentClient } from '../server/agent-bridge.ts';
import { TokenAuth } from '../server/auth.ts';
import { createContext } from '../server/context.ts';
import { DEFAULT_LISTEN, isLoopback, parseListen } from '../server/listen.ts';
import { SandboxManager } from '../server/manager.ts';
import { ForklingServer } from '../server/server.ts';
import { ServerMetrics } from '../server/telemetry.ts';
import { DEFAULT_SPARES, intOption, parseCommandLine, sparesOption } from './args.ts';

const USAGE = `usage: forkling serve [options]

  --listen <host:port>      where to listen (default ${DEFAULT_LISTEN}; port 0 picks a free one)
  --token-file <path>       bearer tokens, one a line; required to listen on anything but loopback
  --engine kvm|process|auto sandbox engine (default auto, or $FORKLING_ENGINE)
  --max-sandboxes <n>       most live sandboxes (default 100)
  --max-memory-mib <n>      refuse new sandboxes while all of them use more private memory (default: no limit)
  --min-free-mib <n>        refuse new sandboxes while the host has less available memory (default 256)
  --default-timeout-ms <n>  sandbox timeout when a client sets none (default 300000 = 5 minutes)
  --max-timeout-ms <n>      longest timeout a client may set (default 86400000 = 24 hours; at most 604800000 = 7 days)
  --max-in-flight <n>       open requests per WebSocket connection (default ${DEFAULT_MAX_IN_FLIGHT})
  --spares <n>              process engine: forks kept ready per template, so that a new sandbox needs no
                            fork of its own (default $FORKLING_PROCESS_SPARES, else ${DEFAULT_SPARES}; 0: none);
                            each holds an idle sandbox's memory (~0.4 MiB once idle 2-5 s) and counts in no limit
  --sleep-after-ms <n>      kvm engine: a sandbox idle this long, with nothing left running in it, sleeps: its
                            memory is packed away and its KVM VM closed (~70-90 KiB left of it) until its next
                            request, which wakes it first (default $FORKLING_KVM_SLEEP_AFTER_MS, else 1000; 0:
                            never: each holds 1.8 MiB or more and answers at once). A sandbox that gave back little
                            waits twice as long the next time, up to 60 s or this. A template's first children
                            wait this long before they build its pattern. The process engine gives memory back after
                            2-5 s idle by itself
  --max-unsent-mib <n>      most output held for clients that read slower than their sandboxes write, all
                            of them together (default 1024); past it, those holding the most are cut off
                            (so is a client that takes none of 64 KiB or more for 60 s)
  --drain-ms <n>            on SIGTERM, how long open requests may still finish (default 10000)
  --tls-cert <file> --tls-key <file>   serve HTTPS/WSS

Prints \`listening <url>\` as its first line on stdout. SIGTERM or SIGINT drains and kills every sandbox.`;

const positiveInt = (name: string, v: string | undefined, dflt: number, min = 1) => intOption(name, v, dflt, min, USAGE.split('\n')[0] as string);

export async function serveCommand(argv: string[]): Promise<number> {
  const { values }: { values: Record<string, string | boolean | undefined> } = parseCommandLine(
    {
      args: argv,
      options: {
        listen: { type: 'string' },
        'token-file': { type: 'string' },
        engine: { type: 'string' },
        'max-sandboxes': { type: 'string' },
        'max-memory-mib': { type: 'string' },
        'min-free-mib': { type: 'string' },
        'default-timeout-ms': { type: 'string' },
        'max-timeout-ms': { type: 'string' },
        'max-in-flight': { type: 'string' },
        spares: { type: 'string' },
        'sleep-after-ms': { type: 'string' },
        'max-unsent-mib': { type: 'string' },
        'drain-ms': { type: 'string' },
        'tls-cert': { type: 'string' },
        'tls-key': { type: 'string' },
        help: { type: 'boolean', short: 'h' },
      },
    },
    'run `forkling serve --help` for the options',
  );
  if (values.help) {
    console.log(USAGE);
    return 0;
  }
  const str = (k: string) => values[k] as string | undefined;
  const listen = parseListen(str('listen') ?? DEFAULT_LISTEN);
  const tokenFile = str('token-file');
  if (!tokenFile && !isLoopback(listen.host)) {
    throw new UserError(
      `refusing to listen on ${listen.host} without a token: anyone who can reach it could run code`,
      'pass --token-file <path> (one random token a line, chmod 600), or listen on 127.0.0.1',
    );
  }
  const certFile = str('tls-cert');
  const keyFile = str('tls-key');
  if (Boolean(certFile) !== Boolean(keyFile)) {
    throw new UserError('--tls-cert and --tls-key go together', 'give both (PEM files), or neither for plain HTTP');
  }
  const maxSandboxes = positiveInt('max-sandboxes', str('max-sandboxes'), 100);
  const maxMemoryMiB = positiveInt('max-memory-mib', str('max-memory-mib'), 0, 0);
  const minFreeMiB = positiveInt('min-free-mib', str('min-free-mib'), 256, 0);
  const defaultTimeoutMs = positiveInt('default-timeout-ms', str('default-timeout-ms'), 300_000);
  const maxTimeoutMs = positiveInt('max-timeout-ms', str('max-timeout-ms'), 86_400_000);
  if (maxTimeoutMs > MAX_TIMEOUT_MS) {
    throw new UserError(`--max-timeout-ms is above ${MAX_TIMEOUT_MS} (7 days), the longest a sandbox may live`, `use at most --max-timeout-ms ${MAX_TIMEOUT_MS}`);
  }
  if (defaultTimeoutMs > maxTimeoutMs) {
    throw new UserError('--default-timeout-ms is above --max-timeout-ms', 'lower the default or raise the maximum');
  }
  const maxInFlight = positiveInt('max-in-flight', str('max-in-flight'), DEFAULT_MAX_IN_FLIGHT);
  const drainMs = positiveInt('drain-ms', str('drain-ms'), 10_000, 0);
  const maxUnsentMiB = positiveInt('max-unsent-mib', str('max-unsent-mib'), 1024);
  if (maxUnsentMiB > 2 ** 30) throw new UserError(`--max-unsent-mib ${maxUnsentMiB} is more than any host holds`, 'give MiB, e.g. 1024');
  const sparesEnv = process.env.FORKLING_PROCESS_SPARES || undefined;
  const spares = sparesOption(str('spares'), USAGE.split('\n')[0] as string);
  const sleepAfterMs = str('sleep-after-ms') === undefined ? undefined : positiveInt('sleep-after-ms', str('sleep-after-ms'), 0, 0);
  if (sleepAfterMs !== undefined && sleepAfterMs > MAX_SLEEP_AFTER_MS) {
    throw new UserError(`--sleep-after-ms ${sleepAfterMs} is more than a day`, `give at most ${MAX_SLEEP_AFTER_MS}, or 0 for never`);
  }
  const auth = tokenFile ? await TokenAuth.fromFile(tokenFile) : null;

  // (the engine's lines start with "forkling: " of their own)
  const log = (line: string) => process.stderr.write(`forkling serve: ${line.replace(/^forkling: /, '')}\n`);
  const engine = await openEngine(str('engine'), {
    log,
    ...(spares !== undefined ? { processSpares: spares } : {}),
    ...(sleepAfterMs !== undefined ? { kvmSleepAfterMs: sleepAfterMs } : {}),
  });
  const metrics = new ServerMetrics();
  const manager = new SandboxManager({
    engine,
    maxSandboxes,
    maxMemoryMiB,
    minFreeMiB,
    defaultTimeoutMs,
    maxTimeoutMs,
    metrics,
    log,
  });
  const ctx = createContext({ manager, metrics, maxInFlight, callAgent: callAgentClient, log, maxUnsentBytes: maxUnsentMiB * 2 ** 20 });
  let server: ForklingServer;
  try {
    server = new ForklingServer({ ctx, auth, ...(certFile && keyFile ? { tls: { certFile, keyFile } } : {}) });
  } catch (e) {
    await engine.close();
    throw new UserError(`cannot load the TLS certificate or key: ${(e as Error).message}`, 'give PEM files');
  }
  let addr: { url: string };
  try {
    addr = await server.listen(listen.host, listen.port);
  } catch (e) {
    await manager.close();
    const code = (e as NodeJS.ErrnoException).code;
    throw new UserError(
      `cannot listen on ${listen.host}:${listen.port}: ${code ?? (e as Error).message}`,
      code === 'EADDRINUSE' ? 'another process uses that port: pick another with --listen' : undefined,
    );
  }
  // Handlers before `listening`: a SIGTERM sent as soon as that line is read drains, not kills.
  const stopped = new Promise<void>((resolve) => {
    let stopping = false;
    const stop = (sig: string) => {
      if (stopping) {
        log(`${sig} again: exiting without waiting`);
        process.exit(1);
      }
      stopping = true;
      log(`${sig}: draining (up to ${drainMs} ms), then killing ${manager.size} sandboxes`);
      server.shutdown(drainMs).then(
        () => resolve(),
        (e) => {
          log(`shutdown: ${(e as Error).message}`);
          resolve();
        },
      );
    };
    process.on('SIGTERM', () => stop('SIGTERM'));
    process.on('SIGINT', () => stop('SIGINT'));
  });
  process.stdout.write(`listening ${addr.url}\n`);
  log(
    `engine ${engine.name}; auth ${auth ? 'bearer token' : 'none (loopback only)'}; ` +
      `max ${maxSandboxes} sandboxes; default timeout ${defaultTimeoutMs} ms` +
      (engine.name === 'process' ? `; ${spares ?? `$FORKLING_PROCESS_SPARES (${sparesEnv})`} spare forks per template` : '') +
      (engine.name === 'process' && sleepAfterMs !== undefined ? '; --sleep-after-ms is for the kvm engine: ignored' : '') +
      (engine.name === 'kvm' ? `; idle sandboxes sleep after ${sleepAfterMs ?? defaultReclaimIdleMs()} ms (0: never)` : ''),
  );

  await stopped;
  log('stopped');
  return 0;
}
