// Pattern: what the children of one template write alike.
//
// Most pages an idle child owns privately hold what every child of the same
// template holds there after the same first requests: kernel objects of the
// host's connection, the agent's bookkeeping, counters that went the same
// way. The engine forks hidden children (three), sends them a child's first
// requests, lets them go idle and captures their private pages as a
// *pattern* (a diff layer in an unlinked file, small gaps filled with the
// first one's bytes there; a page where the first alone holds other bytes
// than the other two hold alike takes theirs). At
// reclaim, a run of a child's pages that holds byte for byte what the
// pattern holds is mapped from the pattern file (MAP_PRIVATE | MAP_FIXED over
// the RAM mapping; KVM follows through its MMU notifier): every child then
// shares one copy through the page cache, and a write copies one page again.
//
// The pattern is only ever a guess: a page is mapped only while the vCPUs
// and the vsock loop are held and its bytes are equal, so a wrong or stale
// pattern costs nothing but the comparison. What it changes is what backs a
// page: a private copy of a page mapped from the pattern falls back to the
// pattern's bytes when dropped, so reclaim compares such a page with the
// pattern, and a BRANCH copies pattern-backed pages into its diff layer (its
// children map the template and the layers, not the pattern).
//
// Each mapped run costs up to two VMAs of this process (the kernel allows
// 65530 by default): a VM maps at most kPatternMapsPerVm runs and all VMs of
// the process together at most kPatternMapsPerProcess; a VM whose mmap fails
// (mostly that limit, reached with other mappings) maps no more. Only the
// children of a template get a pattern (a page not mapped from it then falls
// back to the memory file, which a failed mmap can restore).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "vmm/snapshot/diff_layer.h"

namespace forkling::vmm {
class Vm;
}

namespace forkling::vmm::snapshot {

// Gaps between a pattern's private pages filled up to this many pages: the
// child's bytes there are mostly the template's, so longer runs map at once.
inline constexpr uint64_t kPatternMaxGap = 8;
// A reclaim pass maps a pattern's run over up to this many private pages in a
// row that hold other bytes (written back after: reclaim.cc), so as not to split it.
inline constexpr uint64_t kPatternMaxBridge = 8;
inline constexpr size_t kPatternMapsPerVm = 128;
inline constexpr size_t kPatternMapsPerProcess = 16384;

// Runs mapped from patterns by all VMs of this process now (the budget above).
size_t PatternMapsInProcess();

// The pattern of one VM and which of its RAM pages are mapped from it now.
class PatternBacking {
 public:
  explicit PatternBacking(std::shared_ptr<const DiffLayer> layer) : layer_(std::move(layer)) {}
  ~PatternBacking();
  PatternBacking(const PatternBacking&) = delete;
  PatternBacking& operator=(const PatternBacking&) = delete;

  const DiffLayer& layer() const { return *layer_; }
  // RAM pages mapped from the pattern (sorted).
  std::vector<uint64_t> Pages() const;
  uint64_t page_count() const { return page_count_; }
  bool Has(uint64_t page) const;
  // Runs this VM may still map (its own budget and the process's).
  size_t MapsLeft() const;
  // Runs this VM has mapped.
  size_t maps() const { return stretches_.size(); }
  // Records [first, first + count) as mapped from the pattern (joining stretches mapped before).
  void Add(uint64_t first, uint64_t count);
  // Records [first, first + count) as the memory file's again (a failed mmap mapped it back).
  void Remove(uint64_t first, uint64_t count);
  // No more runs for this VM (an mmap failed: mostly the limit on mappings).
  void Exhaust() { exhausted_ = true; }
  // Maps the pattern's pages again over RAM at `ram` (after it was mapped
  // anew: vm_snapshot.cc Vm::DropRamTables), a stretch per mapping as before.
  // False if an mmap failed (the rest is then the memory file's).
  bool MapAgain(uint8_t* ram) const;

 private:
  // Pages in a row, [first, end); kept sorted, apart and not touching: a
  // stretch costs one mapping however it was mapped (one file, one offset per
  // page), and an idle child keeps these for as long as it lives, so they are
  // stretches (at most ~kPatternMapsPerVm), not a list of its pages.
  struct Stretch {
    uint64_t first, end;
  };
  void Changed(size_t maps_before);  // the process's count and page_count_ follow stretches_

  std::shared_ptr<const DiffLayer> layer_;
  std::vector<Stretch> stretches_;
  uint64_t page_count_ = 0;
  bool exhausted_ = false;
};

// The RAM pages of a restored VM that do not read its snapshot's bytes
// through its mapping: its private pages and those mapped from its pattern
// (sorted). What a BRANCH or a pattern captures.
std::vector<uint64_t> WrittenPages(const Vm& vm);

// Captures the private pages of a restored VM (and the pages it maps from a
// pattern of its own), small gaps filled, into an unlinked diff file in
// `dir`, with the vCPUs and the vsock loop held. `others`: more children of
// the same snapshot with the same history (held too): their written pages
// are captured as well, and with two of them a page where `vm` alone holds
// other bytes than the two hold alike takes theirs. Throws std::system_error.
std::shared_ptr<DiffLayer> CapturePattern(Vm& vm, const std::vector<Vm*>& others, const std::string& dir);

}  // namespace forkling::vmm::snapshot
