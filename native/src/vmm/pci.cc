#include "vmm/pci.h"

#include <algorithm>
#include <cstring>

#include "vmm/layout.h"

namespace forkling::vmm {

uint32_t PciDevice::ConfigRead(uint32_t off, uint32_t size) const {
  uint32_t v = 0;
  for (uint32_t i = 0; i < size && off + i < 256; i++) v |= uint32_t(cfg_[off + i]) << (8 * i);
  return v;
}

void PciDevice::ConfigWrite(uint32_t off, uint32_t size, uint32_t value) {
  for (uint32_t i = 0; i < size && off + i < 256; i++) {
    uint8_t b = uint8_t(value >> (8 * i));
    cfg_[off + i] = uint8_t((cfg_[off + i] & ~wmask_[off + i]) | (b & wmask_[off + i]));
  }
  OnConfigWrite(off, size);
}

uint64_t PciDevice::BarAddress(int bar) const {
  if (bar < 0 || bar >= kMaxBars || !bar_size_[bar]) return 0;
  uint32_t lo, hi = 0;
  std::memcpy(&lo, cfg_ + 0x10 + 4 * bar, 4);
  if ((lo & 0x6) == 0x4 && bar + 1 < kMaxBars) std::memcpy(&hi, cfg_ + 0x14 + 4 * bar, 4);
  return (uint64_t(hi) << 32) | (lo & ~0xfu);
}

void PciDevice::InitHeader(uint16_t vendor, uint16_t device, uint32_t class_code, uint8_t revision,
                           uint16_t subsys_vendor, uint16_t subsys_id) {
  std::memset(cfg_, 0, sizeof cfg_);
  std::memset(wmask_, 0, sizeof wmask_);
  std::memcpy(cfg_ + 0x00, &vendor, 2);
  std::memcpy(cfg_ + 0x02, &device, 2);
  cfg_[0x08] = revision;
  cfg_[0x09] = uint8_t(class_code);        // prog-if
  cfg_[0x0a] = uint8_t(class_code >> 8);   // subclass
  cfg_[0x0b] = uint8_t(class_code >> 16);  // class
  cfg_[0x0e] = 0;                          // header type 0, single function
  std::memcpy(cfg_ + 0x2c, &subsys_vendor, 2);
  std::memcpy(cfg_ + 0x2e, &subsys_id, 2);
  // Command: I/O space, memory space, bus master, INTx disable are writable.
  wmask_[0x04] = 0x07;
  wmask_[0x05] = 0x04;
  wmask_[0x3c] = 0xff;  // interrupt line (scratch for the OS)
  last_cap_ = 0;
  next_cap_ = 0x40;
}

void PciDevice::AddMemBar64(int bar, uint64_t size, uint64_t addr) {
  if (bar < 0 || bar + 1 >= kMaxBars || size < 16 || (size & (size - 1))) return;
  bar_size_[bar] = size;
  uint64_t mask = ~(size - 1);
  uint32_t lo = uint32_t(addr & mask) | 0x4;  // memory, 64-bit, not prefetchable
  uint32_t hi = uint32_t(addr >> 32);
  std::memcpy(cfg_ + 0x10 + 4 * bar, &lo, 4);
  std::memcpy(cfg_ + 0x14 + 4 * bar, &hi, 4);
  // Writable address bits: sizing (write all ones) reads back the size mask.
  uint32_t wlo = uint32_t(mask) & ~0xfu, whi = uint32_t(mask >> 32);
  std::memcpy(wmask_ + 0x10 + 4 * bar, &wlo, 4);
  std::memcpy(wmask_ + 0x14 + 4 * bar, &whi, 4);
}

uint8_t PciDevice::AddCapability(const std::vector<uint8_t>& body, const std::vector<uint8_t>& wmask) {
  uint32_t len = uint32_t(body.size());
  if (len < 2 || next_cap_ + len > 256) return 0;
  uint8_t at = next_cap_;
  std::memcpy(cfg_ + at, body.data(), len);
  cfg_[at + 1] = 0;
  if (!wmask.empty()) std::memcpy(wmask_ + at, wmask.data(), std::min<size_t>(len, wmask.size()));
  if (last_cap_) {
    cfg_[last_cap_ + 1] = at;
  } else {
    cfg_[0x34] = at;
    cfg_[0x06] |= 0x10;  // status: capabilities list
  }
  last_cap_ = at;
  next_cap_ = uint8_t((at + len + 3) & ~3u);
  return at;
}

PciHostBridge::PciHostBridge() {
  // Red Hat / QEMU's generic host bridge id: no kernel quirks apply to it.
  InitHeader(0x1b36, 0x0008, 0x060000, 0, 0x1af4, 0x1100);
}

void PciHostBridge::BarRead(int, uint64_t, uint8_t* data, uint32_t len) { std::memset(data, 0xff, len); }

PciBus::PciBus() : next_mmio_(layout::kPciMmioBase) { slots_[0] = std::make_shared<PciHostBridge>(); }

int PciBus::Add(std::shared_ptr<PciDevice> dev) {
  for (int s = 1; s < kSlots; s++) {
    if (!slots_[s]) {
      slots_[s] = std::move(dev);
      return s;
    }
  }
  return -1;
}

uint64_t PciBus::AllocateMmio(uint64_t size) {
  uint64_t a = (next_mmio_ + size - 1) & ~(size - 1);
  if (a + size > layout::kPciMmioEnd) return 0;
  next_mmio_ = a + size;
  return a;
}

uint32_t PciBus::IoRead(uint16_t port, uint32_t size) {
  if (port >= 0xcf8 && port < 0xcfc) {
    // Only a full dword read of 0xCF8 returns the address (pci_check_type1 relies on it).
    return port == 0xcf8 && size == 4 ? address_ : 0xffffffffu;
  }
  uint32_t off = port - 0xcfc;
  if (!(address_ & 0x80000000u) || off + size > 4 || (off & (size - 1))) return 0xffffffffu;
  uint32_t bus = (address_ >> 16) & 0xff, slot = (address_ >> 11) & 0x1f, fn = (address_ >> 8) & 7;
  uint32_t reg = (address_ & 0xfc) + off;
  if (bus != 0 || fn != 0 || !slots_[slot]) return size == 4 ? 0xffffffffu : (1u << (8 * size)) - 1;
  return slots_[slot]->ConfigRead(reg, size);
}

void PciBus::IoWrite(uint16_t port, uint32_t size, uint32_t value) {
  if (port == 0xcf8 && size == 4) {
    address_ = value & 0x80fffffcu;
    return;
  }
  if (port < 0xcfc) return;  // byte writes to 0xCF9-0xCFB (reset control etc.): ignored
  uint32_t off = port - 0xcfc;
  if (!(address_ & 0x80000000u) || off + size > 4 || (off & (size - 1))) return;
  uint32_t bus = (address_ >> 16) & 0xff, slot = (address_ >> 11) & 0x1f, fn = (address_ >> 8) & 7;
  if (bus != 0 || fn != 0 || !slots_[slot]) return;
  slots_[slot]->ConfigWrite((address_ & 0xfc) + off, size, value);
}

PciDevice* PciBus::Find(uint64_t addr, uint32_t len, int* bar, uint64_t* offset) const {
  for (int s = 1; s < kSlots; s++) {
    PciDevice* d = slots_[s].get();
    if (!d || !d->MemoryEnabled()) continue;
    for (int b = 0; b < PciDevice::kMaxBars; b++) {
      uint64_t size = d->BarSize(b);
      if (!size) continue;
      uint64_t base = d->BarAddress(b);
      if (addr >= base && addr - base < size && len <= size - (addr - base)) {
        *bar = b;
        *offset = addr - base;
        return d;
      }
    }
  }
  return nullptr;
}

bool PciBus::MmioRead(uint64_t addr, uint8_t* data, uint32_t len) {
  int bar;
  uint64_t off;
  PciDevice* d = Find(addr, len, &bar, &off);
  if (!d) return false;
  d->BarRead(bar, off, data, len);
  return true;
}

bool PciBus::MmioWrite(uint64_t addr, const uint8_t* data, uint32_t len) {
  int bar;
  uint64_t off;
  PciDevice* d = Find(addr, len, &bar, &off);
  if (!d) return false;
  d->BarWrite(bar, off, data, len);
  return true;
}

}  // namespace forkling::vmm
