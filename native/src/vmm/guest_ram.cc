#include "vmm/guest_ram.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <vector>

#include "vmm/layout.h"
#include "vmm/ram_guard.h"

namespace forkling::vmm {
namespace {
[[noreturn]] void Throw(const char* what) { throw std::system_error(errno, std::generic_category(), what); }
}  // namespace

GuestRam GuestRam::CreateAnonymous(uint64_t size) {
  GuestRam r;
  r.fd_ = memfd_create("forkling-guest-ram", MFD_CLOEXEC);
  if (r.fd_ < 0) Throw("memfd_create");
  if (ftruncate(r.fd_, off_t(size)) != 0) Throw("ftruncate");
  // MAP_NORESERVE: a guest only costs the pages it touches.
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, r.fd_, 0);
  if (p == MAP_FAILED) Throw("mmap");
  r.host_ = static_cast<uint8_t*>(p);
  r.size_ = size;
  r.shared_ = true;
  // Guest RAM must not leak into a host core dump, and the guest decides
  // about its own huge pages.
  madvise(p, size, MADV_DONTDUMP);
  r.BuildRegions();
  return r;
}

GuestRam GuestRam::MapFilePrivate(const std::string& path, uint64_t size) {
  GuestRam r;
  r.fd_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (r.fd_ < 0) Throw("open");
  struct stat st;
  if (fstat(r.fd_, &st) != 0) Throw("fstat");
  if (uint64_t(st.st_size) < size) {
    errno = EINVAL;
    Throw("memory file is shorter than the guest RAM");
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, r.fd_, 0);
  if (p == MAP_FAILED) Throw("mmap");
  r.host_ = static_cast<uint8_t*>(p);
  r.size_ = size;
  r.shared_ = false;
  madvise(p, size, MADV_DONTDUMP);
  r.BuildRegions();
  return r;
}

GuestRam GuestRam::AdoptPrivate(uint8_t* host, uint64_t size) {
  GuestRam r;
  r.host_ = host;
  r.size_ = size;
  r.shared_ = false;
  madvise(host, size, MADV_DONTDUMP);
  r.BuildRegions();
  return r;
}

GuestRam& GuestRam::operator=(GuestRam&& o) noexcept {
  if (this != &o) {
    Release();
    host_ = o.host_;
    size_ = o.size_;
    fd_ = o.fd_;
    guard_ = o.guard_;
    shared_ = o.shared_;
    mem_ = o.mem_;
    o.host_ = nullptr;
    o.size_ = 0;
    o.fd_ = -1;
    o.guard_ = -1;
    o.mem_ = GuestMemory();
  }
  return *this;
}

void GuestRam::Release() {
  ram_guard::Unregister(guard_);  // (before the range can be mapped again by anyone)
  guard_ = -1;
  if (host_) munmap(host_, size_);
  if (fd_ >= 0) close(fd_);
  host_ = nullptr;
  size_ = 0;
  fd_ = -1;
  mem_ = GuestMemory();
}

uint64_t GuestRam::low_size() const { return size_ < layout::kPciHole ? size_ : layout::kPciHole; }

void GuestRam::BuildRegions() {
  if (guard_ < 0) guard_ = ram_guard::Register(host_, size_);
  mem_ = GuestMemory();
  mem_.set_lost_flag(ram_guard::LostFlag(guard_));
  mem_.AddRegion(0, host_, low_size());
  if (high_size()) mem_.AddRegion(layout::kHighRam, host_ + low_size(), high_size());
}

uint64_t GuestRam::ResidentBytes() const {
  if (!host_) return 0;
  if (shared_) {
    struct stat st;
    if (fstat(fd_, &st) == 0) return uint64_t(st.st_blocks) * 512;
    return 0;
  }
  const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((size_ + page - 1) / page);
  if (mincore(host_, size_, vec.data()) != 0) return 0;
  uint64_t n = 0;
  for (unsigned char v : vec) n += v & 1;
  return n * page;
}

}  // namespace forkling::vmm
