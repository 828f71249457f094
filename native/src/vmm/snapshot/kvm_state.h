// Capture and restore of KVM's own state: per vCPU (registers, special
// registers, FPU/XSAVE, XCRs, MSRs, LAPIC, pending events, MP state, debug
// registers) and per VM (PIC master and slave, IOAPIC, PIT, kvm-clock).
// Works on plain file descriptors; serialises into state-file sections.
//
// Restore order for a vCPU (after KVM_SET_CPUID2, which the VM set-up does):
//   sregs  - CR0/CR4/EFER decide which XSAVE components and MSRs are valid
//   XCRs   - XCR0 before XSAVE, or KVM refuses components XCR0 does not enable
//   XSAVE  (or FPU when the kernel has no XSAVE)
//   regs
//   LAPIC  - before MSRs: TSC_DEADLINE is only accepted in TSC-deadline mode
//   MSRs   - includes the TSC and the kvm-clock MSRs (system time, wall clock)
//   MP state, vcpu events (pending exceptions/NMIs/SIPI), debug registers.
#pragma once
#include <linux/kvm.h>

#include <cstdint>
#include <string>
#include <vector>

#include "vmm/snapshot/state_file.h"

namespace forkling::vmm::snapshot {

inline constexpr uint32_t kTagVcpu = Tag("VCPU");
inline constexpr uint32_t kTagVm = Tag("KVMV");

struct VcpuState {
  kvm_regs regs;
  kvm_sregs sregs;
  std::vector<uint8_t> xsave;  // KVM_GET_XSAVE2/XSAVE area (>= 4096 bytes); empty: `fpu` is used
  kvm_fpu fpu;
  kvm_xcrs xcrs;
  bool have_xcrs = false;
  std::vector<kvm_msr_entry> msrs;
  kvm_lapic_state lapic;
  kvm_vcpu_events events;
  kvm_mp_state mp_state;
  kvm_debugregs debugregs;
};

struct VmKvmState {
  kvm_irqchip pic_master;
  kvm_irqchip pic_slave;
  kvm_irqchip ioapic;
  kvm_pit_state2 pit;
  kvm_clock_data clock;
};

// The MSRs worth saving on this host: KVM_GET_MSR_INDEX_LIST, filtered to
// those KVM_GET_MSRS reads on `vcpu_fd` (some listed ones depend on CPUID).
// Computed once per process (the answer depends on the host, not the VM).
const std::vector<uint32_t>& SaveableMsrs(int kvm_fd, int vcpu_fd);

// The vCPU must not be in KVM_RUN. Throws std::system_error naming the ioctl.
VcpuState CaptureVcpu(int kvm_fd, int vm_fd, int vcpu_fd);
void RestoreVcpu(int vm_fd, int vcpu_fd, const VcpuState& s);

VmKvmState CaptureVm(int vm_fd);
// Restores PIC/IOAPIC/PIT and sets kvm-clock to the saved value, so the
// guest's monotonic clock continues from the moment of the snapshot (its wall
// clock is set by the agent's restore call).
void RestoreVm(int vm_fd, const VmKvmState& s);

// KVM's state of a VM and of each of its vCPUs, as a template's state file
// (and a shelved VM: vm_shelf.cc) keeps them: a KVMV section and a VCPU
// section per vCPU (index: the vCPU's number).
struct KvmState {
  VmKvmState vm;
  std::vector<VcpuState> vcpus;
};
void CaptureKvmSections(int kvm_fd, int vm_fd, const std::vector<int>& vcpu_fds, std::vector<Section>& out);
// Throws CorruptError naming `what` for a section missing or corrupt.
KvmState DecodeKvmSections(const std::vector<Section>& sections, uint32_t vcpus, const std::string& what);

Section EncodeVcpu(uint32_t index, const VcpuState& s);
VcpuState DecodeVcpu(const Section& s, const std::string& what);
Section EncodeVm(const VmKvmState& s);
VmKvmState DecodeVm(const Section& s, const std::string& what);

}  // namespace forkling::vmm::snapshot
