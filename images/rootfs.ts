// The guest's root tree: Debian's mmdebstrap installs the essential set plus
// the requested packages with dpkg and their maintainer scripts (numpy finds
// its BLAS through update-alternatives, which only those scripts set up),
// from the private lists and the .deb cache of apt.ts; then the tree is pruned
// of what a sandbox never reads and its timestamps are made reproducible.
import { spawn } from 'node:child_process';
import { existsSync, lstatSync, lutimesSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { UserError } from '../host/errors.ts';
import { type AptContext, aptEnv, hasPackage } from './apt.ts';
import { walkTree } from './cpio.ts';

const MERGED_USR_HOOKS = '/usr/share/mmdebstrap/hooks/merged-usr';

// Copies the cached lists into the new tree (the update step is skipped: apt
// already refreshed them, or we are offline) and links the cached .debs into
// its archive directory so apt downloads only what is missing.
const SETUP_HOOK = `set -e
mkdir -p "$1/var/lib/apt/lists" "$1/var/cache/apt/archives"
for f in "$FORKLING_LISTS"/*_*; do if [ -f "$f" ]; then cp "$f" "$1/var/lib/apt/lists/"; fi; done
for f in "$FORKLING_DEBS"/*.deb; do if [ -f "$f" ]; then ln "$f" "$1/var/cache/apt/archives/" 2>/dev/null || cp "$f" "$1/var/cache/apt/archives/"; fi; done`;

// Copies newly downloaded .debs back into the cache (atomically, by rename).
const CUSTOMIZE_HOOK = `set -e
for f in "$1"/var/cache/apt/archives/*.deb; do
  if [ -f "$f" ]; then
    b=\${f##*/}; d="$FORKLING_DEBS/$b"
    if ! cmp -s "$f" "$d"; then cp "$f" "$FORKLING_DEBS/.$b.tmp"; mv "$FORKLING_DEBS/.$b.tmp" "$d"; fi
  fi
done`;

// dpkg skips these paths while installing; prune() removes what the
// extraction stage put there before dpkg's own configuration applied.
const DPKG_EXCLUDES = [
  'path-exclude=/usr/share/doc/*',
  'path-exclude=/usr/share/man/*',
  'path-exclude=/usr/share/info/*',
  'path-exclude=/usr/share/locale/*',
  'path-include=/usr/share/locale/locale.alias',
  'path-exclude=/usr/share/lintian/*',
  'path-exclude=/usr/share/linda/*',
];

export interface RootfsOptions {
  ctx: AptContext;
  /** packages to install besides the essential set */
  include: string[];
  /** SOURCE_DATE_EPOCH for maintainer scripts */
  sourceDateEpoch: number;
  /** called with each line mmdebstrap prints (status lines) */
  onLine?: (line: string) => void;
}

/** Runs mmdebstrap into `target` (which must not exist or be empty). */
export async function installTree(target: string, o: RootfsOptions): Promise<void> {
  const args = [
    '--variant=essential',
    `--include=${o.include.join(',')}`,
    '--skip=update',
    '--skip=essential/unlink',
    // The sources are complete files (with their own Signed-By); this check needs gpg and only applies to bare mirror URIs.
    '--skip=check/signed-by',
    `--setup-hook=${SETUP_HOOK}`,
  ];
  // Debian since bookworm (and Ubuntu) ship usr-is-merged: the tree must have merged /usr
  // or init-system-helpers pulls in the usrmerge converter (and perl with it).
  if (hasPackage(o.ctx, 'usr-is-merged')) {
    if (!existsSync(MERGED_USR_HOOKS)) throw new UserError(`${MERGED_USR_HOOKS} is missing`, 'install mmdebstrap 1.0 or newer');
    args.push(`--hook-dir=${MERGED_USR_HOOKS}`);
  }
  args.push(`--customize-hook=${CUSTOMIZE_HOOK}`);
  for (const d of DPKG_EXCLUDES) args.push(`--dpkgopt=${d}`);
  for (const a of o.ctx.aptopts) args.push(`--aptopt=${a}`);
  args.push(o.ctx.suite, target, ...o.ctx.sources);
  await runLogged('mmdebstrap', args, {
    ...aptEnv(),
    SOURCE_DATE_EPOCH: String(o.sourceDateEpoch),
    FORKLING_LISTS: o.ctx.listsDir,
    FORKLING_DEBS: o.ctx.debsDir,
  }, o.onLine);
}

/** Runs a long tool, passing its status lines on; on failure, one error with the end of its output. */
function runLogged(cmd: string, args: string[], env: NodeJS.ProcessEnv, onLine?: (line: string) => void): Promise<void> {
  return new Promise((resolve, reject) => {
    const p = spawn(cmd, args, { env, stdio: ['ignore', 'pipe', 'pipe'] });
    const tail: string[] = [];
    let partial = '';
    const take = (d: Buffer): void => {
      const lines = (partial + d.toString('utf8')).split('\n');
      partial = lines.pop() ?? '';
      for (const l of lines) {
        tail.push(l);
        if (tail.length > 40) tail.shift();
        onLine?.(l);
      }
    };
    p.stdout.on('data', take);
    p.stderr.on('data', take);
    p.on('error', (e: NodeJS.ErrnoException) =>
      reject(new UserError(`cannot run ${cmd}: ${e.code ?? e.message}`, 'install mmdebstrap: apt-get install mmdebstrap')),
    );
    p.on('close', (status, signal) => {
      if (partial) tail.push(partial);
      if (status === 0) return resolve();
      const text = tail.filter((l) => l.trim()).join('\n');
      if (/No space left on device/.test(text)) {
        return reject(new UserError('the disk is full: the image tree did not fit', 'free space where FORKLING_HOME lives (or point FORKLING_HOME elsewhere) and build again'));
      }
      const errors = tail.filter((l) => /^(E:|W:|Err:|dpkg: error|mmdebstrap: )/.test(l) || /Failed to fetch|Unable to|error/i.test(l));
      reject(
        new UserError(
          `${cmd} failed (${signal ? `signal ${signal}` : `exit ${status}`}):\n  ${(errors.length ? errors : tail.slice(-10)).slice(-10).join('\n  ')}`,
          'if a download failed, check the network and the apt sources (run `apt-get update`); a rebuild from the cache needs no network',
        ),
      );
    });
  });
}

/** Removes what a sandbox never needs; each entry is relative to the root. */
export function prune(root: string): void {
  const emptyDirs = ['usr/share/doc', 'usr/share/man', 'usr/share/info', 'usr/share/lintian', 'usr/share/linda', 'var/cache/apt', 'var/lib/apt/lists', 'var/log', 'tmp', 'run'];
  for (const d of emptyDirs) clearDir(join(root, d));
  const locale = join(root, 'usr/share/locale');
  if (existsSync(locale)) for (const f of readdirSync(locale)) if (f !== 'locale.alias') rmSync(join(locale, f), { recursive: true, force: true });
  for (const dir of ['var/cache/debconf', 'var/lib/dpkg']) {
    const p = join(root, dir);
    if (existsSync(p)) for (const f of readdirSync(p)) if (f.endsWith('-old')) rmSync(join(p, f), { force: true });
  }
  // Host-specific files mmdebstrap copies in (they would make the image depend on the build host).
  for (const f of ['etc/resolv.conf', 'etc/hostname', 'var/cache/ldconfig/aux-cache']) rmSync(join(root, f), { force: true });
}

function clearDir(dir: string): void {
  let st: ReturnType<typeof lstatSync>;
  try {
    st = lstatSync(dir);
  } catch {
    return;
  }
  if (!st.isDirectory()) return;
  for (const f of readdirSync(dir)) rmSync(join(dir, f), { recursive: true, force: true });
}

/**
 * Makes timestamps reproducible: files unpacked from packages keep their
 * mtime from the .deb (Python's .pyc files record their source's mtime, so
 * keeping it keeps them valid); everything written during the build (newer
 * than `buildStart`) gets the newest packaged mtime instead, which depends
 * only on the packages. Returns that epoch.
 */
export function normalizeTimes(root: string, buildStartSec: number): number {
  const entries = walkTree(root);
  let epoch = 0;
  for (const e of entries) {
    const t = Math.floor(e.stat.mtimeMs / 1000);
    if (t < buildStartSec && t > epoch) epoch = t;
  }
  for (const e of [...entries, { path: '', stat: lstatSync(root) }]) {
    if (Math.floor(e.stat.mtimeMs / 1000) >= buildStartSec) lutimesSync(join(root, e.path), epoch, epoch);
  }
  return epoch;
}

export interface InstalledPackage {
  name: string;
  version: string;
  arch: string;
}

/** Installed packages, from the tree's dpkg database (read, not executed). */
export function installedPackages(root: string): InstalledPackage[] {
  const status = readFileSync(join(root, 'var/lib/dpkg/status'), 'utf8');
  const out: InstalledPackage[] = [];
  for (const stanza of status.split(/\n\n+/)) {
    const field = (k: string): string | undefined => new RegExp(`^${k}: (.*)$`, 'm').exec(stanza)?.[1];
    const name = field('Package');
    if (name && field('Status') === 'install ok installed') {
      out.push({ name, version: field('Version') ?? '', arch: field('Architecture') ?? '' });
    }
  }
  return out.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
}
