// Guest-physical memory layout of a forkling VM (x86-64). Low addresses follow
// the Linux boot protocol and what Firecracker does; the 3-4 GiB hole holds the
// PCI MMIO window, the IOAPIC, the LAPIC and KVM's TSS/identity-map pages.
#pragma once
#include <cstdint>

namespace forkling::vmm::layout {

inline constexpr uint64_t kGdt = 0x500;           // boot GDT (5 entries)
inline constexpr uint64_t kIdt = 0x520;           // empty boot IDT
inline constexpr uint64_t kBootParams = 0x7000;   // the "zero page"
inline constexpr uint64_t kBootStack = 0x8ff0;    // rsp at the 64-bit entry
inline constexpr uint64_t kPml4 = 0x9000;         // identity page tables:
inline constexpr uint64_t kPdpt = 0xa000;         //   PML4 -> PDPT -> 4 PDs of 2 MiB pages
inline constexpr uint64_t kPd = 0xb000;           //   = the first 4 GiB (0xb000..0xefff)
inline constexpr uint64_t kIdentityMapped = 4ull << 30;
inline constexpr uint64_t kCmdline = 0x20000;     // kernel command line
inline constexpr uint64_t kCmdlineMax = 0x10000;
inline constexpr uint64_t kEbda = 0x9fc00;        // MP table lives here (Linux scans 639 KiB)
inline constexpr uint64_t kLowMemEnd = 0xa0000;   // end of conventional memory (e820)
inline constexpr uint64_t kHighMem = 0x100000;    // 1 MiB: bzImage protected-mode code

// The most RAM a VM may have (CheckVmSize), and so any file that describes one.
inline constexpr uint64_t kMaxRam = 1ull << 40;

// RAM below the hole: up to 3 GiB; the rest goes above 4 GiB.
inline constexpr uint64_t kPciHole = 0xc0000000ull;
inline constexpr uint64_t kHighRam = 1ull << 32;
// PCI BARs are allocated from here (below the IOAPIC).
inline constexpr uint64_t kPciMmioBase = 0xd0000000ull;
inline constexpr uint64_t kPciMmioEnd = 0xfe000000ull;
inline constexpr uint64_t kIoapic = 0xfec00000ull;
inline constexpr uint64_t kLapic = 0xfee00000ull;
inline constexpr uint64_t kIdentityMapAddr = 0xfffbc000ull;  // KVM_SET_IDENTITY_MAP_ADDR (1 page)
inline constexpr uint64_t kTssAddr = 0xfffbd000ull;          // KVM_SET_TSS_ADDR (3 pages)

// Legacy IRQs (ISA) on the in-kernel PIC/IOAPIC.
inline constexpr uint32_t kUartIrq = 4;
inline constexpr uint16_t kUartPort = 0x3f8;

}  // namespace forkling::vmm::layout
