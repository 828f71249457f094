// BRANCH of a running KVM sandbox: the source is paused, its state saved and
// the pages it wrote since it was restored (its private pages) copied into a
// diff layer; then it resumes, and n children start from the template's
// memory file with the source's layers and the new one mapped over it. Cost
// scales with the pages written, not with RAM; branches of branches stack
// layers (collapsed into one past a depth of 16), never copying the base.
import { existsSync, mkdirSync } from 'node:fs';
import { storePath } from '../../store.ts';
import { startChildren } from './fork.ts';
import type { NativeBranch } from './native-vm.ts';
import type { KvmSandbox } from './vm.ts';

/**
 * Where diff layers live, as unlinked files that vanish with the last VM
 * mapping them: $FORKLING_DIFF_DIR, else /dev/shm (no disk writeback for
 * pages that only live as long as the sandboxes), else the store.
 */
export function diffDir(): string {
  const env = process.env.FORKLING_DIFF_DIR;
  if (env) return env;
  if (existsSync('/dev/shm')) return '/dev/shm';
  const d = storePath('run');
  mkdirSync(d, { recursive: true });
  return d;
}

export type BranchFigures = Omit<NativeBranch, 'snapshot'>;

export async function branchChildren(source: KvmSandbox, n: number, readyTimeoutMs?: number): Promise<{ children: KvmSandbox[]; figures: BranchFigures }> {
  const { snapshot, ...figures } = source.nativeVm().branch(diffDir());
  const children = await startChildren(snapshot, n, { prefix: 'br', readyTimeoutMs });
  return { children, figures };
}
