// Packing: a dozing VM's private pages kept as the bytes in which each
// differs from the page that backs it, the pages themselves given back.
//
// Most of what an idle child still holds alone after reclaim differs from
// its template (or its pattern) in a few bytes per page: time stamps,
// counters, pointers, random state. While a VM dozes (vm.h) nothing writes
// its RAM: its vCPUs wait outside KVM_RUN and its vsock loop waits for host
// input. Packing then keeps, for each private page, the runs of bytes that
// differ from its backing (the pattern's page if it is mapped from there,
// else the snapshot's: snapshot_pages.h), or from zeros where that is
// shorter (a page the guest freed), in one read-only mapping of the
// host's, and drops the page (MADV_DONTNEED: it reads its backing again).
// Before anything reads or runs that RAM again (a vCPU entering KVM_RUN, a
// hold, the owner's pause, a pass of the vsock loop, a test's read) the VM
// writes the runs back (Vm::Unpack): each page is copied again and holds the
// guest's bytes. What a page is backed by cannot change in between: files
// are never written, and the pattern mappings change only under a hold.
//
// Every page's bytes stay in the host process, so the VM's memory figures
// count the mapping (`packed_bytes`). A page whose runs would take more than
// kMaxPageBytes is kept whole (as much as the page itself), so that no page
// is left private and the VM's page tables can go too (vm.h DropRamTables).
// A VM with more than kMaxPackPages private pages is not packed: packing runs
// on the caller's thread (the host's event loop), and waking would write it
// all back.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace forkling::vmm {
class Vm;
}

namespace forkling::vmm::snapshot {

class PackedPages {
 public:
  static constexpr size_t kMaxPageBytes = 3072;
  static constexpr uint64_t kMaxPackPages = 4096;  // 16 MiB private

  PackedPages() = default;
  ~PackedPages();
  PackedPages(const PackedPages&) = delete;
  PackedPages& operator=(const PackedPages&) = delete;

  // Keeps RAM page `page` (its 4096 bytes, and the bytes of what backs it)
  // as the runs in which they differ (or in which the page differs from
  // zeros, where that is shorter), or whole where those would take more
  // than kMaxPageBytes. A page equal to its backing keeps nothing. False,
  // keeping nothing, only when the page number does not fit.
  bool Add(uint64_t page, const uint8_t* bytes, const uint8_t* base);
  // Moves what Add kept into a read-only mapping of its own (page-rounded:
  // what it takes of the host's memory). Add is refused after.
  void Seal();
  // Writes every kept run back into RAM (`ram_pages` pages at `host`). False
  // if an entry does not fit that RAM (nothing past it is written).
  bool Apply(uint8_t* host, uint64_t ram_pages) const;

  uint64_t pages() const { return pages_; }       // pages with runs kept
  uint64_t encoded_bytes() const { return used_; }  // their runs and headers
  uint64_t host_bytes() const;                      // what the store takes: the mapping, or the buffer before Seal

 private:
  std::vector<uint8_t> building_;
  uint8_t* map_ = nullptr;
  size_t map_size_ = 0;
  size_t used_ = 0;
  uint64_t pages_ = 0;
};

struct PackResult {
  bool packed = false;          // the VM holds packed pages now
  uint64_t private_pages = 0;   // looked at
  uint64_t packed_pages = 0;    // given back (their differing bytes kept, if any)
  uint64_t kept_pages = 0;      // left private (all of them past kMaxPackPages)
  uint64_t host_bytes = 0;      // the store's mapping
  // Nothing was left private: KVM's nested tables and the host's page tables for its RAM were
  // freed too (vm.h DropRamTables) until it wakes.
  bool ram_tables_dropped = false;
  // And its KVM VM was closed, KVM's state of it kept (vm.h Shelve) until it wakes.
  bool shelved = false;
  uint64_t total_ns = 0;
};

// Packs the private pages of a restored VM that is held still (vm.cc
// Vm::Pack). Sets `slot` before it drops any page, so that a failure after
// that leaves every byte in the store or in its page. Throws
// std::system_error when a snapshot file cannot be read or madvise fails.
void PackPages(Vm& vm, std::unique_ptr<PackedPages>& slot, PackResult& r);

}  // namespace forkling::vmm::snapshot
