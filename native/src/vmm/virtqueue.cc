#include "vmm/virtqueue.h"

#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>

namespace forkling::vmm {
namespace {

struct Desc {
  uint64_t addr;
  uint32_t len;
  uint16_t flags;
  uint16_t next;
};
static_assert(sizeof(Desc) == 16);

// Ring indices and flags are shared with the guest's vCPUs: read and write
// them as single atomic 16-bit accesses (the rings are checked to be aligned).
uint16_t Load16(const uint8_t* p) {
  return __atomic_load_n(reinterpret_cast<const uint16_t*>(p), __ATOMIC_RELAXED);
}
void Store16(uint8_t* p, uint16_t v) {
  __atomic_store_n(reinterpret_cast<uint16_t*>(p), v, __ATOMIC_RELAXED);
}

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%" PRIx64, v);
  return buf;
}

}  // namespace

void DescriptorChain::Clear() {
  head = 0;
  readable.clear();
  writable.clear();
  readable_len = 0;
  writable_len = 0;
}

uint64_t DescriptorChain::Read(uint64_t offset, void* dst, uint64_t len) const {
  uint8_t* out = static_cast<uint8_t*>(dst);
  uint64_t done = 0;
  for (const ChainSegment& s : readable) {
    if (done == len) break;
    if (offset >= s.len) {
      offset -= s.len;
      continue;
    }
    uint64_t n = s.len - offset;
    if (n > len - done) n = len - done;
    std::memcpy(out + done, s.host + offset, n);
    done += n;
    offset = 0;
  }
  return done;
}

uint64_t DescriptorChain::Write(uint64_t offset, const void* src, uint64_t len) const {
  const uint8_t* in = static_cast<const uint8_t*>(src);
  uint64_t done = 0;
  for (const ChainSegment& s : writable) {
    if (done == len) break;
    if (offset >= s.len) {
      offset -= s.len;
      continue;
    }
    uint64_t n = s.len - offset;
    if (n > len - done) n = len - done;
    std::memcpy(s.host + offset, in + done, n);
    done += n;
    offset = 0;
  }
  return done;
}

std::string Virtqueue::Error(const std::string& what) const { return name_ + ": " + what; }

void Virtqueue::Clear() {
  mem_ = GuestMemory();
  config_ = QueueConfig();
  ready_ = false;
  indirect_ = false;
  size_ = 0;
  desc_ = avail_ = used_ = nullptr;
  last_avail_ = next_used_ = 0;
}

std::string Virtqueue::Init(const GuestMemory& mem, const QueueConfig& config, uint16_t max_size,
                            bool indirect_allowed, const std::string& name) {
  Clear();
  name_ = name;
  if (!config.ready) return "";
  const uint32_t n = config.size;
  if (n == 0 || (n & (n - 1)) != 0) return Error("queue size " + std::to_string(n) + " is not a power of two");
  if (n > max_size)
    return Error("queue size " + std::to_string(n) + " is above the maximum " + std::to_string(max_size));
  if (config.desc % 16 != 0) return Error("descriptor table " + Hex(config.desc) + " is not 16-byte aligned");
  if (config.driver % 2 != 0) return Error("available ring " + Hex(config.driver) + " is not 2-byte aligned");
  if (config.device % 4 != 0) return Error("used ring " + Hex(config.device) + " is not 4-byte aligned");
  uint8_t* desc = mem.Ptr(config.desc, 16ull * n);
  uint8_t* avail = mem.Ptr(config.driver, 4ull + 2ull * n);
  uint8_t* used = mem.Ptr(config.device, 4ull + 8ull * n);
  if (!desc) return Error("descriptor table " + Hex(config.desc) + " is outside guest RAM");
  if (!avail) return Error("available ring " + Hex(config.driver) + " is outside guest RAM");
  if (!used) return Error("used ring " + Hex(config.device) + " is outside guest RAM");
  mem_ = mem;
  config_ = config;
  size_ = static_cast<uint16_t>(n);
  desc_ = desc;
  avail_ = avail;
  used_ = used;
  indirect_ = indirect_allowed;
  // A freshly enabled queue starts at index 0, whatever the memory holds.
  last_avail_ = 0;
  next_used_ = 0;
  ready_ = true;
  return "";
}

std::string Virtqueue::Restore(const GuestMemory& mem, const State& state, uint16_t max_size,
                               bool indirect_allowed, const std::string& name) {
  std::string err = Init(mem, state.config, max_size, indirect_allowed, name);
  if (!err.empty() || !ready_) return err;
  last_avail_ = state.last_avail;
  next_used_ = state.next_used;
  return "";
}

bool Virtqueue::WalkChain(uint16_t head, DescriptorChain* chain, std::string* error) const {
  chain->Clear();
  chain->head = head;
  const uint8_t* table = desc_;
  uint32_t table_size = size_;
  bool in_indirect = false;
  uint32_t index = head;
  uint32_t seen = 0;
  for (;;) {
    if (index >= table_size) {
      *error = Error((in_indirect ? "indirect descriptor index " : "descriptor index ") + std::to_string(index) +
                     " is outside the table of " + std::to_string(table_size));
      return false;
    }
    if (++seen > table_size) {
      *error = Error("descriptor chain from head " + std::to_string(head) + " is longer than its table (a loop?)");
      return false;
    }
    Desc d;
    // One copy: the guest may rewrite the table while we look at it.
    std::memcpy(&d, table + 16ull * index, sizeof d);
    if (d.flags & kVirtqDescFIndirect) {
      if (!indirect_) {
        *error = Error("indirect descriptor used but VIRTIO_F_INDIRECT_DESC was not negotiated");
        return false;
      }
      if (in_indirect) {
        *error = Error("nested indirect descriptor");
        return false;
      }
      if (seen != 1) {
        *error = Error("indirect descriptor in the middle of a chain");
        return false;
      }
      if (d.flags & kVirtqDescFNext) {
        *error = Error("indirect descriptor with VIRTQ_DESC_F_NEXT");
        return false;
      }
      if (d.len == 0 || d.len % 16 != 0 || d.len / 16 > kMaxIndirectDescriptors) {
        *error = Error("indirect table length " + std::to_string(d.len) + " is not a multiple of 16 between 16 and " +
                       std::to_string(16 * kMaxIndirectDescriptors));
        return false;
      }
      const uint8_t* t = mem_.Ptr(d.addr, d.len);
      if (!t) {
        *error = Error("indirect table " + Hex(d.addr) + "+" + std::to_string(d.len) + " is outside guest RAM");
        return false;
      }
      table = t;
      table_size = d.len / 16;
      in_indirect = true;
      index = 0;
      seen = 0;
      continue;
    }
    if (d.len == 0) {
      *error = Error("zero-length buffer in descriptor " + std::to_string(index));
      return false;
    }
    uint8_t* host = mem_.Ptr(d.addr, d.len);
    if (!host) {
      *error = Error("buffer " + Hex(d.addr) + "+" + std::to_string(d.len) + " is outside guest RAM");
      return false;
    }
    if (d.flags & kVirtqDescFWrite) {
      chain->writable.push_back(ChainSegment{d.addr, host, d.len});
      chain->writable_len += d.len;
    } else {
      if (!chain->writable.empty()) {
        *error = Error("device-readable buffer after a device-writable one");
        return false;
      }
      chain->readable.push_back(ChainSegment{d.addr, host, d.len});
      chain->readable_len += d.len;
    }
    // The used length is 32 bits; a chain cannot describe more.
    if (chain->readable_len + chain->writable_len > UINT32_MAX) {
      *error = Error("descriptor chain is longer than 4 GiB");
      return false;
    }
    if (!(d.flags & kVirtqDescFNext)) return true;
    index = d.next;
  }
}

Virtqueue::PopResult Virtqueue::Pop(DescriptorChain* chain, std::string* error) {
  if (!ready_) return PopResult::kEmpty;
  const uint16_t avail_idx = Load16(avail_ + 2);
  const uint16_t pending = static_cast<uint16_t>(avail_idx - last_avail_);
  if (pending == 0) return PopResult::kEmpty;
  if (pending > size_) {
    *error = Error("available index " + std::to_string(avail_idx) + " is " + std::to_string(pending) +
                   " ahead of the device, more than the queue size " + std::to_string(size_));
    return PopResult::kError;
  }
  // Read the ring entry and descriptors only after seeing the index.
  std::atomic_thread_fence(std::memory_order_acquire);
  const uint16_t head = Load16(avail_ + 4 + 2u * (last_avail_ & (size_ - 1)));
  if (!WalkChain(head, chain, error)) return PopResult::kError;
  last_avail_++;
  return PopResult::kChain;
}

void Virtqueue::UndoPop() { last_avail_--; }

void Virtqueue::PushUsed(uint16_t head, uint32_t len) {
  if (!ready_) return;
  uint8_t* elem = used_ + 4 + 8u * (next_used_ & (size_ - 1));
  const uint32_t id = head;
  std::memcpy(elem, &id, 4);
  std::memcpy(elem + 4, &len, 4);
  next_used_++;
  // The element (and the buffer contents) must be visible before the index.
  std::atomic_thread_fence(std::memory_order_release);
  Store16(used_ + 2, next_used_);
}

bool Virtqueue::ShouldNotify() const {
  if (!ready_) return false;
  // Order the used index store before reading the driver's flags (virtio 2.7.7.2).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return (Load16(avail_) & kVirtqAvailFNoInterrupt) == 0;
}

}  // namespace forkling::vmm
