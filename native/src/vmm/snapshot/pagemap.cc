#include "vmm/snapshot/pagemap.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <system_error>

namespace forkling::vmm::snapshot {
namespace {

constexpr uint64_t kPresent = 1ull << 63, kSwapped = 1ull << 62, kFileOrShared = 1ull << 61;
constexpr uint64_t kPage = 4096;
constexpr size_t kBatch = 16384;  // entries per read (128 KiB)

int PagemapFd() {
  static std::once_flag once;
  static int fd = -1;
  static int err = 0;
  std::call_once(once, [] {
    fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (fd < 0) err = errno;
  });
  if (fd < 0) throw std::system_error(err, std::generic_category(), "cannot open /proc/self/pagemap");
  return fd;
}

template <class Fn>
void Walk(const void* addr, uint64_t len, Fn fn) {
  int fd = PagemapFd();
  const uint64_t first = reinterpret_cast<uintptr_t>(addr) / kPage;
  const uint64_t n = (len + kPage - 1) / kPage;
  std::vector<uint64_t> buf(kBatch);
  for (uint64_t done = 0; done < n;) {
    size_t want = size_t(std::min<uint64_t>(kBatch, n - done));
    ssize_t r = pread(fd, buf.data(), want * 8, off_t((first + done) * 8));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0 || r % 8) throw std::system_error(r < 0 ? errno : EIO, std::generic_category(), "read /proc/self/pagemap");
    size_t got = size_t(r) / 8;
    for (size_t i = 0; i < got; i++) fn(done + i, buf[i]);
    done += got;
  }
}

}  // namespace

std::vector<uint64_t> PrivatePages(const void* addr, uint64_t len) {
  std::vector<uint64_t> out;
  Walk(addr, len, [&](uint64_t page, uint64_t e) {
    if ((e & (kPresent | kSwapped)) && !(e & kFileOrShared)) out.push_back(page);
  });
  return out;
}

PageCounts CountPages(const void* addr, uint64_t len) {
  PageCounts c;
  const uint64_t first = reinterpret_cast<uintptr_t>(addr) / kPage;
  uint64_t last_span = ~0ull;
  Walk(addr, len, [&](uint64_t page, uint64_t e) {
    if (!(e & (kPresent | kSwapped))) return;
    const uint64_t span = (first + page) >> 9;  // 512 pages: what one page-table page maps
    if (span != last_span) c.table_spans++, last_span = span;
    if (e & kFileOrShared) c.shared_pages++;
    else c.private_pages++;
  });
  return c;
}

}  // namespace forkling::vmm::snapshot
