// Intel MultiProcessor Specification 1.4 table: how a kernel booted with
// acpi=off finds its CPUs (one entry per vCPU, APIC id = index, 0 is the BSP),
// the IOAPIC, and the ISA interrupt wiring (IRQ n -> IOAPIC pin n, matching
// KVM's default GSI routing). Written into the EBDA at 0x9fc00.
#pragma once
#include <cstdint>
#include <string>

#include "vmm/guest_memory.h"

namespace forkling::vmm {

inline constexpr uint32_t kMaxVcpus = 64;

// Bytes the table takes for `vcpus` CPUs (floating pointer included).
uint64_t MpTableSize(uint32_t vcpus);

// The IOAPIC's MP id: after the CPUs.
inline uint8_t MpIoapicId(uint32_t vcpus) { return uint8_t(vcpus); }

bool WriteMpTable(const GuestMemory& mem, uint64_t addr, uint32_t vcpus, std::string* err);

}  // namespace forkling::vmm
