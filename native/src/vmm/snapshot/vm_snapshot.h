// Templates and branches of whole VMs: the glue between vm.h and the
// snapshot formats.
//
// Template directory: state.bin (state file: META, MEMF, KVMV, VCPU per vCPU,
// UART, I842, RTC_, and per virtio device PCIC (config space) and VPCI
// (transport), VSCK, VRNG) and memory.bin (sparse memory file; MEMF records
// its size, data pages and checksum).
//
// Branch: the pages the source's RAM mapping owns privately (written since it
// was restored: pagemap) are copied into a diff layer (an unlinked file in
// `dir`) while it runs, with KVM dirty logging on; then it is paused, the
// pages the guest wrote since (dirty log) and those virtio-rng may have
// written are copied again, its state saved, and it resumes. Children map
// the template's memory file, the source's layers and the new one.
#pragma once
#include <vector>
#include <memory>
#include <string>

#include "vmm/snapshot/memory_file.h"
#include "vmm/vm.h"

namespace forkling::vmm::snapshot {

inline constexpr uint32_t kSnapshotVersion = 1;
// A chain longer than this is collapsed into one layer at branch time.
inline constexpr size_t kMaxChainDepth = 16;

struct TemplateWritten {
  MemoryFileInfo memory;
  uint64_t state_bytes = 0;
  double save_ms = 0, memory_ms = 0;
};
// The VM must be paused (vm.Pause()). Writes dir/state.bin and dir/memory.bin.
TemplateWritten WriteTemplate(Vm& vm, const std::string& dir);

// Reads and checks dir/state.bin, verifies dir/memory.bin (once per process
// per file), returns what a child VM is restored from. Throws CorruptError
// ("<what> is corrupt: ...").
std::shared_ptr<RestoreSpec> LoadTemplate(const std::string& dir, const std::string& what);

struct BranchResult {
  std::shared_ptr<RestoreSpec> spec;
  uint64_t pause_ns = 0;     // vCPUs stopped until they run again
  // Where the pause went: stopping the vCPUs, saving state, finding the
  // written pages (pagemap), writing them to the diff.
  uint64_t stop_ns = 0, save_ns = 0, scan_ns = 0, copy_ns = 0;
  // Pre-copy while the source ran: time and pages; pages copied again in the pause.
  uint64_t precopy_ns = 0, precopy_pages = 0, recopied_pages = 0;
  uint64_t private_pages = 0;
  uint64_t diff_pages = 0;   // with gap filling
  uint64_t runs = 0;
  size_t depth = 0;          // layers in the child's chain
  bool collapsed = false;
};
// The VM must be running and restored from a snapshot (origin() set).
BranchResult Branch(Vm& vm, const std::string& dir);

struct MemoryUsage {
  uint64_t guest_private_bytes = 0;  // anonymous copies in the guest RAM mapping
  uint64_t guest_shared_bytes = 0;   // present pages shared with the page cache
  uint64_t guest_memfd_bytes = 0;    // a booted VM: pages its memfd holds
  uint64_t guest_pattern_bytes = 0;  // mapped from its pattern (written since or not)
  uint64_t guest_table_bytes = 0;    // the host's page-table pages for the RAM: one per 2 MiB span in use
};
MemoryUsage MeasureGuestMemory(const Vm& vm);

// Guest frame numbers (gpa >> 12) of the pages a restored VM owns privately,
// ascending: what a child has written since its restore (diagnostics).
std::vector<uint64_t> PrivateGuestFrames(const Vm& vm);

}  // namespace forkling::vmm::snapshot
