// virtio-pci (modern, virtio 1.x) transport for a VirtioDevice: the common,
// notify, ISR and device-config structures and an MSI-X table in one 64-bit
// memory BAR. Interrupts are MSI-X messages delivered with KVM_SIGNAL_MSI
// (no INTx, so no interrupt routing tables are needed with acpi=off).
//
// Threading: config space and BAR accesses come from vCPU threads under the
// VM's I/O lock. Interrupts come from vCPU threads or a device's own thread;
// they only touch the MSI-X state, under its own lock.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "vmm/guest_memory.h"
#include "vmm/pci.h"
#include "vmm/virtio_device.h"

namespace forkling::vmm {

class VirtioPciDevice : public PciDevice {
 public:
  using SignalMsi = std::function<void(uint64_t address, uint32_t data)>;
  using DeviceError = std::function<void(const std::string& message)>;

  // BAR0 layout.
  static constexpr uint64_t kCommonOff = 0x0000, kCommonLen = 0x38;
  static constexpr uint64_t kIsrOff = 0x1000, kIsrLen = 4;
  static constexpr uint64_t kDeviceOff = 0x2000, kDeviceLen = 0x1000;
  static constexpr uint64_t kNotifyOff = 0x3000, kNotifyMultiplier = 4;
  static constexpr uint64_t kMsixTableOff = 0x4000, kMsixPbaOff = 0x5000;
  static constexpr uint64_t kBarSize = 0x8000;
  static constexpr uint16_t kNoVector = 0xffff;

  // Device status bits.
  static constexpr uint8_t kAcknowledge = 1, kDriver = 2, kDriverOk = 4, kFeaturesOk = 8, kNeedsReset = 0x40,
                           kFailed = 0x80;

  VirtioPciDevice(std::shared_ptr<VirtioDevice> dev, const GuestMemory& mem, uint64_t bar_addr, SignalMsi msi,
                  DeviceError on_error);
  ~VirtioPciDevice() override;

  void BarRead(int bar, uint64_t offset, uint8_t* data, uint32_t len) override;
  void BarWrite(int bar, uint64_t offset, const uint8_t* data, uint32_t len) override;

  // Driver-visible reset, also used at VM teardown (stops device threads).
  void Reset();
  VirtioDevice* device() const { return dev_.get(); }
  uint8_t status() const { return status_ | (needs_reset_ ? kNeedsReset : 0); }
  uint16_t num_vectors() const { return nvec_; }
  uint64_t interrupts_sent() const { return interrupts_.load(); }

  // Snapshot of the transport registers, queue layouts and vectors, and the
  // MSI-X table (config space is saved by PciDevice::SaveConfig). Take it
  // with the vCPUs paused.
  struct TransportState {
    uint32_t device_feature_select = 0, driver_feature_select = 0;
    uint32_t driver_features[2] = {};
    uint16_t queue_select = 0;
    uint8_t status = 0;
    bool active = false, needs_reset = false;
    uint16_t config_vector = kNoVector;
    uint8_t isr = 0;
    std::vector<QueueConfig> queues;
    std::vector<uint16_t> vectors;
    std::vector<uint32_t> msix_table;
    std::vector<uint8_t> msix_pending;
  };
  TransportState SaveTransport();
  // Restores the registers (after RestoreConfig). When the saved device was
  // active, calls `restore_device(memory, notify_guest)`, which must bring
  // the device model back from its own saved state (instead of a fresh
  // Activate). Returns "" or why the saved state does not fit this device.
  std::string RestoreTransport(const TransportState& s,
                               const std::function<void(const GuestMemory&, VirtioDevice::NotifyGuest)>& restore_device);

 protected:
  void OnConfigWrite(uint32_t off, uint32_t size) override;

 private:
  struct Queue {
    QueueConfig cfg;
    std::atomic<uint16_t> vector{kNoVector};
  };

  void CommonRead(uint64_t off, uint8_t* data, uint32_t len);
  void CommonWrite(uint64_t off, const uint8_t* data, uint32_t len);
  void SnapshotCommon(uint8_t* buf);
  void SetStatus(uint8_t v);
  void Activate();
  void NotifyQueue(uint16_t q);   // device -> guest, any thread
  void NotifyConfig();            // config change / needs reset, any thread
  void SignalVector(uint16_t v);  // any thread
  void MsixTableRead(uint64_t off, uint8_t* data, uint32_t len);
  void MsixTableWrite(uint64_t off, const uint8_t* data, uint32_t len);
  void DeliverPendingLocked();

  std::shared_ptr<VirtioDevice> dev_;
  GuestMemory mem_;
  SignalMsi msi_;
  DeviceError on_error_;
  uint16_t nq_;
  uint16_t nvec_;
  uint8_t msix_cap_ = 0;

  // Transport registers (vCPU threads, under the VM's I/O lock).
  uint32_t device_feature_select_ = 0, driver_feature_select_ = 0;
  uint32_t driver_features_[2] = {};
  uint16_t queue_select_ = 0;
  uint8_t status_ = 0;
  bool active_ = false;
  std::unique_ptr<Queue[]> queues_;
  std::atomic<uint16_t> config_vector_{kNoVector};
  std::atomic<uint8_t> isr_{0};
  std::atomic<bool> needs_reset_{false};
  std::atomic<uint64_t> interrupts_{0};

  // MSI-X state: table entries (addr lo, addr hi, data, control) and pending bits.
  std::mutex msix_mu_;
  std::vector<uint32_t> table_;
  std::vector<bool> pending_;
  bool msix_enabled_ = false, msix_masked_ = false;
};

}  // namespace forkling::vmm
