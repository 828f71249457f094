// What a shelved VM keeps of its KVM VM (vm.h Shelve, Unshelve; vm_shelf.cc).
#pragma once
#include <cstdint>
#include <vector>

#include "vmm/snapshot/kvm_state.h"

namespace forkling::vmm::snapshot {

struct Shelf {
  VmKvmState vm;
  std::vector<VcpuState> vcpus;
  std::vector<uint64_t> tsc_khz;  // per vCPU (0: unknown, its TSC is left as it was)
  uint64_t at_ns = 0;             // CLOCK_BOOTTIME when shelved: kvm-clock counts from it
};

}  // namespace forkling::vmm::snapshot
