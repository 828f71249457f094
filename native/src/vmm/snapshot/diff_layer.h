// Diff layers: the memory of a BRANCH child is the template's memory file
// mapped MAP_PRIVATE, with one or more diff layers mapped over it.
//
// A diff file holds the pages the source sandbox owned privately when it was
// branched (the pages it wrote since its own template or parent layers):
//
//   header (4096 bytes)  "FKLDIFF\0" | u32 version | u32 page size | u64 RAM size
//                        | u64 page count | u64 index offset | u64 data offset
//                        | u64 flags | u32 index crc32c | u32 data crc32c | u32 header crc32c
//                        (flags bit 0: the data checksum is set; a diff that lives only
//                        in this process as an unlinked file skips it, because computing
//                        it would mean reading the pages back during the source's pause)
//   index                u64 guest page number per slot (unique, any order)
//   data                 one 4096-byte page per slot, at data offset (page-aligned)
//
// Mapping: slots are grouped into runs (consecutive page numbers in
// consecutive slots) and each run is mmap'ed MAP_FIXED|MAP_PRIVATE from the
// diff file over the base mapping. So children share the diff's pages through
// the page cache exactly as they share the base's, and a child's write copies
// one page, never the layer. A chain (branch of a branch ...) is the base
// plus layers in order, later layers over earlier ones; nothing is copied
// from the base or from older layers. Each run costs the child up to two
// VMAs, so the writer fills small gaps between dirty pages (with the source's
// current content of those pages, which is what a child must see there
// anyway) until the number of runs is within a budget; Collapse merges a
// chain into one layer.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace forkling::vmm::snapshot {

inline constexpr uint32_t kDiffFormatVersion = 1;
// Runs per layer the writer aims for (each is one or two VMAs per child; the
// kernel allows 65530 per process by default).
inline constexpr size_t kDiffRunBudget = 128;

struct DiffRun {
  uint64_t page;   // first guest page
  uint64_t slot;   // first slot in the file
  uint64_t count;  // pages
};

// An opened, checked diff layer. Holds its fd (the file may be unlinked).
class DiffLayer {
 public:
  ~DiffLayer();
  int fd() const { return fd_; }
  uint64_t ram_size() const { return ram_size_; }
  uint64_t page_count() const { return pages_; }
  uint64_t data_offset() const { return data_off_; }
  const std::vector<DiffRun>& runs() const { return runs_; }
  // Guest page numbers, ascending.
  std::vector<uint64_t> Pages() const;
  // The run holding `page`, or null.
  const DiffRun* Find(uint64_t page) const;
  // Copies the layer's copy of `page` (which Find must have found) into buf.
  // Throws std::system_error.
  void ReadPage(uint64_t page, uint8_t* buf) const;

  // Opens and checks a diff file (`fd` is taken over). The data checksum, when
  // the file has one, is verified here, once per layer object. Throws CorruptError naming `what`.
  static std::shared_ptr<DiffLayer> Open(int fd, const std::string& what);

 private:
  int fd_ = -1;
  uint64_t ram_size_ = 0, pages_ = 0, data_off_ = 0;
  std::vector<DiffRun> runs_;
};

// Adds gap pages to a sorted page list until it forms at most `budget` runs
// (closing the smallest gaps first). Returns the new sorted list.
std::vector<uint64_t> FillGaps(const std::vector<uint64_t>& pages, size_t budget);

// Adds the pages of every gap of at most `max_gap` pages between pages of a
// sorted list. Returns the new sorted list.
std::vector<uint64_t> FillSmallGaps(const std::vector<uint64_t>& pages, uint64_t max_gap);

// Writes a diff file to `fd` (empty, e.g. O_TMPFILE) with the given pages of
// [mem, mem+ram_size) (`pages` sorted, unique). Throws std::system_error.
void WriteDiff(int fd, const uint8_t* mem, uint64_t ram_size, const std::vector<uint64_t>& pages,
               bool data_checksum = true);

// A diff being built while its source runs (pre-copy): Add copies pages now;
// pages added again later overwrite their slot; Finish writes the index and
// header. The caller makes sure the last Add of every page happens while the
// source is paused.
class DiffBuilder {
 public:
  DiffBuilder(int fd, uint64_t ram_size, uint64_t max_pages);
  void Add(const uint8_t* mem, const std::vector<uint64_t>& pages);
  void Finish(bool data_checksum);
  uint64_t pages() const { return index_.size(); }

 private:
  int fd_;
  uint64_t ram_size_;
  uint64_t data_off_;
  std::vector<uint64_t> index_;   // slot -> page
  std::vector<uint32_t> slot_of_; // page -> slot + 1 (0: none)
};

// Merges a chain (oldest first) into one diff written to `fd`: for each page
// the newest layer's copy. Throws std::system_error.
void CollapseDiffs(const std::vector<std::shared_ptr<DiffLayer>>& chain, int fd);

// Maps `size` bytes of `base_fd` MAP_PRIVATE|MAP_NORESERVE and the chain over
// it. Returns the mapping (munmap(size) releases everything). With `at`, in
// place of the mapping there (MAP_FIXED: the old one, its private pages and
// page tables go; on failure `at` may be left half mapped, never unmapped).
uint8_t* MapLayered(int base_fd, uint64_t size, const std::vector<std::shared_ptr<DiffLayer>>& chain, uint8_t* at = nullptr);

// An O_TMPFILE (unlinked) in `dir` for a diff that lives only as long as the
// sandboxes that map it. Throws std::system_error.
int CreateTempDiffFile(const std::string& dir);

}  // namespace forkling::vmm::snapshot
