#include "vmm/mptable.h"

#include <cstring>
#include <vector>

#include "vmm/layout.h"

namespace forkling::vmm {
namespace {

#pragma pack(push, 1)
struct MpFloating {  // 16 bytes
  char signature[4];
  uint32_t physptr;
  uint8_t length;  // in 16-byte units
  uint8_t spec;
  uint8_t checksum;
  uint8_t feature[5];
};
struct MpConfigHeader {  // 44 bytes
  char signature[4];
  uint16_t length;
  uint8_t spec;
  uint8_t checksum;
  char oem[8];
  char product[12];
  uint32_t oemptr;
  uint16_t oemsize;
  uint16_t count;
  uint32_t lapic;
  uint16_t ext_length;
  uint8_t ext_checksum;
  uint8_t reserved;
};
struct MpCpu {  // 20 bytes
  uint8_t type, apicid, apicver, cpuflag;
  uint32_t signature, featureflag;
  uint32_t reserved[2];
};
struct MpBus {  // 8 bytes
  uint8_t type, busid;
  char bustype[6];
};
struct MpIoapic {  // 8 bytes
  uint8_t type, apicid, apicver, flags;
  uint32_t addr;
};
struct MpIntsrc {  // 8 bytes (type 3 I/O interrupt, type 4 local interrupt)
  uint8_t type, irqtype;
  uint16_t irqflag;
  uint8_t srcbus, srcbusirq, dstapic, dstirq;
};
#pragma pack(pop)
static_assert(sizeof(MpFloating) == 16 && sizeof(MpConfigHeader) == 44 && sizeof(MpCpu) == 20 &&
              sizeof(MpBus) == 8 && sizeof(MpIoapic) == 8 && sizeof(MpIntsrc) == 8);

constexpr uint8_t kApicVersion = 0x14;
constexpr uint8_t kIoapicVersion = 0x11;
constexpr uint8_t kCpuEnabled = 1, kCpuBsp = 2;
constexpr uint8_t kIsaBus = 0;
constexpr uint32_t kIsaIrqs = 16;

uint8_t Checksum(const uint8_t* p, size_t n) {
  uint8_t s = 0;
  for (size_t i = 0; i < n; i++) s += p[i];
  return uint8_t(-s);
}

template <class T>
void Append(std::vector<uint8_t>& v, const T& x) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(&x);
  v.insert(v.end(), p, p + sizeof(T));
}

}  // namespace

uint64_t MpTableSize(uint32_t vcpus) {
  return sizeof(MpFloating) + sizeof(MpConfigHeader) + vcpus * sizeof(MpCpu) + sizeof(MpBus) +
         sizeof(MpIoapic) + kIsaIrqs * sizeof(MpIntsrc) + 2 * sizeof(MpIntsrc);
}

bool WriteMpTable(const GuestMemory& mem, uint64_t addr, uint32_t vcpus, std::string* err) {
  if (vcpus == 0 || vcpus > kMaxVcpus) {
    *err = "vcpus must be between 1 and " + std::to_string(kMaxVcpus);
    return false;
  }
  uint64_t size = MpTableSize(vcpus);
  // The floating pointer sits in the EBDA's first KiB, where Linux scans; the
  // config table follows it and may run into the reserved area below 1 MiB.
  if (addr + size > layout::kHighMem || !mem.Contains(addr, size)) {
    *err = "MP table does not fit below 1 MiB";
    return false;
  }
  std::vector<uint8_t> body;
  uint16_t count = 0;
  for (uint32_t i = 0; i < vcpus; i++) {
    MpCpu c{};
    c.type = 0;
    c.apicid = uint8_t(i);
    c.apicver = kApicVersion;
    c.cpuflag = kCpuEnabled | (i == 0 ? kCpuBsp : 0);
    c.signature = 0x600;  // family 6; Linux does not rely on it
    c.featureflag = 0x201;  // FPU | APIC
    Append(body, c);
    count++;
  }
  MpBus isa{1, kIsaBus, {'I', 'S', 'A', ' ', ' ', ' '}};
  Append(body, isa);
  count++;
  MpIoapic io{2, MpIoapicId(vcpus), kIoapicVersion, 1, uint32_t(layout::kIoapic)};
  Append(body, io);
  count++;
  for (uint32_t irq = 0; irq < kIsaIrqs; irq++) {
    // Conforming polarity/trigger (ISA: edge, active high).
    MpIntsrc s{3, 0 /*INT*/, 0, kIsaBus, uint8_t(irq), MpIoapicId(vcpus), uint8_t(irq)};
    Append(body, s);
    count++;
  }
  // LINT0 = ExtINT (the 8259), LINT1 = NMI, on all local APICs (0xff).
  MpIntsrc l0{4, 3 /*ExtINT*/, 0, kIsaBus, 0, 0xff, 0};
  MpIntsrc l1{4, 1 /*NMI*/, 0, kIsaBus, 0, 0xff, 1};
  Append(body, l0);
  Append(body, l1);
  count += 2;

  MpConfigHeader h{};
  std::memcpy(h.signature, "PCMP", 4);
  h.length = uint16_t(sizeof h + body.size());
  h.spec = 4;
  std::memcpy(h.oem, "FORKLING", 8);
  std::memcpy(h.product, "microVM     ", 12);
  h.count = count;
  h.lapic = uint32_t(layout::kLapic);
  std::vector<uint8_t> table;
  Append(table, h);
  table.insert(table.end(), body.begin(), body.end());
  table[7] = Checksum(table.data(), table.size());  // offsetof(checksum) == 7

  MpFloating f{};
  std::memcpy(f.signature, "_MP_", 4);
  f.physptr = uint32_t(addr + sizeof f);
  f.length = 1;
  f.spec = 4;
  uint8_t fb[16];
  std::memcpy(fb, &f, 16);
  fb[10] = Checksum(fb, 16);  // offsetof(checksum) == 10

  mem.WriteBytes(addr, fb, 16);
  mem.WriteBytes(addr + 16, table.data(), table.size());
  return true;
}

}  // namespace forkling::vmm
