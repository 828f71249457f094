// `forkling mcp`: a Model Context Protocol server on stdin/stdout, for agent
// clients that start their tools as processes. Its sandboxes live in this
// process (the same engine and SandboxManager as `forkling serve`) and end
// with it: when the client closes stdin, or on SIGTERM/SIGINT. stdout carries
// only protocol messages; logs go to stderr.
import { MAX_TIMEOUT_MS } from '../../protocol/server-ops.ts';
import { openEngine } from '../engine/select.ts';
import { UserError } from '../errors.ts';
import { MAX_LINE_BYTES, McpServer } from '../mcp/server.ts';
import { SandboxManager } from '../server/manager.ts';
import { packageVersion } from '../version.ts';
import { DEFAULT_SPARES, intOption, parseCommandLine, sparesOption } from './args.ts';

const USAGE = `usage: forkling mcp [options]
  --engine kvm|process|auto sandbox engine (default auto, or $FORKLING_ENGINE)
  --max-sandboxes <n>       most live sandboxes (default 32)
  --default-timeout-ms <n>  a sandbox's lifetime when the model sets none (default 3600000 = 1 hour)
  --spares <n>              process engine: forks kept ready per template, so that sandbox_create needs no
                            fork of its own (default $FORKLING_PROCESS_SPARES, else ${DEFAULT_SPARES}; 0: none)
Speaks MCP (JSON-RPC 2.0, one message a line) on stdin/stdout; its tools make
sandboxes and run Python, commands and file transfers in them. Every sandbox
ends when stdin closes or on SIGTERM/SIGINT. E.g. for a client's config:
  {"command": "forkling", "args": ["mcp"]}`;

export async function mcpCommand(argv: string[]): Promise<number> {
  const { values } = parseCommandLine(
    {
      args: argv,
      options: {
        engine: { type: 'string' },
        'max-sandboxes': { type: 'string' },
        'default-timeout-ms': { type: 'string' },
        spares: { type: 'string' },
        help: { type: 'boolean', short: 'h' },
      },
    },
    'run `forkling mcp --help` for the options',
  );
  if (values.help) {
    console.log(USAGE);
    return 0;
  }
  const hint = USAGE.split('\n')[0] as string;
  const maxSandboxes = intOption('max-sandboxes', values['max-sandboxes'], 32, 1, hint);
  const defaultTimeoutMs = intOption('default-timeout-ms', values['default-timeout-ms'], 3_600_000, 1, hint);
  if (defaultTimeoutMs > MAX_TIMEOUT_MS) throw new UserError(`--default-timeout-ms ${defaultTimeoutMs} is more than 7 days`, `give at most ${MAX_TIMEOUT_MS}`);

  const log = (line: string) => process.stderr.write(`forkling mcp: ${line.replace(/^forkling: /, '')}\n`);
  const spares = sparesOption(values.spares, hint);
  const engine = await openEngine(values.engine, { log, ...(spares !== undefined ? { processSpares: spares } : {}) });
  const manager = new SandboxManager({ engine, maxSandboxes, defaultTimeoutMs, maxTimeoutMs: MAX_TIMEOUT_MS, log });
  // The template most calls use, made ready while the client starts up: its first sandbox_create then only forks.
  let ended = false;
  void engine.prepare('default').catch((e) => ended || log(`the template default is not ready: ${(e as Error).message}`));
  const server = new McpServer({ manager, version: packageVersion(), log, send: (line) => process.stdout.write(`${line}\n`) });

  await new Promise<void>((resolve) => {
    const end = (why: string) => {
      if (ended) return;
      ended = true;
      process.stdin.destroy(); // (no more lines: the process ends once the sandboxes are killed)
      log(`${why}: killing ${manager.size} sandboxes`);
      resolve();
    };
    process.stdout.on('error', () => end('stdout closed')); // (the client went away: EPIPE)
    process.stdin.on('error', (e) => end(`stdin: ${e.message}`));
    process.once('SIGTERM', () => end('SIGTERM'));
    process.once('SIGINT', () => end('SIGINT'));
    readLines(process.stdin, (line) => server.take(line), (head, tail) => server.tooLong(head, tail), () => end('stdin closed'));
    log(`ready (engine ${engine.name}; max ${maxSandboxes} sandboxes, each ${defaultTimeoutMs} ms unless the model says otherwise)`);
  });
  // (together: an engine closed ends a fork still being made, so its call answers at once)
  await Promise.all([server.close(), manager.close()]);
  return 0;
}

/** Bytes kept of each end of a line too long to take (where its id is). */
const EDGE_BYTES = 256;

/**
 * Calls `line` for each line of `input` (the last one also without a newline);
 * a line longer than MAX_LINE_BYTES is skipped (never buffered whole) and
 * reported through `tooLong` with its first and last bytes.
 */
function readLines(input: NodeJS.ReadableStream, line: (l: string) => void, tooLong: (head: string, tail: string) => void, end: () => void): void {
  let parts: Buffer[] = [];
  let size = 0;
  let head: Buffer | null = null; // set while a line is skipped
  let tail = Buffer.alloc(0);
  const finish = () => {
    if (head) tooLong(head.toString('utf8'), tail.toString('utf8'));
    else if (size) line(Buffer.concat(parts).toString('utf8'));
    parts = [];
    size = 0;
    head = null;
    tail = Buffer.alloc(0);
  };
  input.on('data', (chunk: Buffer) => {
    for (let at = 0; at < chunk.length; ) {
      const nl = chunk.indexOf(0x0a, at);
      const piece = chunk.subarray(at, nl < 0 ? chunk.length : nl);
      at = nl < 0 ? chunk.length : nl + 1;
      size += piece.length;
      if (!head && size > MAX_LINE_BYTES) {
        head = Buffer.from(Buffer.concat([...parts, piece]).subarray(0, EDGE_BYTES)); // (a copy: the rest is let go)
        parts = [];
      }
      if (head) tail = Buffer.concat([tail, piece]).subarray(-EDGE_BYTES);
      else parts.push(piece);
      if (nl >= 0) finish();
    }
  });
  input.on('end', () => {
    finish();
    end();
  });
}
