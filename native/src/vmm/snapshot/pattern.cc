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

PatternBacking::~PatternBacking() { g_process_maps -= maps_; }

bool PatternBacking::Has(uint64_t page) const { return std::binary_search(pages_.begin(), pages_.end(), page); }

size_t PatternBacking::MapsLeft() const {
  if (exhausted_) return 0;
  const size_t process = g_process_maps.load();
  const size_t own = kPatternMapsPerVm - std::min(maps_, kPatternMapsPerVm);
  return std::min(own, kPatternMapsPerProcess - std::min(process, kPatternMapsPerProcess));
}

void PatternBacking::Add(uint64_t first, uint64_t count) {
  std::vector<uint64_t> run(count);
  for (uint64_t i = 0; i < count; i++) run[i] = first + i;
  std::vector<uint64_t> merged;
  merged.reserve(pages_.size() + count);
  std::set_union(pages_.begin(), pages_.end(), run.begin(), run.end(), std::back_inserter(merged));
  pages_ = std::move(merged);
  Recount();
}

void PatternBacking::Remove(uint64_t first, uint64_t count) {
  pages_.erase(std::lower_bound(pages_.begin(), pages_.end(), first), std::lower_bound(pages_.begin(), pages_.end(), first + count));
  Recount();
}

void PatternBacking::Recount() {
  // A run mapped over or next to runs mapped before replaces or joins them (one file, one
  // offset per page): about a mapping per stretch of pages in a row.
  size_t maps = 0;
  for (size_t i = 0; i < pages_.size(); i++) maps += i == 0 || pages_[i] != pages_[i - 1] + 1;
  g_process_maps += maps;
  g_process_maps -= maps_;
  maps_ = maps;
}

std::vector<uint64_t> WrittenPages(const Vm& vm) {
  const GuestRam& ram = vm.ram();
  std::vector<uint64_t> pages = PrivatePages(ram.host(), ram.size());
  const PatternBacking* pb = vm.pattern();
  if (!pb) return pages;
  std::vector<uint64_t> all;
  std::set_union(pages.begin(), pages.end(), pb->pages().begin(), pb->pages().end(), std::back_inserter(all));
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
  for (size_t i = 0; i < pages_.size();) {
    const uint64_t first = pages_[i], off = offset(first);
    if (off == ~uint64_t(0)) return false;
    size_t j = i + 1;
    while (j < pages_.size() && pages_[j] == first + (j - i) && offset(pages_[j]) == off + (j - i) * kPage) j++;
    uint8_t* at = ram + first * kPage;
    const uint64_t bytes = (j - i) * kPage;
    if (mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, layer_->fd(), off_t(off)) == MAP_FAILED)
      return false;
    madvise(at, bytes, MADV_DONTDUMP);
    i = j;
  }
  return true;
}

}  // namespace forkling::vmm::snapshot
