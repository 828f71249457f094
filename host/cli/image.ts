// `forkling image build|ls|inspect|rm`: guest images in the store.
import { UserError } from '../errors.ts';
import { type BuildStep, buildImage, listImages, loadImage, removeImage, verifyImage } from '../images.ts';
import { parseSubcommand } from './args.ts';

const USAGE = `usage:
  forkling image build <name> [--extra <package>]... [--kernel <path>] [--json]
  forkling image ls [--json]
  forkling image inspect <name> [--json] [--verify]
  forkling image rm <name>`;

const HELP = `${USAGE}

build    builds an image from the host's apt sources: python3, python3-msgpack, the agent
         and each --extra package (e.g. --extra python3-numpy); --kernel takes a bzImage
         or vmlinux instead of the distribution's kernel (its drivers must be built in)
ls       lists the images in the store
inspect  shows an image's manifest; --verify checks its files against the recorded sha256
rm       removes an image`;

const mib = (n: number): string => `${(n / 1048576).toFixed(1)} MiB`;

const OPTIONS = {
  extra: { type: 'string', multiple: true },
  kernel: { type: 'string' },
  json: { type: 'boolean' },
  verify: { type: 'boolean' },
  help: { type: 'boolean', short: 'h' },
} as const;

/** Parses the options, refusing those `sub` does not take. */
const parse = (sub: string, argv: string[], allowed: (keyof typeof OPTIONS)[]) => parseSubcommand(`image ${sub}`, argv, OPTIONS, allowed, USAGE);

function oneName(positionals: string[], sub: string): string {
  if (positionals.length !== 1) throw new UserError(`image ${sub} takes exactly one image name`, USAGE);
  return positionals[0]!;
}

/** Progress on a terminal: one line per step on stderr; nothing otherwise. */
function progressPrinter(): ((step: BuildStep, detail: string) => void) | undefined {
  if (!process.stderr.isTTY) return undefined;
  const t0 = Date.now();
  return (step, detail) => {
    const t = ((Date.now() - t0) / 1000).toFixed(1).padStart(5);
    process.stderr.write(`${t}s  ${step === 'note' ? 'note' : step.padEnd(8)}  ${detail}\n`);
  };
}

export async function imageCommand(argv: string[]): Promise<number> {
  const [sub, ...rest] = argv;
  if (!sub || sub === '--help' || sub === '-h' || sub === 'help') {
    console.log(HELP);
    return sub ? 0 : 2;
  }
  switch (sub) {
    case 'build': {
      const { values, positionals } = parse(sub, rest, ['extra', 'kernel', 'json']);
      if (values.help) {
        console.log(HELP);
        return 0;
      }
      const name = oneName(positionals, 'build');
      const m = await buildImage({
        name,
        extras: values.extra ?? [],
        kernel: values.kernel,
        onProgress: values.json ? undefined : progressPrinter(),
      });
      if (values.json) console.log(JSON.stringify(m, null, 2));
      else {
        console.log(
          `image ${m.name}: initramfs ${mib(m.sizes.compressed)} (${mib(m.sizes.unpacked)} unpacked), kernel ${m.kernel.release ?? m.kernel.format}, ` +
            `${m.packages.installed.length} packages, ${m.modules.length} modules, built in ${m.buildSeconds} s`,
        );
      }
      return 0;
    }
    case 'ls': {
      const { values, positionals } = parse(sub, rest, ['json']);
      if (values.help) {
        console.log(HELP);
        return 0;
      }
      if (positionals.length) throw new UserError('image ls takes no arguments', USAGE);
      const all = listImages();
      if (values.json) {
        console.log(JSON.stringify(all.map((e) => (e.image ? { name: e.name, manifest: e.image.manifest } : e)), null, 2));
        return 0;
      }
      if (all.length === 0) {
        console.log('no images (forkling image build default builds the default one)');
        return 0;
      }
      console.log(`${'NAME'.padEnd(20)} ${'INITRAMFS'.padStart(11)} ${'UNPACKED'.padStart(11)}  ${'KERNEL'.padEnd(18)} ${'EXTRAS'.padEnd(24)} CREATED`);
      for (const e of all) {
        if (!e.image) {
          console.log(`${e.name.padEnd(20)} damaged: ${e.error}`);
          continue;
        }
        const m = e.image.manifest;
        console.log(
          `${m.name.padEnd(20)} ${mib(m.sizes.compressed).padStart(11)} ${mib(m.sizes.unpacked).padStart(11)}  ${(m.kernel.release ?? m.kernel.format).padEnd(18)} ${(m.packages.extras.join(',') || '-').padEnd(24)} ${m.createdAt}`,
        );
      }
      return 0;
    }
    case 'inspect': {
      const { values, positionals } = parse(sub, rest, ['json', 'verify']);
      if (values.help) {
        console.log(HELP);
        return 0;
      }
      const img = loadImage(oneName(positionals, 'inspect'));
      const problems = values.verify ? await verifyImage(img.name) : [];
      if (values.json) {
        console.log(JSON.stringify(values.verify ? { ...img.manifest, verified: problems.length === 0, problems } : img.manifest, null, 2));
      } else {
        const m = img.manifest;
        const lines = [
          `name        ${m.name}`,
          `directory   ${img.dir}`,
          `created     ${m.createdAt} (${m.buildSeconds} s)`,
          `kernel      ${m.kernel.format} ${m.kernel.release ?? '(release unknown)'}  ${m.kernel.source}`,
          `initramfs   ${m.initramfs.file}  ${mib(m.sizes.compressed)} ${m.initramfs.compression}, ${mib(m.sizes.unpacked)} in ${m.initramfs.entries} entries`,
          `cmdline     ${m.cmdline.join(' ')}`,
          `agent       ${m.agent.version ?? '(no __version__)'}  sha256 ${m.agent.sha256.slice(0, 16)}`,
          `modules     ${m.modules.map((x) => x.name).join(' ') || '(none)'}${m.modulesNote ? `  (${m.modulesNote})` : ''}`,
          `packages    ${m.packages.installed.length} installed; asked for ${m.packages.requested.join(' ')}`,
          ...Object.entries(m.files).map(([f, d]) => `file        ${f}  ${d.size} bytes  sha256 ${d.sha256}`),
        ];
        if (values.verify) lines.push(problems.length ? `verify      FAILED\n  ${problems.join('\n  ')}` : 'verify      ok: every file matches its sha256');
        console.log(lines.join('\n'));
      }
      return problems.length ? 1 : 0;
    }
    case 'rm': {
      const { values, positionals } = parse(sub, rest, []);
      if (values.help) {
        console.log(HELP);
        return 0;
      }
      const name = oneName(positionals, 'rm');
      removeImage(name);
      console.log(`removed image ${name}`);
      return 0;
    }
    default:
      throw new UserError(`unknown image command ${JSON.stringify(sub)}`, USAGE);
  }
}
