// `forkling doctor`: one line per check (pass/warn/fail) and how to fix what fails.
import { type Check, runChecks } from '../doctor/checks.ts';
import { UserError } from '../errors.ts';
import { parseCommandLine } from './args.ts';

const MARK: Record<Check['status'], string> = { pass: 'pass', warn: 'warn', fail: 'FAIL' };

export async function doctorCommand(argv: string[]): Promise<number> {
  const { values } = parseCommandLine(
    { args: argv, options: { json: { type: 'boolean' }, engine: { type: 'string' }, help: { type: 'boolean', short: 'h' } } },
    'usage: forkling doctor [--json] [--engine kvm|process|auto]',
  );
  if (values.help) {
    console.log('usage: forkling doctor [--json] [--engine kvm|process|auto]\n\nChecks this host for both engines; exits non-zero when the chosen engine cannot run.');
    return 0;
  }
  const wanted = values.engine ?? process.env.FORKLING_ENGINE ?? 'auto';
  if (!['kvm', 'process', 'auto'].includes(wanted)) {
    throw new UserError(`unknown engine ${JSON.stringify(wanted)}`, 'use --engine kvm, process or auto');
  }
  const report = await runChecks(wanted as 'kvm' | 'process' | 'auto');
  if (values.json) {
    console.log(JSON.stringify(report, null, 2));
  } else {
    for (const c of report.checks) {
      console.log(`${MARK[c.status]}  ${c.name.padEnd(22)} ${c.detail}`);
      if (c.fix && c.status !== 'pass') console.log(`      ${''.padEnd(22)} fix: ${c.fix}`);
    }
    console.log(
      report.ok
        ? `\nengine: ${report.engine} (${report.engineReason})`
        : `\nengine ${report.engine} cannot run here: ${report.engineReason}`,
    );
  }
  return report.ok ? 0 : 1;
}
