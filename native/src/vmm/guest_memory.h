// Checked access to guest-physical memory. Every address and length that
// comes from the guest goes through Ptr(), which refuses any range that is not
// wholly inside one RAM region (overflow-safe), so a hostile guest cannot make
// the VMM touch host memory outside its RAM.
#pragma once
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace forkling::vmm {

struct GuestRegion {
  uint64_t gpa = 0;        // first guest-physical address
  uint64_t size = 0;       // bytes
  uint8_t* host = nullptr; // host mapping of gpa
};

// Up to kMaxRegions RAM regions (RAM below the PCI hole and above 4 GiB, say).
// Copyable and cheap: devices keep their own copy.
class GuestMemory {
 public:
  static constexpr size_t kMaxRegions = 4;

  GuestMemory() = default;
  // One region of `size` bytes at guest-physical 0.
  GuestMemory(uint8_t* base, uint64_t size) { AddRegion(0, base, size); }

  // False when the table is full, the region is empty, wraps the address space
  // or overlaps an existing region.
  bool AddRegion(uint64_t gpa, uint8_t* host, uint64_t size) {
    if (count_ == kMaxRegions || size == 0 || host == nullptr || gpa + size < gpa) return false;
    for (size_t i = 0; i < count_; i++) {
      const GuestRegion& r = regions_[i];
      if (gpa < r.gpa + r.size && r.gpa < gpa + size) return false;
    }
    regions_[count_++] = GuestRegion{gpa, size, host};
    return true;
  }

  size_t region_count() const { return count_; }
  const GuestRegion& region(size_t i) const { return regions_[i]; }
  // Total RAM bytes.
  uint64_t size() const {
    uint64_t s = 0;
    for (size_t i = 0; i < count_; i++) s += regions_[i].size;
    return s;
  }

  // Host pointer for [gpa, gpa+len), or nullptr when that range is not wholly
  // inside one region. len 0 is allowed (a valid gpa inside a region).
  uint8_t* Ptr(uint64_t gpa, uint64_t len) const {
    for (size_t i = 0; i < count_; i++) {
      const GuestRegion& r = regions_[i];
      if (gpa < r.gpa) continue;
      uint64_t off = gpa - r.gpa;
      if (off >= r.size) continue;
      if (len > r.size - off) return nullptr;  // no overflow: both sides <= r.size
      return r.host + off;
    }
    return nullptr;
  }

  bool Contains(uint64_t gpa, uint64_t len) const { return Ptr(gpa, len) != nullptr; }

  // True once a host read or write of this RAM met a file it maps that was
  // cut short or unreadable (vmm/ram_guard.h): the RAM reads as zeros from
  // then on, and whoever sees this stops the VM.
  bool lost() const { return lost_ && lost_->load(std::memory_order_acquire) != 0; }
  void set_lost_flag(const std::atomic<uint32_t>* flag) { lost_ = flag; }

  // Copies of plain values (the guest may change memory concurrently, so a
  // value is read once into host memory and checked there).
  template <class T>
  bool Read(uint64_t gpa, T* out) const {
    static_assert(std::is_trivially_copyable_v<T>);
    const uint8_t* p = Ptr(gpa, sizeof(T));
    if (!p) return false;
    std::memcpy(out, p, sizeof(T));
    return true;
  }
  template <class T>
  bool Write(uint64_t gpa, const T& v) const {
    static_assert(std::is_trivially_copyable_v<T>);
    uint8_t* p = Ptr(gpa, sizeof(T));
    if (!p) return false;
    std::memcpy(p, &v, sizeof(T));
    return true;
  }
  bool ReadBytes(uint64_t gpa, void* out, uint64_t len) const {
    const uint8_t* p = Ptr(gpa, len);
    if (!p) return false;
    std::memcpy(out, p, len);
    return true;
  }
  bool WriteBytes(uint64_t gpa, const void* in, uint64_t len) const {
    uint8_t* p = Ptr(gpa, len);
    if (!p) return false;
    std::memcpy(p, in, len);
    return true;
  }

 private:
  std::array<GuestRegion, kMaxRegions> regions_{};
  size_t count_ = 0;
  const std::atomic<uint32_t>* lost_ = nullptr;
};

}  // namespace forkling::vmm
