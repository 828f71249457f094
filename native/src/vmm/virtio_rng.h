// virtio-rng (entropy device, id 4): one request queue whose device-writable
// buffers are filled from getrandom(). Requests are served synchronously on
// the vCPU thread that kicks the queue.
#pragma once
#include <mutex>

#include "vmm/virtio_device.h"
#include "vmm/virtqueue.h"

namespace forkling::vmm {

class VirtioRng : public VirtioDevice {
 public:
  static constexpr uint16_t kQueueSize = 256;
  // At most this many bytes per request: a chain may describe gigabytes of
  // guest RAM, and filling it all would stall the vCPU.
  static constexpr uint32_t kMaxBytesPerRequest = 64 * 1024;

  uint32_t DeviceId() const override { return kVirtioIdEntropy; }
  uint64_t DeviceFeatures() const override { return kVirtioFVersion1 | kVirtioFIndirectDesc; }
  uint16_t NumQueues() const override { return 1; }
  uint16_t MaxQueueSize(uint16_t queue) const override { return queue == 0 ? kQueueSize : 0; }
  void ReadConfig(uint32_t offset, uint8_t* data, uint32_t len) override;
  void WriteConfig(uint32_t offset, const uint8_t* data, uint32_t len) override {}
  void Activate(const GuestMemory& mem, const std::vector<QueueConfig>& queues, uint64_t driver_features,
                NotifyGuest notify_guest) override;
  void QueueNotify(uint16_t queue) override;
  void Reset() override;

  // Snapshot support: the ring positions (with the vCPUs paused, the device
  // is idle: it only works inside QueueNotify), and activation from them.
  struct State {
    bool active = false;
    uint64_t driver_features = 0;
    Virtqueue::State queue;
  };
  State SaveState() const;
  void RestoreState(const GuestMemory& mem, const State& state, NotifyGuest notify_guest);

 private:
  mutable std::mutex mu_;
  bool active_ = false;
  uint64_t driver_features_ = 0;
  Virtqueue queue_;
  NotifyGuest notify_;
  DescriptorChain chain_;
};

}  // namespace forkling::vmm
