// Reclaim: give back the private pages of a restored VM that hold its
// snapshot's bytes again.
//
// A child's private page is the copy the kernel made when the guest first
// wrote it. Many return to what they were: a refcount up and down, a slab
// object allocated and freed (zeroed again under init_on_free), a stack that
// unwound. Such a page is dropped with MADV_DONTNEED: the MAP_PRIVATE mapping
// then reads the page of the file it copied (memory file, or the diff layer
// mapped there) again, which is byte for byte the same, so the guest cannot
// tell. Pages are compared only with the VM's own snapshot (which every
// child already shares) and its template's pattern (a hidden child's memory,
// made by the host), never with other sandboxes' memory, so unlike KSM this
// opens no timing channel between sandboxes.
//
// A VM with a pattern (pattern.h) first maps the pattern's runs over its
// pages where they hold the pattern's bytes, and compares a page mapped from
// the pattern with the pattern's copy, not the snapshot's.
//
// Candidates are compared while the guest runs; then the vCPUs and the vsock
// loop (the only writers of guest RAM) are held still, the candidates
// compared again and the equal ones dropped, a chunk at a time so that a
// pause stays short.
#pragma once
#include <cstdint>

#include "vmm/vm.h"

namespace forkling::vmm::snapshot {

struct ReclaimResult {
  uint64_t private_pages = 0;  // looked at (private before)
  uint64_t dropped_pages = 0;  // equal to the snapshot's again: now shared
  uint64_t pattern_pages = 0;  // equal to the VM's pattern: now mapped from it (shared)
  // RAM page to go on from when max_pages stopped the call early.
  bool done = true;
  uint64_t next_page = 0;
  uint64_t pause_ns = 0;       // vCPUs held, summed over chunks
  uint64_t longest_pause_ns = 0;
  uint64_t total_ns = 0;
};
// Looks at the private pages from RAM page `from_page` on, at most
// `max_pages` of them (a caller on an event loop goes on in slices). The VM
// must be restored from a snapshot (origin() set). Its owner's pause is left
// as it is (vm.Hold()).
ReclaimResult Reclaim(Vm& vm, uint64_t from_page = 0, uint64_t max_pages = ~uint64_t(0));

}  // namespace forkling::vmm::snapshot
