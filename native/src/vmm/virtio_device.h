// The interface between a virtio transport (virtio-pci, later virtio-mmio) and
// a device model (vsock, rng). The transport owns feature negotiation, the
// device status register and the queue registers; when the driver sets
// DRIVER_OK it hands the device the guest memory and the queue layout.
//
// Threading: QueueNotify, ReadConfig and WriteConfig run on vCPU threads;
// Activate and Reset are called by the transport (a vCPU thread, or the VMM
// thread before the vCPUs start / after they stop). A device that needs host
// I/O runs its own thread and calls notify_guest from there, so the callback
// must be thread-safe (KVM_SIGNAL_MSI / an irqfd write are).
//
// Failure: a device that sees a hostile or impossible request (a descriptor
// outside RAM, a looping chain, an avail index that jumps) marks itself failed
// with a message and stops processing its queues. The transport should then
// set DEVICE_NEEDS_RESET (0x40) in the status and raise a config interrupt;
// the VM and every other VM go on. A driver reset (status 0) calls Reset(),
// which clears the failure.
#pragma once
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "vmm/guest_memory.h"

namespace forkling::vmm {

// Feature bits the transport and devices share (virtio 1.x).
inline constexpr uint64_t kVirtioFIndirectDesc = 1ull << 28;
inline constexpr uint64_t kVirtioFEventIdx = 1ull << 29;  // never offered
inline constexpr uint64_t kVirtioFVersion1 = 1ull << 32;

// Device ids.
inline constexpr uint32_t kVirtioIdEntropy = 4;
inline constexpr uint32_t kVirtioIdVsock = 19;

// One queue as the driver configured it through the transport.
struct QueueConfig {
  uint16_t size = 0;    // entries; must be a power of two <= MaxQueueSize
  bool ready = false;   // queue_enable; a queue that is not ready is ignored
  uint64_t desc = 0;    // descriptor table gpa (16-byte aligned)
  uint64_t driver = 0;  // available ring gpa (2-byte aligned)
  uint64_t device = 0;  // used ring gpa (4-byte aligned)
};

class VirtioDevice {
 public:
  using NotifyGuest = std::function<void(uint16_t queue)>;
  using FailureCallback = std::function<void(const std::string& message)>;

  virtual ~VirtioDevice() = default;

  virtual uint32_t DeviceId() const = 0;
  // Offered features; always includes kVirtioFVersion1.
  virtual uint64_t DeviceFeatures() const = 0;
  virtual uint16_t NumQueues() const = 0;
  virtual uint16_t MaxQueueSize(uint16_t queue) const = 0;
  // Device-specific config space, from offset 0. Out-of-range bytes read as 0
  // and are ignored on write.
  virtual void ReadConfig(uint32_t offset, uint8_t* data, uint32_t len) = 0;
  virtual void WriteConfig(uint32_t offset, const uint8_t* data, uint32_t len) = 0;

  // DRIVER_OK. `queues` has NumQueues() entries (missing ones count as not
  // ready). driver_features is what the driver accepted (a subset of
  // DeviceFeatures()). A bad queue layout marks the device failed.
  virtual void Activate(const GuestMemory& mem, const std::vector<QueueConfig>& queues,
                        uint64_t driver_features, NotifyGuest notify_guest) = 0;
  // The driver wrote queue index `queue` to the notify register.
  virtual void QueueNotify(uint16_t queue) = 0;
  // Driver reset (status 0) or VM teardown: stop all processing and host I/O,
  // forget the queues, clear the failure. The device can be activated again.
  virtual void Reset() = 0;

  bool failed() const {
    std::lock_guard<std::mutex> l(failure_mu_);
    return failed_;
  }
  std::string failure() const {
    std::lock_guard<std::mutex> l(failure_mu_);
    return failure_;
  }
  // Called once per failure, from the thread that saw it (vCPU or device thread).
  void set_failure_callback(FailureCallback cb) {
    std::lock_guard<std::mutex> l(failure_mu_);
    on_failure_ = std::move(cb);
  }

 protected:
  // Marks the device failed (first message wins) and tells the callback.
  void Fail(const std::string& message) {
    FailureCallback cb;
    {
      std::lock_guard<std::mutex> l(failure_mu_);
      if (failed_) return;
      failed_ = true;
      failure_ = message;
      cb = on_failure_;
    }
    if (cb) cb(message);
  }
  void ClearFailure() {
    std::lock_guard<std::mutex> l(failure_mu_);
    failed_ = false;
    failure_.clear();
  }

 private:
  mutable std::mutex failure_mu_;
  bool failed_ = false;
  std::string failure_;
  FailureCallback on_failure_;
};

}  // namespace forkling::vmm
