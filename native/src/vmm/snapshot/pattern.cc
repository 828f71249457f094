#include "vmm/snapshot/pattern.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>

#include "vmm/snapshot/memory_file.h"
#include "vmm/snapshot/pagemap.h"
#include "vmm/vm.h"

namespace forkling::vmm::snapshot {
namespace {
// Runs mapped from patterns by all VMs of this process (each VM adds its own).
std::atomic<size_t> g_process_maps{0};
}  // namespace

size_t PatternMapsInProcess() { return g_process_maps.load(); }

PatternBacking::~PatternBacking() { g_process_maps -= stretches_.size(); }

bool PatternBacking::Has(uint64_t page) const {
  // the last stretch that starts at or before `page`
  auto it = std::upper_bound(stretches_.begin(), stretches_.end(), page, [](uint64_t p, const Stretch& s) { return p < s.first; });
  return it != stretches_.begin() && page < std::prev(it)->end;
}

std::vector<uint64_t> PatternBacking::Pages() const {
  std::vector<uint64_t> pages;
  pages.reserve(page_count_);
  for (const Stretch& s : stretches_)
    for (uint64_t p = s.first; p < s.end; p++) pages.push_back(p);
  return pages;
}

size_t PatternBacking::MapsLeft() const {
  if (exhausted_) return 0;
  const size_t process = g_process_maps.load();
  const size_t own = kPatternMapsPerVm - std::min(maps(), kPatternMapsPerVm);
  return std::min(own, kPatternMapsPerProcess - std::min(process, kPatternMapsPerProcess));
}

void PatternBacking::Add(uint64_t first, uint64_t count) {
  if (count == 0) return;
  const size_t before = stretches_.size();
  uint64_t end = first + count;
  // Stretches that overlap or touch [first, end) join it.
  auto lo = std::lower_bound(stretches_.begin(), stretches_.end(), first, [](const Stretch& s, uint64_t f) { return s.end < f; });
  auto hi = lo;
  while (hi != stretches_.end() && hi->first <= end) {
    first = std::min(first, hi->first);
    end = std::max(end, hi->end);
    ++hi;
  }
  lo = stretches_.erase(lo, hi);
  stretches_.insert(lo, Stretch{first, end});
  Changed(before);
}

void PatternBacking::Remove(uint64_t first, uint64_t count) {
  if (count == 0) return;
  const size_t before = stretches_.size();
  const uint64_t end = first + count;
  std::vector<Stretch> kept;
  kept.reserve(stretches_.size() + 1);
  for (const Stretch& s : stretches_) {
    if (s.end <= first || s.first >= end) {
      kept.push_back(s);
      continue;
    }
    if (s.first < first) kept.push_back(Stretch{s.first, first});
    if (s.end > end) kept.push_back(Stretch{end, s.end});
  }
  stretches_ = std::move(kept);
  Changed(before);
}

void PatternBacking::Changed(size_t maps_before) {
  stretches_.shrink_to_fit();
  page_count_ = 0;
  for (const Stretch& s : stretches_) page_count_ += s.end - s.first;
  g_process_maps.fetch_add(stretches_.size() - maps_before);  // (one step; unsigned wrap-around subtracts)
}

std::vector<uint64_t> WrittenPages(const Vm& vm) {
  const GuestRam& ram = vm.ram();
  std::vector<uint64_t> pages = PrivatePages(ram.host(), ram.size());
  const PatternBacking* pb = vm.pattern();
  if (!pb) return pages;
  std::vector<uint64_t> all;
  const std::vector<uint64_t> mapped = pb->Pages();
  std::set_union(pages.begin(), pages.end(), mapped.begin(), mapped.end(), std::back_inserter(all));
  return all;
}

std::shared_ptr<DiffLayer> CapturePattern(Vm& vm, const std::vector<Vm*>& others, const std::string& dir) {
  std::shared_ptr<const RestoreSpec> origin = vm.origin();
  const GuestRam& ram = vm.ram();
  auto check = [&](const Vm& v) {
    if (!v.origin() || !v.ram().host() || v.ram().shared()) throw std::runtime_error("only a VM restored from a snapshot has a pattern to capture");
    if (v.stopped()) throw std::runtime_error("the VM has stopped: it has no pattern to capture");
  };
  check(vm);
  for (const Vm* o : others) {
    check(*o);
    if (o == &vm || o->origin() != origin) throw std::invalid_argument("a pattern's other samples must be other children of the same snapshot");
  }
  int fd = CreateTempDiffFile(dir);
  try {
    HeldStill held(vm);
    std::vector<std::unique_ptr<HeldStill>> held_others;
    std::vector<uint64_t> pages = WrittenPages(vm);
    for (Vm* o : others) {
      held_others.push_back(std::make_unique<HeldStill>(*o));
      std::vector<uint64_t> theirs = WrittenPages(*o), all;
      std::set_union(pages.begin(), pages.end(), theirs.begin(), theirs.end(), std::back_inserter(all));
      pages = std::move(all);
    }
    pages = FillSmallGaps(pages, kPatternMaxGap);
    DiffBuilder b(fd, ram.size(), pages.size());
    b.Add(ram.host(), pages);
    // With two other samples, a page this VM alone holds otherwise takes the bytes the other two
    // hold alike: one sample that went its own way does not decide the pattern.
    if (others.size() >= 2) {
      const uint8_t* x = others[0]->ram().host();
      const uint8_t* y = others[1]->ram().host();
      const uint8_t* a = ram.host();
      std::vector<uint64_t> outvoted;
      for (uint64_t p : pages) {
        const uint64_t off = p * kPageSize;
        if (std::memcmp(a + off, x + off, kPageSize) == 0 || std::memcmp(a + off, y + off, kPageSize) == 0) continue;
        if (std::memcmp(x + off, y + off, kPageSize) == 0) outvoted.push_back(p);
      }
      b.Add(x, outvoted);
    }
    b.Finish(false);
  } catch (...) {
    close(fd);
    throw;
  }
  return DiffLayer::Open(fd, "the pattern of " + origin->what);
}

bool PatternBacking::MapAgain(uint8_t* ram) const {
  constexpr uint64_t kPage = 4096;
  auto offset = [&](uint64_t page) {
    const DiffRun* r = layer_->Find(page);
    return r ? layer_->data_offset() + (r->slot + page - r->page) * kPage : ~uint64_t(0);
  };
  for (const Stretch& s : stretches_) {
    // A stretch is one mapping unless the pattern's file holds its pages apart.
    for (uint64_t i = s.first; i < s.end;) {
      const uint64_t off = offset(i);
      if (off == ~uint64_t(0)) return false;
      uint64_t j = i + 1;
      while (j < s.end && offset(j) == off + (j - i) * kPage) j++;
      uint8_t* at = ram + i * kPage;
      const uint64_t bytes = (j - i) * kPage;
      if (mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, layer_->fd(), off_t(off)) == MAP_FAILED)
        return false;
      madvise(at, bytes, MADV_DONTDUMP);
      i = j;
    }
  }
  return true;
}

}  // namespace forkling::vmm::snapshot
