// Is /dev/kvm here and good enough for the KVM engine? Opens it through the
// addon and asks for the API version and every capability the engine uses.
import { accessSync, constants, existsSync } from 'node:fs';
import { isErrnoError, native } from '../native.ts';
import type { Check } from './checks.ts';

/** Capabilities the KVM engine relies on (numbers from linux/kvm.h). */
const NEEDED_CAPS: [string, number][] = [
  ['IRQCHIP', 0],
  ['USER_MEMORY', 3],
  ['SET_TSS_ADDR', 4],
  ['EXT_CPUID', 7],
  ['MP_STATE', 14],
  ['IRQ_ROUTING', 25],
  ['IRQFD', 32],
  ['PIT2', 33],
  ['SET_IDENTITY_MAP_ADDR', 37],
  ['ADJUST_CLOCK', 39],
  ['VCPU_EVENTS', 41],
  ['DEBUGREGS', 50],
  ['XSAVE', 55],
  ['XCRS', 56],
  ['SIGNAL_MSI', 77],
  ['IMMEDIATE_EXIT', 136],
];

export interface KvmProbe {
  usable: boolean;
  reason: string;
  checks: Check[];
}

/**
 * Why this host's /dev/kvm cannot boot a stock kernel, or null. kvm_pvm (a
 * software nested-virtualization KVM with shadow paging, as on some cloud
 * sandboxes) runs a distribution kernel's early boot mostly by emulation:
 * minutes to the first message, then an emulation failure (measured: the
 * decompressor alone > 45 s, then XRSTOR and CMPXCHG16B fail to emulate).
 * FORKLING_ALLOW_PVM=1 tries anyway.
 */
export function kvmHostProblem(pvmMarker = '/sys/module/kvm_pvm'): string | null {
  if (existsSync(pvmMarker) && process.env.FORKLING_ALLOW_PVM !== '1') {
    return "this host's /dev/kvm is kvm_pvm (software nested virtualization), which cannot run the distribution kernel in reasonable time";
  }
  return null;
}

/** `device` is a parameter for tests; the engine always uses /dev/kvm. */
export function probeKvm(device = '/dev/kvm'): KvmProbe {
  const fixAccess = 'add this user to the kvm group (usermod -aG kvm $USER, then log in again) or run as root';
  if (!existsSync(device)) {
    const reason = `${device} does not exist`;
    return {
      usable: false,
      reason,
      checks: [
        {
          name: '/dev/kvm',
          status: 'warn',
          detail: `${reason}: no hardware virtualisation here (the process engine is used instead)`,
          fix: 'on bare metal: enable VT-x/AMD-V in firmware and load kvm_intel or kvm_amd; on a cloud VM: pick an instance type with nested virtualisation',
        },
      ],
    };
  }
  try {
    accessSync(device, constants.R_OK | constants.W_OK);
  } catch {
    const reason = `${device} is not readable and writable by this user`;
    return { usable: false, reason, checks: [{ name: '/dev/kvm', status: 'fail', detail: reason, fix: fixAccess }] };
  }
  let n: ReturnType<typeof native>;
  try {
    n = native();
  } catch (e) {
    const reason = `the native addon cannot be loaded: ${(e as Error).message}`;
    return { usable: false, reason, checks: [{ name: '/dev/kvm', status: 'fail', detail: reason, fix: 'npm run build:native' }] };
  }
  let fd = -1;
  try {
    fd = n.openKvm();
  } catch (e) {
    const reason = `cannot open /dev/kvm: ${isErrnoError(e) ? e.code : (e as Error).message}`;
    return { usable: false, reason, checks: [{ name: '/dev/kvm', status: 'fail', detail: reason, fix: fixAccess }] };
  }
  try {
    const checks: Check[] = [{ name: '/dev/kvm', status: 'pass', detail: 'present and usable' }];
    const api = n.kvmGetApiVersion(fd);
    if (api !== 12) {
      const reason = `KVM API version ${api}, expected 12`;
      checks.push({ name: 'KVM API', status: 'fail', detail: reason, fix: 'use a Linux kernel from 2.6.22 on with the stable KVM API' });
      return { usable: false, reason, checks };
    }
    const missing = NEEDED_CAPS.filter(([, cap]) => n.kvmCheckExtension(fd, cap) <= 0).map(([name]) => name);
    checks.push(
      missing.length === 0
        ? { name: 'KVM API', status: 'pass', detail: `version 12, all ${NEEDED_CAPS.length} needed capabilities` }
        : {
            name: 'KVM API',
            status: 'fail',
            detail: `version 12, missing capabilities: ${missing.join(', ')}`,
            fix: 'use a newer host kernel (5.10+) with KVM built in',
          },
    );
    if (missing.length) return { usable: false, reason: `KVM lacks ${missing.join(', ')}`, checks };
    const problem = kvmHostProblem();
    if (problem) {
      checks.push({ name: 'KVM flavour', status: 'warn', detail: problem, fix: 'use the process engine here, or a host with hardware KVM; the KVM tests run in the lab (npm run test:kvm)' });
      return { usable: false, reason: problem, checks };
    }
    return { usable: true, reason: '/dev/kvm is usable', checks };
  } finally {
    n.close(fd);
  }
}
