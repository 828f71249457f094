// Guest RAM: one contiguous host mapping, split into guest-physical regions
// around the PCI hole (below 3 GiB, then from 4 GiB). Backed either by a fresh
// memfd mapped MAP_SHARED (a booting VM: part 2 writes the memfd out as the
// snapshot) or by an existing memory file mapped MAP_PRIVATE (a forked child:
// reads share the page cache, writes copy one page). Every mapping is
// guarded against SIGBUS (vmm/ram_guard.h): memory().lost() says so.
#pragma once
#include <cstdint>
#include <string>

#include "vmm/guest_memory.h"

namespace forkling::vmm {

class GuestRam {
 public:
  // Throws std::system_error on failure.
  static GuestRam CreateAnonymous(uint64_t size);
  static GuestRam MapFilePrivate(const std::string& path, uint64_t size);
  // Takes over a private mapping made elsewhere (a memory file with diff
  // layers mapped over it, vmm/snapshot/diff_layer.h); no fd.
  static GuestRam AdoptPrivate(uint8_t* host, uint64_t size);

  GuestRam() = default;
  GuestRam(GuestRam&& o) noexcept { *this = std::move(o); }
  GuestRam& operator=(GuestRam&& o) noexcept;
  GuestRam(const GuestRam&) = delete;
  GuestRam& operator=(const GuestRam&) = delete;
  ~GuestRam() { Release(); }

  // munmap + close: the pages go back to the host (for a memfd, once no one
  // else holds the fd).
  void Release();

  uint8_t* host() const { return host_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  bool shared() const { return shared_; }
  const GuestMemory& memory() const { return mem_; }
  // RAM below the hole (starts at gpa 0) and above 4 GiB (may be 0).
  uint64_t low_size() const;
  uint64_t high_size() const { return size_ - low_size(); }

  // Bytes of guest RAM backed by host pages now: for a memfd the pages it
  // holds (st_blocks), for a private mapping the resident pages (mincore).
  uint64_t ResidentBytes() const;

 private:
  void BuildRegions();
  uint8_t* host_ = nullptr;
  uint64_t size_ = 0;
  int fd_ = -1;
  int guard_ = -1;  // ram_guard slot
  bool shared_ = false;
  GuestMemory mem_;
};

}  // namespace forkling::vmm
