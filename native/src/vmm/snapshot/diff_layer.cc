#include "vmm/snapshot/diff_layer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include "vmm/layout.h"
#include "vmm/snapshot/checksum.h"
#include "vmm/snapshot/memory_file.h"
#include "vmm/snapshot/state_file.h"

namespace forkling::vmm::snapshot {
namespace {

constexpr char kMagic[8] = {'F', 'K', 'L', 'D', 'I', 'F', 'F', 0};
constexpr uint64_t kFlagDataCrc = 1;  // data_crc is set (diffs kept on disk)

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t page_size;
  uint64_t ram_size;
  uint64_t pages;
  uint64_t index_off;
  uint64_t data_off;
  uint64_t flags;
  uint32_t index_crc;
  uint32_t data_crc;
  uint32_t header_crc;
};

[[noreturn]] void ThrowErrno(const char* what) { throw std::system_error(errno, std::generic_category(), what); }

void PwriteAll(int fd, const void* p, uint64_t len, uint64_t off) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  while (len) {
    ssize_t n = pwrite(fd, b, len, off_t(off));
    if (n < 0) {
      if (errno == EINTR) continue;
      ThrowErrno("write diff file");
    }
    b += n;
    off += uint64_t(n);
    len -= uint64_t(n);
  }
}

bool PreadAll(int fd, void* p, uint64_t len, uint64_t off) {
  uint8_t* b = static_cast<uint8_t*>(p);
  while (len) {
    ssize_t n = pread(fd, b, len, off_t(off));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    b += n;
    off += uint64_t(n);
    len -= uint64_t(n);
  }
  return true;
}

uint64_t DataOffset(uint64_t max_pages) { return (kPageSize + max_pages * 8 + kPageSize - 1) & ~(kPageSize - 1); }

void WriteHeaderAndIndex(int fd, uint64_t ram_size, uint64_t data_off, const std::vector<uint64_t>& index,
                         bool has_data_crc, uint32_t data_crc) {
  Header h;
  std::memset(&h, 0, sizeof h);
  std::memcpy(h.magic, kMagic, 8);
  h.version = kDiffFormatVersion;
  h.page_size = uint32_t(kPageSize);
  h.ram_size = ram_size;
  h.pages = index.size();
  h.index_off = kPageSize;
  h.data_off = data_off;
  h.flags = has_data_crc ? kFlagDataCrc : 0;
  h.index_crc = Crc32c(index.data(), index.size() * 8);
  h.data_crc = data_crc;
  h.header_crc = Crc32c(&h, offsetof(Header, header_crc));
  PwriteAll(fd, index.data(), index.size() * 8, kPageSize);
  PwriteAll(fd, &h, sizeof h, 0);
}

// CRC over (page number, page data) for each slot in slot order.
uint32_t DataCrc(int fd, uint64_t data_off, const std::vector<uint64_t>& index) {
  uint32_t crc = 0;
  std::vector<uint8_t> buf(kPageSize * 64);
  for (uint64_t s = 0; s < index.size();) {
    uint64_t n = std::min<uint64_t>(64, index.size() - s);
    if (!PreadAll(fd, buf.data(), n * kPageSize, data_off + s * kPageSize)) return ~crc;
    for (uint64_t i = 0; i < n; i++) {
      crc = Crc32c(&index[s + i], 8, crc);
      crc = Crc32c(buf.data() + i * kPageSize, kPageSize, crc);
    }
    s += n;
  }
  return crc;
}

}  // namespace

DiffLayer::~DiffLayer() {
  if (fd_ >= 0) close(fd_);
}

std::vector<uint64_t> DiffLayer::Pages() const {
  std::vector<uint64_t> out;
  out.reserve(pages_);
  for (const DiffRun& r : runs_)
    for (uint64_t i = 0; i < r.count; i++) out.push_back(r.page + i);
  return out;
}

const DiffRun* DiffLayer::Find(uint64_t page) const {
  auto r = std::upper_bound(runs_.begin(), runs_.end(), page, [](uint64_t p, const DiffRun& x) { return p < x.page; });
  if (r == runs_.begin()) return nullptr;
  --r;
  return page < r->page + r->count ? &*r : nullptr;
}

void DiffLayer::ReadPage(uint64_t page, uint8_t* buf) const {
  const DiffRun* r = Find(page);
  if (!r) throw std::logic_error("a diff layer was asked for a page it does not hold");
  if (!PreadAll(fd_, buf, kPageSize, data_off_ + (r->slot + page - r->page) * kPageSize)) ThrowErrno("read a diff layer page");
}

std::shared_ptr<DiffLayer> DiffLayer::Open(int fd, const std::string& what) {
  auto layer = std::shared_ptr<DiffLayer>(new DiffLayer());
  layer->fd_ = fd;
  auto bad = [&](const std::string& why) { return CorruptError(what + " is corrupt: diff layer " + why); };
  struct stat st;
  if (fstat(fd, &st) != 0) throw bad("cannot be read");
  Header h;
  if (uint64_t(st.st_size) < kPageSize || !PreadAll(fd, &h, sizeof h, 0)) throw bad("is truncated");
  if (std::memcmp(h.magic, kMagic, 8) != 0) throw bad("is not a forkling diff file");
  if (h.header_crc != Crc32c(&h, offsetof(Header, header_crc))) throw bad("header fails its checksum");
  if (h.version != kDiffFormatVersion) throw bad("has an unknown format version");
  // (a RAM size no VM may have would size what a collapse allocates per page)
  if (h.page_size != kPageSize || h.ram_size == 0 || h.ram_size % kPageSize || h.ram_size > layout::kMaxRam)
    throw bad("has a bad page or RAM size");
  const uint64_t ram_pages = h.ram_size / kPageSize;
  if (h.pages > ram_pages || h.index_off != kPageSize || h.data_off < DataOffset(h.pages) ||
      h.data_off % kPageSize || h.data_off > uint64_t(st.st_size) ||
      (uint64_t(st.st_size) - h.data_off) / kPageSize < h.pages)
    throw bad("is truncated or has a bad layout");
  std::vector<uint64_t> index(h.pages);
  if (!PreadAll(fd, index.data(), h.pages * 8, h.index_off)) throw bad("index is truncated");
  if (Crc32c(index.data(), index.size() * 8) != h.index_crc) throw bad("index fails its checksum");
  if (h.flags & ~kFlagDataCrc) throw bad("has unknown flags");
  if ((h.flags & kFlagDataCrc) && DataCrc(fd, h.data_off, index) != h.data_crc) throw bad("data fails its checksum");
  std::vector<std::pair<uint64_t, uint64_t>> order;  // (page, slot)
  order.reserve(index.size());
  for (uint64_t s = 0; s < index.size(); s++) {
    if (index[s] >= ram_pages) throw bad("names a page outside guest RAM");
    order.emplace_back(index[s], s);
  }
  std::sort(order.begin(), order.end());
  for (size_t i = 0; i < order.size(); i++) {
    if (i && order[i].first == order[i - 1].first) throw bad("names a page twice");
    if (!layer->runs_.empty()) {
      DiffRun& r = layer->runs_.back();
      if (r.page + r.count == order[i].first && r.slot + r.count == order[i].second) {
        r.count++;
        continue;
      }
    }
    layer->runs_.push_back(DiffRun{order[i].first, order[i].second, 1});
  }
  layer->ram_size_ = h.ram_size;
  layer->pages_ = h.pages;
  layer->data_off_ = h.data_off;
  return layer;
}

std::vector<uint64_t> FillGaps(const std::vector<uint64_t>& pages, size_t budget) {
  if (pages.empty() || budget == 0) return pages;
  // Runs and the gaps between them.
  std::vector<uint64_t> gaps;  // gap length before run i (i >= 1)
  size_t runs = 1;
  for (size_t i = 1; i < pages.size(); i++)
    if (pages[i] != pages[i - 1] + 1) {
      gaps.push_back(pages[i] - pages[i - 1] - 1);
      runs++;
    }
  if (runs <= budget) return pages;
  // Close the (runs - budget) smallest gaps: find the threshold length.
  std::vector<uint64_t> sorted = gaps;
  size_t close_n = runs - budget;
  std::nth_element(sorted.begin(), sorted.begin() + long(close_n - 1), sorted.end());
  uint64_t threshold = sorted[close_n - 1];
  size_t below = 0;
  for (uint64_t g : gaps) below += g < threshold;
  size_t at_threshold_allowed = close_n - below;
  std::vector<uint64_t> out;
  out.reserve(pages.size());
  out.push_back(pages[0]);
  for (size_t i = 1; i < pages.size(); i++) {
    uint64_t gap = pages[i] - pages[i - 1] - 1;
    bool fill = gap > 0 && (gap < threshold || (gap == threshold && at_threshold_allowed > 0));
    if (fill) {
      if (gap == threshold) at_threshold_allowed--;
      for (uint64_t p = pages[i - 1] + 1; p < pages[i]; p++) out.push_back(p);
    }
    out.push_back(pages[i]);
  }
  return out;
}

std::vector<uint64_t> FillSmallGaps(const std::vector<uint64_t>& pages, uint64_t max_gap) {
  std::vector<uint64_t> out;
  out.reserve(pages.size());
  for (size_t i = 0; i < pages.size(); i++) {
    if (i && pages[i] - pages[i - 1] - 1 <= max_gap)
      for (uint64_t p = pages[i - 1] + 1; p < pages[i]; p++) out.push_back(p);
    out.push_back(pages[i]);
  }
  return out;
}

DiffBuilder::DiffBuilder(int fd, uint64_t ram_size, uint64_t max_pages)
    : fd_(fd), ram_size_(ram_size), data_off_(DataOffset(max_pages)), slot_of_(ram_size / kPageSize, 0) {
  if (ftruncate(fd, 0) != 0) ThrowErrno("truncate diff file");
}

void DiffBuilder::Add(const uint8_t* mem, const std::vector<uint64_t>& pages) {
  std::vector<uint64_t> slots(pages.size());
  for (size_t i = 0; i < pages.size(); i++) {
    uint64_t p = pages[i];
    if (p >= slot_of_.size()) throw std::out_of_range("diff page outside guest RAM");
    if (!slot_of_[p]) {
      if (data_off_ < DataOffset(index_.size() + 1)) throw std::length_error("diff has more pages than planned");
      index_.push_back(p);
      slot_of_[p] = uint32_t(index_.size());
    }
    slots[i] = slot_of_[p] - 1;
  }
  // Consecutive pages in consecutive slots go out in one write.
  for (size_t i = 0; i < pages.size();) {
    size_t j = i + 1;
    while (j < pages.size() && pages[j] == pages[j - 1] + 1 && slots[j] == slots[j - 1] + 1) j++;
    PwriteAll(fd_, mem + pages[i] * kPageSize, (j - i) * kPageSize, data_off_ + slots[i] * kPageSize);
    i = j;
  }
}

void DiffBuilder::Finish(bool data_checksum) {
  WriteHeaderAndIndex(fd_, ram_size_, data_off_, index_, data_checksum, data_checksum ? DataCrc(fd_, data_off_, index_) : 0);
}

void WriteDiff(int fd, const uint8_t* mem, uint64_t ram_size, const std::vector<uint64_t>& pages, bool data_checksum) {
  DiffBuilder b(fd, ram_size, pages.size());
  b.Add(mem, pages);
  b.Finish(data_checksum);
}

void CollapseDiffs(const std::vector<std::shared_ptr<DiffLayer>>& chain, int fd) {
  if (chain.empty()) throw std::invalid_argument("nothing to collapse");
  const uint64_t ram_size = chain[0]->ram_size();
  const uint64_t ram_pages = ram_size / kPageSize;
  // For each page the newest layer that has it: (layer, slot).
  std::vector<int32_t> owner(ram_pages, -1);
  std::vector<uint64_t> owner_slot(ram_pages, 0);
  for (size_t l = 0; l < chain.size(); l++) {
    if (chain[l]->ram_size() != ram_size) throw std::invalid_argument("diff layers of different RAM sizes");
    for (const DiffRun& r : chain[l]->runs())
      for (uint64_t i = 0; i < r.count; i++) {
        owner[r.page + i] = int32_t(l);
        owner_slot[r.page + i] = r.slot + i;
      }
  }
  std::vector<uint64_t> pages;
  for (uint64_t p = 0; p < ram_pages; p++)
    if (owner[p] >= 0) pages.push_back(p);
  const uint64_t data_off = DataOffset(pages.size());
  if (ftruncate(fd, 0) != 0) ThrowErrno("truncate diff file");
  std::vector<uint8_t> page(kPageSize);
  uint32_t crc = 0;
  for (uint64_t s = 0; s < pages.size(); s++) {
    const DiffLayer& src = *chain[size_t(owner[pages[s]])];
    if (!PreadAll(src.fd(), page.data(), kPageSize, src.data_offset() + owner_slot[pages[s]] * kPageSize))
      throw std::system_error(EIO, std::generic_category(), "read diff layer");
    PwriteAll(fd, page.data(), kPageSize, data_off + s * kPageSize);
    crc = Crc32c(&pages[s], 8, crc);
    crc = Crc32c(page.data(), kPageSize, crc);
  }
  WriteHeaderAndIndex(fd, ram_size, data_off, pages, true, crc);
}

uint8_t* MapLayered(int base_fd, uint64_t size, const std::vector<std::shared_ptr<DiffLayer>>& chain, uint8_t* at) {
  for (const auto& layer : chain)
    if (layer->ram_size() != size) throw std::invalid_argument("diff layer is for a different RAM size");
  void* p = mmap(at, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE | (at ? MAP_FIXED : 0), base_fd, 0);
  if (p == MAP_FAILED) ThrowErrno("mmap memory file");
  uint8_t* base = static_cast<uint8_t*>(p);
  for (const auto& layer : chain) {
    for (const DiffRun& r : layer->runs()) {
      void* q = mmap(base + r.page * kPageSize, r.count * kPageSize, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, layer->fd(), off_t(layer->data_offset() + r.slot * kPageSize));
      if (q == MAP_FAILED) {
        int e = errno;
        if (!at) munmap(p, size);
        throw std::system_error(e, std::generic_category(),
                                e == ENOMEM ? "mmap diff run (too many mappings: collapse the branch chain or raise "
                                              "vm.max_map_count)"
                                            : "mmap diff run");
      }
    }
  }
  return base;
}

int CreateTempDiffFile(const std::string& dir) {
  int fd = open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) ThrowErrno("cannot create a diff file (O_TMPFILE)");
  return fd;
}

}  // namespace forkling::vmm::snapshot
