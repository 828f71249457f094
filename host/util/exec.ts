// Runs external tools (apt, dpkg-deb, qemu) with clear errors when they fail.
import { spawn, spawnSync } from 'node:child_process';
import { UserError } from '../errors.ts';

export interface RunResult {
  stdout: string;
  stderr: string;
  status: number;
}

/** Runs a command to completion; throws a UserError naming the command and its stderr on failure. */
export function runTool(cmd: string, args: string[], opts: { cwd?: string; hint?: string; env?: NodeJS.ProcessEnv } = {}): RunResult {
  const r = spawnSync(cmd, args, { cwd: opts.cwd, env: opts.env, encoding: 'utf8', maxBuffer: 256 * 1024 * 1024 });
  if (r.error) {
    throw new UserError(`cannot run ${cmd}: ${(r.error as NodeJS.ErrnoException).code ?? r.error.message}`, opts.hint);
  }
  if (r.status !== 0) {
    const tail = (r.stderr || r.stdout || '').trim().split('\n').slice(-8).join('\n');
    throw new UserError(`${cmd} ${args.slice(0, 3).join(' ')} failed (exit ${r.status}):\n${tail}`, opts.hint);
  }
  return { stdout: r.stdout, stderr: r.stderr, status: r.status };
}

/** Async variant that streams nothing and resolves with the output; used for long steps. */
export function runToolAsync(cmd: string, args: string[], opts: { cwd?: string; hint?: string; env?: NodeJS.ProcessEnv } = {}): Promise<RunResult> {
  return new Promise((resolve, reject) => {
    const p = spawn(cmd, args, { cwd: opts.cwd, env: opts.env, stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    p.stdout.on('data', (d) => {
      stdout += d;
    });
    p.stderr.on('data', (d) => {
      stderr += d;
    });
    p.on('error', (e: NodeJS.ErrnoException) => reject(new UserError(`cannot run ${cmd}: ${e.code ?? e.message}`, opts.hint)));
    p.on('close', (status) => {
      if (status === 0) return resolve({ stdout, stderr, status });
      const tail = (stderr || stdout).trim().split('\n').slice(-8).join('\n');
      reject(new UserError(`${cmd} ${args.slice(0, 3).join(' ')} failed (exit ${status}):\n${tail}`, opts.hint));
    });
  });
}
