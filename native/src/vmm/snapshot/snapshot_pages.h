// What a restored VM's RAM holds at a page where the VM has no copy of its
// own: the topmost diff layer that has the page, else the template's memory
// file (a hole there is zeros). Reclaim compares private pages with it, and
// packing (packed_pages.h) keeps a page's differences from it.
#pragma once
#include <cstdint>

#include "vmm/vm.h"

namespace forkling::vmm::snapshot {

class SnapshotPages {
 public:
  // The very memory file the VM maps (spec.memory_fd), not whatever its path names now.
  explicit SnapshotPages(const RestoreSpec& spec);
  ~SnapshotPages();
  SnapshotPages(const SnapshotPages&) = delete;
  SnapshotPages& operator=(const SnapshotPages&) = delete;

  // Copies the page into buf (4096 bytes) and returns true, or returns false
  // for a hole of the memory file (zeros; read without making a page-cache
  // page). Throws std::system_error when a file cannot be read.
  bool Read(uint64_t page, uint8_t* buf) const;

 private:
  const RestoreSpec& spec_;
  int fd_ = -1;
};

}  // namespace forkling::vmm::snapshot
