// A split virtqueue (virtio 1.x, section 2.7) seen from the device side.
//
// Everything read from the rings and descriptor tables is checked: queue size
// (a power of two, at most the device maximum), ring alignment and placement
// in RAM, head and next indices below the queue size, every buffer wholly
// inside RAM, no zero-length buffers, chains no longer than the queue (or the
// indirect table), indirect tables only when negotiated and never nested,
// device-readable buffers before device-writable ones, and an available index
// that never runs more than one queue ahead of the device. Any violation is an
// error; the device then marks itself failed and stops using the queue.
//
// VIRTIO_F_EVENT_IDX is not supported (not offered): interrupts are
// suppressed with VIRTQ_AVAIL_F_NO_INTERRUPT only, and the device never sets
// VIRTQ_USED_F_NO_NOTIFY.
//
// Not thread-safe: one thread uses a queue at a time.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "vmm/guest_memory.h"
#include "vmm/virtio_device.h"

namespace forkling::vmm {

inline constexpr uint16_t kVirtqDescFNext = 1;
inline constexpr uint16_t kVirtqDescFWrite = 2;
inline constexpr uint16_t kVirtqDescFIndirect = 4;
inline constexpr uint16_t kVirtqAvailFNoInterrupt = 1;
// Largest indirect table accepted (entries). Linux never needs more than a
// few for vsock and rng; the bound keeps one chain's walk short.
inline constexpr uint32_t kMaxIndirectDescriptors = 1024;

// One guest buffer of a chain, already checked and translated.
struct ChainSegment {
  uint64_t gpa;
  uint8_t* host;
  uint32_t len;
};

// The buffers of one available chain, split into the device-readable part
// (first) and the device-writable part, each seen as one byte stream.
class DescriptorChain {
 public:
  uint16_t head = 0;
  std::vector<ChainSegment> readable;
  std::vector<ChainSegment> writable;
  uint64_t readable_len = 0;
  uint64_t writable_len = 0;

  void Clear();
  // Copies up to len bytes starting `offset` bytes into the readable stream;
  // returns the number copied (short at the end of the stream).
  uint64_t Read(uint64_t offset, void* dst, uint64_t len) const;
  // Copies up to len bytes into the writable stream at `offset`; returns the
  // number copied.
  uint64_t Write(uint64_t offset, const void* src, uint64_t len) const;
};

class Virtqueue {
 public:
  // What a snapshot needs besides guest memory: the layout and the device's
  // ring positions.
  struct State {
    QueueConfig config;
    uint16_t last_avail = 0;  // next avail ring slot the device reads
    uint16_t next_used = 0;   // next used ring slot the device writes
  };
  enum class PopResult { kChain, kEmpty, kError };

  // Checks and adopts the layout. `name` prefixes error messages (e.g.
  // "vsock tx queue"). Returns "" or the reason the layout is unusable.
  // A config with ready == false gives a queue that is simply not ready.
  std::string Init(const GuestMemory& mem, const QueueConfig& config, uint16_t max_size,
                   bool indirect_allowed, const std::string& name);
  // As Init, then continues from saved ring positions.
  std::string Restore(const GuestMemory& mem, const State& state, uint16_t max_size,
                      bool indirect_allowed, const std::string& name);
  void Clear();

  bool ready() const { return ready_; }
  uint16_t size() const { return size_; }
  State state() const { return State{config_, last_avail_, next_used_}; }

  // Takes the next available chain. kEmpty when the driver has posted nothing
  // new; kError (with *error set) when the ring or chain is invalid, in which
  // case nothing is consumed.
  PopResult Pop(DescriptorChain* chain, std::string* error);
  // Gives back the chain Pop returned last (not yet pushed), e.g. when the
  // device found nothing to put in it.
  void UndoPop();
  // Returns chain `head` to the driver with `len` bytes written.
  void PushUsed(uint16_t head, uint32_t len);
  // After PushUsed: whether the driver wants an interrupt now.
  bool ShouldNotify() const;

 private:
  std::string Error(const std::string& what) const;
  bool WalkChain(uint16_t head, DescriptorChain* chain, std::string* error) const;

  GuestMemory mem_;
  QueueConfig config_;
  std::string name_;
  bool ready_ = false;
  bool indirect_ = false;
  uint16_t size_ = 0;
  uint8_t* desc_ = nullptr;   // size_ * 16 bytes
  uint8_t* avail_ = nullptr;  // flags, idx, ring[size_]
  uint8_t* used_ = nullptr;   // flags, idx, ring[size_] of {id, len}
  uint16_t last_avail_ = 0;
  uint16_t next_used_ = 0;
};

}  // namespace forkling::vmm
