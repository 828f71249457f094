// Which pages of a mapping this process owns privately, from
// /proc/self/pagemap (one u64 per virtual page: bit 63 present, bit 62
// swapped, bit 61 file-backed or shared anonymous). In a MAP_PRIVATE file
// mapping a page the VM has written is an anonymous copy (present, bit 61
// clear); a page it has only read is the page cache's, shared with every
// sibling (bit 61 set); a page never touched is not present.
#pragma once
#include <cstdint>
#include <vector>

namespace forkling::vmm::snapshot {

// Page numbers (relative to addr) of the private pages of [addr, addr+len),
// ascending. addr page-aligned. Throws std::system_error.
std::vector<uint64_t> PrivatePages(const void* addr, uint64_t len);

struct PageCounts {
  uint64_t private_pages = 0;  // anonymous copies (present or swapped)
  uint64_t shared_pages = 0;   // present, from the page cache / shared memory
  // 2 MiB-aligned spans of the range with a page present or swapped: each
  // costs the host one page-table page (and KVM about one more for the guest).
  uint64_t table_spans = 0;
};
PageCounts CountPages(const void* addr, uint64_t len);

}  // namespace forkling::vmm::snapshot
