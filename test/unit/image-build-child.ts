// Helper of image.test.ts (not a test): builds one image in a process of its
// own, so the test can run it without network (unshare -n). Prints the
// manifest on stdout and progress on stderr.
import { buildImage } from '../../host/images.ts';

const [agentPath, name, ...extras] = process.argv.slice(2);
if (!agentPath || !name) throw new Error('usage: image-build-child.ts <agent.py> <name> [extra...]');
const m = await buildImage({ name, extras, agentPath, onProgress: (step, detail) => process.stderr.write(`${step}: ${detail}\n`) });
process.stdout.write(JSON.stringify(m));
