// A minimal PCI: one bus, reached through configuration mechanism #1 (ports
// 0xCF8 address / 0xCFC data), a host bridge at 00:00.0 and devices with
// memory BARs. Debian's kernel has no virtio-mmio command-line devices and we
// boot with acpi=off, so PCI (CONFIG_PCI_DIRECT) is the one transport the
// stock kernel finds by itself; MSI-X avoids any INTx routing tables.
//
// BARs are assigned here, like firmware would; the guest may move them
// (sizing writes and reprogramming are honoured) and MMIO is routed only while
// the device's memory decoding is enabled.
#pragma once
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace forkling::vmm {

class PciDevice {
 public:
  static constexpr int kMaxBars = 6;
  virtual ~PciDevice() = default;

  // Config space access at byte offset `off` (< 256) of `size` 1, 2 or 4,
  // naturally aligned (the bus enforces it).
  uint32_t ConfigRead(uint32_t off, uint32_t size) const;
  void ConfigWrite(uint32_t off, uint32_t size, uint32_t value);

  // MMIO inside BAR `bar` at `offset` (< the BAR size; the bus checks).
  virtual void BarRead(int bar, uint64_t offset, uint8_t* data, uint32_t len) = 0;
  virtual void BarWrite(int bar, uint64_t offset, const uint8_t* data, uint32_t len) = 0;

  // Guest-physical address of a memory BAR (0 when not present).
  uint64_t BarAddress(int bar) const;
  uint64_t BarSize(int bar) const { return bar >= 0 && bar < kMaxBars ? bar_size_[bar] : 0; }
  bool MemoryEnabled() const { return cfg_[0x04] & 0x02; }

  // Snapshot: the 256 bytes of config space (BAR addresses, command
  // register, capability control bits as the guest left them). Restore calls
  // OnConfigWrite over the whole space so derived state follows.
  void SaveConfig(uint8_t out[256]) const { std::memcpy(out, cfg_, 256); }
  void RestoreConfig(const uint8_t in[256]) {
    std::memcpy(cfg_, in, 256);
    OnConfigWrite(0, 256);
  }

 protected:
  // Header type 0 with vendor/device/class; capabilities start at 0x40.
  void InitHeader(uint16_t vendor, uint16_t device, uint32_t class_code, uint8_t revision, uint16_t subsys_vendor,
                  uint16_t subsys_id);
  // A 64-bit memory BAR at index `bar` (uses bar and bar+1). size: power of two >= 16.
  void AddMemBar64(int bar, uint64_t size, uint64_t addr);
  // Appends a capability (`body` includes the id and next bytes, which are filled in).
  // Returns its offset. `wmask` marks writable bits (same length), may be empty.
  uint8_t AddCapability(const std::vector<uint8_t>& body, const std::vector<uint8_t>& wmask);
  // Hook after a config write (e.g. MSI-X control changed).
  virtual void OnConfigWrite(uint32_t off, uint32_t size) {}

  uint8_t cfg_[256] = {};
  uint8_t wmask_[256] = {};
  uint64_t bar_size_[kMaxBars] = {};
  uint8_t last_cap_ = 0;
  uint8_t next_cap_ = 0x40;
};

class PciHostBridge : public PciDevice {
 public:
  PciHostBridge();
  void BarRead(int, uint64_t, uint8_t* data, uint32_t len) override;
  void BarWrite(int, uint64_t, const uint8_t*, uint32_t) override {}
};

class PciBus {
 public:
  static constexpr int kSlots = 32;
  PciBus();
  // Adds a device at the next free slot; returns the slot, or -1 when full.
  int Add(std::shared_ptr<PciDevice> dev);

  // Ports 0xCF8-0xCFF. size 1, 2 or 4.
  uint32_t IoRead(uint16_t port, uint32_t size);
  void IoWrite(uint16_t port, uint32_t size, uint32_t value);
  // MMIO: true when a device BAR claimed the access.
  bool MmioRead(uint64_t addr, uint8_t* data, uint32_t len);
  bool MmioWrite(uint64_t addr, const uint8_t* data, uint32_t len);

  // Next free, `size`-aligned MMIO address for a BAR.
  uint64_t AllocateMmio(uint64_t size);
  PciDevice* device(int slot) const { return slot >= 0 && slot < kSlots ? slots_[slot].get() : nullptr; }

 private:
  PciDevice* Find(uint64_t addr, uint32_t len, int* bar, uint64_t* offset) const;
  uint32_t address_ = 0;
  std::shared_ptr<PciDevice> slots_[kSlots];
  uint64_t next_mmio_;
};

}  // namespace forkling::vmm
