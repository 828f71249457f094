// Package sources for images: the host's own apt sources, read by the host's
// apt (so signatures are checked with the host's keys and no mirror is named
// here). Package lists live in a private directory of the cache, keyed by the
// sources' contents, so a build never touches the host's apt state and a
// rebuild works offline from the cached lists and .deb files.
import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, readdirSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { basename, join } from 'node:path';
import { UserError } from '../host/errors.ts';
import { runTool, runToolAsync } from '../host/util/exec.ts';

export interface AptContext {
  /** source files given to apt and mmdebstrap (deb822 .sources or one-line .list) */
  sources: string[];
  /** sha256 of the sources' names and contents: the lists directory's name */
  key: string;
  /** private apt lists for these sources */
  listsDir: string;
  /** shared .deb cache (apt checks every cached file against the lists' hashes) */
  debsDir: string;
  /** private dir for apt's own caches and the sources copy */
  stateDir: string;
  /** suite given to mmdebstrap (the host's release codename) */
  suite: string;
  /** host apt settings a chroot's apt must share (proxies), as --aptopt values */
  aptopts: string[];
}

const SOURCES_HINT =
  'check the apt sources (/etc/apt/sources.list.d/*.sources, /etc/apt/sources.list) and the network; run `apt-get update` to see apt\'s own report';

/** The host's enabled apt source files, or the one in $FORKLING_APT_SOURCES. */
export function hostSourceFiles(): string[] {
  const override = process.env.FORKLING_APT_SOURCES;
  if (override) {
    if (!existsSync(override)) throw new UserError(`FORKLING_APT_SOURCES=${override} does not exist`, 'point it at a .sources or .list file');
    return [override];
  }
  const out: string[] = [];
  const main = '/etc/apt/sources.list';
  if (existsSync(main) && /^\s*deb\s/m.test(readFileSync(main, 'utf8'))) out.push(main);
  const dir = '/etc/apt/sources.list.d';
  if (existsSync(dir)) {
    for (const f of readdirSync(dir).sort()) {
      if (f.endsWith('.list') || f.endsWith('.sources')) {
        const p = join(dir, f);
        if (statSync(p).isFile() && readFileSync(p, 'utf8').trim()) out.push(p);
      }
    }
  }
  if (out.length === 0) throw new UserError('this host has no apt sources configured', SOURCES_HINT);
  return out;
}

/** The host's release codename (VERSION_CODENAME in /etc/os-release). */
export function hostSuite(): string {
  const osr = existsSync('/etc/os-release') ? readFileSync('/etc/os-release', 'utf8') : '';
  const m = /^VERSION_CODENAME="?([A-Za-z0-9.-]+)"?$/m.exec(osr);
  if (!m?.[1]) {
    throw new UserError('cannot tell the host release from /etc/os-release (no VERSION_CODENAME)', 'build images on a Debian or Ubuntu host');
  }
  return m[1];
}

/** Proxy settings of the host's apt, which mmdebstrap's apt (rooted in the new tree) would not read. */
function hostProxyOptions(): string[] {
  const r = runTool('apt-config', ['dump'], { hint: 'install apt' }).stdout;
  return r
    .split('\n')
    .filter((l) => /^Acquire::(http|https|ftp|socks)::Proxy(::[^ ]+)? "/.test(l))
    .map((l) => `${l};`);
}

export function aptContext(cacheRoot: string): AptContext {
  const sources = hostSourceFiles();
  const h = createHash('sha256');
  for (const s of sources) h.update(`${basename(s)}\0${readFileSync(s, 'utf8')}\0`);
  const key = h.digest('hex').slice(0, 16);
  const stateDir = join(cacheRoot, 'apt', key);
  const listsDir = join(stateDir, 'lists');
  const debsDir = join(cacheRoot, 'debs');
  mkdirSync(join(listsDir, 'partial'), { recursive: true });
  mkdirSync(debsDir, { recursive: true });
  // A private sources.list.d holding copies, so apt reads exactly these files.
  const parts = join(stateDir, 'sources.list.d');
  mkdirSync(parts, { recursive: true });
  for (const s of sources) {
    const name = basename(s).endsWith('.sources') || basename(s).endsWith('.list') ? basename(s) : `${basename(s)}.list`;
    writeFileSync(join(parts, name), readFileSync(s));
  }
  return { sources, key, listsDir, debsDir, stateDir, suite: hostSuite(), aptopts: hostProxyOptions() };
}

/** -o options that point the host's apt at the private lists and sources. */
function aptOpts(ctx: AptContext): string[] {
  return [
    '-o',
    `Dir::State::Lists=${ctx.listsDir}`,
    '-o',
    `Dir::Cache=${join(ctx.stateDir, 'cache')}`,
    '-o',
    'Dir::Cache::pkgcache=',
    '-o',
    'Dir::Cache::srcpkgcache=',
    '-o',
    'Dir::State::status=/dev/null',
    '-o',
    'Dir::Etc::SourceList=/dev/null',
    '-o',
    `Dir::Etc::SourceParts=${join(ctx.stateDir, 'sources.list.d')}`,
    '-o',
    'Acquire::Languages=none',
  ];
}

const haveLists = (ctx: AptContext): boolean => readdirSync(ctx.listsDir).some((f) => /_Packages(\.[a-z0-9]+)?$/.test(f));

/**
 * Refreshes the private package lists. When the sources cannot be reached but
 * lists from an earlier build exist, goes on with those (offline rebuild) and
 * says so through `note`; otherwise fails with apt's message.
 */
export async function refreshLists(ctx: AptContext, note: (msg: string) => void): Promise<{ offline: boolean }> {
  mkdirSync(join(ctx.stateDir, 'cache', 'archives', 'partial'), { recursive: true });
  try {
    await runToolAsync('apt-get', [...aptOpts(ctx), '--error-on=any', '-q', 'update'], { hint: SOURCES_HINT, env: aptEnv() });
    return { offline: false };
  } catch (e) {
    if (!(e instanceof UserError)) throw e;
    if (haveLists(ctx)) {
      note(`package sources unreachable, using the cached package lists (${e.message.split('\n').at(-1)})`);
      return { offline: true };
    }
    throw new UserError(`cannot read the package sources:\n${e.message.split('\n').slice(1).join('\n')}`, SOURCES_HINT);
  }
}

export const aptEnv = (): NodeJS.ProcessEnv => ({ ...process.env, LC_ALL: 'C.UTF-8', DEBIAN_FRONTEND: 'noninteractive' });

/** A Debian package name, optionally pinned to a version: `name` or `name=version`. */
export const PACKAGE_RE = /^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+~:-]+)?$/;

/**
 * Checks that apt can install each package from the sources (a real package
 * with a candidate version, or the pinned version exists). Throws one error
 * naming every unknown package. Returns name -> version apt would pick.
 */
export function checkPackages(ctx: AptContext, pkgs: string[]): Map<string, string> {
  for (const p of pkgs) {
    if (!PACKAGE_RE.test(p)) {
      throw new UserError(`invalid package name ${JSON.stringify(p)}`, 'use a Debian package name such as python3-numpy (optionally name=version)');
    }
  }
  const names = [...new Set(pkgs.map((p) => p.split('=')[0]!))];
  const out = runTool('apt-cache', [...aptOpts(ctx), 'policy', ...names], { env: aptEnv(), hint: SOURCES_HINT }).stdout;
  const found = new Map<string, { candidate: string; versions: Set<string> }>();
  let cur: { candidate: string; versions: Set<string> } | null = null;
  for (const line of out.split('\n')) {
    const head = /^(\S+):$/.exec(line);
    if (head?.[1]) {
      cur = { candidate: '(none)', versions: new Set() };
      found.set(head[1], cur);
      continue;
    }
    if (!cur) continue;
    const cand = /^ {2}Candidate: (\S+)/.exec(line);
    if (cand?.[1]) cur.candidate = cand[1];
    const ver = /^ (?:\*\*\*| {3}) (\S+) -?\d+$/.exec(line);
    if (ver?.[1]) cur.versions.add(ver[1]);
  }
  const problems: string[] = [];
  const result = new Map<string, string>();
  for (const p of pkgs) {
    const [name, pin] = p.split('=') as [string, string | undefined];
    const f = found.get(name);
    if (!f) problems.push(`${name}: Unable to locate package ${name}`);
    else if (f.candidate === '(none)') problems.push(`${name}: no installable version (a purely virtual or removed package)`);
    else if (pin && !f.versions.has(pin)) problems.push(`${name}: version ${pin} not found (available: ${[...f.versions].join(', ') || 'none'})`);
    else result.set(name, pin ?? f.candidate);
  }
  if (problems.length) {
    throw new UserError(
      `apt cannot install ${problems.length === 1 ? 'this package' : 'these packages'} from the host's sources:\n  ${problems.join('\n  ')}`,
      'check the name with `apt-cache search <word>`; packages come from the host\'s apt sources',
    );
  }
  return result;
}

/** Whether the sources know a package at all (used to decide on merged /usr). */
export function hasPackage(ctx: AptContext, name: string): boolean {
  const out = runTool('apt-cache', [...aptOpts(ctx), 'policy', name], { env: aptEnv() }).stdout;
  return /^ {2}Candidate: (?!\(none\))/m.test(out);
}

/** Newest `Date:` of the lists' Release files: SOURCE_DATE_EPOCH for maintainer scripts (depends only on the inputs). */
export function listsDate(ctx: AptContext): number {
  let newest = 0;
  for (const f of readdirSync(ctx.listsDir)) {
    if (!/_(In)?Release$/.test(f)) continue;
    const m = /^Date: (.+)$/m.exec(readFileSync(join(ctx.listsDir, f), 'utf8'));
    const t = m?.[1] ? Date.parse(m[1]) : Number.NaN;
    if (Number.isFinite(t)) newest = Math.max(newest, Math.floor(t / 1000));
  }
  return newest;
}
