// The guest kernel command line for the stock distribution kernel in a
// forkling microVM. Each option is here for a reason:
//   console=ttyS0          the 8250 at 0x3f8 is the console (lines reach the host)
//   reboot=k panic=-1      a panic or a reboot pulses the i8042 reset line at
//                          once; the VMM ends the VM there (a reset we asked for
//                          through the agent is the clean poweroff)
//   acpi=off               no ACPI tables: CPUs and the IOAPIC come from the MP
//                          table, PCI from configuration mechanism #1
//   nokaslr                the kernel lands where the loader put it (also keeps
//                          part 2's snapshots reproducible)
//   no_timer_check         skip the IOAPIC timer check, unreliable when nested
//   mitigations=off        the VM is the security boundary, not the guest kernel
//   i8042.*                no PS/2 mouse/mux probing; no keyboard commands to wait on
//   8250.nr_uarts=1        probe one UART, not four
//   init_on_free=1         freed guest pages are zero (part 2 writes them as holes);
//                          the price: the kernel zeroes all of RAM as it frees it
//                          at boot, so every guest page is touched (host memory =
//                          guest RAM); `initOnFree: false` drops it
//   random.trust_cpu=on    RDRAND seeds the CRNG at once where the CPU has it
//   quiet                  the console costs a VM exit per byte
export const BASE_CMDLINE = [
  'console=ttyS0',
  'reboot=k',
  'panic=-1',
  'acpi=off',
  'nokaslr',
  'no_timer_check',
  'mitigations=off',
  'i8042.noaux',
  'i8042.nomux',
  'i8042.dumbkbd',
  '8250.nr_uarts=1',
  'random.trust_cpu=on',
];

/** Base options, then the image's (e.g. rdinit=/init forkling.port=1024), then extras. */
export function kernelCmdline(
  imageArgs: readonly string[],
  opts: { verbose?: boolean; initOnFree?: boolean; extra?: readonly string[] } = {},
): string {
  const args = [
    ...BASE_CMDLINE,
    ...(opts.initOnFree === false ? [] : ['init_on_free=1']),
    ...(opts.verbose ? [] : ['quiet']),
    ...imageArgs,
    ...(opts.extra ?? []),
  ];
  for (const a of args) {
    if (!/^[\x21-\x7e]+$/.test(a)) throw new Error(`kernel argument ${JSON.stringify(a)} is empty or has spaces/control characters`);
  }
  return args.join(' ');
}
