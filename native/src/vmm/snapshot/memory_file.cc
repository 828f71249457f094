#include "vmm/snapshot/memory_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <system_error>
#include <tuple>
#include <vector>

#include "vmm/snapshot/checksum.h"
#include "vmm/snapshot/state_file.h"

namespace forkling::vmm::snapshot {
namespace {

[[noreturn]] void ThrowErrno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// Calls fn(offset, length) for each data range of fd within [0, size), in
// order (page-aligned outward). Without SEEK_DATA support: one range.
template <class Fn>
void ForEachDataRange(int fd, uint64_t size, Fn fn) {
  if (fd < 0) {
    fn(uint64_t(0), size);
    return;
  }
  uint64_t pos = 0;
  while (pos < size) {
    off_t d = lseek(fd, off_t(pos), SEEK_DATA);
    if (d < 0) {
      if (errno == ENXIO) return;  // only holes from here on
      if (errno == EINVAL || errno == EOPNOTSUPP) {
        fn(pos, size - pos);
        return;
      }
      ThrowErrno("lseek(SEEK_DATA)");
    }
    if (uint64_t(d) >= size) return;
    off_t h = lseek(fd, d, SEEK_HOLE);
    if (h < 0) ThrowErrno("lseek(SEEK_HOLE)");
    uint64_t start = uint64_t(d) & ~(kPageSize - 1);
    uint64_t end = std::min<uint64_t>((uint64_t(h) + kPageSize - 1) & ~(kPageSize - 1), size);
    if (end > start) fn(start, end - start);
    pos = end > uint64_t(d) ? end : uint64_t(d) + kPageSize;
  }
}

uint32_t PageCrc(uint32_t crc, uint64_t page, const uint8_t* data) {
  crc = Crc32c(&page, 8, crc);
  return Crc32c(data, kPageSize, crc);
}

using CacheKey = std::tuple<uint64_t, uint64_t, uint64_t, int64_t, int64_t, int64_t, int64_t, uint64_t, uint64_t, uint32_t>;
std::mutex cache_mu;
std::set<CacheKey> verified;

}  // namespace

MemoryFileInfo WriteMemoryFile(const uint8_t* host, uint64_t size, int src_fd, const std::string& path) {
  if (size % kPageSize) throw std::invalid_argument("memory size is not a multiple of the page size");
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) ThrowErrno("cannot create " + path);
  MemoryFileInfo info;
  info.size = size;
  uint32_t crc = 0;
  try {
    if (ftruncate(fd, off_t(size)) != 0) ThrowErrno("cannot size " + path);
    auto flush = [&](uint64_t from, uint64_t to) {  // page range [from, to) of non-zero pages
      uint64_t off = from * kPageSize, len = (to - from) * kPageSize;
      while (len) {
        ssize_t n = pwrite(fd, host + off, len, off_t(off));
        if (n < 0) {
          if (errno == EINTR) continue;
          ThrowErrno("cannot write " + path);
        }
        off += uint64_t(n);
        len -= uint64_t(n);
      }
    };
    ForEachDataRange(src_fd, size, [&](uint64_t off, uint64_t len) {
      uint64_t first = off / kPageSize, last = (off + len) / kPageSize;
      uint64_t run = UINT64_MAX;
      for (uint64_t p = first; p < last; p++) {
        const uint8_t* page = host + p * kPageSize;
        if (IsZero(page, kPageSize)) {
          if (run != UINT64_MAX) flush(run, p);
          run = UINT64_MAX;
          continue;
        }
        crc = PageCrc(crc, p, page);
        info.data_pages++;
        if (run == UINT64_MAX) run = p;
      }
      if (run != UINT64_MAX) flush(run, last);
    });
    if (fsync(fd) != 0) ThrowErrno("cannot sync " + path);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  info.checksum = crc;
  return info;
}

MemoryFileInfo ScanMemoryFile(int fd, const std::string& path, const std::string& what) {
  auto bad = [&](const std::string& why) { return CorruptError(what + " is corrupt: memory file " + path + " " + why); };
  struct stat st;
  if (fstat(fd, &st) != 0) throw bad("cannot be read");
  MemoryFileInfo info;
  info.size = uint64_t(st.st_size);
  if (info.size == 0 || info.size % kPageSize) throw bad("has a size that is not a whole number of pages");
  // Read with pread, never mapped: a file cut short meanwhile is an error here, not a SIGBUS.
  std::vector<uint8_t> buf(1 << 20);
  uint32_t crc = 0;
  try {
    ForEachDataRange(fd, info.size, [&](uint64_t off, uint64_t len) {
      for (uint64_t at = off; at < off + len;) {
        const size_t want = size_t(std::min<uint64_t>(buf.size(), off + len - at));
        size_t got = 0;
        while (got < want) {
          ssize_t n = pread(fd, buf.data() + got, want - got, off_t(at + got));
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) throw bad(n == 0 ? "was cut short while it was read" : std::string("cannot be read: ") + std::strerror(errno));
          got += size_t(n);
        }
        for (size_t i = 0; i < want; i += kPageSize) {
          const uint8_t* page = buf.data() + i;
          if (IsZero(page, kPageSize)) continue;
          crc = PageCrc(crc, (at + i) / kPageSize, page);
          info.data_pages++;
        }
        at += want;
      }
    });
  } catch (const std::system_error& e) {
    throw bad(e.what());
  }
  info.checksum = crc;
  return info;
}

void VerifyMemoryFile(int fd, const std::string& path, const MemoryFileInfo& expected, const std::string& what) {
  struct stat st;
  if (fstat(fd, &st) != 0)
    throw CorruptError(what + " is corrupt: memory file " + path + " cannot be read (" + std::strerror(errno) + ")");
  if (uint64_t(st.st_size) != expected.size)
    throw CorruptError(what + " is corrupt: memory file " + path + " has " + std::to_string(st.st_size) +
                       " bytes, the state file says " + std::to_string(expected.size) +
                       (uint64_t(st.st_size) < expected.size ? " (truncated)" : ""));
  CacheKey key{uint64_t(st.st_dev), uint64_t(st.st_ino),     uint64_t(st.st_size), int64_t(st.st_mtim.tv_sec),
               int64_t(st.st_mtim.tv_nsec), int64_t(st.st_ctim.tv_sec), int64_t(st.st_ctim.tv_nsec),
               expected.size, expected.data_pages, expected.checksum};
  {
    std::lock_guard<std::mutex> l(cache_mu);
    if (verified.count(key)) return;
  }
  MemoryFileInfo got = ScanMemoryFile(fd, path, what);
  if (got.size != expected.size || got.data_pages != expected.data_pages || got.checksum != expected.checksum)
    throw CorruptError(what + " is corrupt: memory file " + path + " fails its checksum (" +
                       std::to_string(got.data_pages) + " data pages, expected " +
                       std::to_string(expected.data_pages) + ")");
  std::lock_guard<std::mutex> l(cache_mu);
  verified.insert(key);
}

void ClearVerifyCache() {
  std::lock_guard<std::mutex> l(cache_mu);
  verified.clear();
}

}  // namespace forkling::vmm::snapshot
