#include "vmm/snapshot/packed_pages.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include "vmm/snapshot/bytes.h"
#include "vmm/snapshot/diff_layer.h"
#include "vmm/snapshot/pagemap.h"
#include "vmm/snapshot/pattern.h"
#include "vmm/snapshot/snapshot_pages.h"
#include "vmm/vm.h"

namespace forkling::vmm::snapshot {
namespace {

constexpr uint64_t kPage = 4096;
// An entry: page (u32) and run count (u16); a run: offset (u16), length - 1 (u16), its bytes.
constexpr size_t kEntryHeader = 6;
constexpr size_t kRunHeader = 4;
// Equal bytes shorter than a run header are kept inside the run around them.
constexpr size_t kJoinGap = kRunHeader;

}  // namespace

PackedPages::~PackedPages() {
  if (map_) munmap(map_, map_size_);
}

namespace {

// Each run costs its header and at least one byte: no more fit in kMaxPageBytes.
constexpr size_t kMaxRuns = PackedPages::kMaxPageBytes / (kRunHeader + 1) + 1;
// The run count's top bit: the runs go over a zero page, not the backing.
constexpr uint16_t kOverZero = 0x8000;
static_assert(kMaxRuns < kOverZero);
alignas(64) const uint8_t kZeroPage[kPage] = {};

struct Runs {
  uint16_t off[kMaxRuns], len[kMaxRuns];
  size_t count = 0;
  size_t bytes = kEntryHeader;  // the entry's size
};

// The runs in which `bytes` differ from `base`; false once they would take more than kMaxPageBytes.
bool FindRuns(const uint8_t* bytes, const uint8_t* base, Runs& r) {
  r.count = 0;
  r.bytes = kEntryHeader;
  for (size_t i = 0; i < kPage;) {
    if ((i & 7) == 0) {
      while (i < kPage && Load<uint64_t>(bytes + i) == Load<uint64_t>(base + i)) i += 8;
      if (i == kPage) break;
    }
    if (bytes[i] == base[i]) {
      i++;
      continue;
    }
    size_t end = i + 1;
    for (size_t j = end; j < kPage && j - end < kJoinGap; j++)
      if (bytes[j] != base[j]) end = j + 1;
    r.bytes += kRunHeader + (end - i);
    if (r.bytes > PackedPages::kMaxPageBytes) return false;
    r.off[r.count] = uint16_t(i);
    r.len[r.count] = uint16_t(end - i);
    r.count++;
    i = end;
  }
  return true;
}

}  // namespace

bool PackedPages::Add(uint64_t page, const uint8_t* bytes, const uint8_t* base) {
  // (kMaxRuns holds a page's runs up to kMaxPageBytes; past that it is kept whole)
  if (map_) throw std::logic_error("PackedPages::Add after Seal");
  if (page > UINT32_MAX) return false;
  // Against the backing, or against zeros where that is smaller (a page the guest freed, zeroed
  // as it frees, over a backing that held data; a little data on a page that held other data).
  Runs vs_base, vs_zero;
  const bool base_ok = FindRuns(bytes, base, vs_base);
  if (base_ok && vs_base.count == 0) return true;  // the backing's bytes: nothing to keep
  const bool zero_ok = FindRuns(bytes, kZeroPage, vs_zero);
  const bool over_zero = zero_ok && (!base_ok || vs_zero.bytes < vs_base.bytes);
  if (!base_ok && !zero_ok) {  // kept whole: one run, as much as the page itself
    vs_base.count = 1;
    vs_base.off[0] = 0;
    vs_base.len[0] = uint16_t(kPage);
    vs_base.bytes = kEntryHeader + kRunHeader + kPage;
  }
  const Runs& r = over_zero ? vs_zero : vs_base;
  building_.reserve(building_.size() + r.bytes);
  Append<uint32_t>(building_, uint32_t(page));
  Append<uint16_t>(building_, uint16_t(r.count | (over_zero ? kOverZero : 0)));
  for (size_t k = 0; k < r.count; k++) {
    Append<uint16_t>(building_, r.off[k]);
    Append<uint16_t>(building_, uint16_t(r.len[k] - 1));
    building_.insert(building_.end(), bytes + r.off[k], bytes + r.off[k] + r.len[k]);
  }
  used_ = building_.size();
  pages_++;
  return true;
}

void PackedPages::Seal() {
  if (map_ || building_.empty()) return;
  const size_t size = (building_.size() + kPage - 1) & ~(kPage - 1);
  void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap for packed pages");
  std::memcpy(m, building_.data(), building_.size());
  mprotect(m, size, PROT_READ);  // (only Apply reads it from now on)
  map_ = static_cast<uint8_t*>(m);
  map_size_ = size;
  std::vector<uint8_t>().swap(building_);
}

uint64_t PackedPages::host_bytes() const { return map_ ? map_size_ : building_.capacity(); }

bool PackedPages::Apply(uint8_t* host, uint64_t ram_pages) const {
  const uint8_t* p = map_ ? map_ : building_.data();
  const uint8_t* const e = p + used_;
  while (p < e) {
    if (size_t(e - p) < kEntryHeader) return false;
    const uint32_t page = Load<uint32_t>(p);
    const uint16_t word = Load<uint16_t>(p + 4), runs = word & ~kOverZero;
    p += kEntryHeader;
    if (page >= ram_pages) return false;
    uint8_t* dst = host + uint64_t(page) * kPage;
    if (word & kOverZero) std::memset(dst, 0, kPage);
    for (uint16_t k = 0; k < runs; k++) {
      if (size_t(e - p) < kRunHeader) return false;
      const size_t off = Load<uint16_t>(p), len = size_t(Load<uint16_t>(p + 2)) + 1;
      p += kRunHeader;
      if (off + len > kPage || size_t(e - p) < len) return false;
      std::memcpy(dst + off, p, len);
      p += len;
    }
  }
  return true;
}

void PackPages(Vm& vm, std::unique_ptr<PackedPages>& slot, PackResult& r) {
  const auto t0 = std::chrono::steady_clock::now();
  std::shared_ptr<const RestoreSpec> origin = vm.origin();
  const GuestRam& ram = vm.ram();
  if (!origin || !ram.host() || ram.shared() || vm.stopped()) return;
  const std::vector<uint64_t> priv = PrivatePages(ram.host(), ram.size());
  r.private_pages = priv.size();
  if (priv.size() > PackedPages::kMaxPackPages) {
    r.kept_pages = priv.size();
    return;
  }
  SnapshotPages snap(*origin);
  PatternBacking* pattern = vm.pattern();
  auto store = std::make_unique<PackedPages>();
  std::vector<uint64_t> drop;
  uint8_t base[kPage];
  for (uint64_t page : priv) {
    // What the page reads once dropped: the pattern's copy if it is mapped from there.
    if (pattern && pattern->Has(page)) {
      pattern->layer().ReadPage(page, base);
    } else if (!snap.Read(page, base)) {
      std::memset(base, 0, kPage);
    }
    if (store->Add(page, ram.host() + page * kPage, base)) {
      drop.push_back(page);
    } else {
      r.kept_pages++;
    }
  }
  if (!drop.empty()) {
    store->Seal();
    r.packed_pages = drop.size();
    r.host_bytes = store->host_bytes();
    slot = std::move(store);
    r.packed = true;
    // In runs of pages in a row; a page equal to its backing has no entry and is dropped too.
    for (size_t i = 0; i < drop.size();) {
      size_t j = i + 1;
      while (j < drop.size() && drop[j] == drop[j - 1] + 1) j++;
      if (madvise(ram.host() + drop[i] * kPage, (j - i) * kPage, MADV_DONTNEED) != 0)
        throw std::system_error(errno, std::generic_category(), "madvise(MADV_DONTNEED) of packed pages");
      i = j;
    }
  }
  r.total_ns = uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace forkling::vmm::snapshot
