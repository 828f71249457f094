// Images in the store, for engines and the CLI: find one, build `default` on
// first use, list, verify, remove. Building itself lives in images/build.ts.
import { existsSync, readdirSync, readFileSync, renameSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { agentDiffers, type BuildOptions, buildImage, DEFAULT_AGENT, imageDir, imagesDir, readAgent, sha256File } from '../images/build.ts';
import { type ImageManifest, parseManifest } from '../images/manifest.ts';
import { checkName, UserError } from './errors.ts';

export type { BuildOptions, BuildStep } from '../images/build.ts';
export type { ImageManifest } from '../images/manifest.ts';

export const DEFAULT_IMAGE = 'default';

export interface ImageInfo {
  name: string;
  /** <store>/images/<name> */
  dir: string;
  /** kernel to boot (bzImage or vmlinux, see manifest.kernel.format) */
  kernel: string;
  /** compressed newc initramfs */
  initramfs: string;
  /** the unpacked tree: the process engine's root */
  rootfs: string;
  manifest: ImageManifest;
}

export function imageExists(name: string): boolean {
  return existsSync(join(imageDir(name), 'manifest.json'));
}

/** The built image `name`; a UserError saying how to build it when it is missing or damaged. */
export function loadImage(name: string): ImageInfo {
  const dir = imageDir(name);
  const mf = join(dir, 'manifest.json');
  if (!existsSync(mf)) {
    throw new UserError(
      `image ${JSON.stringify(name)} does not exist`,
      name === DEFAULT_IMAGE ? 'run `forkling image build default`' : `run \`forkling image build ${name}\` (see \`forkling image ls\`)`,
      3,
    );
  }
  const manifest = parseManifest(readFileSync(mf, 'utf8'), mf);
  const info: ImageInfo = {
    name,
    dir,
    kernel: join(dir, manifest.kernel.file),
    initramfs: join(dir, manifest.initramfs.file),
    rootfs: join(dir, manifest.rootfs.dir),
    manifest,
  };
  for (const p of [info.kernel, info.initramfs, info.rootfs]) {
    if (!existsSync(p)) throw new UserError(`image ${name} is incomplete: ${p} is missing`, `rebuild it: forkling image build ${name}`);
  }
  return info;
}

const inFlight = new Map<string, Promise<ImageInfo>>();

/** True when `default` must be (re)built: missing, or holding another agent than guest-agent/ (the image bakes it in). */
function defaultNeedsBuild(): boolean {
  if (!imageExists(DEFAULT_IMAGE)) return true;
  try {
    return agentDiffers(loadImage(DEFAULT_IMAGE).manifest, readAgent(DEFAULT_AGENT));
  } catch {
    return false; // a damaged image: loadImage reports it to the caller
  }
}

/**
 * The image `name`, built first when it is `default` and missing or built
 * with another agent than this checkout's (concurrent callers, in this
 * process or others, share one build). Other names must have been built with
 * `forkling image build`. `progress` gets a line when a build starts, at each
 * of its steps and when it is done: a first use takes a minute or more, which
 * without a word looks like a hang.
 */
export function ensureImage(name = DEFAULT_IMAGE, opts: { progress?: (line: string) => void } = {}): Promise<ImageInfo> {
  if (name !== DEFAULT_IMAGE || !defaultNeedsBuild()) return Promise.resolve().then(() => loadImage(name));
  let p = inFlight.get(name);
  if (!p) {
    const say = opts.progress;
    const t0 = performance.now();
    say?.(`forkling: building image ${name} (first use, or guest-agent/ changed since it was built): a minute or more`);
    p = buildImage({ name, ifMissing: true, ...(say ? { onProgress: buildSteps(name, say) } : {}) })
      .then(() => {
        say?.(`forkling: image ${name} ready in ${((performance.now() - t0) / 1000).toFixed(0)} s`);
        return loadImage(name);
      })
      .finally(() => inFlight.delete(name));
    inFlight.set(name, p);
  }
  return p;
}

/** A build's progress as lines: each note, and each step once (unpack reports every package). */
function buildSteps(name: string, say: (line: string) => void): NonNullable<BuildOptions['onProgress']> {
  let last = '';
  return (step, detail) => {
    if (step !== 'note' && step === last) return;
    last = step;
    say(`forkling: image ${name}: ${step === 'note' ? '' : `${step}: `}${detail}`);
  };
}

export { buildImage };

/** Every image in the store, by name; damaged ones are reported, not thrown. */
export function listImages(): { name: string; image?: ImageInfo; error?: string }[] {
  const dir = imagesDir();
  if (!existsSync(dir)) return [];
  return readdirSync(dir, { withFileTypes: true })
    .filter((d) => d.isDirectory() && !d.name.startsWith('.'))
    .map((d) => d.name)
    .sort()
    .map((name) => {
      try {
        return { name, image: loadImage(name) };
      } catch (e) {
        return { name, error: e instanceof UserError ? e.message : String(e) };
      }
    });
}

/** Compares the image's files with the sha256 sums its manifest records; returns what differs. */
export async function verifyImage(name: string): Promise<string[]> {
  const img = loadImage(name);
  const problems: string[] = [];
  for (const [file, want] of Object.entries(img.manifest.files)) {
    const p = join(img.dir, file);
    if (!existsSync(p)) {
      problems.push(`${file}: missing`);
      continue;
    }
    const got = await sha256File(p);
    if (got.sha256 !== want.sha256 || got.size !== want.size) problems.push(`${file}: sha256 ${got.sha256} (${got.size} bytes), manifest says ${want.sha256} (${want.size} bytes)`);
  }
  return problems;
}

/** Removes image `name` (atomically: renamed away first, then deleted). */
export function removeImage(name: string): void {
  checkName('image', name);
  const dir = imageDir(name);
  if (!existsSync(dir)) throw new UserError(`image ${JSON.stringify(name)} does not exist`, 'see `forkling image ls`', 3);
  const trash = join(imagesDir(), `.rm-${name}-${process.pid}-${Date.now()}`);
  renameSync(dir, trash);
  rmSync(trash, { recursive: true, force: true });
}
