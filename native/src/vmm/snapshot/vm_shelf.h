// What a shelved VM keeps of its KVM VM (vm.h Shelve, Unshelve; vm_shelf.cc).
#pragma once
#include <cstdint>
#include <vector>

namespace forkling::vmm::snapshot {

struct Shelf {
  // KVM's state of the VM and of each vCPU, as a template's state file holds
  // it (kvm_state.h sections in a state_file.h container), its zeros
  // squeezed out (zero_runs.h): ~10 KiB a vCPU as structs, mostly zeros.
  std::vector<uint8_t> state;
  std::vector<uint64_t> tsc_khz;  // per vCPU (0: unknown, its TSC is left as it was)
  uint64_t at_ns = 0;             // CLOCK_BOOTTIME when shelved: kvm-clock counts from it
};

}  // namespace forkling::vmm::snapshot
