// A SIGBUS guard for guest RAM. A restored VM's RAM maps files (a template's
// memory file, diff layers): when one is cut short or cannot be read (an I/O
// error), the host's own reads of guest RAM (device models, the vsock loop,
// snapshots) take SIGBUS, which would end the host process. Registered ranges
// are guarded instead: at the first such fault the handler maps anonymous
// zero memory over the whole range (one mapping, whatever the guest touches
// next), marks it lost and returns, so the access completes reading zeros,
// as from a hostile guest. The VM's owner sees lost() and stops that VM.
// A fault outside every range goes to the handler that was there before.
//
// The guest's own accesses never raise SIGBUS: KVM_RUN fails with EFAULT.
#pragma once
#include <atomic>
#include <cstdint>

namespace forkling::vmm::ram_guard {

// Guards [host, host + size); returns a slot, or -1 when every slot is taken
// (the range then goes unguarded). Installs the handler at the first call.
int Register(uint8_t* host, uint64_t size);
// Stops guarding a slot (before its range is unmapped). -1 is ignored.
void Unregister(int slot);
// The slot's flag, set once a fault in its range has been absorbed; stays
// valid (and reads 0 again) after Unregister. Null for slot -1.
const std::atomic<uint32_t>* LostFlag(int slot);

}  // namespace forkling::vmm::ram_guard
