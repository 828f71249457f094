#include "vmm/snapshot/snapshot_pages.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>

#include "vmm/snapshot/diff_layer.h"

namespace forkling::vmm::snapshot {
namespace {

constexpr uint64_t kPage = 4096;

[[noreturn]] void Fail(const char* what) { throw std::system_error(errno, std::generic_category(), what); }

void PreadPage(int fd, uint8_t* buf, uint64_t off) {
  for (size_t done = 0; done < kPage;) {
    ssize_t r = pread(fd, buf + done, kPage - done, off_t(off + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) Fail("read a snapshot page");
    if (r == 0) {  // past the end of a sparse file: zeros
      std::memset(buf + done, 0, kPage - done);
      return;
    }
    done += size_t(r);
  }
}

}  // namespace

SnapshotPages::SnapshotPages(const RestoreSpec& spec) : spec_(spec) {
  if (!spec.memory_fd) throw std::logic_error(spec.what + ": the snapshot has no open memory file");
  // Opened anew so that the hint below stays ours: single pages, no read-ahead into the page cache.
  const std::string self = "/proc/self/fd/" + std::to_string(spec.memory_fd->get());
  fd_ = open(self.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ >= 0) posix_fadvise(fd_, 0, 0, POSIX_FADV_RANDOM);
}

SnapshotPages::~SnapshotPages() {
  if (fd_ >= 0) close(fd_);
}

bool SnapshotPages::Read(uint64_t page, uint8_t* buf) const {
  for (auto it = spec_.layers.rbegin(); it != spec_.layers.rend(); ++it) {
    if ((*it)->Find(page)) {
      (*it)->ReadPage(page, buf);
      return true;
    }
  }
  const uint64_t off = page * kPage;
  const int fd = fd_ >= 0 ? fd_ : spec_.memory_fd->get();
  off_t data = lseek(fd, off_t(off), SEEK_DATA);
  if (data < 0) {
    if (errno == ENXIO) return false;  // a hole up to the end
    Fail("seek in the memory file");
  }
  if (uint64_t(data) != off) return false;
  PreadPage(fd, buf, off);
  return true;
}

}  // namespace forkling::vmm::snapshot
