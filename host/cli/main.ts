// `forkling <command> [...]`: dispatches to one module per command group.
// Modules load lazily so `forkling doctor` does not pay for the server.
import { UserError } from '../errors.ts';

type Command = (argv: string[]) => Promise<number>;

interface Entry {
  usage: string;
  summary: string;
  load: () => Promise<Command>;
}

const COMMANDS: Record<string, Entry> = {
  doctor: {
    usage: 'doctor [--json] [--engine kvm|process|auto]',
    summary: 'check this host: KVM, kernel, cgroups, namespaces, store, lab tools',
    load: async () => (await import('./doctor.ts')).doctorCommand,
  },
  image: {
    usage: 'image build|ls|inspect|rm ...',
    summary: 'build and manage guest images (kernel + initramfs from apt)',
    load: async () => (await import('./image.ts')).imageCommand,
  },
  run: {
    usage: 'run <image> [--eval code | --exec cmd] [--json]',
    summary: 'cold-boot one microVM from an image, run, power off',
    load: async () => (await import('./run.ts')).runCommand,
  },
  template: {
    usage: 'template create|ls|rm ...',
    summary: 'warm templates: booted, warmed-up sandboxes frozen to disk',
    load: async () => (await import('./template.ts')).templateCommand,
  },
  fork: {
    usage: 'fork [<template>] [-n N] [--eval code | --exec cmd] [--json]',
    summary: 'fork N children from a template and print their answers',
    load: async () => (await import('./fork.ts')).forkCommand,
  },
  serve: {
    usage: 'serve [--listen host:port] [--token-file f] [--engine e]',
    summary: 'the WebSocket + REST service for SDKs and agent frameworks',
    load: async () => (await import('./serve.ts')).serveCommand,
  },
  mcp: {
    usage: 'mcp [--engine e] [--max-sandboxes n]',
    summary: 'an MCP server on stdio: sandbox tools for agent clients',
    load: async () => (await import('./mcp.ts')).mcpCommand,
  },
};

function help(): string {
  const lines = ['forkling: fork warm sandboxes for AI agents in milliseconds', '', 'usage: forkling <command> [options]', ''];
  for (const e of Object.values(COMMANDS)) lines.push(`  forkling ${e.usage.padEnd(58)} ${e.summary}`);
  lines.push('', 'Run `forkling <command> --help` for the options of one command.');
  return lines.join('\n');
}

/** Prints a people-facing error and returns its exit code; anything else is a bug and keeps its stack. */
export function reportError(e: unknown): number {
  if (e instanceof UserError) {
    console.error(`forkling: ${e.message}`);
    if (e.hint) console.error(`  fix: ${e.hint}`);
    return e.exitCode;
  }
  console.error(e instanceof Error ? (e.stack ?? e.message) : String(e));
  return 70;
}

export async function main(argv: string[]): Promise<number> {
  const [name, ...rest] = argv;
  if (!name || name === 'help' || name === '--help' || name === '-h') {
    console.log(help());
    return name ? 0 : 2;
  }
  if (name === '--version' || name === 'version') {
    console.log((await import('../version.ts')).packageVersion());
    return 0;
  }
  const entry = COMMANDS[name];
  if (!entry) {
    console.error(`forkling: unknown command ${JSON.stringify(name)}\n  fix: run \`forkling help\` for the list of commands`);
    return 2;
  }
  try {
    return await (await entry.load())(rest);
  } catch (e) {
    return reportError(e);
  }
}
