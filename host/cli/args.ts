// Command-line parsing shared by the CLI commands: node's parseArgs, with a
// malformed command line (unknown option, missing value, stray argument)
// turned into a UserError whose hint tells how to call the command.
import { type ParseArgsConfig, parseArgs } from 'node:util';
import { UserError } from '../errors.ts';

type ParseArgsOptions = NonNullable<ParseArgsConfig['options']>;

/** parseArgs(config); what it refuses becomes a UserError with `hint`. */
export function parseCommandLine<T extends ParseArgsConfig>(config: T, hint: string): ReturnType<typeof parseArgs<T>> {
  try {
    return parseArgs(config);
  } catch (e) {
    throw new UserError((e as Error).message, hint);
  }
}

/**
 * For a command whose subcommands share one option table: parses `argv`
 * (positionals allowed) and refuses any option but --help that `allowed`
 * does not list, as "<command> does not take --<option>".
 */
export function parseSubcommand<O extends ParseArgsOptions>(command: string, argv: string[], options: O, allowed: readonly (keyof O)[], usage: string) {
  const r = parseCommandLine({ args: argv, options, allowPositionals: true }, usage);
  for (const k of Object.keys(r.values)) {
    if (k !== 'help' && !allowed.includes(k)) throw new UserError(`${command} does not take --${k}`, usage);
  }
  return r;
}

/** An integer option (`--name <n>`): `dflt` when absent, else a whole number ≥ `min`, or a UserError with `hint`. */
export function intOption(name: string, v: string | undefined, dflt: number, min: number, hint: string): number {
  if (v === undefined) return dflt;
  if (!/^\d+$/.test(v) || Number(v) < min || !Number.isSafeInteger(Number(v))) {
    throw new UserError(`--${name} must be an integer ≥ ${min}, got ${JSON.stringify(v)}`, hint);
  }
  return Number(v);
}

/** Spare forks per template that a long-lived process-engine host (serve, mcp) keeps ready (a new sandbox answers its first eval in ~5 ms instead of ~10-20 here: README). */
export const DEFAULT_SPARES = 4;

/**
 * `--spares <n>` of serve and mcp: the flag, else undefined where
 * $FORKLING_PROCESS_SPARES is set (the engine reads it), else DEFAULT_SPARES.
 * (The engine's own default is none: a one-shot `forkling fork` would only waste them.)
 */
export function sparesOption(v: string | undefined, hint: string): number | undefined {
  if (v === undefined && process.env.FORKLING_PROCESS_SPARES) return undefined;
  return intOption('spares', v, DEFAULT_SPARES, 0, hint);
}
